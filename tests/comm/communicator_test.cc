// Both communicators (Gloo over TCP on loopback, and shared memory) with 1 to 4 ranks as
// processes, each meeting the others through a rendezvous store served by rank 0, as a launched
// job does: every behaviour of communicator.h is checked on each.
#include <dirent.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <csignal>
#include <cstdio>
#include <fstream>
#include <functional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "comm/gloo_communicator.h"
#include "comm/shm_communicator.h"
#include "comm/tcp_store.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/aio/test_util.h"
#include "tests/comm/comm_test_util.h"

namespace strata::comm {
namespace {

using ::testing::HasSubstr;
using Clock = std::chrono::steady_clock;

using testing::FreePort;

// What one rank does once connected; a non-empty return is its failure, reported to the parent.
using RankBody = std::function<std::string(Communicator&)>;

// Makes rank `rank`'s communicator of world size `size`.
using Make = std::function<absl::StatusOr<std::unique_ptr<Communicator>>(TcpStore&, int rank,
                                                                         int size, Duration)>;

absl::StatusOr<std::unique_ptr<Communicator>> MakeGloo(TcpStore& store, int rank, int size,
                                                       Duration timeout) {
  return CreateGlooCommunicator(
      store, {.rank = rank, .size = size, .host = "127.0.0.1", .timeout = timeout});
}

absl::StatusOr<std::unique_ptr<Communicator>> MakeShm(TcpStore& store, int rank, int size,
                                                      Duration timeout) {
  return CreateShmCommunicator(store, {.rank = rank, .size = size, .timeout = timeout});
}

// Small slots: every collective below takes many rounds, the last one short.
absl::StatusOr<std::unique_ptr<Communicator>> MakeShmSmall(TcpStore& store, int rank, int size,
                                                           Duration timeout) {
  return CreateShmCommunicator(
      store, {.rank = rank, .size = size, .timeout = timeout, .slot_bytes = 4096u * size});
}

struct Transport {
  const char* name;
  Make make;
};

void PrintTo(const Transport& t, std::ostream* os) { *os << t.name; }

const Transport kTransports[] = {{"gloo", MakeGloo}, {"shm", MakeShm}, {"shm_small", MakeShmSmall}};

struct RankOutcome {
  int exit_code = -1;
  std::string message;  // the rank's failure (or the error it was expected to see)
};

// Runs `size` ranks as child processes; rank r uses world size sizes[r] (default: size).
std::vector<RankOutcome> RunRanks(const Make& make, int size, const RankBody& body,
                                  Duration timeout, std::vector<int> sizes = {}) {
  if (sizes.empty()) sizes.assign(size, size);
  const uint16_t port = FreePort();
  strata::testing::ScratchDir dir;
  std::vector<pid_t> pids;
  for (int r = 0; r < size; ++r) {
    const std::string out = dir.File("rank" + std::to_string(r));
    pid_t pid = fork();
    if (pid == 0) {
      std::string message;
      std::unique_ptr<TcpStoreServer> server;
      if (r == 0) {
        auto s = TcpStoreServer::Start("127.0.0.1", port);
        if (!s.ok())
          message = std::string(s.status().message());
        else
          server = std::move(*s);
      }
      if (message.empty()) {
        auto store = TcpStore::Connect("127.0.0.1", port, timeout);
        if (!store.ok()) {
          message = std::string(store.status().message());
        } else {
          auto comm = make(**store, r, sizes[r], timeout);
          message = comm.ok() ? body(**comm) : std::string(comm.status().message());
        }
      }
      std::ofstream(out) << message;
      std::fflush(nullptr);
      _exit(message.empty() ? 0 : 1);
    }
    pids.push_back(pid);
  }
  std::vector<RankOutcome> outcomes(size);
  for (int r = 0; r < size; ++r) {
    int status = 0;
    waitpid(pids[r], &status, 0);
    outcomes[r].exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    std::ifstream in(dir.File("rank" + std::to_string(r)));
    std::stringstream text;
    text << in.rdbuf();
    outcomes[r].message = text.str();
  }
  return outcomes;
}

std::string Check(bool ok, const std::string& what) { return ok ? "" : what; }

// Every collective, with values that tell ranks and positions apart, checked on every rank.
std::string EveryCollective(Communicator& c) {
  const int n = c.size(), r = c.rank();
  // All-gather of 5 bytes per rank.
  std::vector<std::byte> mine(5), all(5 * n);
  for (int i = 0; i < 5; ++i) mine[i] = static_cast<std::byte>(r * 10 + i);
  if (auto s = c.AllGather(mine, absl::MakeSpan(all))->Wait(); !s.ok()) return s.ToString();
  for (int q = 0; q < n; ++q) {
    for (int i = 0; i < 5; ++i) {
      if (all[q * 5 + i] != static_cast<std::byte>(q * 10 + i)) return "all-gather: wrong bytes";
    }
  }
  // Reduce-scatter of n shards of 1000 floats (an odd size): shard q of rank p holds p + q + i.
  const size_t chunk = 1001;
  std::vector<float> in(chunk * n), out(chunk);
  for (int q = 0; q < n; ++q) {
    for (size_t i = 0; i < chunk; ++i) in[q * chunk + i] = static_cast<float>(r + q + i % 7);
  }
  if (auto s = c.ReduceScatter(in, absl::MakeSpan(out))->Wait(); !s.ok()) return s.ToString();
  for (size_t i = 0; i < chunk; ++i) {
    // sum over p of (p + r + i%7) = n(n-1)/2 + n*(r + i%7)
    const float want = static_cast<float>(n * (n - 1) / 2 + n * (r + static_cast<int>(i % 7)));
    if (out[i] != want) {
      return "reduce-scatter: element " + std::to_string(i) + " is " + std::to_string(out[i]) +
             ", want " + std::to_string(want);
    }
  }
  // All-reduce, several issued before any is waited for (they run in order).
  std::vector<float> a(300, static_cast<float>(r + 1)), b(7, 1.0f);
  auto wa = c.AllReduce(absl::MakeSpan(a));
  auto wb = c.AllReduce(absl::MakeSpan(b));
  if (auto s = wb->Wait(); !s.ok()) return s.ToString();
  if (!wa->done()) return "all-reduce: a later collective finished before an earlier one";
  if (auto s = wa->Wait(); !s.ok()) return s.ToString();
  if (a[299] != static_cast<float>(n * (n + 1) / 2) || b[0] != static_cast<float>(n)) {
    return "all-reduce: wrong sum";
  }
  // Broadcast from the last rank.
  std::vector<std::byte> data(64, static_cast<std::byte>(r));
  if (auto s = c.Broadcast(absl::MakeSpan(data), n - 1)->Wait(); !s.ok()) return s.ToString();
  if (data[63] != static_cast<std::byte>(n - 1)) return "broadcast: wrong bytes";
  if (auto s = c.Barrier()->Wait(); !s.ok()) return s.ToString();
  // Bad shapes are refused on the spot, naming what is accepted, and break nothing.
  auto bad = c.ReduceScatter(in, absl::MakeSpan(out).subspan(1))->Wait();
  if (bad.code() != absl::StatusCode::kInvalidArgument) return "a bad shape was not refused";
  return Check(c.Barrier()->Wait().ok(), "a barrier after a refused call failed");
}

// Collectives of many rounds on shared memory (larger than its slots, sizes that leave a short
// last round), on every rank: each element tells rank and position apart.
std::string LargeCollectives(Communicator& c) {
  const int n = c.size(), r = c.rank();
  const size_t bytes = 100003;
  std::vector<std::byte> mine(bytes), all(bytes * n);
  for (size_t i = 0; i < bytes; ++i) mine[i] = static_cast<std::byte>((r * 31 + i) % 251);
  if (auto s = c.AllGather(mine, absl::MakeSpan(all))->Wait(); !s.ok()) return s.ToString();
  for (int q = 0; q < n; ++q) {
    for (size_t i = 0; i < bytes; ++i) {
      if (all[q * bytes + i] != static_cast<std::byte>((q * 31 + i) % 251)) {
        return "all-gather: rank " + std::to_string(q) + "'s byte " + std::to_string(i);
      }
    }
  }
  const size_t chunk = 50001;
  std::vector<float> in(chunk * n), out(chunk);
  for (size_t k = 0; k < in.size(); ++k) in[k] = static_cast<float>((k + r) % 1000);
  if (auto s = c.ReduceScatter(in, absl::MakeSpan(out))->Wait(); !s.ok()) return s.ToString();
  for (size_t i = 0; i < chunk; ++i) {
    float want = 0;
    for (int p = 0; p < n; ++p) want += static_cast<float>((r * chunk + i + p) % 1000);
    if (out[i] != want) return "reduce-scatter: element " + std::to_string(i);
  }
  std::vector<float> sum(30001);
  for (size_t i = 0; i < sum.size(); ++i) sum[i] = static_cast<float>(i % 97 + r);
  if (auto s = c.AllReduce(absl::MakeSpan(sum))->Wait(); !s.ok()) return s.ToString();
  for (size_t i = 0; i < sum.size(); ++i) {
    if (sum[i] != static_cast<float>(n * (i % 97) + n * (n - 1) / 2)) return "all-reduce: wrong";
  }
  std::vector<std::byte> data(70001, static_cast<std::byte>(r));
  if (r == 0) {
    for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<std::byte>(i % 13);
  }
  if (auto s = c.Broadcast(absl::MakeSpan(data), 0)->Wait(); !s.ok()) return s.ToString();
  for (size_t i = 0; i < data.size(); ++i) {
    if (data[i] != static_cast<std::byte>(i % 13)) return "broadcast: byte " + std::to_string(i);
  }
  return "";
}

class Ranks : public ::testing::TestWithParam<std::tuple<Transport, int>> {};

TEST_P(Ranks, EveryCollectiveGivesTheSameResultOnEveryRank) {
  const auto [transport, size] = GetParam();
  for (const RankBody& body : {RankBody(EveryCollective), RankBody(LargeCollectives)}) {
    const auto outcomes = RunRanks(transport.make, size, body, Duration(30000));
    for (size_t r = 0; r < outcomes.size(); ++r) {
      EXPECT_EQ(outcomes[r].exit_code, 0) << "rank " << r << ": " << outcomes[r].message;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(TransportsAndSizes, Ranks,
                         ::testing::Combine(::testing::ValuesIn(kTransports),
                                            ::testing::Values(1, 2, 4)),
                         [](const auto& info) {
                           return std::string(std::get<0>(info.param).name) + "_" +
                                  std::to_string(std::get<1>(info.param));
                         });

class EachTransport : public ::testing::TestWithParam<Transport> {};

INSTANTIATE_TEST_SUITE_P(Transports, EachTransport, ::testing::ValuesIn(kTransports),
                         [](const auto& info) { return std::string(info.param.name); });

TEST_P(EachTransport, AWorldSizeThatDiffersFromRankZerosIsNamedAndNothingHangs) {
  const auto t0 = Clock::now();
  const auto outcomes =
      RunRanks(GetParam().make, 2,
               [](Communicator&) { return std::string("connected, but should not have"); },
               Duration(3000), {2, 3});
  EXPECT_NE(outcomes[1].exit_code, 0);
  EXPECT_THAT(outcomes[1].message, HasSubstr("was given world size 3 but rank 0 was given 2"));
  EXPECT_NE(outcomes[0].exit_code, 0);  // it reads rank 1's size too: named there at once
  EXPECT_THAT(outcomes[0].message,
              HasSubstr("this rank (0) was given world size 2 but rank 1 was given 3"));
  EXPECT_LT(Clock::now() - t0, std::chrono::seconds(2));
}

TEST_P(EachTransport, ARankThatDiesEndsTheOthersCollectivesWithAnError) {
  const auto t0 = Clock::now();
  const auto outcomes = RunRanks(
      GetParam().make, 3,
      [](Communicator& c) -> std::string {
        // Everyone connected first (a rank dying in the rendezvous is another case).
        if (absl::Status s = c.Barrier()->Wait(); !s.ok()) return "barrier: " + s.ToString();
        if (c.rank() == 2) _exit(0);  // dies without a word
        std::vector<float> x(1 << 16, 1.0f);
        absl::Status s = c.AllReduce(absl::MakeSpan(x))->Wait();
        if (s.ok()) return "an all-reduce with a dead rank succeeded";
        absl::Status again = c.Barrier()->Wait();
        if (again.ok() || again.message().find("broken") == std::string::npos) {
          return "the communicator went on after a failure: " + again.ToString();
        }
        return "expected: " + std::string(s.message());
      },
      Duration(10000));
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(outcomes[r].exit_code, 1) << outcomes[r].message;
    EXPECT_THAT(outcomes[r].message, HasSubstr("expected: rank "));
    EXPECT_THAT(outcomes[r].message, HasSubstr("all-reduce failed"));
  }
  // Gloo sees the closed connection; shared memory the dead rank's mutex, within 100 ms or so.
  EXPECT_LT(Clock::now() - t0, std::chrono::seconds(GetParam().name[0] == 's' ? 5 : 30));
}

// A caller that gives up waiting (Ctrl-C) aborts: the peers' collectives fail at once, and later
// ones here are refused at once instead of queued behind the one left blocked.
TEST_P(EachTransport, AnAbortEndsThePeersCollectivesAndRefusesLaterOnesAtOnce) {
  const auto outcomes = RunRanks(
      GetParam().make, 2,
      [](Communicator& c) -> std::string {
        if (absl::Status s = c.Barrier()->Wait(); !s.ok()) return "barrier: " + s.ToString();
        std::vector<float> x(1 << 10, 1.0f);
        if (c.rank() == 1) {  // late: rank 0 has given up by then
          std::this_thread::sleep_for(std::chrono::seconds(2));
          const auto t0 = Clock::now();
          absl::Status s = c.AllReduce(absl::MakeSpan(x))->Wait();
          if (s.ok()) return "an all-reduce with an aborted peer succeeded";
          if (Clock::now() - t0 > std::chrono::seconds(3)) return "failed only at the timeout";
          return "";
        }
        auto work = c.AllReduce(absl::MakeSpan(x));
        if (work->WaitFor(std::chrono::milliseconds(300))) return "done without rank 1";
        c.Abort();
        const auto t0 = Clock::now();
        absl::Status s = c.Barrier()->Wait();
        if (s.ok() || s.message().find("the communicator was aborted") == std::string::npos) {
          return "after the abort: " + s.ToString();
        }
        if (Clock::now() - t0 > std::chrono::milliseconds(500)) return "refused only late";
        work->Wait().IgnoreError();  // (a blocked one ends by its timeout before the join)
        return "";
      },
      Duration(6000));
  EXPECT_EQ(outcomes[0].exit_code, 0) << outcomes[0].message;
  EXPECT_EQ(outcomes[1].exit_code, 0) << outcomes[1].message;
}

// Ranks that issue different collectives are named on shared memory, not left reading each
// other's bytes (Gloo has no such check: its ranks wait until the timeout, or mix bytes).
TEST(ShmCommunicatorTest, RanksThatIssueDifferentCollectivesAreNamed) {
  const auto outcomes = RunRanks(
      MakeShm, 2,
      [](Communicator& c) -> std::string {
        std::vector<float> x(c.rank() == 0 ? 10 : 12, 1.0f);
        absl::Status s = c.AllReduce(absl::MakeSpan(x))->Wait();
        if (s.ok()) return "all-reduces of different sizes succeeded";
        return "expected: " + std::string(s.message());
      },
      Duration(10000));
  EXPECT_THAT(outcomes[0].message,
              HasSubstr("all-reduce of 40 bytes: rank 1 issued all-reduce of 48 bytes"));
  EXPECT_THAT(outcomes[1].message,
              HasSubstr("all-reduce of 48 bytes: rank 0 issued all-reduce of 40 bytes"));
}

// One that moves nothing still takes a round: a rank whose all-gather is empty where the other's
// is not is named, not handed the other's next collective's bytes (an audit's finding).
TEST(ShmCommunicatorTest, AnEmptyCollectiveAgainstAFullOneIsNamed) {
  const auto outcomes = RunRanks(
      MakeShm, 2,
      [](Communicator& c) -> std::string {
        std::vector<std::byte> in(c.rank() == 0 ? 0 : 8, std::byte{1}), out(2 * in.size());
        absl::Status s = c.AllGather(in, absl::MakeSpan(out))->Wait();
        if (s.ok()) return "all-gathers of 0 and 8 bytes succeeded";
        return "expected: " + std::string(s.message());
      },
      Duration(10000));
  EXPECT_THAT(outcomes[0].message,
              HasSubstr("all-gather of 0 bytes: rank 1 issued all-gather of 8 bytes"));
  EXPECT_THAT(outcomes[1].message,
              HasSubstr("all-gather of 8 bytes: rank 0 issued all-gather of 0 bytes"));
}

// The segment is unlinked once every rank has mapped it: nothing is left in /dev/shm while the
// ranks run (rank 0 names it after its process id), nor after.
bool SegmentOf(pid_t pid) {
  bool found = false;
  const std::string mine = "strata-" + std::to_string(pid) + "-";
  if (DIR* d = opendir("/dev/shm")) {
    while (dirent* e = readdir(d)) found = found || std::string(e->d_name).rfind(mine, 0) == 0;
    closedir(d);
  }
  return found;
}

TEST(ShmCommunicatorTest, NothingIsLeftInDevShm) {
  const auto outcomes = RunRanks(
      MakeShm, 2,
      [](Communicator& c) -> std::string {
        if (absl::Status s = c.Barrier()->Wait(); !s.ok()) return s.ToString();
        if (c.rank() != 0) return "";
        // (the same check sees a segment of its own: one made beside the communicator's)
        if (SegmentOf(getpid())) return "the segment is left in /dev/shm while the ranks run";
        const int fd = shm_open(("/strata-" + std::to_string(getpid()) + "-check").c_str(),
                                O_CREAT | O_EXCL | O_RDWR, 0600);
        const bool seen = SegmentOf(getpid());
        shm_unlink(("/strata-" + std::to_string(getpid()) + "-check").c_str());
        if (fd >= 0) close(fd);
        return seen ? "" : "the check cannot see a segment";
      },
      Duration(10000));
  EXPECT_EQ(outcomes[0].exit_code, 0) << outcomes[0].message;
  EXPECT_EQ(outcomes[1].exit_code, 0) << outcomes[1].message;
}

// A rank that cannot map rank 0's segment (here: it expects another size of it) is named on
// every rank, with the same FailedPrecondition, so that all may take another transport.
TEST(ShmCommunicatorTest, ARankThatCannotMapTheSegmentIsNamedOnEveryRank) {
  const auto outcomes = RunRanks(
      [](TcpStore& store, int rank, int size, Duration timeout) {
        return CreateShmCommunicator(store, {.rank = rank,
                                             .size = size,
                                             .timeout = timeout,
                                             .slot_bytes = rank == 1 ? 8192u * 2 : 4096u * 2});
      },
      2, [](Communicator&) { return std::string("mapped, but should not have"); }, Duration(10000));
  for (int r = 0; r < 2; ++r) {
    EXPECT_THAT(outcomes[r].message, HasSubstr("rank 1 could not map the segment")) << r;
  }
}

TEST(ShmCommunicatorTest, BadSlotBytesAreRefusedNamingWhatIsAccepted) {
  auto server = TcpStoreServer::Start("127.0.0.1", 0);
  ASSERT_TRUE(server.ok());
  auto store = TcpStore::Connect("127.0.0.1", (*server)->port(), Duration(5000));
  ASSERT_TRUE(store.ok());
  for (size_t bad : {size_t{100}, size_t{12290}}) {  // too small; not a multiple of 64
    auto c = CreateShmCommunicator(**store, {.rank = 0, .size = 2, .slot_bytes = bad});
    EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_THAT(c.status().message(), HasSubstr("a multiple of 64 bytes, 4096 x size (8192)"));
  }
}

// The default slot holds a page a rank whatever the world size: 65 ranks and more were refused
// by their own default (an audit's finding). Rank 0 of 65 alone: it waits for the others, and
// says so at the timeout.
TEST(ShmCommunicatorTest, TheDefaultSlotIsAcceptedAtEveryWorldSize) {
  auto server = TcpStoreServer::Start("127.0.0.1", 0);
  ASSERT_TRUE(server.ok());
  for (int size : {65, 1000}) {
    auto store = TcpStore::Connect("127.0.0.1", (*server)->port(), Duration(5000));
    ASSERT_TRUE(store.ok());
    auto c = CreateShmCommunicator(**store, {.rank = 0,
                                             .size = size,
                                             .timeout = Duration(200),
                                             .prefix = "shm" + std::to_string(size)});
    EXPECT_EQ(c.status().code(), absl::StatusCode::kDeadlineExceeded) << c.status();
    EXPECT_THAT(std::string(c.status().message()), HasSubstr("waiting for \"shm")) << size;
  }
}

// Gloo writes to its sockets without MSG_NOSIGNAL: a write racing a dead peer's close raised
// SIGPIPE and ended a survivor (seen as exit 141 in the test above, about one run in eight).
// Making a communicator ignores SIGPIPE when it was left at its default, and keeps a handler.
void OnSigpipe(int) {}

TEST(GlooCommunicatorTest, SigpipeIsIgnoredUnlessTheProgramHandlesIt) {
  for (bool own_handler : {false, true}) {
    pid_t pid = fork();
    if (pid == 0) {
      signal(SIGPIPE, own_handler ? OnSigpipe : SIG_DFL);
      auto server = TcpStoreServer::Start("127.0.0.1", 0);
      if (!server.ok()) _exit(2);
      auto store = TcpStore::Connect("127.0.0.1", (*server)->port(), Duration(5000));
      if (!store.ok()) _exit(3);
      auto c = CreateGlooCommunicator(**store, {.rank = 0, .size = 1});
      if (!c.ok()) _exit(4);
      struct sigaction now {};
      sigaction(SIGPIPE, nullptr, &now);
      _exit(now.sa_handler == (own_handler ? OnSigpipe : SIG_IGN) ? 0 : 5);
    }
    int status = 0;
    waitpid(pid, &status, 0);
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0)
        << "own handler " << own_handler << ": status " << status;
  }
}

}  // namespace
}  // namespace strata::comm
