// bench/comm: all-gather and reduce-scatter as bus bandwidth (NCCL's convention: the bytes each
// rank must move, (n - 1) / n of the collective's whole buffer, over the time), on one of
// strata's transports (--transport):
//   gloo  Gloo on loopback, beside the ceiling of streaming every byte the collective puts on
//         loopback (n(n-1) shards) over one TCP connection between two processes in the same
//         round, in the same bus terms (so the ratio is that stream's time over the
//         collective's; Gloo's transport is TCP), with memcpy's rate printed too;
//   shm   shared memory (comm/shm_communicator.h), beside the ceiling of one memcpy of the n
//         shards each rank must copy into and out of the segment, timed in the same round, in
//         the same bus terms.
// Ranks are processes, meeting through the rendezvous store as a launched job does.
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "bench/common/report.h"
#include "comm/gloo_communicator.h"
#include "comm/shm_communicator.h"
#include "comm/tcp_store.h"

ABSL_FLAG(int, ranks, 2, "ranks (processes)");
ABSL_FLAG(int64_t, shard_mib, 16, "each rank's shard, MiB (the collective's buffer is ranks x it)");
ABSL_FLAG(int, rounds, 5, "measured rounds after one warm-up round");
ABSL_FLAG(int, iterations, 5, "collectives per round");
ABSL_FLAG(std::string, json, "", "write the report here");
ABSL_FLAG(std::string, transport, "gloo", "gloo (TCP on loopback) or shm (shared memory)");

