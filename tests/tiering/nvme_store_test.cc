// The NVMe store: round trips, copy on write and its reserve, partitions spanning files, a full
// store and a full disk, swap files that grow on demand up to the cap (a failed growth, a kill
// after one, a reopen of a grown store), files removed on close, injected faults during data and
// manifest-log writes (reopening finds the previous generation whole), a kill at each step of a
// commit and of a compaction, torn log tails, flipped bytes found on Verify and Get, the directory
// lock, bad paths, and concurrent use.
#include "tiering/nvme_store.h"

#include <spawn.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <thread>
#include <utility>

#include "absl/strings/match.h"
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
  o.on_warning = [](absl::string_view) {};
  o.capacity_bytes = 8 << 20;
  o.file_bytes = 3 << 20;  // three swap files: 3 + 3 + 2 MiB
  return o;
}

NvmeStoreOptions Verifying() {
  NvmeStoreOptions o;
  o.on_warning = [](absl::string_view) {};
  o.verify_on_open = true;
  return o;
}

std::vector<std::string> Listing(const std::string& dir) {
  std::vector<std::string> names;
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    names.push_back(e.path().filename().string());
  }
  std::sort(names.begin(), names.end());
  return names;
}

// The swap files in `dir`: how many, their sizes, and the bytes of disk they take (st_blocks).
struct SwapFiles {
  int count = 0;
  uint64_t size_bytes = 0;
  uint64_t disk_bytes = 0;
};
SwapFiles Swap(const std::string& dir) {
  SwapFiles out;
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    if (e.path().filename().string().rfind("swap-", 0) != 0) continue;
    struct stat st;
    EXPECT_EQ(stat(e.path().c_str(), &st), 0);
    ++out.count;
    out.size_bytes += static_cast<uint64_t>(st.st_size);
    out.disk_bytes += static_cast<uint64_t>(st.st_blocks) * 512;
  }
  return out;
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
    EXPECT_EQ((*store)->allocated_bytes(), 0u);
    ASSERT_TRUE((*store)->Put(1, a).ok());
    ASSERT_TRUE((*store)->Put(2, b).ok());
    ASSERT_TRUE((*store)->Put(3, c).ok());
    EXPECT_EQ(GetAll(**store, 1), a);
    EXPECT_EQ(GetAll(**store, 3), c);
    EXPECT_EQ((*store)->used_bytes(), 102400u + 4096 + (2u << 20));
    // Grown on demand: the partitions and one copy-on-write of the largest, in two of the 3 MiB
    // files (the cap would allow a third).
    EXPECT_EQ((*store)->allocated_bytes(), 102400u + 4096 + (2u << 20) + (2u << 20));
    EXPECT_EQ(Swap(path).count, 2);
    EXPECT_EQ(Swap(path).size_bytes, (*store)->allocated_bytes());
    EXPECT_EQ(std::filesystem::status(path).permissions() & std::filesystem::perms::all,
              std::filesystem::perms::owner_all);
  }
  std::vector<PartitionId> corrupt;
  auto store = NvmeStore::Open(path, Verifying(), engine.get(), &corrupt);
  ASSERT_TRUE(store.ok()) << store.status();
  EXPECT_TRUE(corrupt.empty());
  EXPECT_EQ(GetAll(**store, 1), a);
  EXPECT_EQ(GetAll(**store, 2), b);
  EXPECT_EQ(GetAll(**store, 3), c);
  EXPECT_EQ((*store)->generation(), 4u);  // creation + three puts
}

// NvmeStoreOptions::durable: a commit syncs its data and its log record, or (off) writes them
// alone; either way the partitions read back, and a reopen finds them (the process did not die).
TEST(NvmeStoreTest, ACommitSyncsOnlyADurableStore) {
  for (const bool durable : {true, false}) {
    SCOPED_TRACE(durable ? "durable" : "not durable");
    ScratchDir dir;
    const std::string path = dir.File("store");
    auto engine = MakeEngine();
    const auto a = RandomBytes(100001, 1);
    std::vector<std::string> steps;
    NvmeStoreOptions o = Small();
    o.durable = durable;
    o.test_hook = [&](absl::string_view at) { steps.emplace_back(at); };
    {
      auto store = NvmeStore::Open(path, o, engine.get());
      ASSERT_TRUE(store.ok()) << store.status();
      ASSERT_TRUE((*store)->Put(1, a).ok());
      EXPECT_EQ(GetAll(**store, 1), a);
    }
    auto count = [&](const char* at) { return std::count(steps.begin(), steps.end(), at); };
    EXPECT_EQ(count("commit:data-synced"), durable ? 1 : 0);
    EXPECT_EQ(count("commit:log-synced"), durable ? 1 : 0);
    EXPECT_EQ(count("commit:data-written"), durable ? 0 : 1);
    EXPECT_EQ(count("commit:log-unsynced"), durable ? 0 : 1);
    auto reopened = NvmeStore::Open(path, Small(), engine.get());
    ASSERT_TRUE(reopened.ok()) << reopened.status();
    EXPECT_EQ(GetAll(**reopened, 1), a);
  }
}

TEST(NvmeStoreTest, MeasuringTheCommitTimesPutsAndLeavesNothingBehind) {
  ScratchDir dir;
  auto engine = MakeEngine();
  const std::string scratch = dir.File("probe");
  auto commit = MeasureCommitSeconds(scratch, engine.get(), 3);
  ASSERT_TRUE(commit.ok()) << commit.status();
  EXPECT_GT(*commit, 0);
  EXPECT_LT(*commit, 10);
  EXPECT_FALSE(std::filesystem::exists(scratch));
  // A path that exists is not the probe's to remove; a count below one is refused; a write that
  // fails is named and the scratch store removed all the same.
  EXPECT_EQ(MeasureCommitSeconds(dir.path(), engine.get()).status().code(),
            absl::StatusCode::kAlreadyExists);
  EXPECT_THAT(MeasureCommitSeconds(scratch, engine.get(), 0).status().message(),
              HasSubstr("puts is 0"));
  auto failing = MakeEngine({aio::FaultRule::Error(EIO)});
  auto failed = MeasureCommitSeconds(scratch, failing.get());
  EXPECT_FALSE(failed.ok());
  EXPECT_THAT(failed.status().message(), HasSubstr("measuring the store's commit"));
  EXPECT_FALSE(std::filesystem::exists(scratch));
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
  EXPECT_NE(first.extents, second.extents);  // never in place
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
  const auto a = RandomBytes(3 << 20, 6), b = RandomBytes(2 << 20, 7);
  ASSERT_TRUE((*store)->Put(1, a).ok());
  ASSERT_TRUE((*store)->Put(2, b).ok());  // 3 MiB left: one copy-on-write of the largest
  const uint64_t generation = (*store)->generation();
  // A third partition would leave less than the copy-on-write reserve.
  absl::Status s = (*store)->Put(3, RandomBytes(1 << 20, 7));
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  EXPECT_THAT(s.message(), HasSubstr("nothing was written"));
  EXPECT_THAT(s.message(), HasSubstr("needs 9437184 bytes"));  // 3 + 2 + 1 MiB, + the largest
  EXPECT_EQ((*store)->generation(), generation);
  EXPECT_EQ(GetAll(**store, 1), a);
  EXPECT_EQ((*store)->used_bytes(), 5u << 20);
}

