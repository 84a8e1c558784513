// The conformance suite of aio::Engine, run against every backend this host has (one it lacks is
// skipped with the reason) and against the engine's main option sets.
#include "aio/engine.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/vfs.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <thread>

#include "aio/buffer.h"
#include "aio/fault_injection.h"
#include "base/status.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/aio/test_util.h"

namespace strata::aio {
namespace {

using ::strata::testing::RandomBytes;
using ::strata::testing::ScratchDir;
using ::testing::HasSubstr;

struct Variant {
  std::string name;
  AioConfig config;
};

AioConfig Make(EngineKind kind, int qd = 8, int threads = 1) {
  AioConfig c;
  c.engine = kind;
  c.queue_depth = qd;
  c.intra_op_parallelism = threads;
  c.block_size = 64 << 10;  // small blocks: requests here span many pieces
  return c;
}

std::vector<Variant> Variants() {
  std::vector<Variant> v;
  v.push_back({"io_uring", Make(EngineKind::kIoUring)});
  v.push_back({"libaio", Make(EngineKind::kLibAio)});
  v.push_back({"posix", Make(EngineKind::kPosix)});
  AioConfig reg = Make(EngineKind::kIoUring, 16, 2);
  reg.registered_buffers = reg.registered_files = true;
  v.push_back({"io_uring_registered_2threads", reg});
  AioConfig single = Make(EngineKind::kLibAio, 4, 3);
  single.single_submit = true;
  single.overlap_events = false;
  v.push_back({"libaio_single_submit_no_overlap_3threads", single});
  AioConfig sqpoll = Make(EngineKind::kIoUring);
  sqpoll.sqpoll = true;
  sqpoll.sqpoll_idle_ms = 10;
  v.push_back({"io_uring_sqpoll", sqpoll});
  AioConfig buffered = Make(EngineKind::kIoUring);
  buffered.direct = false;
  v.push_back({"io_uring_buffered", buffered});
  return v;
}

void PrintTo(const Variant& v, std::ostream* os) { *os << v.name; }

class EngineTest : public ::testing::TestWithParam<Variant> {
 protected:
  void SetUp() override {
    auto engine = Engine::Create(GetParam().config, Options());
    ASSERT_TRUE(engine.ok()) << engine.status();
    engine_ = *std::move(engine);
    if (engine_->backend_name() != EngineKindName(GetParam().config.engine)) {
      std::string why;
      for (const auto& w : engine_->warnings()) why += w + "; ";
      GTEST_SKIP() << "this host has no " << EngineKindName(GetParam().config.engine)
                   << " backend: " << why;
    }
    if (GetParam().config.sqpoll && !engine_->config().sqpoll) {
      GTEST_SKIP() << "SQPOLL refused here: " << engine_->warnings().front();
    }
  }

  virtual EngineOptions Options() {
    EngineOptions o;
    o.on_warning = [](absl::string_view) {};
    return o;
  }

  File OpenRw(const std::string& name) {
    OpenOptions o;
    o.writable = o.create = true;
    auto f = engine_->Open(dir_.File(name), o);
    EXPECT_TRUE(f.ok()) << f.status();
    return f.ok() ? *std::move(f) : File();
  }

