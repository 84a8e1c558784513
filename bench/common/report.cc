#include "bench/common/report.h"

#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <thread>

namespace strata::bench {
namespace {

std::string ReadLine(const std::string& path) {
  std::ifstream in(path);
  std::string line;
  std::getline(in, line);
  return line;
}

std::string FsName(long type) {
  switch (static_cast<unsigned long>(type)) {
    case 0xEF53:
      return "ext4";
    case 0x58465342:
      return "xfs";
    case 0x9123683E:
      return "btrfs";
    case 0x01021994:
      return "tmpfs";
    case 0x794c7630:
      return "overlayfs";
    default: {
      char buf[32];
      std::snprintf(buf, sizeof(buf), "fs 0x%lx", static_cast<unsigned long>(type));
      return buf;
    }
  }
}

}  // namespace

double ProcessCpuSeconds() {
  rusage ru;
  getrusage(RUSAGE_SELF, &ru);
  return ru.ru_utime.tv_sec + ru.ru_utime.tv_usec / 1e6 + ru.ru_stime.tv_sec +
         ru.ru_stime.tv_usec / 1e6;
}

Summary Summary::Of(std::vector<double> v) {
  Summary s;
  if (v.empty()) return s;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  s.median = n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
  s.min = v.front();
  s.max = v.back();
  return s;
}

MachineInfo MachineInfo::Probe(const std::string& dir) {
  MachineInfo m;
  std::ifstream cpuinfo("/proc/cpuinfo");
  for (std::string line; std::getline(cpuinfo, line);) {
    if (line.rfind("model name", 0) == 0) {
      m.cpu = line.substr(line.find(':') + 2);
      break;
    }
  }
  m.cores = static_cast<int>(std::thread::hardware_concurrency());
  struct statfs fs;
  if (statfs(dir.c_str(), &fs) == 0) m.fs = FsName(fs.f_type);
  struct stat st;
  if (stat(dir.c_str(), &st) == 0) {
    const std::string sys = "/sys/dev/block/" + std::to_string(major(st.st_dev)) + ":" +
                            std::to_string(minor(st.st_dev));
    char real[4096];
    const ssize_t n = readlink(sys.c_str(), real, sizeof(real) - 1);
    if (n > 0) {
      real[n] = '\0';
      std::string name = real;
      m.device = name.substr(name.rfind('/') + 1);
    }
    std::string model = ReadLine(sys + "/device/model");
    if (model.empty()) model = ReadLine(sys + "/../device/model");
    const std::string rotational = ReadLine(sys + "/queue/rotational");
    if (!model.empty()) m.device += " (" + model + ")";
    if (m.device.rfind("vd", 0) == 0) m.device += " virtio disk";
    if (rotational == "1") m.device += ", rotational";
  }
  return m;
}

Report::Report(std::string bench, MachineInfo machine)
    : bench_(std::move(bench)), machine_(std::move(machine)) {}

void Report::PrintClosingLines() const {
  for (const Figure& f : figures_) {
    if (f.ceiling_source.empty() || f.ratio.median == 0) {
      std::printf("%s/%s: %.3f %s (%s)\n", bench_.c_str(), f.name.c_str(), f.value.median,
                  f.unit.c_str(), f.note.empty() ? "no ceiling" : f.note.c_str());
      continue;
    }
    std::printf("%s/%s: %.3f %s = %.3f of %s%s\n", bench_.c_str(), f.name.c_str(), f.value.median,
                f.unit.c_str(), f.ratio.median, f.ceiling_source.c_str(),
                f.lower_is_better ? " (lower is better)" : "");
  }
}

nlohmann::json Report::ToJson() const {
  nlohmann::json figures = nlohmann::json::array();
  auto summary = [](const Summary& s) {
    return nlohmann::json{{"median", s.median}, {"min", s.min}, {"max", s.max}};
  };
  for (const Figure& f : figures_) {
    nlohmann::json j = {{"name", f.name},
                        {"value", f.value.median},
                        {"unit", f.unit},
                        {"ceiling", f.ceiling.median},
                        {"ceiling_source", f.ceiling_source},
                        {"ratio", f.ratio.median},
                        {"config", f.config},
                        {"spread",
                         {{"value", summary(f.value)},
                          {"ceiling", summary(f.ceiling)},
                          {"ratio", summary(f.ratio)}}}};
    if (f.lower_is_better) j["better"] = "lower";
    if (!f.note.empty()) j["note"] = f.note;
    figures.push_back(std::move(j));
  }
  return {{"bench", bench_},
          {"figures", figures},
          {"machine",
           {{"cpu", machine_.cpu},
            {"cores", machine_.cores},
            {"fs", machine_.fs},
            {"device", machine_.device}}}};
}

bool Report::WriteJson(const std::string& path) const {
  std::ofstream out(path);
  out << ToJson().dump(2) << "\n";
  if (!out) {
    std::fprintf(stderr, "cannot write %s\n", path.c_str());
    return false;
  }
  return true;
}

}  // namespace strata::bench
