// bench/common/report.h: how strata's benchmarks report (see shared BENCH.md): figures beside a
// ceiling measured in the same run, medians of per-round ratios with min and max, one JSON object
// written to --json, and one closing line per figure.
//
// Thread safety: none; a benchmark reports from one thread.
#ifndef STRATA_BENCH_COMMON_REPORT_H_
#define STRATA_BENCH_COMMON_REPORT_H_

#include <string>
#include <vector>

#include "nlohmann/json.hpp"

namespace strata::bench {

// CPU seconds (user + system) this process has used, all threads.
double ProcessCpuSeconds();

// Median, min and max of a sample (empty: all zero).
struct Summary {
  double median = 0, min = 0, max = 0;
  static Summary Of(std::vector<double> values);
};

struct Figure {
  std::string name;
  std::string unit;
  Summary value;    // Our figure over the rounds.
  Summary ceiling;  // The ceiling over the same rounds.
  std::string ceiling_source;
  Summary ratio;  // Per-round value/ceiling.
  bool lower_is_better = false;
  nlohmann::json config = nlohmann::json::object();
  std::string note;  // e.g. "fio missing: no ceiling" (then ceiling/ratio are empty).
};

struct MachineInfo {
  std::string cpu;
  int cores = 0;
  std::string fs;
  std::string device;
  static MachineInfo Probe(const std::string& dir);
};

class Report {
 public:
  Report(std::string bench, MachineInfo machine);
  void Add(Figure figure) { figures_.push_back(std::move(figure)); }
  const std::vector<Figure>& figures() const { return figures_; }
  // Prints the closing lines: "<bench>/<figure>: <value> <unit> = <ratio> of <ceiling_source>".
  void PrintClosingLines() const;
  // Writes the JSON object; returns false (after printing why) when the file cannot be written.
  bool WriteJson(const std::string& path) const;
  nlohmann::json ToJson() const;

 private:
  std::string bench_;
  MachineInfo machine_;
  std::vector<Figure> figures_;
};

}  // namespace strata::bench

#endif  // STRATA_BENCH_COMMON_REPORT_H_