  // Writes `bytes` at 0 with plain POSIX calls (the reference), outside the engine.
  void WriteReference(const std::string& name, const std::vector<std::byte>& bytes) {
    std::ofstream out(dir_.File(name), std::ios::binary | std::ios::trunc);
    out.write(reinterpret_cast<const char*>(bytes.data()),
              static_cast<std::streamsize>(bytes.size()));
  }
  std::vector<std::byte> ReadReference(const std::string& name) {
    std::ifstream in(dir_.File(name), std::ios::binary);
    std::vector<char> data((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    std::vector<std::byte> out(data.size());
    std::memcpy(out.data(), data.data(), data.size());
    return out;
  }

  ScratchDir dir_;
  std::unique_ptr<Engine> engine_;
};

TEST_P(EngineTest, RoundTripsRandomDataAtOddSizesOffsetsAndAlignments) {
  File f = OpenRw("rt");
  ASSERT_TRUE(f.is_open());
  auto aligned = AlignedBuffer::Allocate(8 << 20);
  ASSERT_TRUE(aligned.ok());
  const size_t sizes[] = {1, 511, 4096, 65536, 65536 + 13, 200000, 3 * 65536 + 4096, 1 << 20};
  const uint64_t offsets[] = {0, 4096, 12345, (7 << 20) + 3, 65536 * 5};
  uint64_t seed = 1;
  for (size_t size : sizes) {
    for (uint64_t offset : offsets) {
      for (int misalign : {0, 1, 17}) {
        SCOPED_TRACE(::testing::Message()
                     << "size " << size << " offset " << offset << " misalign " << misalign);
        const auto data = RandomBytes(size, seed++);
        // An ordinary heap buffer shifted by `misalign`, or the aligned one.
        std::vector<std::byte> heap(size + 64);
        std::byte* src = misalign ? heap.data() + misalign : aligned->data();
        std::memcpy(src, data.data(), size);
        ASSERT_TRUE(engine_->WriteSync(f, offset, {src, size}).ok());
        std::memset(src, 0, size);
        absl::Status s = engine_->ReadSync(f, offset, {src, size});
        ASSERT_TRUE(s.ok()) << s;
        ASSERT_EQ(std::memcmp(src, data.data(), size), 0);
      }
    }
  }
  // What the engine wrote is what a plain read sees.
  f.Close();
  const auto data = RandomBytes(100000, 99);
  File g = OpenRw("rt2");
  ASSERT_TRUE(engine_->WriteSync(g, 0, data).ok());
  EXPECT_EQ(ReadReference("rt2"), data);
  EXPECT_EQ(*g.Size(), 100000u);
}

TEST_P(EngineTest, UnalignedWriteInsideFileKeepsItsNeighbours) {
  const auto base = RandomBytes(300000, 5);
  WriteReference("rmw", base);
  File f = OpenRw("rmw");
  const auto patch = RandomBytes(70001, 6);
  ASSERT_TRUE(engine_->WriteSync(f, 4097, patch).ok());
  auto expected = base;
  std::memcpy(&expected[4097], patch.data(), patch.size());
  EXPECT_EQ(ReadReference("rmw"), expected);
  EXPECT_EQ(*f.Size(), base.size());
}

TEST_P(EngineTest, UnalignedWritePastTheEndLeavesTheFileExactlyThatLong) {
  File f = OpenRw("extend");
  const auto a = RandomBytes(5000, 7);
  ASSERT_TRUE(engine_->WriteSync(f, 0, a).ok());
  EXPECT_EQ(*f.Size(), 5000u);
  const auto b = RandomBytes(3, 8);
  ASSERT_TRUE(engine_->WriteSync(f, 9000, b).ok());
  EXPECT_EQ(*f.Size(), 9003u);
  auto expected = a;
  expected.resize(9003, std::byte{0});
  std::memcpy(&expected[9000], b.data(), 3);
  EXPECT_EQ(ReadReference("extend"), expected);
}

TEST_P(EngineTest, ReadUpToAnUnalignedEndOfFileSucceeds) {
  const auto base = RandomBytes(10000, 9);
  WriteReference("eof", base);
  File f = OpenRw("eof");
  std::vector<std::byte> out(10000);
  ASSERT_TRUE(engine_->ReadSync(f, 0, absl::MakeSpan(out)).ok());
  EXPECT_EQ(out, base);
  std::vector<std::byte> tail(100);
  ASSERT_TRUE(engine_->ReadSync(f, 9900, absl::MakeSpan(tail)).ok());
  EXPECT_EQ(0, std::memcmp(tail.data(), &base[9900], 100));
}

TEST_P(EngineTest, ReadPastTheEndOfFileIsOutOfRangeNamingTheFile) {
  WriteReference("short", RandomBytes(10000, 10));
  File f = OpenRw("short");
  std::vector<std::byte> out(8192);
  absl::Status s = engine_->ReadSync(f, 8192, absl::MakeSpan(out));
  EXPECT_EQ(s.code(), absl::StatusCode::kOutOfRange) << s;
  EXPECT_THAT(s.message(), HasSubstr(dir_.File("short")));
  EXPECT_THAT(s.message(), HasSubstr("ends at 10000"));
  std::vector<std::byte> big(1 << 20);
  s = engine_->ReadSync(f, 0, absl::MakeSpan(big));
  EXPECT_EQ(s.code(), absl::StatusCode::kOutOfRange) << s;
}

TEST_P(EngineTest, ManyConcurrentRequestsFromSeveralThreads) {
  File f = OpenRw("concurrent");
  constexpr int kThreads = 4, kPerThread = 24;
  constexpr size_t kRegion = 150000;  // regions do not share an aligned block: 150000 -> padded
  constexpr size_t kStride = 4096 * 40;
  std::vector<std::thread> threads;
  std::atomic<int> failures{0};
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      std::vector<std::vector<std::byte>> data;
      std::vector<std::future<absl::Status>> futures;
      for (int i = 0; i < kPerThread; ++i) {
        data.push_back(RandomBytes(kRegion, 1000 * t + i));
      }
      for (int i = 0; i < kPerThread; ++i) {
        futures.push_back(engine_->WriteAsync(f, (t * kPerThread + i) * kStride, data[i]));
      }
      for (auto& fu : futures) {
        absl::Status s = fu.get();
        if (!s.ok()) ADD_FAILURE() << s;
      }
      futures.clear();
      std::vector<std::vector<std::byte>> back(kPerThread, std::vector<std::byte>(kRegion));
      for (int i = 0; i < kPerThread; ++i) {
        futures.push_back(
            engine_->ReadAsync(f, (t * kPerThread + i) * kStride, absl::MakeSpan(back[i])));
      }
      for (auto& fu : futures) failures += !fu.get().ok();
      for (int i = 0; i < kPerThread; ++i) failures += back[i] != data[i];
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(failures.load(), 0);
  EngineStats stats = engine_->Stats();
  EXPECT_EQ(stats.requests, 2u * kThreads * kPerThread);
  EXPECT_EQ(stats.bytes_written, uint64_t{kThreads} * kPerThread * kRegion);
  EXPECT_EQ(stats.bytes_read, uint64_t{kThreads} * kPerThread * kRegion);
  EXPECT_GT(stats.piece_latency.count(), 0u);
}

TEST_P(EngineTest, ResetStatsStartsTheCountsOver) {
  File f = OpenRw("reset");
  const auto data = RandomBytes(200000, 21);
  ASSERT_TRUE(engine_->WriteSync(f, 0, data).ok());
  EXPECT_EQ(engine_->Stats().bytes_written, data.size());
  engine_->ResetStats();
  const EngineStats stats = engine_->Stats();
  EXPECT_EQ(stats.requests, 0u);
  EXPECT_EQ(stats.bytes_written, 0u);
  EXPECT_EQ(stats.piece_latency.count(), 0u);
}

TEST_P(EngineTest, RegisteredUserBufferRoundTrips) {
  auto buffer = AlignedBuffer::Allocate(1 << 20);
  ASSERT_TRUE(buffer.ok());
  ASSERT_TRUE(engine_->RegisterBuffer(buffer->span()).ok());
  File f = OpenRw("registered");
  const auto data = RandomBytes(1 << 20, 11);
  std::memcpy(buffer->data(), data.data(), data.size());
  ASSERT_TRUE(engine_->WriteSync(f, 0, buffer->span()).ok());
  std::memset(buffer->data(), 0, buffer->size());
  ASSERT_TRUE(engine_->ReadSync(f, 0, buffer->span()).ok());
  EXPECT_EQ(0, std::memcmp(buffer->data(), data.data(), data.size()));
  EXPECT_TRUE(engine_->UnregisterBuffer(buffer->span()).ok());
}

TEST_P(EngineTest, EmptyRequestCompletesAtOnceAndWriteToReadOnlyFileIsRejected) {
  WriteReference("ro", RandomBytes(4096, 12));
  auto f = engine_->Open(dir_.File("ro"));
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_TRUE(engine_->ReadSync(*f, 0, {}).ok());
  std::vector<std::byte> data(4096);
  absl::Status s = engine_->WriteSync(*f, 0, data);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(s.message(), HasSubstr("read-only"));
  EXPECT_EQ(engine_->ReadSync(File(), 0, absl::MakeSpan(data)).code(),
            absl::StatusCode::kFailedPrecondition);
}

TEST_P(EngineTest, MissingPathIsNotFoundNamingIt) {
  auto f = engine_->Open(dir_.File("nope/nothing"));
  EXPECT_EQ(f.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(f.status().message(), HasSubstr(dir_.File("nope/nothing")));
  EXPECT_EQ(StatusErrno(f.status()), ENOENT);
  auto d = engine_->Open(dir_.path());
  EXPECT_FALSE(d.ok());
}

INSTANTIATE_TEST_SUITE_P(Backends, EngineTest, ::testing::ValuesIn(Variants()),
                         [](const auto& info) { return info.param.name; });

// --- Injected faults ---------------------------------------------------------------------------

class EngineFaultTest : public EngineTest {
 protected:
  EngineOptions Options() override {
    EngineOptions o = EngineTest::Options();
    injector_ = std::make_shared<FaultInjector>(42, rules_);
    o.wrap_backend = FaultInjector::ForEngine(injector_);
    return o;
  }
  void UseRules(std::vector<FaultRule> rules) {
    rules_ = std::move(rules);
    engine_.reset();
    auto engine = Engine::Create(GetParam().config, Options());
    ASSERT_TRUE(engine.ok()) << engine.status();
    engine_ = *std::move(engine);
  }
  std::vector<FaultRule> rules_;
  std::shared_ptr<FaultInjector> injector_;
};

TEST_P(EngineFaultTest, ShortTransfersAreResubmittedUntilWhole) {
  FaultRule rule = FaultRule::Short();
  rule.probability = 0.5;
  UseRules({rule});
  File f = OpenRw("short");
  const auto data = RandomBytes(3 << 20, 13);
  std::vector<std::byte> heap(data.size() + 1);
  std::memcpy(heap.data() + 1, data.data(), data.size());
  ASSERT_TRUE(engine_->WriteSync(f, 777, {heap.data() + 1, data.size()}).ok());
  std::vector<std::byte> back(data.size());
  absl::Status s = engine_->ReadSync(f, 777, absl::MakeSpan(back));
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_EQ(back, data);
  EXPECT_GT(injector_->total_hits(), 0u);
  EXPECT_GT(engine_->Stats().retries, 0u);
}

TEST_P(EngineFaultTest, EagainAndEintrAreRetried) {
  FaultRule again = FaultRule::Error(EAGAIN);
  again.probability = 0.3;
  FaultRule intr = FaultRule::Error(EINTR);
  intr.probability = 0.3;
  UseRules({again, intr});
  File f = OpenRw("again");
  const auto data = RandomBytes(2 << 20, 14);
  ASSERT_TRUE(engine_->WriteSync(f, 0, data).ok());
  std::vector<std::byte> back(data.size());
  ASSERT_TRUE(engine_->ReadSync(f, 0, absl::MakeSpan(back)).ok());
  EXPECT_EQ(back, data);
  EXPECT_GT(injector_->total_hits(), 0u);
  EXPECT_EQ(engine_->Stats().retries, injector_->total_hits());
}

TEST_P(EngineFaultTest, ReadEioFailsTheRequestWithPathOffsetAndErrno) {
  FaultRule eio = FaultRule::Error(EIO);
  eio.only = OpKind::kRead;
  eio.offset_begin = 5 * 65536;
  eio.offset_end = 5 * 65536 + 1;
  UseRules({eio});
  File f = OpenRw("eio");
  const auto data = RandomBytes(1 << 20, 15);
  ASSERT_TRUE(engine_->WriteSync(f, 0, data).ok());
  std::vector<std::byte> back(data.size());
  absl::Status s = engine_->ReadSync(f, 0, absl::MakeSpan(back));
  EXPECT_EQ(StatusErrno(s), EIO) << s;
  EXPECT_THAT(s.message(), HasSubstr("read " + dir_.File("eio") + " @ 327680 len 65536"));
  EXPECT_THAT(s.message(), HasSubstr("Input/output error"));
  // The engine is still good for what the fault does not touch.
  std::vector<std::byte> head(65536);
  ASSERT_TRUE(engine_->ReadSync(f, 0, absl::MakeSpan(head)).ok());
  EXPECT_EQ(0, std::memcmp(head.data(), data.data(), head.size()));
  EXPECT_EQ(engine_->Stats().failed_requests, 1u);
}

TEST_P(EngineFaultTest, WriteEnospcIsResourceExhaustedAndTouchesNothingOutsideTheRequest) {
  FaultRule enospc = FaultRule::Error(ENOSPC);
  enospc.only = OpKind::kWrite;
  enospc.offset_begin = 200000;  // a piece in the middle of the request fails
  enospc.offset_end = 200001;
  UseRules({enospc});
  const auto base = RandomBytes(2 << 20, 16);
  WriteReference("enospc", base);  // laid down outside the engine: every byte is known
  File f = OpenRw("enospc");
  const auto patch = RandomBytes(300000, 17);
  absl::Status s = engine_->WriteSync(f, 100000, patch);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  EXPECT_EQ(StatusErrno(s), ENOSPC);
  EXPECT_THAT(s.message(), HasSubstr("write " + dir_.File("enospc")));
  const auto after = ReadReference("enospc");
  ASSERT_EQ(after.size(), base.size());
  EXPECT_EQ(0, std::memcmp(after.data(), base.data(), 100000));
  EXPECT_EQ(0, std::memcmp(after.data() + 400000, base.data() + 400000, base.size() - 400000));
}

TEST_P(EngineFaultTest, AddedLatencyShowsInThePercentiles) {
  UseRules({FaultRule::Latency(std::chrono::microseconds(3000))});
  File f = OpenRw("slow");
  const auto data = RandomBytes(4 * 65536, 18);
  ASSERT_TRUE(engine_->WriteSync(f, 0, data).ok());
  EXPECT_GE(injector_->total_hits(), 4u);
  EXPECT_GT(engine_->Stats().piece_latency.max_us(), 0u);
}

TEST_P(EngineFaultTest, FailedRequestCompletesOnceAndLaterRequestsSucceed) {
  FaultRule eio = FaultRule::Error(EIO);
  eio.max_hits = 1;
  UseRules({eio});
  File f = OpenRw("once");
  const auto data = RandomBytes(1 << 20, 19);
  std::atomic<int> calls{0};
  std::promise<absl::Status> done;
  engine_->Write(f, 0, data, [&](absl::Status s) {
    ++calls;
    done.set_value(std::move(s));
  });
  EXPECT_EQ(StatusErrno(done.get_future().get()), EIO);
  ASSERT_TRUE(engine_->WriteSync(f, 0, data).ok());
  std::vector<std::byte> back(data.size());
  ASSERT_TRUE(engine_->ReadSync(f, 0, absl::MakeSpan(back)).ok());
  EXPECT_EQ(back, data);
  EXPECT_EQ(calls.load(), 1);
}

INSTANTIATE_TEST_SUITE_P(Backends, EngineFaultTest, ::testing::ValuesIn(Variants()),
                         [](const auto& info) { return info.param.name; });

// --- Configuration and the filesystem -----------------------------------------------------------

TEST(EngineConfigTest, BadConfigIsRejectedNamingTheKey) {
  AioConfig c;
  c.queue_depth = 0;
  auto e = Engine::Create(c);
  EXPECT_EQ(e.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(e.status().message(), HasSubstr("queue_depth: must be in [1, 1024], got 0"));
  c = AioConfig();
  c.intra_op_parallelism = 0;
  EXPECT_THAT(Engine::Create(c).status().message(), HasSubstr("intra_op_parallelism"));
  c = AioConfig();
  c.block_size = 3 << 12;
  EXPECT_THAT(Engine::Create(c).status().message(),
              HasSubstr("block_size: must be a power of two"));
}

TEST(EngineConfigTest, FilesystemWithoutODirectIsRefusedNamingTheWayOut) {
  // procfs refuses O_DIRECT on every kernel (tmpfs accepts it since Linux 6.6).
  auto engine = Engine::Create(AioConfig());
  ASSERT_TRUE(engine.ok());
  auto f = (*engine)->Open("/proc/self/status");
  EXPECT_EQ(f.status().code(), absl::StatusCode::kFailedPrecondition) << f.status();
  EXPECT_THAT(f.status().message(), HasSubstr("refuses O_DIRECT"));
  EXPECT_THAT(f.status().message(), HasSubstr("strata.aio.direct"));
}

TEST(EngineConfigTest, BufferedEngineRunsOnTmpfs) {
  struct statfs fs;
  if (statfs("/dev/shm", &fs) != 0 || fs.f_type != 0x01021994 /* TMPFS_MAGIC */) {
    GTEST_SKIP() << "/dev/shm is not tmpfs on this host";
  }
  char dir[] = "/dev/shm/strata-test-XXXXXX";
  ASSERT_NE(mkdtemp(dir), nullptr);
  OpenOptions o;
  o.writable = o.create = true;
  AioConfig c;
  c.engine = EngineKind::kPosix;
  c.direct = false;
  auto engine = Engine::Create(c);
  ASSERT_TRUE(engine.ok());
  {
    auto f = (*engine)->Open(std::string(dir) + "/f", o);
    ASSERT_TRUE(f.ok()) << f.status();
    EXPECT_EQ(f->alignment().source, "none");
    const auto data = RandomBytes(12345, 20);
    ASSERT_TRUE((*engine)->WriteSync(*f, 3, data).ok());
    std::vector<std::byte> back(data.size());
    ASSERT_TRUE((*engine)->ReadSync(*f, 3, absl::MakeSpan(back)).ok());
    EXPECT_EQ(back, data);
  }
  std::filesystem::remove_all(dir);
}

// Runs in a child that drops to an unprivileged user when the test runs as root (root bypasses
// permission bits).
int OpenInReadOnlyDirectory(const std::string& dir) {
  if (geteuid() == 0 && (setgid(65534) != 0 || setuid(65534) != 0)) return 3;
  auto engine = Engine::Create(AioConfig());
  if (!engine.ok()) return 4;
  OpenOptions o;
  o.writable = o.create = true;
  auto f = (*engine)->Open(dir + "/f", o);
  if (f.status().code() != absl::StatusCode::kPermissionDenied) return 1;
  if (f.status().message().find(dir + "/f") == absl::string_view::npos) return 2;
  return 0;
}

TEST(EngineConfigTest, DirectoryWithoutWritePermissionIsPermissionDenied) {
  ScratchDir scratch = ScratchDir::Traversable();  // the other user must reach it
  const std::string dir = scratch.File("ro");
  ASSERT_EQ(mkdir(dir.c_str(), 0555), 0);
  const pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) _exit(OpenInReadOnlyDirectory(dir));
  int status = 0;
  ASSERT_EQ(waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0) << "1: not PermissionDenied, 2: path not named, 3: setuid";
}

TEST(EngineConfigTest, AnOptionThatCannotBeHadIsTurnedOffWithAWarningInTheSink) {
  // An empty registered-file table is refused by the kernel: registered files are turned off,
  // said once to the sink and kept in warnings(), and the engine works without them.
  AioConfig c;
  c.engine = EngineKind::kIoUring;
  c.registered_files = true;
  std::vector<std::string> seen;
  EngineOptions o;
  o.on_warning = [&](absl::string_view w) { seen.emplace_back(w); };
  o.max_registered_files = 0;
  auto engine = Engine::Create(c, o);
  ASSERT_TRUE(engine.ok()) << engine.status();
  if ((*engine)->backend_name() != "io_uring") GTEST_SKIP() << "no io_uring here";
  ASSERT_EQ(seen.size(), 1u);
  EXPECT_THAT(seen[0], HasSubstr("registering files failed"));
  EXPECT_EQ(seen, (*engine)->warnings());
  EXPECT_FALSE((*engine)->config().registered_files);
  ScratchDir scratch;
  OpenOptions oo;
  oo.writable = oo.create = true;
  auto f = (*engine)->Open(scratch.File("f"), oo);
  ASSERT_TRUE(f.ok());
  const auto data = RandomBytes(70000, 22);
  ASSERT_TRUE((*engine)->WriteSync(*f, 0, data).ok());
}

TEST(EngineDeathTest, FileOutlivingItsEngineIsAProgrammingErrorCaughtAtOnce) {
  ScratchDir scratch;
  EXPECT_DEATH(
      {
        File f;
        {
          auto engine = Engine::Create(AioConfig());
          OpenOptions o;
          o.writable = o.create = true;
          f = *(*engine)->Open(scratch.File("f"), o);
        }
      },
      "destroyed while a File it opened is still open");
}

}  // namespace
}  // namespace strata::aio
