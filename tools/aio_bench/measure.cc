#include "tools/aio_bench/measure.h"

#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <deque>
#include <future>

#include "absl/strings/str_cat.h"
#include "aio/probe.h"
#include "tools/aio_bench/flags.h"

namespace strata::aio_bench {
namespace {

using Clock = std::chrono::steady_clock;
constexpr uint64_t kMinRequest = 4 << 20;

uint64_t InFlightBytes(const aio::AioConfig& c) {
  return c.block_size * static_cast<uint64_t>(c.queue_depth) *
         static_cast<uint64_t>(c.intra_op_parallelism);
}

}  // namespace

const char* OpName(Op op) { return op == Op::kRead ? "read" : "write"; }

std::string Point::Describe() const {
  std::string d = absl::StrCat(aio::EngineKindName(config.engine), " ", OpName(op),
                               " bs=", SizeText(config.block_size), " qd=", config.queue_depth,
                               " t=", config.intra_op_parallelism);
  if (config.registered_buffers) absl::StrAppend(&d, " +regbuf");
  if (config.registered_files) absl::StrAppend(&d, " +regfile");
  if (config.sqpoll) absl::StrAppend(&d, " +sqpoll");
  if (config.single_submit) absl::StrAppend(&d, " +single_submit");
  if (!config.overlap_events) absl::StrAppend(&d, " -overlap");
  if (!config.direct) absl::StrAppend(&d, " BUFFERED");
  return d;
}

std::string Point::ConfigKey() const {
  Point p = *this;
  p.op = Op::kRead;
  return p.Describe();
}

uint64_t RequestBytesFor(const aio::AioConfig& c) { return std::max(c.block_size, kMinRequest); }

uint64_t BufferBytesFor(const aio::AioConfig& c) {
  const uint64_t request = RequestBytesFor(c);
  const uint64_t slots = (InFlightBytes(c) + request - 1) / request + 1;
  return slots * request;
}

MemoryLimits MemoryLimits::Probe() {
  MemoryLimits limits;
  if (FILE* f = std::fopen("/proc/meminfo", "r"); f != nullptr) {
    char line[256];
    unsigned long long kib = 0;
    while (std::fgets(line, sizeof(line), f) != nullptr) {
      if (std::sscanf(line, "MemAvailable: %llu kB", &kib) == 1) break;
    }
    std::fclose(f);
    limits.available_bytes = static_cast<uint64_t>(kib) << 10;
  }
  limits.lockable_bytes = aio::ProbeSystem().LockableBytes();
  return limits;
}

absl::Status CheckBufferFits(const aio::AioConfig& config, const MemoryLimits& limits) {
  const uint64_t need = BufferBytesFor(config);
  const std::string what =
      absl::StrCat("block size x queue depth x threads (", SizeText(config.block_size), " x ",
                   config.queue_depth, " x ", config.intra_op_parallelism, ") needs a ", need >> 20,
                   " MiB buffer");
  if (limits.available_bytes > 0 && need > limits.available_bytes / 2) {
    return absl::ResourceExhaustedError(
        absl::StrCat(what, "; this machine has ", limits.available_bytes >> 20,
                     " MiB available (MemAvailable) and a point may use half of it"));
  }
  if (config.registered_buffers && need > limits.lockable_bytes) {
    return absl::ResourceExhaustedError(
        absl::StrCat(what, ", registered (locked), but RLIMIT_MEMLOCK allows ",
                     limits.lockable_bytes >> 20, " MiB (raise it, or grant CAP_IPC_LOCK)"));
  }
  return absl::OkStatus();
}

absl::StatusOr<StreamResult> Stream(aio::Engine& engine, const aio::File& file, uint64_t file_bytes,
                                    Op op, std::byte* buffer,
                                    const std::vector<double>& boundaries) {
  const aio::AioConfig& c = engine.config();
  const uint64_t request = RequestBytesFor(c);
  const size_t slots = BufferBytesFor(c) / request;
  StreamResult result;
  if (boundaries.size() < 2) return result;
  const size_t windows = boundaries.size() - 1;
  result.window_seconds.resize(windows);
  result.window_bytes.assign(windows, 0);
  result.window_cpu_seconds.resize(windows);
  for (size_t w = 0; w < windows; ++w) result.window_seconds[w] = boundaries[w + 1] - boundaries[w];

  std::deque<std::future<absl::Status>> in_flight;
  absl::Status status;
  uint64_t offset = 0;
  size_t slot = 0;
  const auto t0 = Clock::now();
  auto now_s = [&] { return std::chrono::duration<double>(Clock::now() - t0).count(); };
  size_t window = 0;  // the window the next completion lands in, once started
  bool started = false;
  double cpu_mark = 0;
  // Advances the window bookkeeping to time `t`.
  auto advance = [&](double t) {
    if (!started && t >= boundaries[0]) {
      started = true;
      engine.ResetStats();
      cpu_mark = bench::ProcessCpuSeconds();
    }
    while (started && window < windows && t >= boundaries[window + 1]) {
      const double cpu = bench::ProcessCpuSeconds();
      result.window_cpu_seconds[window] = cpu - cpu_mark;
      cpu_mark = cpu;
      ++window;
    }
  };
  while (status.ok()) {
    const double t = now_s();
    advance(t);
    if (t >= boundaries.back()) break;
    if (in_flight.size() == slots) {
      status.Update(in_flight.front().get());
      in_flight.pop_front();
      const double done_at = now_s();
      advance(done_at);
      if (started && window < windows) result.window_bytes[window] += request;
      continue;
    }
    std::byte* p = buffer + slot * request;
    slot = (slot + 1) % slots;
    in_flight.push_back(op == Op::kWrite ? engine.WriteAsync(file, offset, {p, request})
                                         : engine.ReadAsync(file, offset, {p, request}));
    offset += request;
    if (offset + request > file_bytes) offset = 0;
  }
  for (auto& f : in_flight) status.Update(f.get());
  if (!status.ok()) return status;
  return result;
}

PointResult MeasurePoint(const Point& point, const std::string& path, uint64_t file_bytes,
                         std::byte* buffer, const MeasureOptions& options) {
  PointResult result;
  result.point = point;
  const auto t0 = Clock::now();
  auto finish = [&](std::string error) {
    result.error = std::move(error);
    result.ok = result.error.empty();
    result.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
    return result;
  };
  aio::EngineOptions engine_options;
  engine_options.on_warning = [](absl::string_view) {};  // kept in Engine::warnings()
  auto engine = aio::Engine::Create(point.config, engine_options);
  if (!engine.ok()) return finish(std::string(engine.status().message()));
  result.engine_warnings = (*engine)->warnings();
  // A point that silently ran as something else would be a lie: a fallback fails the point.
  if ((*engine)->backend_name() != aio::EngineKindName(point.config.engine) ||
      (*engine)->config().registered_buffers != point.config.registered_buffers ||
      (*engine)->config().registered_files != point.config.registered_files ||
      (*engine)->config().sqpoll != point.config.sqpoll) {
    std::string why = "not available here";
    if (!result.engine_warnings.empty()) why = result.engine_warnings.front();
    return finish(absl::StrCat("configuration not available: ", why));
  }
  // With registered buffers, the data buffer itself is registered, as strata's pinned pools are.
  const absl::Span<std::byte> region(buffer, BufferBytesFor(point.config));
  if (point.config.registered_buffers) {
    if (auto s = (*engine)->RegisterBuffer(region); !s.ok()) {
      return finish(
          absl::StrCat("registering the ", region.size() >> 20, " MiB buffer: ", s.message()));
    }
  }
  aio::OpenOptions open_options;
  open_options.writable = point.op == Op::kWrite;
  auto file = (*engine)->Open(path, open_options);
  if (!file.ok()) return finish(std::string(file.status().message()));
  const uint64_t request = RequestBytesFor(point.config);
  const uint64_t usable = file_bytes / request * request;
  if (usable < request) {
    return finish(absl::StrCat("the test file (", file_bytes, " B) is smaller than one request (",
                               request, " B)"));
  }
  std::vector<double> boundaries = {options.warmup_seconds};
  for (int rep = 1; rep <= options.reps; ++rep) {
    boundaries.push_back(options.warmup_seconds + rep * options.rep_seconds);
  }
  std::vector<double> gbps, iops;
  double cpu = 0, wall = 0;
  auto spread = [&] {
    const bench::Summary s = bench::Summary::Of(gbps);
    return s.median > 0 ? (s.max - s.min) / s.median : 0.0;
  };
  for (int round = 0;; ++round) {
    // The engine's statistics (latency) are reset at each round's warm-up end: the last round's.
    auto stream = Stream(**engine, *file, usable, point.op, buffer, boundaries);
    if (!stream.ok()) return finish(std::string(stream.status().message()));
    for (size_t w = 0; w < stream->window_bytes.size(); ++w) {
      const double seconds = stream->window_seconds[w];
      gbps.push_back(stream->window_bytes[w] / seconds / 1e9);
      iops.push_back(stream->window_bytes[w] / static_cast<double>(point.config.block_size) /
                     seconds);
      cpu += stream->window_cpu_seconds[w];
      wall += seconds;
    }
    if (spread() <= options.max_spread) break;
    if (round == options.extra_rounds) {
      result.noisy = true;
      break;
    }
    ++result.rounds_repeated;
  }
  const aio::EngineStats stats = (*engine)->Stats();
  result.gb_per_s = bench::Summary::Of(gbps);
  result.iops = bench::Summary::Of(iops).median;
  result.latency_p50_us = stats.piece_latency.Percentile(0.5);
  result.latency_p99_us = stats.piece_latency.Percentile(0.99);
  result.latency_max_us = static_cast<double>(stats.piece_latency.max_us());
  result.cpu_cores = wall > 0 ? cpu / wall : 0;
  file->Close();
  if (point.config.registered_buffers) (*engine)->UnregisterBuffer(region).IgnoreError();
  return finish("");
}

nlohmann::json PointResult::ToJson() const {
  const aio::AioConfig& c = point.config;
  nlohmann::json j = {{"engine", std::string(aio::EngineKindName(c.engine))},
                      {"op", OpName(point.op)},
                      {"block_size", c.block_size},
                      {"queue_depth", c.queue_depth},
                      {"intra_op_parallelism", c.intra_op_parallelism},
                      {"single_submit", c.single_submit},
                      {"overlap_events", c.overlap_events},
                      {"registered_buffers", c.registered_buffers},
                      {"registered_files", c.registered_files},
                      {"sqpoll", c.sqpoll},
                      {"direct", c.direct},
                      {"status", ok ? "ok" : "failed"},
                      {"rounds_repeated", rounds_repeated},
                      {"noisy", noisy},
                      {"seconds", seconds}};
  if (!ok) {
    j["error"] = error;
    return j;
  }
  j["gb_per_s"] = {{"median", gb_per_s.median}, {"min", gb_per_s.min}, {"max", gb_per_s.max}};
  j["iops"] = iops;
  j["latency_us"] = {{"p50", latency_p50_us}, {"p99", latency_p99_us}, {"max", latency_max_us}};
  j["cpu_cores"] = cpu_cores;
  if (!engine_warnings.empty()) j["engine_warnings"] = engine_warnings;
  return j;
}

}  // namespace strata::aio_bench