TEST(NvmeStoreTest, GrowingAPartitionKeepsTheReserve) {
  // A Put that makes a partition larger is admitted like a new one: had it been let through, the
  // store would be left without room for the largest partition's copy-on-write.
  ScratchDir dir;
  auto engine = MakeEngine();
  auto store = NvmeStore::Open(dir.File("s"), Small(), engine.get());  // 8 MiB
  ASSERT_TRUE(store.ok());
  const auto a = RandomBytes(3 << 20, 6);
  ASSERT_TRUE((*store)->Put(1, a).ok());
  ASSERT_TRUE((*store)->Put(2, RandomBytes(2 << 20, 7)).ok());  // 3 MiB left: the reserve
  absl::Status s = (*store)->Put(2, RandomBytes(3 << 20, 8));
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  EXPECT_THAT(s.message(), HasSubstr("growing the partition by 1048576"));
  EXPECT_THAT(s.message(), HasSubstr("needs 9437184 bytes"));  // 3 + 3 MiB, + the largest
  EXPECT_EQ(GetAll(**store, 2), RandomBytes(2 << 20, 7));
  // The rewrites the reserve is for still find room.
  ASSERT_TRUE((*store)->Put(1, a).ok());
  ASSERT_TRUE((*store)->Put(2, RandomBytes(1 << 20, 9)).ok());   // shrinking
  ASSERT_TRUE((*store)->Put(2, RandomBytes(2 << 20, 10)).ok());  // growing within the rule
  ASSERT_TRUE((*store)->Put(1, a).ok());
  EXPECT_EQ(GetAll(**store, 2), RandomBytes(2 << 20, 10));
}

TEST(NvmeStoreTest, AStoreSizedByTheRuleNeverJamsOnWriteBacks) {
  // Capacity = the partitions' sum + the largest: every rewrite finds room for its new copy,
  // even when the free space is split over files and between partitions.
  ScratchDir dir;
  auto engine = MakeEngine();
  NvmeStoreOptions o = Small();
  o.file_bytes = 1 << 20;
  const std::vector<uint64_t> sizes = {700 << 10, 1500 << 10, 300 << 10, 900 << 10};
  o.capacity_bytes = (700 + 1500 + 300 + 900 + 1500) << 10;
  auto store = NvmeStore::Open(dir.File("s"), o, engine.get());
  ASSERT_TRUE(store.ok()) << store.status();
  for (PartitionId id = 0; id < sizes.size(); ++id) {
    ASSERT_TRUE((*store)->Put(id, RandomBytes(sizes[id], id)).ok()) << id;
  }
  for (int round = 0; round < 12; ++round) {
    const PartitionId id = static_cast<PartitionId>((round * 7) % sizes.size());
    const auto v = RandomBytes(sizes[id], 100 + round);
    absl::Status s = (*store)->Put(id, v);
    ASSERT_TRUE(s.ok()) << "round " << round << ": " << s;
    EXPECT_EQ(GetAll(**store, id), v);
  }
}

TEST(NvmeStoreTest, ACapLargerThanTheDiskTakesNothingAtCreation) {
  // The cap is what the store may take, not what it takes: a 1 PiB cap on any disk opens, and a
  // small model takes small files.
  ScratchDir dir;
  auto engine = MakeEngine();
  NvmeStoreOptions o;
  o.on_warning = [](absl::string_view) {};
  o.capacity_bytes = 1ull << 50;
  auto store = NvmeStore::Open(dir.File("s"), o, engine.get());
  ASSERT_TRUE(store.ok()) << store.status();
  EXPECT_EQ((*store)->capacity_bytes(), 1ull << 50);
  EXPECT_EQ((*store)->allocated_bytes(), 0u);
  EXPECT_THAT(Listing(dir.File("s")), ElementsAre("journal-0.log", "lock", "manifest.json"));
  const auto v = RandomBytes(16 << 10, 1);
  ASSERT_TRUE((*store)->Put(1, v).ok());
  EXPECT_EQ(Swap(dir.File("s")).size_bytes, 32u << 10);  // the partition and its reserve
  EXPECT_EQ(GetAll(**store, 1), v);
}

TEST(NvmeStoreTest, SwapFilesTakeNoDiskUntilPartitionsArePutThenGrowWithThem) {
  ScratchDir dir;
  const std::string path = dir.File("s");
  auto engine = MakeEngine();
  NvmeStoreOptions o = Small();
  o.capacity_bytes = 1ull << 30;
  o.file_bytes = 4 << 20;
  auto store = NvmeStore::Open(path, o, engine.get());
  ASSERT_TRUE(store.ok()) << store.status();
  EXPECT_EQ(Swap(path).count, 0);
  EXPECT_EQ(Swap(path).disk_bytes, 0u);
  uint64_t before = 0;
  for (PartitionId id = 0; id < 6; ++id) {
    ASSERT_TRUE((*store)->Put(id, RandomBytes(1 << 20, id)).ok()) << id;
    const SwapFiles swap = Swap(path);
    // Fallocated (on disk, not sparse), at least the partitions and the reserve, and far from
    // the 1 GiB cap: within an eighth of what they hold.
    EXPECT_GE(swap.disk_bytes, (id + 2) << 20) << id;
    EXPECT_LE(swap.size_bytes, ((id + 2) << 20) + ((id + 2) << 20) / 8 + 4096) << id;
    EXPECT_EQ(swap.size_bytes, (*store)->allocated_bytes());
    EXPECT_GE(swap.size_bytes, before);
    before = swap.size_bytes;
  }
  EXPECT_EQ(Swap(path).count, 2);  // 4 MiB files
  for (PartitionId id = 0; id < 6; ++id) EXPECT_EQ(GetAll(**store, id), RandomBytes(1 << 20, id));
}

TEST(NvmeStoreTest, GrowthStopsAtTheCapAndAPutPastItChangesNothing) {
  ScratchDir dir;
  const std::string path = dir.File("s");
  auto engine = MakeEngine();
  auto store = NvmeStore::Open(path, Small(), engine.get());  // an 8 MiB cap in 3 MiB files
  ASSERT_TRUE(store.ok());
  PartitionId admitted = 0;
  for (; admitted < 7; ++admitted) {
    ASSERT_TRUE((*store)->Put(admitted, RandomBytes(1 << 20, admitted)).ok()) << admitted;
    EXPECT_LE((*store)->allocated_bytes(), 8u << 20);
    EXPECT_LE(Swap(path).size_bytes, 8u << 20);
  }
  // Seven 1 MiB partitions and the reserve fill the cap: the files are 3 + 3 + 2 MiB.
  EXPECT_EQ((*store)->allocated_bytes(), 8u << 20);
  EXPECT_THAT(Listing(path), ::testing::Contains(::testing::StartsWith("swap-")).Times(3));
  const uint64_t generation = (*store)->generation();
  absl::Status s = (*store)->Put(7, RandomBytes(1 << 20, 7));
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  EXPECT_THAT(s.message(), HasSubstr("7340032 of 8388608 bytes in use, the cap"));
  EXPECT_THAT(s.message(), HasSubstr("nothing was written"));
  EXPECT_EQ((*store)->generation(), generation);
  EXPECT_EQ((*store)->List().size(), 7u);
  EXPECT_EQ(Swap(path).size_bytes, 8u << 20);
  EXPECT_FALSE(std::filesystem::exists(path + "/swap-003.bin"));
  // The rewrites the reserve is for still go through.
  for (PartitionId id = 0; id < 7; ++id) {
    ASSERT_TRUE((*store)->Put(id, RandomBytes(1 << 20, 100 + id)).ok()) << id;
  }
  EXPECT_EQ(GetAll(**store, 3), RandomBytes(1 << 20, 103));
}

