#include "bench/common/fio.h"

#include <fcntl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cstdio>

#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"

namespace strata::bench {
namespace {

std::string SizeText(uint64_t bytes) {
  if (bytes % (1 << 20) == 0) return absl::StrCat(bytes >> 20, "M");
  if (bytes % 1024 == 0) return absl::StrCat(bytes >> 10, "k");
  return absl::StrCat(bytes);
}

absl::StatusOr<std::string> Capture(const std::string& command) {
  FILE* pipe = popen(command.c_str(), "r");
  if (pipe == nullptr) return absl::InternalError("popen failed: " + command);
  std::string out;
  std::array<char, 65536> buf;
  size_t n;
  while ((n = fread(buf.data(), 1, buf.size(), pipe)) > 0) out.append(buf.data(), n);
  const int status = pclose(pipe);
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    return absl::InternalError(absl::StrCat("`", command, "` failed: ", out.substr(0, 2000)));
  }
  return out;
}

}  // namespace

std::string FioJob::Describe() const {
  std::string d = absl::StrCat("fio ", engine, " bs=", SizeText(block_size), " qd=", queue_depth);
  if (numjobs > 1) absl::StrAppend(&d, " numjobs=", numjobs);
  if (fixedbufs) absl::StrAppend(&d, " fixedbufs");
  if (batch) absl::StrAppend(&d, " batch=", queue_depth);
  return d;
}

bool FioAvailable() { return system("fio --version >/dev/null 2>&1") == 0; }

namespace {
constexpr char kNrHugepages[] = "/proc/sys/vm/nr_hugepages";
constexpr char kFreeHugepages[] = "/sys/kernel/mm/hugepages/hugepages-2048kB/free_hugepages";
constexpr uint64_t kHugePage = 2 << 20;
volatile long g_previous_pages = -1;  // for RestoreFromSignal

long ReadLong(const char* path) {
  FILE* f = fopen(path, "r");
  if (f == nullptr) return -1;
  long v = -1;
  if (fscanf(f, "%ld", &v) != 1) v = -1;
  fclose(f);
  return v;
}

bool WriteLong(const char* path, long v) {
  FILE* f = fopen(path, "w");
  if (f == nullptr) return false;
  const bool ok = fprintf(f, "%ld\n", v) > 0;
  return fclose(f) == 0 && ok;
}
}  // namespace

uint64_t HugetlbReservation::FreeBytes() {
  const long free_pages = ReadLong(kFreeHugepages);
  return free_pages > 0 ? static_cast<uint64_t>(free_pages) * kHugePage : 0;
}

bool HugetlbReservation::Reserve(uint64_t bytes, std::string* why) {
  if (FreeBytes() >= bytes) return true;
  const long total = ReadLong(kNrHugepages);
  if (total < 0) {
    *why = "no hugetlb support";
    return false;
  }
  const long want = total + static_cast<long>((bytes - FreeBytes() + kHugePage - 1) / kHugePage);
  if (!WriteLong(kNrHugepages, want)) {
    *why = absl::StrCat("cannot raise ", kNrHugepages, " (needs root)");
    return false;
  }
  if (previous_ < 0) {
    previous_ = total;
    g_previous_pages = total;
  }
  if (FreeBytes() < bytes) {
    *why = "the kernel could not find enough contiguous memory for huge pages";
    return false;
  }
  return true;
}

HugetlbReservation::~HugetlbReservation() {
  if (previous_ >= 0) WriteLong(kNrHugepages, previous_);
  g_previous_pages = -1;
}

void HugetlbReservation::RestoreFromSignal() {
  long v = g_previous_pages;
  if (v < 0) return;
  char text[24];
  int n = 0;
  char digits[24];
  do {
    digits[n++] = static_cast<char>('0' + v % 10);
    v /= 10;
  } while (v > 0);
  for (int i = 0; i < n; ++i) text[i] = digits[n - 1 - i];
  text[n++] = '\n';
  const int fd = open(kNrHugepages, O_WRONLY);
  if (fd < 0) return;
  ssize_t ignored = write(fd, text, n);
  (void)ignored;
  close(fd);
}

absl::StatusOr<FioResult> RunFio(const FioJob& job) {
  const uint64_t part = job.size_bytes / job.numjobs / job.block_size * job.block_size;
  std::string cmd = absl::StrCat(
      "fio --name=strata --filename='", job.file, "' --rw=", job.write ? "write" : "read",
      " --bs=", job.block_size, " --iodepth=", job.queue_depth, " --ioengine=", job.engine,
      " --direct=1 --size=", part, " --numjobs=", job.numjobs, " --offset_increment=", part,
      " --group_reporting --output-format=json");
  if (job.fixedbufs) absl::StrAppend(&cmd, " --fixedbufs");
  if (job.hugetlb) absl::StrAppend(&cmd, " --mem=mmaphuge");
  if (job.runtime_seconds > 0) {
    absl::StrAppend(&cmd, " --time_based --runtime=",
                    std::max<int64_t>(1, static_cast<int64_t>(job.runtime_seconds * 1000)), "ms");
    if (job.ramp_seconds > 0) {
      absl::StrAppend(&cmd, " --ramp_time=", static_cast<int64_t>(job.ramp_seconds * 1000), "ms");
    }
  }
  if (job.batch) {
    absl::StrAppend(&cmd, " --iodepth_batch_submit=", job.queue_depth,
                    " --iodepth_batch_complete_max=", job.queue_depth);
  }
  absl::StrAppend(&cmd, " 2>&1");
  absl::StatusOr<std::string> out = Capture(cmd);
  if (!out.ok()) return out.status();
  // fio may print notes before the JSON object.
  const size_t brace = out->find('{');
  if (brace == std::string::npos) return absl::InternalError("fio printed no JSON: " + *out);
  nlohmann::json j = nlohmann::json::parse(out->substr(brace), nullptr, false);
  if (j.is_discarded() || !j.contains("jobs") || j["jobs"].empty()) {
    return absl::InternalError("fio's JSON could not be read: " + out->substr(0, 500));
  }
  const nlohmann::json& r = j["jobs"][0];
  const nlohmann::json& io = r[job.write ? "write" : "read"];
  FioResult result;
  result.bytes = io.value("io_bytes", 0.0);
  const double runtime_s = io.value("runtime", 0.0) / 1000.0;
  if (runtime_s <= 0) return absl::InternalError("fio reported no runtime");
  result.gb_per_s = result.bytes / runtime_s / 1e9;
  const double job_runtime_s = r.value("job_runtime", 0.0) / 1000.0;
  result.cpu_seconds = (r.value("usr_cpu", 0.0) + r.value("sys_cpu", 0.0)) / 100.0 * job_runtime_s;
  return result;
}

}  // namespace strata::bench
