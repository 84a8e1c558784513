#include "tools/aio_bench/sweep.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "base/status.h"
#include "tools/aio_bench/flags.h"

namespace strata::aio_bench {
namespace {

template <typename T>
int IndexOf(const std::vector<T>& values, T v) {
  // Exact match, else the nearest (for coarse values that the fine grid lacks).
  int best = 0;
  for (int i = 0; i < static_cast<int>(values.size()); ++i) {
    if (values[i] == v) return i;
    const double d =
        std::fabs(std::log2(static_cast<double>(values[i])) - std::log2(static_cast<double>(v)));
    const double db =
        std::fabs(std::log2(static_cast<double>(values[best])) - std::log2(static_cast<double>(v)));
    if (d < db) best = i;
  }
  return best;
}

aio::AioConfig ConfigOf(aio::EngineKind engine, uint64_t bs, int qd, int threads,
                        const UringOptions& u, bool direct) {
  aio::AioConfig c;
  c.engine = engine;
  c.block_size = bs;
  c.queue_depth = qd;
  c.intra_op_parallelism = threads;
  c.direct = direct;
  if (engine == aio::EngineKind::kIoUring) {
    c.registered_buffers = u.registered_buffers;
    c.registered_files = u.registered_files;
    c.sqpoll = u.sqpoll;
  }
  return c;
}

std::string CsvField(const std::string& s) {
  if (s.find_first_of(",\"\n") == std::string::npos) return s;
  return "\"" + absl::StrReplaceAll(s, {{"\"", "\"\""}, {"\n", " "}}) + "\"";
}

std::string XmlEscape(const std::string& s) {
  return absl::StrReplaceAll(s, {{"&", "&amp;"}, {"<", "&lt;"}, {">", "&gt;"}, {"\"", "&quot;"}});
}

absl::Status WriteFile(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::trunc);
  out << text;
  out.close();
  if (!out) return absl::InternalError(absl::StrCat("cannot write ", path));
  return absl::OkStatus();
}

}  // namespace

std::string UringOptions::Name() const {
  std::string n;
  if (registered_buffers || registered_files) n = "registered";
  if (sqpoll) n += n.empty() ? "sqpoll" : "+sqpoll";
  return n.empty() ? "plain" : n;
}

Grid Grid::Full(int cores) {
  Grid g;
  g.engines = {aio::EngineKind::kIoUring, aio::EngineKind::kLibAio};
  for (uint64_t bs = 128 << 10; bs <= (8u << 20); bs *= 2) g.block_sizes.push_back(bs);
  g.queue_depths = {1, 2, 4, 8, 16, 32, 64};
  for (int t = 1; t <= std::max(1, cores); ++t) g.threads.push_back(t);
  g.ops = {Op::kRead, Op::kWrite};
  g.uring_options = {UringOptions{}, UringOptions{true, true, false},
                     UringOptions{false, false, true}};
  return g;
}

Grid Grid::Quick(int cores) {
  Grid g;
  g.engines = {aio::EngineKind::kIoUring, aio::EngineKind::kLibAio};
  g.block_sizes = {256 << 10, 1 << 20, 4 << 20};
  g.queue_depths = {4, 16, 64};
  g.threads = {1};
  if (cores > 1) g.threads.push_back(cores);
  g.ops = {Op::kRead, Op::kWrite};
  g.uring_options = {UringOptions{}};
  return g;
}

std::vector<Point> Grid::Points() const {
  std::vector<Point> points;
  for (aio::EngineKind engine : engines) {
    const std::vector<UringOptions> options =
        engine == aio::EngineKind::kIoUring && !uring_options.empty()
            ? uring_options
            : std::vector<UringOptions>{UringOptions{}};
    for (const UringOptions& u : options) {
      for (uint64_t bs : block_sizes) {
        for (int qd : queue_depths) {
          for (int t : threads) {
            for (Op op : ops) points.push_back(Point{ConfigOf(engine, bs, qd, t, u, direct), op});
          }
        }
      }
    }
  }
  return points;
}