TEST(NvmeStoreTest, TheReserveIsJudgedAgainstTheCapAndHeldOnDisk) {
  ScratchDir dir;
  const std::string path = dir.File("s");
  auto engine = MakeEngine();
  std::atomic<bool> disk_full{false};
  NvmeStoreOptions o = Small();  // an 8 MiB cap
  o.test_fallocate_errno = [&](const std::string&, uint64_t, uint64_t) {
    return disk_full.load() ? ENOSPC : 0;
  };
  auto store = NvmeStore::Open(path, o, engine.get());
  ASSERT_TRUE(store.ok());
  ASSERT_TRUE((*store)->Put(1, RandomBytes(3 << 20, 1)).ok());
  EXPECT_EQ((*store)->allocated_bytes(), 6u << 20);  // the partition and its reserve
  // 3 MiB are free in the files now, but a second 3 MiB partition would leave 2 MiB under the
  // cap, less than the reserve: refused, though the files could hold it.
  absl::Status s = (*store)->Put(2, RandomBytes(3 << 20, 2));
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  EXPECT_THAT(s.message(), HasSubstr("needs 9437184 bytes"));
  // One that leaves the reserve under the cap is admitted, and the files grow to hold the
  // reserve with it ...
  ASSERT_TRUE((*store)->Put(2, RandomBytes(2 << 20, 2)).ok());
  EXPECT_EQ((*store)->allocated_bytes(), 8u << 20);
  // ... so the rewrites it is for never ask the disk for space, even a full one.
  disk_full = true;
  for (int round = 0; round < 4; ++round) {
    ASSERT_TRUE((*store)->Put(1, RandomBytes(3 << 20, 10 + round)).ok()) << round;
    ASSERT_TRUE((*store)->Put(2, RandomBytes(2 << 20, 20 + round)).ok()) << round;
  }
  EXPECT_EQ(GetAll(**store, 1), RandomBytes(3 << 20, 13));
  EXPECT_EQ(GetAll(**store, 2), RandomBytes(2 << 20, 23));
}

TEST(NvmeStoreTest, AGrowthOnAFullDiskIsResourceExhaustedNamingTheFileWithNothingChanged) {
  ScratchDir dir;
  const std::string path = dir.File("s");
  auto engine = MakeEngine();
  std::string full;              // fallocate fails with ENOSPC on paths ending so
  NvmeStoreOptions o = Small();  // an 8 MiB cap in 3 MiB files
  o.test_fallocate_errno = [&](const std::string& p, uint64_t, uint64_t) {
    return !full.empty() && absl::EndsWith(p, full) ? ENOSPC : 0;
  };
  const auto v1 = RandomBytes(1 << 20, 1), v2 = RandomBytes(1536 << 10, 2);
  auto store = NvmeStore::Open(path, o, engine.get());
  ASSERT_TRUE(store.ok());
  ASSERT_TRUE((*store)->Put(1, v1).ok());
  ASSERT_EQ((*store)->allocated_bytes(), 2u << 20);
  const uint64_t generation = (*store)->generation();
  // Partition 2 needs swap-000.bin grown to its 3 MiB and a new swap-001.bin: the first step
  // works, the second meets a full disk; both are undone.
  full = "swap-001.bin";
  absl::Status s = (*store)->Put(2, v2);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  EXPECT_EQ(StatusErrno(s), ENOSPC);
  EXPECT_THAT(s.message(), HasSubstr(path + "/swap-001.bin"));
  EXPECT_THAT(s.message(), HasSubstr("by 2097152 bytes"));  // 1.5 MiB and its reserve, less 1 free
  EXPECT_THAT(s.message(), HasSubstr("1048576 of 8388608 bytes in use, the cap"));
  EXPECT_THAT(s.message(), HasSubstr("nothing was written"));
  EXPECT_EQ((*store)->generation(), generation);
  EXPECT_EQ((*store)->allocated_bytes(), 2u << 20);
  EXPECT_EQ(std::filesystem::file_size(path + "/swap-000.bin"), 2u << 20);
  EXPECT_FALSE(std::filesystem::exists(path + "/swap-001.bin"));
  EXPECT_EQ(GetAll(**store, 1), v1);
  // The extension itself fails: the same, naming swap-000.bin.
  full = "swap-000.bin";
  s = (*store)->Put(2, v2);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  EXPECT_THAT(s.message(), HasSubstr(path + "/swap-000.bin @ 2097152"));
  EXPECT_EQ(std::filesystem::file_size(path + "/swap-000.bin"), 2u << 20);
  // Space again: it goes through, and a reopen finds both.
  full.clear();
  ASSERT_TRUE((*store)->Put(2, v2).ok());
  store->reset();
  std::vector<PartitionId> corrupt;
  auto again = NvmeStore::Open(path, Verifying(), engine.get(), &corrupt);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_TRUE(corrupt.empty());
  EXPECT_EQ(GetAll(**again, 1), v1);
  EXPECT_EQ(GetAll(**again, 2), v2);
}

TEST(NvmeStoreTest, AGrowthAheadThatTheDiskCannotHoldTakesOnlyWhatIsNeeded) {
  ScratchDir dir;
  auto engine = MakeEngine();
  uint64_t disk_left = ~0ull;
  NvmeStoreOptions o = Small();
  o.capacity_bytes = o.file_bytes = 64 << 20;
  o.test_fallocate_errno = [&](const std::string&, uint64_t, uint64_t length) {
    return length > disk_left ? ENOSPC : 0;
  };
  auto store = NvmeStore::Open(dir.File("s"), o, engine.get());
  ASSERT_TRUE(store.ok());
  ASSERT_TRUE((*store)->Put(1, RandomBytes(16 << 20, 1)).ok());
  ASSERT_EQ((*store)->allocated_bytes(), 32u << 20);
  // A 4 KiB partition would grow the files by an eighth (4 MiB); the disk has 8 KiB.
  disk_left = 8192;
  ASSERT_TRUE((*store)->Put(2, RandomBytes(4096, 2)).ok());
  EXPECT_EQ((*store)->allocated_bytes(), (32u << 20) + 4096);
}

