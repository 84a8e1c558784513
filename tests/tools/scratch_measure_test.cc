// The test file's safety rules and one real measurement on the build disk.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <filesystem>
#include <fstream>

#include "absl/strings/str_cat.h"
#include "aio/buffer.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/aio/test_util.h"
#include "tools/aio_bench/measure.h"
#include "tools/aio_bench/scratch.h"

namespace strata::aio_bench {
namespace {

using ::strata::testing::ScratchDir;
using ::testing::HasSubstr;

TEST(ScratchFileTest, IsLaidDownWholeAndRemovedWhenDone) {
  ScratchDir dir;
  std::string path;
  {
    auto f = ScratchFile::Create(dir.path(), "t.dat", 16 << 20, {});
    ASSERT_TRUE(f.ok()) << f.status();
    path = (*f)->path();
    EXPECT_EQ(std::filesystem::file_size(path), 16u << 20);
    EXPECT_TRUE((*f)->direct());
    EXPECT_TRUE((*f)->warning().empty());
  }
  EXPECT_FALSE(std::filesystem::exists(path));
}

TEST(ScratchFileTest, NeverWritesOverAnExistingFileWithoutOverwrite) {
  ScratchDir dir;
  const std::string path = dir.File("t.dat");
  { std::ofstream(path) << "precious"; }
  auto f = ScratchFile::Create(dir.path(), "t.dat", 16 << 20, {});
  EXPECT_EQ(f.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(f.status().message(), HasSubstr("--overwrite"));
  std::ifstream in(path);
  std::string text;
  in >> text;
  EXPECT_EQ(text, "precious");  // untouched, and not removed
  ScratchOptions o;
  o.overwrite = true;
  auto g = ScratchFile::Create(dir.path(), "t.dat", 16 << 20, o);
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_EQ(std::filesystem::file_size(path), 16u << 20);
}

TEST(ScratchFileTest, RefusesToStartWithoutEnoughSpaceAndSaysHowMuch) {
  ScratchDir dir;
  auto f = ScratchFile::Create(dir.path(), "t.dat", 1ull << 50, {});
  EXPECT_EQ(f.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(f.status().message(), HasSubstr("needs 1073741888 MiB free"));
  EXPECT_FALSE(std::filesystem::exists(dir.File("t.dat")));
}

TEST(ScratchFileTest, MissingDirectoryIsNotFound) {
  auto f = ScratchFile::Create("/nonexistent/strata", "t.dat", 16 << 20, {});
  EXPECT_EQ(f.status().code(), absl::StatusCode::kNotFound);
}

TEST(CheckMeasuredDirectoryTest, ADirectoryThisUserCannotWriteIsRefusedBeforeAnythingIsMade) {
  // As root, the check runs in a child that drops to nobody; the folder stays root's 0755.
  ScratchDir dir = ScratchDir::Traversable();
  const bool root = geteuid() == 0;
  if (!root)
    std::filesystem::permissions(
        dir.path(), std::filesystem::perms::owner_read | std::filesystem::perms::owner_exec);
  int pipefd[2];
  ASSERT_EQ(pipe(pipefd), 0);
  const pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    if (root && setuid(65534) != 0) _exit(3);
    const absl::Status s = CheckMeasuredDirectory(dir.path(), {}, nullptr);
    const std::string text = absl::StrCat(static_cast<int>(s.code()), " ", s.message());
    if (write(pipefd[1], text.data(), text.size()) < 0) _exit(4);
    _exit(0);
  }
  close(pipefd[1]);
  std::string text;
  char buf[512];
  for (ssize_t n; (n = read(pipefd[0], buf, sizeof(buf))) > 0;) text.append(buf, n);
  close(pipefd[0]);
  int status = 0;
  ASSERT_EQ(waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
  EXPECT_THAT(text, HasSubstr(absl::StrCat(static_cast<int>(absl::StatusCode::kPermissionDenied),
                                           " ", dir.path(),
                                           ": this user cannot make the test "
                                           "file there (Permission denied)")));
}

// Stands in a filesystem that refuses O_DIRECT (this kernel's tmpfs takes it).
int RefuseODirect(const char* path, int flags, mode_t mode) {
  if (flags & O_DIRECT) {
    errno = EINVAL;
    return -1;
  }
  return ::open(path, flags, mode);
}

TEST(ScratchFileTest, FilesystemRefusingODirectStopsUnlessBufferedIsAllowed) {
  ScratchDir dir;
  ScratchOptions o;
  o.open_for_probe = RefuseODirect;
  auto f = ScratchFile::Create(dir.path(), "t.dat", 16 << 20, o);
  EXPECT_EQ(f.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(f.status().message(), HasSubstr("refuses O_DIRECT"));
  EXPECT_THAT(f.status().message(), HasSubstr("--allow-buffered"));
  o.allow_buffered = true;
  auto g = ScratchFile::Create(dir.path(), "t.dat", 16 << 20, o);
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_FALSE((*g)->direct());
  EXPECT_THAT((*g)->warning(), HasSubstr("BUFFERED"));
}

TEST(ScratchFileTest, IsRemovedOnCtrlC) {
  ScratchDir dir;
  const std::string path = dir.File("t.dat");
  int pipefd[2];
  ASSERT_EQ(pipe(pipefd), 0);
  const pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    auto f = ScratchFile::Create(dir.path(), "t.dat", 8 << 20, {});
    char c = f.ok() ? 'y' : 'n';
    if (write(pipefd[1], &c, 1) != 1) _exit(3);
    pause();  // until SIGINT
    _exit(4);
  }
  char c = 0;
  ASSERT_EQ(read(pipefd[0], &c, 1), 1);
  ASSERT_EQ(c, 'y');
  EXPECT_TRUE(std::filesystem::exists(path));
  kill(pid, SIGINT);
  int status = 0;
  ASSERT_EQ(waitpid(pid, &status, 0), pid);
  EXPECT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGINT);
  EXPECT_FALSE(std::filesystem::exists(path));
}

TEST(MeasurePointTest, MeasuresARealPointOnTheBuildDisk) {
  ScratchDir dir;
  auto f = ScratchFile::Create(dir.path(), "t.dat", 64 << 20, {});
  ASSERT_TRUE(f.ok()) << f.status();
  Point p;
  p.config.queue_depth = 4;
  p.op = Op::kRead;
  auto buffer = aio::AlignedBuffer::Allocate(BufferBytesFor(p.config), {.huge_pages = true});
  ASSERT_TRUE(buffer.ok());
  MeasureOptions mo;
  mo.reps = 3;
  mo.rep_seconds = 0.05;
  mo.warmup_seconds = 0.02;
  PointResult r = MeasurePoint(p, (*f)->path(), 64 << 20, buffer->data(), mo);
  ASSERT_TRUE(r.ok) << r.error;
  EXPECT_GT(r.gb_per_s.median, 0);
  EXPECT_LE(r.gb_per_s.min, r.gb_per_s.median);
  EXPECT_GE(r.gb_per_s.max, r.gb_per_s.median);
  EXPECT_GT(r.iops, 0);
  EXPECT_GT(r.latency_p99_us, 0);
  EXPECT_GE(r.latency_max_us, r.latency_p99_us);
  p.op = Op::kWrite;
  r = MeasurePoint(p, (*f)->path(), 64 << 20, buffer->data(), mo);
  ASSERT_TRUE(r.ok) << r.error;
}

TEST(MeasurePointTest, AWideSpreadIsMeasuredAgainAndMarkedWhenItStaysWide) {
  ScratchDir dir;
  auto f = ScratchFile::Create(dir.path(), "t.dat", 64 << 20, {});
  ASSERT_TRUE(f.ok()) << f.status();
  Point p;
  p.config.queue_depth = 4;
  auto buffer = aio::AlignedBuffer::Allocate(BufferBytesFor(p.config), {.huge_pages = true});
  ASSERT_TRUE(buffer.ok());
  MeasureOptions mo;
  mo.reps = 2;
  mo.rep_seconds = 0.02;
  mo.warmup_seconds = 0;
  mo.max_spread = -1;  // every spread counts as wide
  mo.extra_rounds = 2;
  PointResult r = MeasurePoint(p, (*f)->path(), 64 << 20, buffer->data(), mo);
  ASSERT_TRUE(r.ok) << r.error;
  EXPECT_EQ(r.rounds_repeated, 2);
  EXPECT_TRUE(r.noisy);
  EXPECT_EQ(r.ToJson()["noisy"], true);
  mo.max_spread = 1e9;  // no spread is wide
  r = MeasurePoint(p, (*f)->path(), 64 << 20, buffer->data(), mo);
  ASSERT_TRUE(r.ok) << r.error;
  EXPECT_EQ(r.rounds_repeated, 0);
  EXPECT_FALSE(r.noisy);
}

TEST(CheckBufferFitsTest, ABufferOverHalfTheAvailableMemoryOrTheLockLimitIsRefused) {
  aio::AioConfig c;
  c.block_size = 1 << 20;
  c.queue_depth = 8;
  c.intra_op_parallelism = 2;  // 16 MiB in flight: 5 requests of 4 MiB = 20 MiB
  ASSERT_EQ(BufferBytesFor(c), 20u << 20);
  MemoryLimits limits;
  limits.available_bytes = 40ull << 20;
  EXPECT_TRUE(CheckBufferFits(c, limits).ok());
  limits.available_bytes = 39ull << 20;
  absl::Status s = CheckBufferFits(c, limits);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(s.message(), HasSubstr("(1M x 8 x 2) needs a 20 MiB buffer"));
  EXPECT_THAT(s.message(), HasSubstr("39 MiB available"));
  limits.available_bytes = 0;  // unknown: not held against the point
  EXPECT_TRUE(CheckBufferFits(c, limits).ok());
  limits.lockable_bytes = 16ull << 20;
  EXPECT_TRUE(CheckBufferFits(c, limits).ok());  // nothing is locked without registered buffers
  c.registered_buffers = true;
  s = CheckBufferFits(c, limits);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(s.message(), HasSubstr("RLIMIT_MEMLOCK allows 16 MiB"));
}

TEST(MeasurePointTest, AnImpossiblePointFailsWithItsReason) {
  Point p;
  p.config.engine = aio::EngineKind::kLibAio;
  p.config.sqpoll = true;  // io_uring only
  PointResult r = MeasurePoint(p, "/nonexistent", 64 << 20, nullptr, {});
  EXPECT_FALSE(r.ok);
  EXPECT_THAT(r.error, HasSubstr("sqpoll"));
  EXPECT_EQ(r.ToJson()["status"], "failed");
}

}  // namespace
}  // namespace strata::aio_bench