Planner::Planner(Grid fine, Grid coarse, double budget_seconds)
    : fine_(std::move(fine)), coarse_(coarse.Points()), budget_seconds_(budget_seconds) {
  // Centre of the grid first (1M, depth 16, one thread), the extremes last, so that a budget too
  // small for the whole coarse grid still spreads over it.
  auto distance = [](const Point& p) {
    return std::fabs(std::log2(static_cast<double>(p.config.block_size) / (1 << 20))) +
           std::fabs(std::log2(p.config.queue_depth / 16.0)) +
           std::fabs(static_cast<double>(p.config.intra_op_parallelism - 1));
  };
  std::stable_sort(coarse_.begin(), coarse_.end(),
                   [&](const Point& a, const Point& b) { return distance(a) < distance(b); });
  for (const Point& p : coarse_) planned_.insert(p.Describe());
}

std::vector<Point> Planner::Neighbours(const Point& p) const {
  std::vector<Point> out;
  const aio::AioConfig& c = p.config;
  const int bi = IndexOf(fine_.block_sizes, c.block_size);
  const int qi = IndexOf(fine_.queue_depths, c.queue_depth);
  const int ti = IndexOf(fine_.threads, c.intra_op_parallelism);
  auto add = [&](aio::AioConfig n) { out.push_back(Point{n, p.op}); };
  for (int d : {-1, 1}) {
    if (bi + d >= 0 && bi + d < static_cast<int>(fine_.block_sizes.size())) {
      aio::AioConfig n = c;
      n.block_size = fine_.block_sizes[bi + d];
      add(n);
    }
    if (qi + d >= 0 && qi + d < static_cast<int>(fine_.queue_depths.size())) {
      aio::AioConfig n = c;
      n.queue_depth = fine_.queue_depths[qi + d];
      add(n);
    }
    if (ti + d >= 0 && ti + d < static_cast<int>(fine_.threads.size())) {
      aio::AioConfig n = c;
      n.intra_op_parallelism = fine_.threads[ti + d];
      add(n);
    }
  }
  if (c.engine == aio::EngineKind::kIoUring) {
    for (const UringOptions& u : fine_.uring_options) {
      aio::AioConfig n = c;
      n.registered_buffers = u.registered_buffers;
      n.registered_files = u.registered_files;
      n.sqpoll = u.sqpoll;
      add(n);
    }
  }
  for (aio::EngineKind e : fine_.engines) {
    if (e == c.engine) continue;
    add(ConfigOf(e, c.block_size, c.queue_depth, c.intra_op_parallelism, UringOptions{}, c.direct));
  }
  return out;
}

std::optional<Point> Planner::Next(const std::vector<PointResult>& done, double elapsed_seconds) {
  double cost = 1.0;
  if (!done.empty()) {
    cost = 0;
    for (const PointResult& r : done) cost += r.seconds;
    cost /= static_cast<double>(done.size());
  }
  if (elapsed_seconds + cost > budget_seconds_) return std::nullopt;
  // The coarse grid takes at most half the budget; then refinement; then what is left of it.
  if (next_coarse_ < coarse_.size() && elapsed_seconds < budget_seconds_ / 2) {
    return coarse_[next_coarse_++];
  }
  if (std::optional<Point> n = Refine(done)) return n;
  if (next_coarse_ < coarse_.size()) return coarse_[next_coarse_++];
  return std::nullopt;
}

std::optional<Point> Planner::Refine(const std::vector<PointResult>& done) {
  // Alternate between read and write, around the best of each so far.
  for (int attempt = 0; attempt < 2; ++attempt) {
    const Op op = (done.size() + attempt) % 2 == 0 ? Op::kRead : Op::kWrite;
    const PointResult* best = nullptr;
    for (const PointResult& r : done) {
      if (r.ok && r.point.op == op &&
          (best == nullptr || r.gb_per_s.median > best->gb_per_s.median)) {
        best = &r;
      }
    }
    if (best == nullptr) continue;
    for (const Point& n : Neighbours(best->point)) {
      if (planned_.insert(n.Describe()).second) return n;
    }
  }
  return std::nullopt;
}