TEST(NvmeStoreTest, AStoreThatGrewReopensWithItsFilesAtTheSizesTheyReached) {
  // Growth recorded in log records (no snapshot in between), then read back by a reopen that
  // passes no capacity: the recorded cap and file size stay in force.
  ScratchDir dir;
  const std::string path = dir.File("s");
  std::map<PartitionId, std::vector<std::byte>> expect;
  uint64_t allocated = 0;
  {
    auto engine = MakeEngine();
    NvmeStoreOptions o = Small();
    o.file_bytes = 1 << 20;
    o.compact_min_log_bytes = 1 << 20;
    auto store = NvmeStore::Open(path, o, engine.get());
    ASSERT_TRUE(store.ok());
    for (PartitionId id = 0; id < 5; ++id) {
      expect[id] = RandomBytes(300000 + id * 100000, id);
      ASSERT_TRUE((*store)->Put(id, expect[id]).ok()) << id;
    }
    allocated = (*store)->allocated_bytes();
    EXPECT_GT((*store)->log_bytes(), 0u);
  }
  EXPECT_EQ(Swap(path).size_bytes, allocated);
  for (int round = 0; round < 2; ++round) {  // the log replayed, then the snapshot it became
    auto engine = MakeEngine();
    std::vector<PartitionId> corrupt;
    auto store = NvmeStore::Open(path, Verifying(), engine.get(), &corrupt);
    ASSERT_TRUE(store.ok()) << round << ": " << store.status();
    EXPECT_TRUE(corrupt.empty());
    EXPECT_EQ((*store)->capacity_bytes(), 8u << 20);
    EXPECT_EQ((*store)->allocated_bytes(), allocated);
    for (const auto& [id, v] : expect) EXPECT_EQ(GetAll(**store, id), v) << id;
  }
  // It goes on growing, in files of the size it was made with, up to its cap.
  auto engine = MakeEngine();
  NvmeStoreOptions bigger;
  bigger.on_warning = [](absl::string_view) {};
  bigger.capacity_bytes = 9 << 20;  // a reopen may raise the cap
  auto store = NvmeStore::Open(path, bigger, engine.get());
  ASSERT_TRUE(store.ok());
  EXPECT_EQ((*store)->capacity_bytes(), 9u << 20);
  ASSERT_TRUE((*store)->Put(9, RandomBytes(1 << 20, 9)).ok());
  for (const auto& name : Listing(path)) {
    if (name.rfind("swap-", 0) == 0) {
      EXPECT_LE(std::filesystem::file_size(path + "/" + name), 1u << 20) << name;
    }
  }
}

