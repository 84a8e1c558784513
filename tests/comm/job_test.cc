#include "comm/job.h"

#include <netinet/in.h>
#include <sched.h>
#include <sys/mount.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <functional>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/comm/comm_test_util.h"

namespace strata::comm {
namespace {

using ::testing::HasSubstr;

GetEnv From(std::map<std::string, std::string> vars) {
  return [vars = std::move(vars)](const char* k) -> const char* {
    auto it = vars.find(k);
    return it == vars.end() ? nullptr : it->second.c_str();
  };
}

std::map<std::string, std::string> Launched(int rank, int size, int port) {
  return {{"MASTER_ADDR", "127.0.0.1"},
          {"MASTER_PORT", std::to_string(port)},
          {"RANK", std::to_string(rank)},
          {"WORLD_SIZE", std::to_string(size)},
          {"LOCAL_RANK", std::to_string(rank)}};
}

TEST(JobEnvTest, NoLauncherVariablesIsAJobOfOneProcess) {
  auto env = JobEnvFromEnvironment(From({}));
  ASSERT_TRUE(env.ok()) << env.status();
  EXPECT_FALSE(env->launched);
  EXPECT_EQ(env->rank, 0);
  EXPECT_EQ(env->world_size, 1);
}

TEST(JobEnvTest, TheLaunchersVariablesAreReadAndTheStoreIsBesideMasterPort) {
  auto vars = Launched(2, 4, 29500);
  vars["LOCAL_RANK"] = "0";
  vars["GLOO_SOCKET_IFNAME"] = "eth1";
  auto env = JobEnvFromEnvironment(From(vars));
  ASSERT_TRUE(env.ok()) << env.status();
  EXPECT_TRUE(env->launched);
  EXPECT_EQ(env->rank, 2);
  EXPECT_EQ(env->world_size, 4);
  EXPECT_EQ(env->local_rank, 0);
  EXPECT_EQ(env->master_port, 29500);
  EXPECT_EQ(env->store_port, 29501);
  EXPECT_EQ(env->gloo_iface, "eth1");
  vars["STRATA_STORE_PORT"] = "40000";
  EXPECT_EQ(JobEnvFromEnvironment(From(vars))->store_port, 40000);
}

struct BadEnv {
  const char* var;
  const char* value;  // null: unset
  const char* message;
};
class JobEnvRejects : public ::testing::TestWithParam<BadEnv> {};

TEST_P(JobEnvRejects, NamingTheVariableAndWhatIsAccepted) {
  auto vars = Launched(1, 2, 29500);
  if (GetParam().value == nullptr) {
    vars.erase(GetParam().var);
  } else {
    vars[GetParam().var] = GetParam().value;
  }
  auto env = JobEnvFromEnvironment(From(vars));
  ASSERT_FALSE(env.ok()) << GetParam().var;
  EXPECT_EQ(env.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(env.status().message(), HasSubstr(GetParam().message));
}

INSTANTIATE_TEST_SUITE_P(
    Variables, JobEnvRejects,
    ::testing::Values(
        BadEnv{"WORLD_SIZE", nullptr, "WORLD_SIZE is not set"},
        BadEnv{"RANK", nullptr, "RANK is not set"},
        BadEnv{"LOCAL_RANK", nullptr, "LOCAL_RANK is not set"},
        BadEnv{"MASTER_PORT", nullptr, "MASTER_PORT is not set"},
        BadEnv{"MASTER_ADDR", nullptr, "MASTER_ADDR is not set"},
        BadEnv{"MASTER_ADDR", "", "MASTER_ADDR is empty"},
        BadEnv{"MASTER_PORT", "http", "MASTER_PORT=\"http\": accepted: an integer in [1, 65534]"},
        BadEnv{"MASTER_PORT", "70000", "MASTER_PORT=\"70000\""},
        BadEnv{"WORLD_SIZE", "0", "WORLD_SIZE=\"0\": accepted: an integer in [1,"},
        BadEnv{"RANK", "2", "RANK=\"2\": accepted: 0..WORLD_SIZE-1 (WORLD_SIZE is 2)"},
        BadEnv{"RANK", "-1", "RANK=\"-1\""},
        BadEnv{"LOCAL_RANK", "3", "LOCAL_RANK=\"3\": accepted: at most RANK"},
        BadEnv{"STRATA_STORE_PORT", "29500", "a port other than MASTER_PORT"}));

TEST(JoinJobTest, AJobOfOneProcessHasACommunicatorOfOne) {
  auto env = JobEnvFromEnvironment(From({}));
  ASSERT_TRUE(env.ok());
  auto job = JoinJob(*env, Duration(5000));
  ASSERT_TRUE(job.ok()) << job.status();
  EXPECT_EQ(job->comm->size(), 1);
  std::vector<float> x = {1, 2, 3};
  ASSERT_TRUE(job->comm->AllReduce(absl::MakeSpan(x))->Wait().ok());
  EXPECT_EQ(x[2], 3);
}

// Ctrl-C in the Python front while a rank waits for the others (one never launched, say): the
// stop check ends the joining, where it waited for the whole timeout before.
TEST(JoinJobTest, AStopCheckEndsTheWaitForRanksThatNeverCome) {
  const uint16_t port = testing::FreePort();
  auto env = JobEnvFromEnvironment(From(Launched(0, 2, port)));
  ASSERT_TRUE(env.ok()) << env.status();
  const auto t0 = std::chrono::steady_clock::now();
  const auto until = t0 + std::chrono::milliseconds(300);
  auto job = JoinJob(*env, Duration(60000), "auto", [until]() -> absl::Status {
    if (std::chrono::steady_clock::now() < until) return absl::OkStatus();
    return absl::CancelledError("interrupted");
  });
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(5));
  ASSERT_FALSE(job.ok());
  EXPECT_EQ(job.status().code(), absl::StatusCode::kCancelled) << job.status();
}

// Runs 2 launched ranks beside a torch store on MASTER_PORT; rank r joins with transports[r] and
// then runs `body`; each rank's exit status.
std::vector<int> TwoRanks(const char* const (&transports)[2],
                          const std::function<int(int rank, absl::StatusOr<Job>&)>& body) {
  // A port for the torch store whose next port (strata's) is free too (FreePort).
  uint16_t port = 0;
  int torch_store = -1;
  for (int attempt = 0; attempt < 50 && torch_store < 0; ++attempt) {
    port = testing::FreePort();
    torch_store = testing::ListenOnLoopback(&port);
  }
  if (torch_store < 0) return {-1, -1};
  const int master_port = port;
  std::vector<pid_t> pids;
  for (int r = 0; r < 2; ++r) {
    pid_t pid = fork();
    if (pid == 0) {
      auto env = JobEnvFromEnvironment(From(Launched(r, 2, master_port)));
      if (!env.ok()) _exit(2);
      auto job = JoinJob(*env, Duration(20000), transports[r]);
      _exit(body(r, job));
    }
    pids.push_back(pid);
  }
  std::vector<int> codes;
  for (pid_t pid : pids) {
    int status = 0;
    waitpid(pid, &status, 0);
    codes.push_back(WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status));
  }
  close(torch_store);
  return codes;
}

// torch.distributed (or torchrun's agent) already listens on MASTER_PORT: strata's store is on
// the next port, and two launched ranks meet and reduce, through shared memory (on one host, by
// default) or over TCP.
TEST(JoinJobTest, RanksMeetBesideATorchStoreOnMasterPort) {
  for (auto [transport, name] : {std::pair{"auto", "shared memory"},
                                 std::pair{"shm", "shared memory"}, std::pair{"tcp", "tcp"}}) {
    const auto codes = TwoRanks(
        {transport, transport}, [name = std::string(name)](int r, absl::StatusOr<Job>& job) {
          if (!job.ok()) {
            fprintf(stderr, "rank %d: %s\n", r, job.status().ToString().c_str());
            return 3;
          }
          if (job->transport != name) return 6;
          std::vector<float> x(10, static_cast<float>(r + 1));
          // The side communicator's collective is issued first and waited for last: it runs beside
          // the first communicator's, not before or after it.
          std::vector<float> y(10, static_cast<float>(10 * (r + 1)));
          auto side = job->side->AllReduce(absl::MakeSpan(y));
          if (!job->comm->AllReduce(absl::MakeSpan(x))->Wait().ok() || x[9] != 3.0f) return 4;
          if (!side->Wait().ok() || y[9] != 30.0f) return 5;
          return 0;
        });
    EXPECT_EQ(codes, (std::vector<int>{0, 0})) << name;
  }
}

// Where /dev/shm has room for the first segment and not the second (a container's small one),
// "auto" lets the first go and every rank takes TCP together (an audit's finding: they raised).
// In a mount namespace of its own, with a /dev/shm of 20 MiB: a segment of 2 ranks is 16 MiB.
TEST(JoinJobTest, AutoTakesTcpWhereDevShmHasRoomForOneSegmentOfTheTwo) {
  const pid_t pid = fork();
  if (pid == 0) {
    if (unshare(CLONE_NEWNS) != 0 ||
        mount(nullptr, "/", nullptr, MS_REC | MS_PRIVATE, nullptr) != 0 ||
        mount("tmpfs", "/dev/shm", "tmpfs", 0, "size=20m") != 0) {
      _exit(77);
    }
    const auto codes = TwoRanks({"auto", "auto"}, [](int r, absl::StatusOr<Job>& job) {
      if (!job.ok()) {
        fprintf(stderr, "rank %d: %s\n", r, job.status().ToString().c_str());
        return 3;
      }
      if (job->transport != "tcp") return 6;
      std::vector<float> x(10, static_cast<float>(r + 1));
      return job->comm->AllReduce(absl::MakeSpan(x))->Wait().ok() && x[9] == 3.0f ? 0 : 4;
    });
    _exit(codes == std::vector<int>{0, 0} ? 0 : 1);
  }
  int status = 0;
  waitpid(pid, &status, 0);
  ASSERT_TRUE(WIFEXITED(status)) << status;
  if (WEXITSTATUS(status) == 77) GTEST_SKIP() << "no mount namespace of its own here";
  EXPECT_EQ(WEXITSTATUS(status), 0);
}

// A rank given another transport than rank 0's is named, rather than left waiting for a
// segment that is never made.
TEST(JoinJobTest, ATransportThatDiffersFromRankZerosIsNamed) {
  const auto codes = TwoRanks({"auto", "tcp"}, [](int r, absl::StatusOr<Job>& job) {
    const std::string want = r == 0 ? "(0) was given the transport \"auto\" "
                                      "(strata.comm_transport) but rank 1 was given \"tcp\""
                                    : "(1) was given the transport \"tcp\" "
                                      "(strata.comm_transport) but rank 0 was given \"auto\"";
    return !job.ok() && absl::StrContains(job.status().message(), want) ? 0 : 7;
  });
  EXPECT_EQ(codes, (std::vector<int>{0, 0}));
}

}  // namespace
}  // namespace strata::comm