Best PickBest(const std::vector<PointResult>& results) {
  Best best;
  std::map<std::string, const PointResult*> reads, writes;
  for (const PointResult& r : results) {
    if (!r.ok) continue;
    auto& slot = r.point.op == Op::kRead ? best.read : best.write;
    if (!slot || r.gb_per_s.median > slot->gb_per_s.median) slot = r;
    (r.point.op == Op::kRead ? reads : writes)[r.point.ConfigKey()] = &r;
  }
  double best_hm = -1;
  for (const auto& [key, r] : reads) {
    auto w = writes.find(key);
    if (w == writes.end()) continue;
    const double a = r->gb_per_s.median, b = w->second->gb_per_s.median;
    const double hm = a + b > 0 ? 2 * a * b / (a + b) : 0;
    if (hm > best_hm) {
      best_hm = hm;
      best.both_read = *r;
      best.both_write = *w->second;
    }
  }
  return best;
}

std::string Heatmap(const std::vector<PointResult>& results, aio::EngineKind engine, Op op,
                    const std::vector<std::string>& warnings) {
  std::vector<uint64_t> sizes;
  std::vector<int> depths;
  for (const PointResult& r : results) {
    if (r.point.config.engine != engine || r.point.op != op) continue;
    sizes.push_back(r.point.config.block_size);
    depths.push_back(r.point.config.queue_depth);
  }
  std::sort(sizes.begin(), sizes.end());
  sizes.erase(std::unique(sizes.begin(), sizes.end()), sizes.end());
  std::sort(depths.begin(), depths.end());
  depths.erase(std::unique(depths.begin(), depths.end()), depths.end());
  // Best per cell over the other axes; a cell only failed points reached is marked failed.
  std::map<std::pair<uint64_t, int>, const PointResult*> cell;
  std::map<std::pair<uint64_t, int>, bool> failed;
  double max_gbps = 0, min_gbps = 0;
  bool first = true;
  for (const PointResult& r : results) {
    if (r.point.config.engine != engine || r.point.op != op) continue;
    const auto key = std::make_pair(r.point.config.block_size, r.point.config.queue_depth);
    if (!r.ok) {
      failed[key] = true;
      continue;
    }
    auto& c = cell[key];
    if (c == nullptr || r.gb_per_s.median > c->gb_per_s.median) c = &r;
    max_gbps = std::max(max_gbps, r.gb_per_s.median);
    min_gbps = first ? r.gb_per_s.median : std::min(min_gbps, r.gb_per_s.median);
    first = false;
  }
  const int cw = 104, ch = 40, left = 80, top = 70 + 16 * static_cast<int>(warnings.size());
  const int width =
      std::max(640, left + cw * static_cast<int>(std::max<size_t>(depths.size(), 1)) + 20);
  const int height = top + ch * static_cast<int>(std::max<size_t>(sizes.size(), 1)) + 50;
  std::string svg = absl::StrFormat(
      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%d\" height=\"%d\" "
      "font-family=\"sans-serif\" font-size=\"12\">\n<rect width=\"100%%\" height=\"100%%\" "
      "fill=\"white\"/>\n<text x=\"10\" y=\"22\" font-size=\"15\" font-weight=\"bold\">%s %s, "
      "GB/s (median; best over threads and io_uring options)</text>\n"
      "<text x=\"10\" y=\"%d\" fill=\"#555\">colour from the lowest (%.2f, pale) to the highest "
      "(%.2f, dark) cell; t = threads</text>\n",
      width, height, aio::EngineKindName(engine), OpName(op), height - 16, min_gbps, max_gbps);
  for (size_t i = 0; i < warnings.size(); ++i) {
    absl::StrAppendFormat(&svg, "<text x=\"10\" y=\"%d\" fill=\"#b00\">%s</text>\n", 40 + 16 * i,
                          XmlEscape(warnings[i]));
  }
  absl::StrAppendFormat(&svg, "<text x=\"%d\" y=\"%d\">queue depth</text>\n",
                        left + cw * static_cast<int>(depths.size()) / 2 - 30, top - 24);
  for (size_t j = 0; j < depths.size(); ++j) {
    absl::StrAppendFormat(&svg, "<text x=\"%d\" y=\"%d\" text-anchor=\"middle\">%d</text>\n",
                          left + cw * static_cast<int>(j) + cw / 2, top - 6, depths[j]);
  }
  absl::StrAppendFormat(&svg, "<text x=\"10\" y=\"%d\">block</text>\n", top - 6);
  for (size_t i = 0; i < sizes.size(); ++i) {
    const int y = top + ch * static_cast<int>(i);
    absl::StrAppendFormat(&svg, "<text x=\"10\" y=\"%d\">%s</text>\n", y + ch / 2 + 4,
                          SizeText(sizes[i]));
    for (size_t j = 0; j < depths.size(); ++j) {
      const int x = left + cw * static_cast<int>(j);
      const auto key = std::make_pair(sizes[i], depths[j]);
      auto it = cell.find(key);
      if (it == cell.end()) {
        const bool f = failed.count(key) > 0;
        absl::StrAppendFormat(&svg,
                              "<rect x=\"%d\" y=\"%d\" width=\"%d\" height=\"%d\" fill=\"%s\" "
                              "stroke=\"white\"/><text x=\"%d\" y=\"%d\" text-anchor=\"middle\" "
                              "fill=\"#666\">%s</text>\n",
                              x, y, cw, ch, f ? "#f3d0d0" : "#eeeeee", x + cw / 2, y + ch / 2 + 4,
                              f ? "failed" : "");
        continue;
      }
      const PointResult& r = *it->second;
      const double f =
          max_gbps > min_gbps ? (r.gb_per_s.median - min_gbps) / (max_gbps - min_gbps) : 1.0;
      // From pale yellow (0) to deep blue (the best cell).
      const int red = static_cast<int>(255 + f * (37 - 255));
      const int green = static_cast<int>(247 + f * (52 - 247));
      const int blue = static_cast<int>(188 + f * (148 - 188));
      const bool dark = f > 0.55;
      std::string detail = absl::StrCat("t=", r.point.config.intra_op_parallelism);
      if (r.point.config.registered_buffers) absl::StrAppend(&detail, " reg");
      if (r.point.config.sqpoll) absl::StrAppend(&detail, " sqpoll");
      absl::StrAppendFormat(
          &svg,
          "<rect x=\"%d\" y=\"%d\" width=\"%d\" height=\"%d\" fill=\"rgb(%d,%d,%d)\" "
          "stroke=\"white\"><title>%s: %.3f GB/s</title></rect>\n"
          "<text x=\"%d\" y=\"%d\" text-anchor=\"middle\" fill=\"%s\" font-weight=\"bold\">"
          "%.2f</text><text x=\"%d\" y=\"%d\" text-anchor=\"middle\" fill=\"%s\" "
          "font-size=\"9\">%s</text>\n",
          x, y, cw, ch, red, green, blue, XmlEscape(r.point.Describe()), r.gb_per_s.median,
          x + cw / 2, y + 17, dark ? "white" : "black", r.gb_per_s.median, x + cw / 2, y + 31,
          dark ? "white" : "#333", detail);
    }
  }
  svg += "</svg>\n";
  return svg;
}