TEST(NvmeStoreTest, FilesAreRemovedOnCloseWhenAskedAndKeptOtherwise) {
  ScratchDir dir;
  auto engine = MakeEngine();
  NvmeStoreOptions o = Small();
  o.remove_files_on_close = true;
  {
    // A directory the store made: removed with it.
    auto store = NvmeStore::Open(dir.File("made"), o, engine.get());
    ASSERT_TRUE(store.ok());
    ASSERT_TRUE((*store)->Put(1, RandomBytes(4 << 20, 1)).ok());
    EXPECT_GE(Swap(dir.File("made")).count, 2);
  }
  EXPECT_FALSE(std::filesystem::exists(dir.File("made")));
  // A directory that was there: the store's files go, the directory and what else is in it stay.
  std::filesystem::create_directory(dir.File("given"));
  std::ofstream(dir.File("given/notes.txt")) << "mine\n";
  {
    auto store = NvmeStore::Open(dir.File("given"), o, engine.get());
    ASSERT_TRUE(store.ok());
    ASSERT_TRUE((*store)->Put(1, RandomBytes(4096, 1)).ok());
  }
  EXPECT_THAT(Listing(dir.File("given")), ElementsAre("notes.txt"));
  // A store that did not open (a damaged manifest) leaves everything where it was.
  {
    NvmeStoreOptions keep = Small();
    auto store = NvmeStore::Open(dir.File("damaged"), keep, engine.get());
    ASSERT_TRUE(store.ok());
    ASSERT_TRUE((*store)->Put(1, RandomBytes(4096, 1)).ok());
  }
  std::ofstream(dir.File("damaged/manifest.json"), std::ios::trunc) << "{";
  const auto before = Listing(dir.File("damaged"));
  EXPECT_EQ(NvmeStore::Open(dir.File("damaged"), o, engine.get()).status().code(),
            absl::StatusCode::kDataLoss);
  EXPECT_EQ(Listing(dir.File("damaged")), before);
  // The directory is free again at once for the next store, which starts empty.
  auto next = NvmeStore::Open(dir.File("given"), Small(), engine.get());
  ASSERT_TRUE(next.ok()) << next.status();
  EXPECT_TRUE((*next)->List().empty());
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
  auto store = NvmeStore::Open(path, Verifying(), engine.get(), &corrupt);
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
  // 64 KiB block it spans, and the write after those is the manifest log's record. That one fails
  // (EIO), or is cut short and then fails (a short transfer, then ENOSPC on the rest).
  uint64_t data_pieces = 0;
  {
    auto engine = MakeEngine();
    auto store = NvmeStore::Open(path, {}, engine.get());
    ASSERT_TRUE(store.ok());
    const PartitionRecord r = *(*store)->Find(1);
    ASSERT_EQ(r.extents.size(), 1u);
    const uint64_t start = r.extents[0].offset + r.extents[0].length, end = start + 100000;
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
  enospc.max_hits = 1;
  for (const auto& rules : {manifest_fault({eio}), manifest_fault({cut, enospc})}) {
    std::shared_ptr<aio::FaultInjector> injector;
    auto engine = MakeEngine(rules, &injector);
    auto store = NvmeStore::Open(path, {}, engine.get());
    ASSERT_TRUE(store.ok()) << store.status();
    absl::Status s = (*store)->Put(1, RandomBytes(100000, 11));
    EXPECT_FALSE(s.ok());
    EXPECT_THAT(s.message(), HasSubstr("writing the manifest log")) << s;
    EXPECT_EQ(injector->total_hits(), rules.size());  // each fault fired, once
    EXPECT_EQ(GetAll(**store, 1), v1);
  }
  std::vector<PartitionId> corrupt;
  auto engine = MakeEngine();
  auto store = NvmeStore::Open(path, Verifying(), engine.get(), &corrupt);
  ASSERT_TRUE(store.ok()) << store.status();
  EXPECT_TRUE(corrupt.empty());
  EXPECT_EQ((*store)->generation(), generation);
  EXPECT_EQ(GetAll(**store, 1), v1);
  // And it goes on: the next put works.
  const auto v2 = RandomBytes(100000, 12);
  ASSERT_TRUE((*store)->Put(1, v2).ok());
  EXPECT_EQ(GetAll(**store, 1), v2);
}

// Reopens the store at `path` (then closes it): reopening compacts the log, so the next session
// starts with an empty one.
void ReopenToEmptyTheLog(const std::string& path) {
  auto engine = MakeEngine();
  auto store = NvmeStore::Open(path, {}, engine.get());
  ASSERT_TRUE(store.ok()) << store.status();
  EXPECT_EQ((*store)->log_bytes(), 0u);
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
  ASSERT_NO_FATAL_FAILURE(ReopenToEmptyTheLog(path));
  // The commit's log record fails (it is written at offset 0 of the empty log; the extents here
  // are not), and so does the compaction that replaces the log after it (the new snapshot is also
  // written at offset 0): neither partition changes, on disk or in memory.
  {
    aio::FaultRule eio = aio::FaultRule::Error(EIO);
    eio.only = aio::OpKind::kWrite;
    eio.offset_begin = 0;
    eio.offset_end = 1;
    auto engine = MakeEngine({eio});
    NvmeStoreOptions o;
    std::vector<std::string> warnings;
    o.on_warning = [&](absl::string_view w) { warnings.emplace_back(w); };
    auto store = NvmeStore::Open(path, o, engine.get());
    ASSERT_TRUE(store.ok()) << store.status();
    auto batch = (*store)->NewBatch();
    ASSERT_TRUE(batch->Stage(1, RandomBytes(70000, 4)).ok());
    ASSERT_TRUE(batch->Stage(2, RandomBytes(70000, 5)).ok());
    absl::Status s = batch->Commit();
    EXPECT_THAT(s.message(), HasSubstr("put partition 1 and others"));
    EXPECT_THAT(warnings, ElementsAre(HasSubstr("compacting the manifest log")));
    EXPECT_EQ(GetAll(**store, 1), a1);
    EXPECT_EQ(GetAll(**store, 2), b1);
    // Until a compaction replaces the log, nothing more is appended to it.
    EXPECT_FALSE((*store)->Put(3, RandomBytes(1000, 6)).ok());
  }
  auto clean = MakeEngine();
  auto reopened = NvmeStore::Open(path, {}, clean.get());
  ASSERT_TRUE(reopened.ok()) << reopened.status();
  EXPECT_EQ(GetAll(**reopened, 1), a1);
  EXPECT_EQ(GetAll(**reopened, 2), b1);
  EXPECT_EQ((*reopened)->Find(3).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ((*reopened)->used_bytes(), 2u * 73728);
}

// A Batch whose commit failed keeps what it staged: committed again (after the log is replaced),
// it lands whole; aborted while a record naming it may be in the log, its space stays taken until
// the log is replaced.
TEST(NvmeStoreTest, ABatchWhoseCommitFailedCommitsWhenCalledAgain) {
  ScratchDir dir;
  const std::string path = dir.File("s");
  const auto a1 = RandomBytes(70000, 1), b1 = RandomBytes(70000, 2);
  const auto a2 = RandomBytes(70000, 3), b2 = RandomBytes(70000, 4);
  {
    auto engine = MakeEngine();
    auto store = NvmeStore::Open(path, Small(), engine.get());
    ASSERT_TRUE(store.ok());
    ASSERT_TRUE((*store)->Put(1, a1).ok());
    ASSERT_TRUE((*store)->Put(2, b1).ok());
  }
  ASSERT_NO_FATAL_FAILURE(ReopenToEmptyTheLog(path));
  // The record (offset 0 of the empty log) fails, and so does the compaction after it (its new
  // log's first write, offset 0 too): the log stays poisoned.
  // `skip`: writes at offset 0 let through first (a data write into space freed there).
  // `hits` 1: only the record fails, and the compaction after it replaces the log at once.
  auto poisoned_engine = [](uint64_t skip, uint64_t hits = 2) {
    aio::FaultRule eio = aio::FaultRule::Error(EIO);
    eio.skip = skip;
    eio.only = aio::OpKind::kWrite;
    eio.offset_begin = 0;
    eio.offset_end = 1;
    eio.max_hits = hits;
    return MakeEngine({eio});
  };
  NvmeStoreOptions quiet;
  quiet.on_warning = [](absl::string_view) {};
  {
    auto engine = poisoned_engine(0);
    auto store = NvmeStore::Open(path, quiet, engine.get());
    ASSERT_TRUE(store.ok()) << store.status();
    const uint64_t used = (*store)->used_bytes();
    auto batch = (*store)->NewBatch();
    ASSERT_TRUE(batch->Stage(1, a2).ok());
    ASSERT_TRUE(batch->Stage(2, b2).ok());
    EXPECT_FALSE(batch->Commit().ok());
    EXPECT_EQ(batch->staged(), 2u);
    EXPECT_EQ(GetAll(**store, 1), a1);
    EXPECT_EQ((*store)->used_bytes(), used + 2 * 73728);
    // Staged again while the failed record may be in the log: the copy it replaces stays taken.
    ASSERT_TRUE(batch->Stage(1, a2).ok());
    EXPECT_EQ((*store)->used_bytes(), used + 3 * 73728);
    // Again: the log is replaced first, then the record lands.
    ASSERT_TRUE(batch->Commit().ok());
    EXPECT_EQ(batch->staged(), 0u);
    EXPECT_EQ(GetAll(**store, 1), a2);
    EXPECT_EQ(GetAll(**store, 2), b2);
    EXPECT_EQ((*store)->used_bytes(), used);
  }
  {
    auto engine = MakeEngine();
    auto store = NvmeStore::Open(path, {}, engine.get());
    ASSERT_TRUE(store.ok()) << store.status();
    EXPECT_EQ(GetAll(**store, 1), a2);
    EXPECT_EQ(GetAll(**store, 2), b2);
    EXPECT_EQ((*store)->used_bytes(), 2u * 73728);
  }
  {
    auto engine = poisoned_engine(1);  // a1's first piece goes where a1 was, at offset 0
    auto store = NvmeStore::Open(path, quiet, engine.get());
    ASSERT_TRUE(store.ok()) << store.status();
    const uint64_t used = (*store)->used_bytes();
    auto batch = (*store)->NewBatch();
    ASSERT_TRUE(batch->Stage(1, a1).ok());
    EXPECT_FALSE(batch->Commit().ok());
    batch->Abort();  // a record naming its extents may be in the log: they stay taken
    EXPECT_EQ((*store)->used_bytes(), used + 73728);
    absl::Status put = (*store)->Put(2, b1);  // the log replaced first: then they are free
    ASSERT_TRUE(put.ok()) << put;
    EXPECT_EQ((*store)->used_bytes(), used);
    EXPECT_EQ(GetAll(**store, 1), a2);
    EXPECT_EQ(GetAll(**store, 2), b1);
  }
  ASSERT_NO_FATAL_FAILURE(ReopenToEmptyTheLog(path));  // the Put above appended to it
  {
    // The compaction after the failed record replaces the log: aborted, its space comes back.
    auto engine = poisoned_engine(1, /*hits=*/1);
    auto store = NvmeStore::Open(path, quiet, engine.get());
    ASSERT_TRUE(store.ok()) << store.status();
    const uint64_t used = (*store)->used_bytes();
    auto batch = (*store)->NewBatch();
    ASSERT_TRUE(batch->Stage(1, a1).ok());
    EXPECT_FALSE(batch->Commit().ok());
    batch->Abort();
    EXPECT_EQ((*store)->used_bytes(), used);
    EXPECT_EQ(GetAll(**store, 1), a2);
  }
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

TEST(NvmeStoreTest, AFlippedByteIsFoundByVerifyAndByGetWithDataLoss) {
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
  std::snprintf(name, sizeof(name), "/swap-%03u.bin", victim.extents[0].file);
  FlipByte(path + name, victim.extents[0].offset + 1234);
  {
    // Reopening reads the manifest only; Verify rereads every partition on request.
    auto engine = MakeEngine();
    auto store = NvmeStore::Open(path, {}, engine.get());
    ASSERT_TRUE(store.ok()) << store.status();
    auto corrupt = (*store)->Verify();
    ASSERT_TRUE(corrupt.ok()) << corrupt.status();
    EXPECT_THAT(*corrupt, ElementsAre(11));
  }
  std::vector<PartitionId> corrupt;
  auto engine = MakeEngine();
  NvmeStoreOptions verify;
  verify.verify_on_open = true;
  auto store = NvmeStore::Open(path, verify, engine.get(), &corrupt);
  ASSERT_TRUE(store.ok()) << store.status();
  EXPECT_THAT(corrupt, ElementsAre(11));
  std::vector<std::byte> out(50000);
  absl::Status s = (*store)->Get(11, absl::MakeSpan(out));
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(s.message(), HasSubstr("partition 11"));
  EXPECT_TRUE((*store)->Get(10, absl::MakeSpan(out)).ok());
}

TEST(NvmeStoreTest, ReopeningDoesNotRereadThePartitions) {
  ScratchDir dir;
  const std::string path = dir.File("s");
  {
    auto engine = MakeEngine();
    auto store = NvmeStore::Open(path, Small(), engine.get());
    ASSERT_TRUE(store.ok());
    ASSERT_TRUE((*store)->Put(1, RandomBytes(300000, 1)).ok());
  }
  aio::FaultRule eio = aio::FaultRule::Error(EIO);
  eio.only = aio::OpKind::kRead;  // any read of a swap file fails
  {
    auto engine = MakeEngine({eio});
    EXPECT_TRUE(NvmeStore::Open(path, {}, engine.get()).ok());
  }
  auto engine = MakeEngine({eio});
  NvmeStoreOptions verify;
  verify.verify_on_open = true;
  EXPECT_EQ(StatusErrno(NvmeStore::Open(path, verify, engine.get()).status()), EIO);
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
  // The other user must reach the folder wherever the checkout lies.
  ScratchDir root = ScratchDir::Traversable();
  const std::string ro = root.File("ro");
  ASSERT_EQ(mkdir(ro.c_str(), 0555), 0);
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

TEST(NvmeStoreTest, ASecondStoreOnOneDirectoryIsRefusedInThisProcessAndAnother) {
  ScratchDir dir;
  const std::string path = dir.File("s");
  auto engine = MakeEngine();
  {
    auto first = NvmeStore::Open(path, Small(), engine.get());
    ASSERT_TRUE(first.ok()) << first.status();
    ASSERT_TRUE((*first)->Put(1, RandomBytes(5000, 1)).ok());
    auto second = NvmeStore::Open(path, Small(), engine.get());
    EXPECT_EQ(second.status().code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_THAT(
        second.status().message(),
        HasSubstr(absl::StrCat("in use by another strata store of this process (", getpid())));
    EXPECT_THAT(second.status().message(), HasSubstr("engine.close()"));  // how to free it
    EXPECT_THAT(second.status().message(), HasSubstr("nvme_path of its own"));
    // Another process (a fresh one: this one has threads, so it is exec'd, not only forked).
    setenv("STRATA_STORE_UNDER_TEST", path.c_str(), 1);
    std::string
        self = "/proc/self/exe",
        filter =
            "--gtest_filter=NvmeStoreSecondProcess.DISABLED_IsRefusedTheStoreNamedByTheEnvironment";
    std::string disabled = "--gtest_also_run_disabled_tests";
    char* argv[] = {self.data(), filter.data(), disabled.data(), nullptr};
    pid_t pid = 0;
    ASSERT_EQ(posix_spawn(&pid, self.c_str(), nullptr, nullptr, argv, environ), 0);
    int status = 0;
    ASSERT_EQ(waitpid(pid, &status, 0), pid);
    unsetenv("STRATA_STORE_UNDER_TEST");
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
    EXPECT_TRUE(std::filesystem::exists(path + ".refused"));  // the child test did run
    EXPECT_EQ(GetAll(**first, 1), RandomBytes(5000, 1));
  }
  // The lock goes with the store.
  auto again = NvmeStore::Open(path, {}, engine.get());
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(GetAll(**again, 1), RandomBytes(5000, 1));
}

TEST(NvmeStoreTest, AChildForkedWhileTheStoreIsOpenDoesNotKeepTheLock) {
  // A trainer's data loader forks workers while the store is open; closing the store must free
  // the folder at once, whatever the workers do (an inherited flock would stay held by them).
  ScratchDir dir;
  const std::string path = dir.File("s");
  int gate[2];
  ASSERT_EQ(pipe(gate), 0);
  pid_t child = -1;
  {
    auto engine = MakeEngine();
    auto store = NvmeStore::Open(path, Small(), engine.get());
    ASSERT_TRUE(store.ok()) << store.status();
    ASSERT_TRUE((*store)->Put(1, RandomBytes(5000, 1)).ok());
    child = fork();
    ASSERT_GE(child, 0);
    if (child == 0) {  // the worker: holds every descriptor it inherited until told to go
      close(gate[1]);
      char c;
      while (read(gate[0], &c, 1) < 0 && errno == EINTR) {
      }
      _exit(0);
    }
    close(gate[0]);
  }
  auto engine = MakeEngine();
  auto again = NvmeStore::Open(path, {}, engine.get());
  EXPECT_TRUE(again.ok()) << again.status();
  if (again.ok()) {
    EXPECT_EQ(GetAll(**again, 1), RandomBytes(5000, 1));
  }
  close(gate[1]);
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
}

TEST(NvmeStoreTest, APartitionLargerThanASwapFileSpansFiles) {
  ScratchDir dir;
  const std::string path = dir.File("s");
  NvmeStoreOptions o = Small();
  o.capacity_bytes = 10 << 20;
  o.file_bytes = 1 << 20;  // ten 1 MiB files
  const auto big = RandomBytes((3 << 20) + 12345, 31), big2 = RandomBytes((3 << 20) + 12345, 32);
  std::vector<std::byte> a(256 << 10), b(256 << 10);
  {
    auto engine = MakeEngine();
    auto store = NvmeStore::Open(path, o, engine.get());
    ASSERT_TRUE(store.ok()) << store.status();
    ASSERT_TRUE((*store)->Put(1, big).ok());
    const PartitionRecord r = *(*store)->Find(1);
    EXPECT_GE(r.extents.size(), 4u);
    EXPECT_EQ(GetAll(**store, 1), big);
    // Chunked staging and reading across the files' boundaries.
    auto batch = (*store)->NewBatch();
    ASSERT_TRUE(batch
                    ->StageChunked(1, big2.size(), absl::MakeSpan(a), absl::MakeSpan(b),
                                   [&](uint64_t off, absl::Span<std::byte> chunk) {
                                     std::memcpy(chunk.data(), big2.data() + off, chunk.size());
                                     return absl::OkStatus();
                                   })
                    .ok());
    ASSERT_TRUE(batch->Commit().ok());
  }
  std::vector<PartitionId> corrupt;
  auto engine = MakeEngine();
  auto store = NvmeStore::Open(path, Verifying(), engine.get(), &corrupt);
  ASSERT_TRUE(store.ok()) << store.status();
  EXPECT_TRUE(corrupt.empty());
  std::vector<std::byte> back(big2.size());
  ASSERT_TRUE((*store)
                  ->GetChunked(1, absl::MakeSpan(a), absl::MakeSpan(b),
                               [&](uint64_t off, absl::Span<const std::byte> chunk) {
                                 std::memcpy(back.data() + off, chunk.data(), chunk.size());
                                 return absl::OkStatus();
                               })
                  .ok());
  EXPECT_EQ(back, big2);
}

TEST(NvmeStoreTest, FragmentedFreeSpaceHoldsAPartitionInPieces) {
  ScratchDir dir;
  auto engine = MakeEngine();
  NvmeStoreOptions o = Small();
  o.capacity_bytes = 5 << 20;
  o.file_bytes = 5 << 20;  // one file
  auto store = NvmeStore::Open(dir.File("s"), o, engine.get());
  ASSERT_TRUE(store.ok());
  // Sixteen 256 KiB partitions, then every other one erased: 2 MiB free in 256 KiB holes, plus
  // the 1 MiB tail; a 1.5 MiB partition fits only in pieces.
  for (PartitionId id = 0; id < 16; ++id) {
    ASSERT_TRUE((*store)->Put(id, RandomBytes(256 << 10, id)).ok()) << id;
  }
  for (PartitionId id = 0; id < 16; id += 2) ASSERT_TRUE((*store)->Erase(id).ok());
  const auto v = RandomBytes(1536 << 10, 99);
  ASSERT_TRUE((*store)->Put(100, v).ok());
  EXPECT_GE((*store)->Find(100)->extents.size(), 2u);
  EXPECT_EQ(GetAll(**store, 100), v);
  EXPECT_EQ(GetAll(**store, 3), RandomBytes(256 << 10, 3));
}

TEST(NvmeStoreTest, ACommitAppendsOneBlockAndLeavesTheSnapshotAlone) {
  ScratchDir dir;
  const std::string path = dir.File("s");
  auto engine = MakeEngine();
  NvmeStoreOptions o = Small();
  o.compact_min_log_bytes = 1 << 20;
  auto store = NvmeStore::Open(path, o, engine.get());
  ASSERT_TRUE(store.ok());
  for (PartitionId id = 0; id < 50; ++id) {
    ASSERT_TRUE((*store)->Put(id, RandomBytes(4096, id)).ok());
  }
  struct stat before;
  ASSERT_EQ(stat((path + "/manifest.json").c_str(), &before), 0);
  const uint64_t log = (*store)->log_bytes();
  EXPECT_EQ(log, 50u * 4096);
  // With 50 partitions stored, one more commit still writes one block.
  ASSERT_TRUE((*store)->Put(7, RandomBytes(4096, 1000)).ok());
  EXPECT_EQ((*store)->log_bytes(), log + 4096);
  struct stat after;
  ASSERT_EQ(stat((path + "/manifest.json").c_str(), &after), 0);
  EXPECT_EQ(after.st_ino, before.st_ino);  // the snapshot was not rewritten
}

TEST(NvmeStoreTest, TheLogIsCompactedWhenItOutgrowsTheSnapshotAndReplayedOnReopen) {
  ScratchDir dir;
  const std::string path = dir.File("s");
  std::map<PartitionId, std::vector<std::byte>> expect;
  {
    auto engine = MakeEngine();
    NvmeStoreOptions o = Small();
    o.compact_min_log_bytes = 16 << 10;
    auto store = NvmeStore::Open(path, o, engine.get());
    ASSERT_TRUE(store.ok());
    uint64_t peak = 0;
    for (int i = 0; i < 40; ++i) {
      const PartitionId id = static_cast<PartitionId>(i % 6);
      expect[id] = RandomBytes(5000 + i, i);
      ASSERT_TRUE((*store)->Put(id, expect[id]).ok());
      peak = std::max(peak, (*store)->log_bytes());
    }
    EXPECT_LE(peak, 20u << 10);  // compacted past 16 KiB
    ASSERT_TRUE((*store)->Erase(5).ok());
    expect.erase(5);
    EXPECT_THAT(Listing(path), ::testing::Contains(::testing::StartsWith("journal-")).Times(1));
  }
  std::vector<PartitionId> corrupt;
  auto engine = MakeEngine();
  auto store = NvmeStore::Open(path, Verifying(), engine.get(), &corrupt);
  ASSERT_TRUE(store.ok()) << store.status();
  EXPECT_TRUE(corrupt.empty());
  EXPECT_EQ((*store)->generation(), 42u);  // creation + 40 puts + the erase
  ASSERT_EQ((*store)->List().size(), expect.size());
  for (const auto& [id, v] : expect) EXPECT_EQ(GetAll(**store, id), v);
  uint64_t used = 0;
  for (const auto& [id, v] : expect) used += (v.size() + 4095) / 4096 * 4096;
  EXPECT_EQ((*store)->used_bytes(), used);
}

TEST(NvmeStoreTest, ATornOrGarbledLogTailIsDroppedAndTheRestKept) {
  ScratchDir dir;
  const std::string path = dir.File("s");
  const auto v1 = RandomBytes(9000, 1), v2 = RandomBytes(9000, 2), w = RandomBytes(3000, 3);
  std::string log;
  {
    auto engine = MakeEngine();
    NvmeStoreOptions o = Small();
    o.compact_min_log_bytes = 1 << 20;
    auto store = NvmeStore::Open(path, o, engine.get());
    ASSERT_TRUE(store.ok());
    ASSERT_TRUE((*store)->Put(1, v1).ok());
    ASSERT_TRUE((*store)->Put(2, w).ok());
    ASSERT_TRUE((*store)->Put(1, v2).ok());  // the last record: torn below
    for (const auto& n : Listing(path)) {
      if (n.rfind("journal-", 0) == 0) log = path + "/" + n;
    }
  }
  ASSERT_FALSE(log.empty());
  const uint64_t size = std::filesystem::file_size(log);
  ASSERT_EQ(size, 3u * 4096);
  std::filesystem::resize_file(log, size - 4096 + 100);  // the last record cut after 100 bytes
  {
    std::ofstream garbage(log, std::ios::app | std::ios::binary);
    garbage << "not a record";
  }
  auto engine = MakeEngine();
  std::vector<PartitionId> corrupt;
  auto store = NvmeStore::Open(path, Verifying(), engine.get(), &corrupt);
  ASSERT_TRUE(store.ok()) << store.status();
  EXPECT_TRUE(corrupt.empty());
  EXPECT_EQ(GetAll(**store, 1), v1);  // the torn commit never happened
  EXPECT_EQ(GetAll(**store, 2), w);
  EXPECT_EQ((*store)->used_bytes(), 3u * 4096 + 4096);  // v2's extent is free again
  ASSERT_TRUE((*store)->Put(1, v2).ok());
  EXPECT_EQ(GetAll(**store, 1), v2);
}

// Run by the test above in a process of its own.
TEST(NvmeStoreSecondProcess, DISABLED_IsRefusedTheStoreNamedByTheEnvironment) {
  const char* path = getenv("STRATA_STORE_UNDER_TEST");
  ASSERT_NE(path, nullptr);
  auto engine = MakeEngine();
  auto s = NvmeStore::Open(path, Small(), engine.get());
  ASSERT_EQ(s.status().code(), absl::StatusCode::kFailedPrecondition) << s.status();
  std::ofstream(std::string(path) + ".refused") << "refused\n";
}

// In a forked child: opens the store at `path` with `o`, killed (exit 42) when its test hook
// reaches `where` while `act` runs; the parent expects exactly that death.
void ExpectKilledAt(const std::string& path, const NvmeStoreOptions& o, const std::string& where,
                    const std::function<void(NvmeStore&)>& act) {
  EXPECT_EXIT(
      {
        auto engine = MakeEngine();
        NvmeStoreOptions k = o;
        k.test_hook = [&](absl::string_view at) {
          if (at == where) _exit(42);
        };
        auto store = NvmeStore::Open(path, k, engine.get());
        if (!store.ok()) _exit(2);
        act(**store);
        _exit(3);  // the kill point was never reached
      },
      ::testing::ExitedWithCode(42), "")
      << where;
}

// A kill at each step of a commit (and of the compaction that follows it): a reopen finds the
// previous state or the new one, whole, and the store goes on.
class NvmeStoreKillTest : public ::testing::TestWithParam<std::pair<const char*, int>> {};

TEST_P(NvmeStoreKillTest, AReopenFindsOneStateWholeAndGoesOn) {
  // The default ("fast") death-test style forks here, so the child sees the store made above; no
  // thread is running at that point (the engine above is gone).
  const auto [point, outcome] = GetParam();  // outcome: 1 the old bytes, 2 the new, 0 either
  ScratchDir dir;
  const std::string path = dir.File("s");
  const auto v1 = RandomBytes(200000, 1), v2 = RandomBytes(200000, 2), other = RandomBytes(7000, 3);
  NvmeStoreOptions o = Small();
  o.compact_min_log_bytes = 1;  // every commit compacts
  {
    auto engine = MakeEngine();
    auto store = NvmeStore::Open(path, o, engine.get());
    ASSERT_TRUE(store.ok());
    ASSERT_TRUE((*store)->Put(1, v1).ok());
    ASSERT_TRUE((*store)->Put(2, other).ok());
  }
  ExpectKilledAt(path, o, point, [&](NvmeStore& store) { (void)store.Put(1, v2); });
  auto engine = MakeEngine();
  std::vector<PartitionId> corrupt;
  auto store = NvmeStore::Open(path, Verifying(), engine.get(), &corrupt);
  ASSERT_TRUE(store.ok()) << point << ": " << store.status();
  EXPECT_TRUE(corrupt.empty()) << point;
  const auto got = GetAll(**store, 1);
  if (outcome == 1) {
    EXPECT_EQ(got, v1) << point;
  } else if (outcome == 2) {
    EXPECT_EQ(got, v2) << point;
  } else {
    EXPECT_TRUE(got == v1 || got == v2) << point;
  }
  EXPECT_EQ(GetAll(**store, 2), other);
  EXPECT_EQ((*store)->used_bytes(), 200704u + 8192u) << point;  // nothing leaked
  EXPECT_THAT(Listing(path), ElementsAre(::testing::StartsWith("journal-"), "lock", "manifest.json",
                                         "swap-000.bin"))
      << point;
  const auto v3 = RandomBytes(200000, 4);
  ASSERT_TRUE((*store)->Put(1, v3).ok()) << point;
  EXPECT_EQ(GetAll(**store, 1), v3);
}

INSTANTIATE_TEST_SUITE_P(EachStep, NvmeStoreKillTest,
                         ::testing::Values(std::make_pair("commit:data-synced", 1),
                                           std::make_pair("commit:log-written", 0),
                                           std::make_pair("commit:log-synced", 2),
                                           std::make_pair("compact:log-created", 2),
                                           std::make_pair("compact:snapshot-written", 2),
                                           std::make_pair("compact:snapshot-renamed", 2),
                                           std::make_pair("compact:old-log-removed", 2)),
                         [](const auto& info) {
                           std::string name = info.param.first;
                           for (char& c : name) {
                             if (c == ':' || c == '-') c = '_';
                           }
                           return name;
                         });

// A kill after the files grew for a new partition, before (or after) the commit that uses the
// space: a reopen finds the previous state with the unrecorded growth given back (the new one
// with the files at their grown sizes), and goes on.
class NvmeStoreGrowthKillTest : public ::testing::TestWithParam<std::pair<const char*, bool>> {};

TEST_P(NvmeStoreGrowthKillTest, AReopenFindsThePreviousStateAndSpace) {
  const auto [point, committed] = GetParam();
  ScratchDir dir;
  const std::string path = dir.File("s");
  const auto v1 = RandomBytes(1 << 20, 1), v2 = RandomBytes(2 << 20, 2);
  const NvmeStoreOptions o = Small();  // 3 MiB files
  {
    auto engine = MakeEngine();
    auto store = NvmeStore::Open(path, o, engine.get());
    ASSERT_TRUE(store.ok());
    ASSERT_TRUE((*store)->Put(1, v1).ok());
    ASSERT_EQ((*store)->allocated_bytes(), 2u << 20);
  }
  // The Put grows swap-000.bin to 3 MiB and adds a 2 MiB swap-001.bin.
  ExpectKilledAt(path, o, point, [&](NvmeStore& store) { (void)store.Put(2, v2); });
  auto engine = MakeEngine();
  std::vector<PartitionId> corrupt;
  auto store = NvmeStore::Open(path, Verifying(), engine.get(), &corrupt);
  ASSERT_TRUE(store.ok()) << point << ": " << store.status();
  EXPECT_TRUE(corrupt.empty()) << point;
  EXPECT_EQ(GetAll(**store, 1), v1) << point;
  if (committed) {
    EXPECT_EQ(GetAll(**store, 2), v2) << point;
    EXPECT_EQ((*store)->allocated_bytes(), 5u << 20) << point;
    EXPECT_EQ(std::filesystem::file_size(path + "/swap-001.bin"), 2u << 20) << point;
  } else {
    EXPECT_EQ((*store)->Find(2).status().code(), absl::StatusCode::kNotFound) << point;
    EXPECT_EQ((*store)->allocated_bytes(), 2u << 20) << point;
    EXPECT_FALSE(std::filesystem::exists(path + "/swap-001.bin")) << point;
  }
  EXPECT_EQ(std::filesystem::file_size(path + "/swap-000.bin"), committed ? 3u << 20 : 2u << 20)
      << point;
  ASSERT_TRUE((*store)->Put(2, v1).ok()) << point;
  EXPECT_EQ(GetAll(**store, 2), v1);
}

INSTANTIATE_TEST_SUITE_P(AroundTheCommit, NvmeStoreGrowthKillTest,
                         ::testing::Values(std::make_pair("grow:allocated", false),
                                           std::make_pair("commit:data-synced", false),
                                           std::make_pair("commit:log-synced", true)),
                         [](const auto& info) {
                           std::string name = info.param.first;
                           for (char& c : name) {
                             if (c == ':' || c == '-') c = '_';
                           }
                           return name;
                         });

}  // namespace
}  // namespace strata::tiering
