// The step bound's arithmetic (planner/step_bound.h) on cases small enough to check by hand.
#include "planner/step_bound.h"

#include "absl/container/flat_hash_map.h"
#include "gtest/gtest.h"

namespace strata::plan {
namespace {

constexpr uint64_t kPage = 4096;

Access Read(PartitionId id, Tier t = Tier::kHost) { return {id, t, false}; }
Access Write(PartitionId id, Tier t = Tier::kHost) { return {id, t, true}; }
Access Discard(PartitionId id) { return {id, Tier::kNvme, false, true}; }

TEST(StepBoundTest, BeladyKeepsTheCopyNeededSoonestOnACycleLargerThanItsBudget) {
  // A B C repeated with room for two: the offline-optimal rule loads once per cycle in the steady
  // state (least-recently-used would load all three).
  auto page = [](PartitionId) { return kPage; };
  const Traffic t = Belady(page, {Read(1), Read(2), Read(3)}, 2 * kPage);
  EXPECT_EQ(t.loaded, kPage);
  EXPECT_EQ(t.written, 0u);
  // The same cycle with A written: A is evicted (dirty) once per cycle and written back.
  const Traffic dirty = Belady(page, {Write(1), Read(2), Read(3)}, 2 * kPage);
  EXPECT_EQ(dirty.loaded, kPage);
  EXPECT_EQ(dirty.written, kPage);
  // Everything fits: nothing moves in the steady state.
  EXPECT_EQ(Belady(page, {Write(1), Read(2), Read(3)}, 3 * kPage).loaded, 0u);
}

TEST(StepBoundTest, BeladyCountsBytesButBudgetsWholePages) {
  // 5000 bytes take two pages: a budget of four pages holds two of them, not three.
  auto size = [](PartitionId) { return uint64_t{5000}; };
  const Traffic t = Belady(size, {Read(1), Read(2), Read(3)}, 4 * kPage);
  EXPECT_EQ(t.loaded, 5000u);
}

TEST(StepBoundTest, ADiscardedCopyIsNeitherWrittenBackNorLoadedAgain) {
  auto page = [](PartitionId) { return kPage; };
  // A gradient written, read, discarded: its next write needs no load, and nothing is written back.
  EXPECT_EQ(Belady(page, {Write(1), Read(1), Discard(1)}, 0).loaded, 0u);
  const Traffic alone = Belady(page, {Write(1), Read(1), Discard(1)}, kPage);
  EXPECT_EQ(alone.loaded, 0u);
  EXPECT_EQ(alone.written, 0u);
  // With room for one: B evicts A, which is dead (its next event is its discard): no write-back;
  // B is loaded once per cycle (it is evicted by the next cycle's fresh A).
  const Traffic t = Belady(page, {Write(1), Read(2), Discard(1)}, kPage);
  EXPECT_EQ(t.loaded, kPage);
  EXPECT_EQ(t.written, 0u);
}

TEST(StepBoundTest, OneTiersLinkCountsWhatTheOtherTierReadsAndWhatItsWritesLeaveStale) {
  auto page = [](PartitionId) { return kPage; };
  // A gradient written on the device, read on the host, discarded: it crosses down once a step,
  // though its next event on the device itself would be its discard.
  const Traffic grad = Belady(page, {Write(1, Tier::kDevice), Read(1, Tier::kHost), Discard(1)},
                              4 * kPage, Tier::kDevice);
  EXPECT_EQ(grad.loaded, 0u);
  EXPECT_EQ(grad.written, kPage);
  // Parameters read on the device and written on the host (the optimizer's new weights): the
  // device copy goes stale, and is loaded again however much room there is.
  const Traffic param =
      Belady(page, {Read(0, Tier::kDevice), Write(0, Tier::kHost)}, 4 * kPage, Tier::kDevice);
  EXPECT_EQ(param.loaded, kPage);
  EXPECT_EQ(param.written, 0u);
  // The host tier's accesses take none of the device's room.
  EXPECT_EQ(Belady(page, {Read(0, Tier::kDevice), Read(1), Read(2)}, kPage, Tier::kDevice).loaded,
            0u);
}

TEST(StepBoundTest, PhasesMoveWhatTheirBudgetsCannotHoldAndNoBytesForADiscardedPartition) {
  // Parameters P0 P1 (4 KiB), gradients G0 G1 (4 KiB, discarded once stepped), states S0 S1 (12
  // KiB). Device budget 4 KiB, device and host together 16 KiB.
  absl::flat_hash_map<PartitionId, uint64_t> sizes = {
      {0, kPage}, {1, kPage}, {10, kPage}, {11, kPage}, {20, 3 * kPage}, {21, 3 * kPage}};
  auto size = [&](PartitionId id) { return sizes.at(id); };
  constexpr Tier kDev = Tier::kDevice;
  std::vector<Group> step = {
      {{Read(0, kDev)}, 0.001, kForward},
      {{Read(1, kDev)}, 0.001, kForward},
      {{Read(1, kDev), Write(11, kDev)}, 0.002, kBackward},
      {{Read(0, kDev), Write(10, kDev)}, 0.002, kBackward},
      {{Write(21), Read(11), Write(1)}, 0.002, kOptimizer, std::nullopt, 11},
      {{Write(20), Read(10), Write(0)}, 0.002, kOptimizer, std::nullopt, 10},
  };
  const auto needs = PhaseLowerBounds(size, step, kPage, 4 * kPage);
  // Forward: reads P0 P1 (8 KiB): the memory holds them; the device one of them.
  EXPECT_DOUBLE_EQ(needs[kForward].compute_s, 0.002);
  EXPECT_EQ(needs[kForward].disk.loaded, 0u);
  EXPECT_EQ(needs[kForward].link.loaded, kPage);
  EXPECT_EQ(needs[kForward].link.written, 0u);
  // Backward: the gradients were discarded last step, so only P1 P0 are read (8 KiB, the device
  // holding 4); G1 G0 are written on the device (8 KiB) and all but 4 KiB must leave it.
  EXPECT_EQ(needs[kBackward].link.loaded, kPage);
  EXPECT_EQ(needs[kBackward].link.written, kPage);
  EXPECT_EQ(needs[kBackward].disk.loaded, 0u);
  EXPECT_EQ(needs[kBackward].disk.written, 0u);
  // Optimizer: reads S1 G1 P1 S0 G0 P0 (40 KiB, 16 held), dirties S1 P1 S0 P0 (32 KiB, 16 held).
  EXPECT_EQ(needs[kOptimizer].disk.loaded, 10 * kPage - 4 * kPage);
  EXPECT_EQ(needs[kOptimizer].disk.written, 8 * kPage - 4 * kPage);
  EXPECT_EQ(needs[kOptimizer].link.loaded, 0u);
  EXPECT_DOUBLE_EQ(needs[kOptimizer].compute_s, 0.004);
}

TEST(StepBoundTest, APartitionDirtiedAndDiscardedWithinAPhaseNeedNotBeWrittenBack) {
  auto page = [](PartitionId) { return kPage; };
  // Interleaved: the gradient is written on the device and stepped from in the same phase.
  std::vector<Group> step = {
      {{Write(1, Tier::kDevice)}, 0.001, kBackward},
      {{Read(1)}, 0.001, kBackward, std::nullopt, 1},
  };
  const auto needs = PhaseLowerBounds(page, step, 0, 0);
  EXPECT_EQ(needs[kBackward].disk.loaded, 0u);  // no bytes at the phase's start
  EXPECT_EQ(needs[kBackward].disk.written, 0u);
  EXPECT_EQ(needs[kBackward].link.loaded, 0u);
  EXPECT_EQ(needs[kBackward].link.written, 0u);
}

}  // namespace
}  // namespace strata::plan