absl::StatusOr<std::vector<std::string>> WriteOutputs(const SweepOutputs& out,
                                                      const std::vector<PointResult>& results,
                                                      const Best& best) {
  std::error_code ec;
  std::filesystem::create_directories(out.dir, ec);
  if (ec) return absl::InternalError(absl::StrCat("cannot create ", out.dir, ": ", ec.message()));
  std::vector<std::string> written;
  const std::string warning_text = absl::StrJoin(out.warnings, "; ");

  std::string csv =
      "engine,op,block_size,queue_depth,intra_op_parallelism,single_submit,overlap_events,"
      "registered_buffers,registered_files,sqpoll,direct,status,rounds_repeated,noisy,"
      "gb_per_s_median,gb_per_s_min,"
      "gb_per_s_max,iops,latency_p50_us,latency_p99_us,latency_max_us,cpu_cores,error,warning\n";
  for (const PointResult& r : results) {
    const aio::AioConfig& c = r.point.config;
    auto b = [](bool v) { return v ? "true" : "false"; };
    absl::StrAppend(&csv, aio::EngineKindName(c.engine), ",", OpName(r.point.op), ",", c.block_size,
                    ",", c.queue_depth, ",", c.intra_op_parallelism, ",", b(c.single_submit), ",",
                    b(c.overlap_events), ",", b(c.registered_buffers), ",", b(c.registered_files),
                    ",", b(c.sqpoll), ",", b(c.direct), ",", r.ok ? "ok" : "failed", ",",
                    r.rounds_repeated, ",", b(r.noisy), ",");
    if (r.ok) {
      absl::StrAppendFormat(&csv, "%.4f,%.4f,%.4f,%.1f,%.0f,%.0f,%.0f,%.3f,", r.gb_per_s.median,
                            r.gb_per_s.min, r.gb_per_s.max, r.iops, r.latency_p50_us,
                            r.latency_p99_us, r.latency_max_us, r.cpu_cores);
    } else {
      csv += ",,,,,,,,";
    }
    absl::StrAppend(&csv, CsvField(r.error), ",", CsvField(warning_text), "\n");
  }
  const std::string csv_path = out.dir + "/results.csv";
  STRATA_RETURN_IF_ERROR(WriteFile(csv_path, csv));
  written.push_back(csv_path);

  nlohmann::json j = out.meta;
  j["tool"] = "aio_bench_perf_sweep";
  j["warnings"] = out.warnings;
  j["points"] = nlohmann::json::array();
  for (const PointResult& r : results) j["points"].push_back(r.ToJson());
  auto pick = [&](const std::optional<PointResult>& r) -> nlohmann::json {
    if (!r) return nullptr;
    return {{"result", r->ToJson()}, {"config", aio::AioConfigToJson(r->point.config)}};
  };
  j["best"] = {{"read", pick(best.read)}, {"write", pick(best.write)}};
  if (best.both_read) {
    j["best"]["both"] = {{"read", best.both_read->ToJson()},
                         {"write", best.both_write->ToJson()},
                         {"config", aio::AioConfigToJson(best.both_read->point.config)}};
  }
  const std::string json_path = out.dir + "/results.json";
  STRATA_RETURN_IF_ERROR(WriteFile(json_path, j.dump(2) + "\n"));
  written.push_back(json_path);

  for (aio::EngineKind engine :
       {aio::EngineKind::kIoUring, aio::EngineKind::kLibAio, aio::EngineKind::kPosix}) {
    for (Op op : {Op::kRead, Op::kWrite}) {
      const bool any = std::any_of(results.begin(), results.end(), [&](const PointResult& r) {
        return r.point.config.engine == engine && r.point.op == op;
      });
      if (!any) continue;
      const std::string path =
          absl::StrCat(out.dir, "/heatmap_", aio::EngineKindName(engine), "_", OpName(op), ".svg");
      STRATA_RETURN_IF_ERROR(WriteFile(path, Heatmap(results, engine, op, out.warnings)));
      written.push_back(path);
    }
  }
  auto block = [&](const aio::AioConfig& c) {
    nlohmann::json b = aio::AioConfigToJson(c);
    if (!out.warnings.empty()) b["strata_sweep_warnings"] = out.warnings;
    return b.dump(2) + "\n";
  };
  for (const auto& [name, r] :
       {std::pair{"best_read.json", &best.read}, std::pair{"best_write.json", &best.write},
        std::pair{"best.json", &best.both_read}}) {
    if (!*r) continue;
    const std::string path = out.dir + "/" + name;
    STRATA_RETURN_IF_ERROR(WriteFile(path, block((*r)->point.config)));
    written.push_back(path);
  }
  return written;
}

}  // namespace strata::aio_bench
