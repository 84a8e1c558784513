// The NVMe store: round trips, copy on write, a full store and a full disk, injected faults during
// data and manifest writes (reopening finds the previous generation whole), flipped bytes found on
// reopen, bad paths, and concurrent use.
#include "tiering/nvme_store.h"

#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <filesystem>
#include <fstream>
#include <thread>

#include "aio/fault_injection.h"
#include "base/status.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/aio/test_util.h"

namespace strata::tiering {
namespace {

using ::strata::testing::RandomBytes;
using ::strata::testing::ScratchDir;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

std::unique_ptr<aio::Engine> MakeEngine(std::vector<aio::FaultRule> rules = {},
                                        std::shared_ptr<aio::FaultInjector>* injector = nullptr) {
  aio::AioConfig c;
  c.block_size = 64 << 10;  // small blocks: a partition is several pieces
  c.queue_depth = 8;
  aio::EngineOptions o;
  o.on_warning = [](absl::string_view) {};
  if (!rules.empty()) {
    auto inj = std::make_shared<aio::FaultInjector>(1, rules);
    o.wrap_backend = aio::FaultInjector::ForEngine(inj);
    if (injector != nullptr) *injector = inj;
  }
  auto e = aio::Engine::Create(c, o);
  EXPECT_TRUE(e.ok()) << e.status();
  return *std::move(e);
}

NvmeStoreOptions Small() {
  NvmeStoreOptions o;
  o.capacity_bytes = 8 << 20;
  o.file_bytes = 3 << 20;  // three swap files: 3 + 3 + 2 MiB
  return o;
}

std::vector<std::byte> GetAll(NvmeStore& s, PartitionId id) {
  auto r = s.Find(id);
  EXPECT_TRUE(r.ok()) << r.status();
  std::vector<std::byte> out(r.ok() ? r->length : 0);
  absl::Status st = s.Get(id, absl::MakeSpan(out));
  EXPECT_TRUE(st.ok()) << st;
  return out;
}

TEST(NvmeStoreTest, PartitionsRoundTripAndSurviveReopening) {
  ScratchDir dir;
  const std::string path = dir.File("store");
  auto engine = MakeEngine();
  const auto a = RandomBytes(100001, 1), b = RandomBytes(4096, 2), c = RandomBytes(2 << 20, 3);
  {
    auto store = NvmeStore::Open(path, Small(), engine.get());
    ASSERT_TRUE(store.ok()) << store.status();
    EXPECT_EQ((*store)->capacity_bytes(), 8u << 20);
    ASSERT_TRUE((*store)->Put(1, a).ok());
    ASSERT_TRUE((*store)->Put(2, b).ok());
    ASSERT_TRUE((*store)->Put(3, c).ok());
    EXPECT_EQ(GetAll(**store, 1), a);
    EXPECT_EQ(GetAll(**store, 3), c);
    EXPECT_EQ((*store)->used_bytes(), 102400u + 4096 + (2u << 20));
    EXPECT_TRUE(std::filesystem::exists(path + "/swap-002.bin"));
    EXPECT_EQ(std::filesystem::status(path).permissions() & std::filesystem::perms::all,
              std::filesystem::perms::owner_all);
  }
  std::vector<PartitionId> corrupt;
  auto store = NvmeStore::Open(path, {}, engine.get(), &corrupt);
  ASSERT_TRUE(store.ok()) << store.status();
  EXPECT_TRUE(corrupt.empty());
  EXPECT_EQ(GetAll(**store, 1), a);
  EXPECT_EQ(GetAll(**store, 2), b);
  EXPECT_EQ(GetAll(**store, 3), c);
  EXPECT_EQ((*store)->generation(), 4u);  // creation + three puts
}

TEST(NvmeStoreTest, PutIsCopyOnWriteAndFreedSpaceIsReused) {
  ScratchDir dir;
  auto engine = MakeEngine();
  auto store = NvmeStore::Open(dir.File("s"), Small(), engine.get());
  ASSERT_TRUE(store.ok());
  const auto v1 = RandomBytes(3 << 20, 4), v2 = RandomBytes(3 << 20, 5);
  ASSERT_TRUE((*store)->Put(7, v1).ok());
  const auto first = *(*store)->Find(7);
  ASSERT_TRUE((*store)->Put(7, v2).ok());
  const auto second = *(*store)->Find(7);
  EXPECT_FALSE(first.file == second.file && first.offset == second.offset);  // never in place
  EXPECT_EQ(GetAll(**store, 7), v2);
  EXPECT_EQ((*store)->used_bytes(), 3u << 20);
  for (int i = 0; i < 10; ++i) ASSERT_TRUE((*store)->Put(7, i % 2 ? v1 : v2).ok()) << i;
  ASSERT_TRUE((*store)->Erase(7).ok());
  EXPECT_EQ((*store)->used_bytes(), 0u);
  EXPECT_EQ((*store)->Get(7, {}).code(), absl::StatusCode::kNotFound);
}

TEST(NvmeStoreTest, AFullStoreRefusesBeforeWritingAndKeepsEverythingElse) {
  ScratchDir dir;
  auto engine = MakeEngine();
  auto store = NvmeStore::Open(dir.File("s"), Small(), engine.get());
  ASSERT_TRUE(store.ok());
  const auto a = RandomBytes(3 << 20, 6);
  ASSERT_TRUE((*store)->Put(1, a).ok());
  ASSERT_TRUE((*store)->Put(2, a).ok());
  const uint64_t generation = (*store)->generation();
  absl::Status s = (*store)->Put(3, RandomBytes(3 << 20, 7));  // 2 MiB left, in one file
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  EXPECT_THAT(s.message(), HasSubstr("nothing was written"));
  EXPECT_EQ((*store)->generation(), generation);
  EXPECT_EQ(GetAll(**store, 1), a);
}

TEST(NvmeStoreTest, NotEnoughDiskIsFoundBeforeAnythingIsWritten) {
  ScratchDir dir;
  auto engine = MakeEngine();
  NvmeStoreOptions o;
  o.capacity_bytes = 1ull << 50;
  auto store = NvmeStore::Open(dir.File("s"), o, engine.get());
  EXPECT_EQ(store.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(store.status().message(), HasSubstr("the store needs 1125899906842624"));
  EXPECT_TRUE(std::filesystem::is_empty(dir.File("s")));
}

TEST(NvmeStoreTest, ADataWriteThatFailsLeavesThePreviousCopy) {
  ScratchDir dir;
  const std::string path = dir.File("s");
  const auto v1 = RandomBytes(300000, 8);
  {
    auto engine = MakeEngine();
    auto store = NvmeStore::Open(path, Small(), engine.get());
    ASSERT_TRUE(store.ok());
    ASSERT_TRUE((*store)->Put(1, v1).ok());
  }
  for (int error : {EIO, ENOSPC}) {
    aio::FaultRule rule = aio::FaultRule::Error(error);
    rule.only = aio::OpKind::kWrite;
    rule.skip = 2;  // the third piece of the data write fails
    rule.max_hits = 1;
    std::shared_ptr<aio::FaultInjector> injector;
    auto engine = MakeEngine({rule}, &injector);
    auto store = NvmeStore::Open(path, {}, engine.get());
    ASSERT_TRUE(store.ok()) << store.status();
    const uint64_t generation = (*store)->generation();
    absl::Status s = (*store)->Put(1, RandomBytes(300000, 9));
    EXPECT_EQ(StatusErrno(s), error) << s;
    EXPECT_THAT(s.message(), HasSubstr("put partition 1"));
    EXPECT_EQ(injector->total_hits(), 1u);
    EXPECT_EQ((*store)->generation(), generation);
    EXPECT_EQ(GetAll(**store, 1), v1);
  }
  std::vector<PartitionId> corrupt;
  auto engine = MakeEngine();
  auto store = NvmeStore::Open(path, {}, engine.get(), &corrupt);
  ASSERT_TRUE(store.ok());
  EXPECT_TRUE(corrupt.empty());
  EXPECT_EQ(GetAll(**store, 1), v1);
}

TEST(NvmeStoreTest, AManifestWriteThatFailsOrIsCutShortLeavesThePreviousGeneration) {
  ScratchDir dir;
  const std::string path = dir.File("s");
  const auto v1 = RandomBytes(100000, 10);
  uint64_t generation = 0;
  {
    auto engine = MakeEngine();
    auto store = NvmeStore::Open(path, Small(), engine.get());
    ASSERT_TRUE(store.ok());
    ASSERT_TRUE((*store)->Put(1, v1).ok());
    generation = (*store)->generation();
  }
  // The next put's extent follows partition 1's (first fit); its data write is one piece per
  // 64 KiB block it spans, and the write after those is the manifest's. That one fails (EIO), or
  // is cut short and then fails (a short transfer, then ENOSPC on the rest).
  uint64_t data_pieces = 0;
  {
    auto engine = MakeEngine();
    auto store = NvmeStore::Open(path, {}, engine.get());
    ASSERT_TRUE(store.ok());
    const PartitionRecord r = *(*store)->Find(1);
    const uint64_t start = r.offset + (r.length + 4095) / 4096 * 4096, end = start + 100000;
    data_pieces = (end - 1) / (64 << 10) - start / (64 << 10) + 1;
  }
  auto manifest_fault = [&](std::vector<aio::FaultRule> rules) {
    for (auto& r : rules) {
      r.only = aio::OpKind::kWrite;
      r.skip += data_pieces;
    }
    return rules;
  };
  aio::FaultRule eio = aio::FaultRule::Error(EIO);
  eio.max_hits = 1;
  aio::FaultRule cut = aio::FaultRule::Short();
  cut.max_hits = 1;
  aio::FaultRule enospc = aio::FaultRule::Error(ENOSPC);
  enospc.skip = 1;  // after the short one
  for (const auto& rules : {manifest_fault({eio}), manifest_fault({cut, enospc})}) {
    std::shared_ptr<aio::FaultInjector> injector;
    auto engine = MakeEngine(rules, &injector);
    auto store = NvmeStore::Open(path, {}, engine.get());
    ASSERT_TRUE(store.ok()) << store.status();
    absl::Status s = (*store)->Put(1, RandomBytes(100000, 11));
    EXPECT_FALSE(s.ok());
    EXPECT_THAT(s.message(), HasSubstr("writing the manifest")) << s;
    EXPECT_EQ(injector->total_hits(), rules.size());  // each fault fired, once
    EXPECT_EQ(GetAll(**store, 1), v1);
  }
  std::vector<PartitionId> corrupt;
  auto engine = MakeEngine();
  auto store = NvmeStore::Open(path, {}, engine.get(), &corrupt);
  ASSERT_TRUE(store.ok()) << store.status();
  EXPECT_TRUE(corrupt.empty());
  EXPECT_EQ((*store)->generation(), generation);
  EXPECT_EQ(GetAll(**store, 1), v1);
  // And it goes on: the next put works.
  const auto v2 = RandomBytes(100000, 12);
  ASSERT_TRUE((*store)->Put(1, v2).ok());
  EXPECT_EQ(GetAll(**store, 1), v2);
}

TEST(NvmeStoreTest, ABatchCommitsAllOrNothing) {
  ScratchDir dir;
  const std::string path = dir.File("s");
  const auto a1 = RandomBytes(70000, 1), b1 = RandomBytes(70000, 2);
  {
    auto engine = MakeEngine();
    auto store = NvmeStore::Open(path, Small(), engine.get());
    ASSERT_TRUE(store.ok());
    ASSERT_TRUE((*store)->Put(1, a1).ok());
    ASSERT_TRUE((*store)->Put(2, b1).ok());
    // Staged but aborted: nothing changes and the space comes back.
    const uint64_t used = (*store)->used_bytes();
    {
      auto batch = (*store)->NewBatch();
      ASSERT_TRUE(batch->Stage(1, RandomBytes(70000, 3)).ok());
      EXPECT_GT((*store)->used_bytes(), used);
    }
    EXPECT_EQ((*store)->used_bytes(), used);
    EXPECT_EQ(GetAll(**store, 1), a1);
  }
  // The commit's manifest write fails: neither partition changes, on disk or in memory.
  aio::FaultRule eio = aio::FaultRule::Error(EIO);
  eio.only = aio::OpKind::kWrite;
  eio.offset_begin = 0;
  eio.offset_end = 1;  // the manifest is written at offset 0; the extents here are not
  auto engine = MakeEngine({eio});
  auto store = NvmeStore::Open(path, {}, engine.get());
  ASSERT_TRUE(store.ok());
  auto batch = (*store)->NewBatch();
  ASSERT_TRUE(batch->Stage(1, RandomBytes(70000, 4)).ok());
  ASSERT_TRUE(batch->Stage(2, RandomBytes(70000, 5)).ok());
  absl::Status s = batch->Commit();
  EXPECT_THAT(s.message(), HasSubstr("put partition 1 and others"));
  EXPECT_EQ(GetAll(**store, 1), a1);
  EXPECT_EQ(GetAll(**store, 2), b1);
  auto clean = MakeEngine();
  auto reopened = NvmeStore::Open(path, {}, clean.get());
  ASSERT_TRUE(reopened.ok());
  EXPECT_EQ(GetAll(**reopened, 1), a1);
  EXPECT_EQ(GetAll(**reopened, 2), b1);
}

TEST(NvmeStoreTest, ChunkedStagingAndReadingDoubleBufferThroughTwoBuffers) {
  ScratchDir dir;
  auto engine = MakeEngine();
  auto store = NvmeStore::Open(dir.File("s"), Small(), engine.get());
  ASSERT_TRUE(store.ok());
  const auto v = RandomBytes(300001, 21);
  std::vector<std::byte> a(64 << 10), b(64 << 10);
  auto batch = (*store)->NewBatch();
  int produced = 0;
  ASSERT_TRUE(batch
                  ->StageChunked(9, v.size(), absl::MakeSpan(a), absl::MakeSpan(b),
                                 [&](uint64_t off, absl::Span<std::byte> chunk) {
                                   ++produced;
                                   std::memcpy(chunk.data(), v.data() + off, chunk.size());
                                   return absl::OkStatus();
                                 })
                  .ok());
  ASSERT_TRUE(batch->Commit().ok());
  EXPECT_EQ(produced, 5);            // 300001 bytes in 64 KiB chunks
  EXPECT_EQ(GetAll(**store, 9), v);  // the checksum of the chunks is the whole's
  std::vector<std::byte> back(v.size());
  std::vector<const std::byte*> seen;
  ASSERT_TRUE((*store)
                  ->GetChunked(9, absl::MakeSpan(a), absl::MakeSpan(b),
                               [&](uint64_t off, absl::Span<const std::byte> chunk) {
                                 seen.push_back(chunk.data());
                                 std::memcpy(back.data() + off, chunk.data(), chunk.size());
                                 return absl::OkStatus();
                               })
                  .ok());
  EXPECT_EQ(back, v);
  ASSERT_EQ(seen.size(), 5u);
  EXPECT_EQ(seen[0], a.data());  // alternating buffers
  EXPECT_EQ(seen[1], b.data());
  EXPECT_EQ(seen[2], a.data());
  // A consumer's failure stops the read and is returned.
  absl::Status s = (*store)->GetChunked(9, absl::MakeSpan(a), absl::MakeSpan(b),
                                        [](uint64_t, absl::Span<const std::byte>) {
                                          return absl::InternalError("device copy failed");
                                        });
  EXPECT_THAT(s.message(), HasSubstr("device copy failed"));
  std::vector<std::byte> odd(1000);
  EXPECT_EQ((*store)->GetChunked(9, absl::MakeSpan(odd), absl::MakeSpan(odd), nullptr).code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(NvmeStoreTest, ShortTransfersAreRetriedByTheEngine) {
  ScratchDir dir;
  aio::FaultRule r = aio::FaultRule::Short();
  r.probability = 0.5;
  auto engine = MakeEngine({r});
  auto store = NvmeStore::Open(dir.File("s"), Small(), engine.get());
  ASSERT_TRUE(store.ok()) << store.status();
  const auto v = RandomBytes(777777, 13);
  ASSERT_TRUE((*store)->Put(5, v).ok());
  EXPECT_EQ(GetAll(**store, 5), v);
}

void FlipByte(const std::string& path, uint64_t offset) {
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  f.seekg(static_cast<std::streamoff>(offset));
  char c;
  f.read(&c, 1);
  c ^= 0x20;
  f.seekp(static_cast<std::streamoff>(offset));
  f.write(&c, 1);
}

TEST(NvmeStoreTest, AFlippedByteIsNamedOnReopenAndGetFailsWithDataLoss) {
  ScratchDir dir;
  const std::string path = dir.File("s");
  PartitionRecord victim;
  {
    auto engine = MakeEngine();
    auto store = NvmeStore::Open(path, Small(), engine.get());
    ASSERT_TRUE(store.ok());
    for (PartitionId id : {10, 11, 12}) ASSERT_TRUE((*store)->Put(id, RandomBytes(50000, id)).ok());
    victim = *(*store)->Find(11);
  }
  char name[32];
  std::snprintf(name, sizeof(name), "/swap-%03u.bin", victim.file);
  FlipByte(path + name, victim.offset + 1234);
  std::vector<PartitionId> corrupt;
  auto engine = MakeEngine();
  auto store = NvmeStore::Open(path, {}, engine.get(), &corrupt);
  ASSERT_TRUE(store.ok()) << store.status();
  EXPECT_THAT(corrupt, ElementsAre(11));
  std::vector<std::byte> out(50000);
  absl::Status s = (*store)->Get(11, absl::MakeSpan(out));
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(s.message(), HasSubstr("partition 11"));
  EXPECT_TRUE((*store)->Get(10, absl::MakeSpan(out)).ok());
}

TEST(NvmeStoreTest, ADamagedManifestIsDataLossNamingIt) {
  ScratchDir dir;
  const std::string path = dir.File("s");
  {
    auto engine = MakeEngine();
    auto store = NvmeStore::Open(path, Small(), engine.get());
    ASSERT_TRUE(store.ok());
    ASSERT_TRUE((*store)->Put(1, RandomBytes(1000, 1)).ok());
  }
  FlipByte(path + "/manifest.json", 40);
  auto engine = MakeEngine();
  auto store = NvmeStore::Open(path, {}, engine.get());
  EXPECT_EQ(store.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(store.status().message(), HasSubstr(path + "/manifest.json"));
}

TEST(NvmeStoreTest, BadPathsAndOptionsAreRejectedClearly) {
  ScratchDir dir;
  auto engine = MakeEngine();
  NvmeStoreOptions zero = Small();
  zero.capacity_bytes = 0;
  EXPECT_THAT(NvmeStore::Open(dir.File("z"), zero, engine.get()).status().message(),
              HasSubstr("capacity_bytes: must be > 0"));
  auto missing = NvmeStore::Open(dir.File("no/such/dir"), Small(), engine.get());
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(missing.status().message(), HasSubstr("nvme_path"));
  { std::ofstream(dir.File("file")) << "x"; }
  auto file = NvmeStore::Open(dir.File("file"), Small(), engine.get());
  EXPECT_EQ(file.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(file.status().message(), HasSubstr("is not a directory"));
  NvmeStoreOptions odd = Small();
  odd.alignment = 1000;
  EXPECT_THAT(NvmeStore::Open(dir.File("o"), odd, engine.get()).status().message(),
              HasSubstr("alignment: must be a power of two"));
}

TEST(NvmeStoreTest, ADirectoryWithoutWritePermissionIsRefused) {
  ScratchDir dir;
  const std::string ro = dir.File("ro");
  ASSERT_EQ(mkdir(ro.c_str(), 0555), 0);
  chmod(dir.path().c_str(), 0755);
  const pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    if (geteuid() == 0 && (setgid(65534) != 0 || setuid(65534) != 0)) _exit(3);
    aio::AioConfig c;
    auto engine = aio::Engine::Create(c);
    if (!engine.ok()) _exit(4);
    auto store = NvmeStore::Open(ro, Small(), engine->get());
    if (store.status().code() != absl::StatusCode::kPermissionDenied) _exit(1);
    if (store.status().message().find("not writable") == absl::string_view::npos) _exit(2);
    _exit(0);
  }
  int status = 0;
  ASSERT_EQ(waitpid(pid, &status, 0), pid);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << WEXITSTATUS(status);
}

TEST(NvmeStoreTest, ConcurrentPutsAndGetsOfDifferentPartitions) {
  ScratchDir dir;
  auto engine = MakeEngine();
  NvmeStoreOptions o = Small();
  o.capacity_bytes = 32 << 20;
  auto store = NvmeStore::Open(dir.File("s"), o, engine.get());
  ASSERT_TRUE(store.ok());
  std::vector<std::thread> threads;
  std::atomic<int> failures{0};
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int round = 0; round < 5; ++round) {
        const auto v = RandomBytes(200000 + t * 1000, 100 * t + round);
        if (!(*store)->Put(t, v).ok()) ++failures;
        std::vector<std::byte> out(v.size());
        if (!(*store)->Get(t, absl::MakeSpan(out)).ok() || out != v) ++failures;
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(failures.load(), 0);
}

}  // namespace
}  // namespace strata::tiering