namespace strata {
namespace {

using Clock = std::chrono::steady_clock;
using bench::Figure;
using bench::Summary;

double Seconds(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// Seconds to stream `bytes` over one loopback TCP connection to another process (what Gloo's
// transport is made of: a byte on the bus can go no faster); -1 when it fails.
double LoopbackTcpSeconds(size_t bytes) {
  int listener = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in at{};
  at.sin_family = AF_INET;
  at.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof at;
  if (bind(listener, reinterpret_cast<sockaddr*>(&at), sizeof at) != 0 ||
      listen(listener, 1) != 0 ||
      getsockname(listener, reinterpret_cast<sockaddr*>(&at), &len) != 0) {
    close(listener);
    return -1;
  }
  const pid_t reader = fork();
  if (reader == 0) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    if (connect(fd, reinterpret_cast<sockaddr*>(&at), sizeof at) != 0) _exit(1);
    std::vector<char> buf(1 << 20);
    size_t got = 0;
    while (got < bytes) {
      const ssize_t n = read(fd, buf.data(), buf.size());
      if (n <= 0) _exit(1);
      got += static_cast<size_t>(n);
    }
    const char done = 1;
    _exit(write(fd, &done, 1) == 1 ? 0 : 1);
  }
  int fd = accept(listener, nullptr, nullptr);
  close(listener);
  std::vector<char> data(1 << 20, 3);
  const auto t0 = Clock::now();
  size_t sent = 0;
  while (fd >= 0 && sent < bytes) {
    const ssize_t n = write(fd, data.data(), std::min(data.size(), bytes - sent));
    if (n <= 0) break;
    sent += static_cast<size_t>(n);
  }
  char done = 0;
  const bool ok = sent == bytes && read(fd, &done, 1) == 1;
  const double seconds = Seconds(t0);
  if (fd >= 0) close(fd);
  int status = 0;
  waitpid(reader, &status, 0);
  return ok ? seconds : -1;
}

// One round's times, written by rank 0: all-gather s, reduce-scatter s, memcpy s.
struct Round {
  double all_gather = 0, reduce_scatter = 0, copy = 0, tcp = 0;
};

int RunRank(int rank, int n, uint16_t port, size_t shard, int rounds, int iterations,
            const std::string& out) {
  std::unique_ptr<comm::TcpStoreServer> server;
  if (rank == 0) {
    auto s = comm::TcpStoreServer::Start("127.0.0.1", port);
    if (!s.ok()) {
      std::fprintf(stderr, "comm: %s\n", s.status().ToString().c_str());
      return 1;
    }
    server = std::move(*s);
  }
  auto store = comm::TcpStore::Connect("127.0.0.1", port, comm::Duration(30000));
  if (!store.ok()) {
    std::fprintf(stderr, "comm: %s\n", store.status().ToString().c_str());
    return 1;
  }
  const bool shm = absl::GetFlag(FLAGS_transport) == "shm";
  auto c =
      shm ? comm::CreateShmCommunicator(
                **store, {.rank = rank, .size = n, .timeout = comm::Duration(120000)})
          : comm::CreateGlooCommunicator(
                **store,
                {.rank = rank, .size = n, .host = "127.0.0.1", .timeout = comm::Duration(120000)});
  if (!c.ok()) {
    std::fprintf(stderr, "comm: %s\n", c.status().ToString().c_str());
    return 1;
  }
  comm::Communicator& comm = **c;
  std::vector<std::byte> mine(shard, std::byte{1}), all(shard * n);
  std::vector<float> grads(shard * n / sizeof(float), 1.0f), own(shard / sizeof(float));
  std::vector<std::byte> copy_from(shard * n, std::byte{2}), copy_to(shard * n);
  std::ofstream report(out);
  for (int round = 0; round <= rounds; ++round) {
    Round r;
    if (!comm.Barrier()->Wait().ok()) return 1;
    auto t0 = Clock::now();
    for (int i = 0; i < iterations; ++i) {
      if (!comm.AllGather(mine, absl::MakeSpan(all))->Wait().ok()) return 1;
    }
    r.all_gather = Seconds(t0) / iterations;
    if (!comm.Barrier()->Wait().ok()) return 1;
    t0 = Clock::now();
    for (int i = 0; i < iterations; ++i) {
      if (!comm.ReduceScatter(grads, absl::MakeSpan(own))->Wait().ok()) return 1;
    }
    r.reduce_scatter = Seconds(t0) / iterations;
    if (!comm.Barrier()->Wait().ok()) return 1;
    if (rank == 0) {
      // The ceiling, while the others wait in the barrier (blocked, not spinning).
      t0 = Clock::now();
      for (int i = 0; i < iterations; ++i) {
        std::memcpy(copy_to.data(), copy_from.data(), copy_to.size());
        copy_from[i] = copy_to[copy_to.size() - 1 - i];  // keeps the copies from being elided
      }
      r.copy = Seconds(t0) / iterations;
      // All the collective puts on loopback (Gloo's ceiling).
      r.tcp = shm ? 0 : LoopbackTcpSeconds(shard * n * (n - 1));
      if (round > 0) {
        report << r.all_gather << " " << r.reduce_scatter << " " << r.copy << " " << r.tcp << "\n";
      }
    }
    if (!comm.Barrier()->Wait().ok()) return 1;
  }
  return 0;
}

int Main() {
  const int n = absl::GetFlag(FLAGS_ranks);
  const int64_t mib = absl::GetFlag(FLAGS_shard_mib);
  const int rounds = absl::GetFlag(FLAGS_rounds);
  const int iterations = absl::GetFlag(FLAGS_iterations);
  const std::string transport = absl::GetFlag(FLAGS_transport);
  if (n < 2 || n > 64 || mib < 1 || mib > 1024 || rounds < 1 || iterations < 1 ||
      (transport != "gloo" && transport != "shm")) {
    std::fprintf(stderr,
                 "comm: accepted: --ranks 2..64, --shard_mib 1..1024, --rounds >= 1, "
                 "--iterations >= 1, --transport gloo or shm\n");
    return 2;
  }
  const bool shm = transport == "shm";
  const size_t shard = static_cast<size_t>(mib) << 20;
  // A free port for the store: bound by a store of our own, then given back.
  uint16_t port;
  {
    auto probe = comm::TcpStoreServer::Start("127.0.0.1", 0);
    if (!probe.ok()) return 1;
    port = (*probe)->port();
  }
  const std::string out = absl::StrCat("/tmp/strata-bench-comm-", getpid());
  std::vector<pid_t> pids;
  for (int r = 0; r < n; ++r) {
    pid_t pid = fork();
    if (pid == 0) _exit(RunRank(r, n, port, shard, rounds, iterations, out));
    pids.push_back(pid);
  }
  bool ok = true;
  for (pid_t pid : pids) {
    int status = 0;
    waitpid(pid, &status, 0);
    ok = ok && WIFEXITED(status) && WEXITSTATUS(status) == 0;
  }
  std::vector<Round> measured;
  {
    std::ifstream in(out);
    Round r;
    while (in >> r.all_gather >> r.reduce_scatter >> r.copy >> r.tcp) measured.push_back(r);
  }
  std::remove(out.c_str());
  if (!ok || measured.empty()) {
    std::fprintf(stderr, "comm: a rank failed\n");
    return 1;
  }
  // Bus bandwidth: (n - 1) / n of the whole buffer (n shards) per collective.
  const double bus_bytes = static_cast<double>(shard) * n * (n - 1) / n;
  const double copy_bytes = static_cast<double>(shard) * n;
  bench::Report report("comm", bench::MachineInfo::Probe("/tmp"));
  for (const char* op : {"all_gather", "reduce_scatter"}) {
    std::vector<double> value, ceiling, ratio, copy;
    for (const Round& r : measured) {
      const double t = std::string(op) == "all_gather" ? r.all_gather : r.reduce_scatter;
      value.push_back(bus_bytes / t / 1e9);
      const double limit = shm ? r.copy : r.tcp;  // shm: a rank copies its n shards
      ceiling.push_back(limit > 0 ? bus_bytes / limit / 1e9 : 0);
      copy.push_back(copy_bytes / r.copy / 1e9);
      ratio.push_back(ceiling.back() > 0 ? value.back() / ceiling.back() : 0);
    }
    Figure f;
    f.name = absl::StrCat(op, "_", transport, "_", n, "ranks");
    f.unit = "GB/s";
    f.value = Summary::Of(value);
    f.ceiling = Summary::Of(ceiling);
    f.ratio = Summary::Of(ratio);
    f.ceiling_source =
        shm ? "one memcpy of the n shards a rank copies into and out of the segment, in the same "
              "round, in bus terms"
            : "one loopback TCP stream between two processes carrying all the bytes the "
              "collective puts on loopback (n(n-1) shards), in the same round, in bus terms";
    f.note = absl::StrFormat("memcpy of the same bytes in the same round: %.2f GB/s",
                             Summary::Of(copy).median);
    f.config = {{"ranks", n},
                {"shard_bytes", shard},
                {"iterations", iterations},
                {"rounds", measured.size()},
                {"transport", shm ? "shared memory" : "Gloo TCP on loopback"}};
    std::printf(
        "%-28s bus %.2f GB/s [%.2f, %.2f]; %s, in bus terms, %.2f GB/s (%.2f of it); memcpy "
        "%.2f GB/s\n",
        f.name.c_str(), f.value.median, f.value.min, f.value.max,
        shm ? "the memcpy of a rank's n shards" : "one loopback TCP stream", f.ceiling.median,
        f.ratio.median, Summary::Of(copy).median);
    report.Add(f);
  }
  report.PrintClosingLines();
  if (!absl::GetFlag(FLAGS_json).empty() && !report.WriteJson(absl::GetFlag(FLAGS_json))) return 1;
  return 0;
}

}  // namespace
}  // namespace strata

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return strata::Main();
}
