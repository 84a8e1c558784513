#include "tiering/residency.h"

#include <random>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace strata::tiering {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

PartitionDesc Desc(PartitionId id, uint64_t bytes = 100) {
  PartitionDesc d;
  d.id = id;
  d.bytes = bytes;
  d.elements = bytes / 4;
  return d;
}

TEST(ResidencyTest, TheOnlyCurrentCopyIsNeverDroppedOrOverwritten) {
  ResidencyTable t({1000, 1000, 1000}, /*granule_bytes=*/1);
  ASSERT_TRUE(t.Register(Desc(1)).ok());
  ASSERT_TRUE(t.Materialize(1, Tier::kDevice).ok());
  absl::Status s = t.Drop(1, Tier::kDevice);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(s.message(), HasSubstr("only current one; write it back first"));
  // Write it back to host, then the device copy may go.
  ASSERT_TRUE(t.BeginMove(1, Tier::kDevice, Tier::kHost).ok());
  EXPECT_FALSE(t.Drop(1, Tier::kDevice).ok());  // the move reads it
  ASSERT_TRUE(t.EndMove(1, true).ok());
  ASSERT_TRUE(t.Drop(1, Tier::kDevice).ok());
  EXPECT_EQ(t.used_bytes(Tier::kDevice), 0u);
  EXPECT_EQ(t.used_bytes(Tier::kHost), 100u);
}

TEST(ResidencyTest, AFailedMoveLeavesThePreviousCopyAndReleasesTheDestination) {
  ResidencyTable t({1000, 1000, 1000}, /*granule_bytes=*/1);
  ASSERT_TRUE(t.Register(Desc(1)).ok());
  ASSERT_TRUE(t.Materialize(1, Tier::kHost).ok());
  ASSERT_TRUE(t.BeginMove(1, Tier::kHost, Tier::kNvme).ok());
  EXPECT_EQ(t.used_bytes(Tier::kNvme), 100u);  // reserved
  ASSERT_TRUE(t.EndMove(1, false).ok());       // the write-back failed
  auto r = t.Get(1);
  EXPECT_TRUE(r->current[static_cast<int>(Tier::kHost)]);
  EXPECT_FALSE(r->has_copy[static_cast<int>(Tier::kNvme)]);
  EXPECT_TRUE(r->dirty(Tier::kHost));
  EXPECT_EQ(t.used_bytes(Tier::kNvme), 0u);
}

TEST(ResidencyTest, TwoMovesOfOnePartitionNeverRace) {
  ResidencyTable t({1000, 1000, 1000}, /*granule_bytes=*/1);
  ASSERT_TRUE(t.Register(Desc(1)).ok());
  ASSERT_TRUE(t.Materialize(1, Tier::kNvme).ok());
  ASSERT_TRUE(t.BeginMove(1, Tier::kNvme, Tier::kHost).ok());
  absl::Status s = t.BeginMove(1, Tier::kNvme, Tier::kDevice);
  EXPECT_THAT(s.message(), HasSubstr("a move nvme -> host is already in flight"));
}

TEST(ResidencyTest, ThePeakIsTheMostATierHeldAtOnce) {
  ResidencyTable t({1000, 1000, 1000}, /*granule_bytes=*/1);
  EXPECT_EQ(t.peak_bytes(Tier::kDevice), 0u);
  ASSERT_TRUE(t.Register(Desc(1, 300)).ok());
  ASSERT_TRUE(t.Register(Desc(2, 200)).ok());
  ASSERT_TRUE(t.Materialize(1, Tier::kDevice).ok());
  ASSERT_TRUE(t.Materialize(2, Tier::kHost).ok());
  ASSERT_TRUE(t.BeginMove(2, Tier::kHost, Tier::kDevice).ok());  // reserved: 500 at once
  ASSERT_TRUE(t.EndMove(2, true).ok());
  ASSERT_TRUE(t.BeginMove(1, Tier::kDevice, Tier::kHost).ok());
  ASSERT_TRUE(t.EndMove(1, true).ok());
  ASSERT_TRUE(t.Drop(1, Tier::kDevice).ok());
  EXPECT_EQ(t.used_bytes(Tier::kDevice), 200u);
  EXPECT_EQ(t.peak_bytes(Tier::kDevice), 500u);
  ASSERT_TRUE(t.SetAside(Tier::kDevice, 700).ok());
  t.GiveBack(Tier::kDevice, 700);
  EXPECT_EQ(t.peak_bytes(Tier::kDevice), 900u);
  EXPECT_EQ(t.peak_bytes(Tier::kHost), 500u);
}

TEST(ResidencyTest, BudgetsAreHardAndNamed) {
  ResidencyTable t({150, 1000, 1000}, /*granule_bytes=*/1);
  ASSERT_TRUE(t.Register(Desc(1)).ok());
  ASSERT_TRUE(t.Register(Desc(2)).ok());
  ASSERT_TRUE(t.Materialize(1, Tier::kDevice).ok());
  absl::Status s = t.Materialize(2, Tier::kDevice);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(s.message(), HasSubstr("device tier's budget of 150 bytes has 50 free, 100 needed"));
}

TEST(ResidencyTest, BytesSetAsideCountAgainstTheBudgetUntilGivenBack) {
  ResidencyTable t({1000, 1000, 1000}, /*granule_bytes=*/1);
  ASSERT_TRUE(t.Register(Desc(1)).ok());
  ASSERT_TRUE(t.Materialize(1, Tier::kHost).ok());
  ASSERT_TRUE(t.SetAside(Tier::kHost, 850).ok());
  EXPECT_EQ(t.used_bytes(Tier::kHost), 950u);
  EXPECT_EQ(t.set_aside_bytes(Tier::kHost), 850u);
  absl::Status s = t.SetAside(Tier::kHost, 51);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(s.message(),
              HasSubstr("host tier's budget aside: its budget of 1000 bytes has 50 free"));
  ASSERT_TRUE(t.Register(Desc(2)).ok());
  EXPECT_EQ(t.Materialize(2, Tier::kHost).code(), absl::StatusCode::kResourceExhausted);
  ASSERT_TRUE(t.CheckInvariants().ok()) << t.CheckInvariants();
  t.GiveBack(Tier::kHost, 5000);  // at most what is set aside
  EXPECT_EQ(t.used_bytes(Tier::kHost), 100u);
  EXPECT_EQ(t.set_aside_bytes(Tier::kHost), 0u);
  ASSERT_TRUE(t.Materialize(2, Tier::kHost).ok());
  ASSERT_TRUE(t.CheckInvariants().ok());
}

TEST(ResidencyTest, ParameterElementsAreCountedPerTier) {
  ResidencyTable t({1000, 1000, 1000}, /*granule_bytes=*/1);
  PartitionDesc grad = Desc(2);
  grad.role = Role::kGrad;
  ASSERT_TRUE(t.Register(Desc(1)).ok());  // a parameter of 25 elements
  ASSERT_TRUE(t.Register(grad).ok());
  ASSERT_TRUE(t.Materialize(1, Tier::kHost).ok());
  ASSERT_TRUE(t.Materialize(2, Tier::kDevice).ok());
  EXPECT_EQ(t.param_elements(Tier::kDevice), 0u);
  ASSERT_TRUE(t.BeginMove(1, Tier::kHost, Tier::kDevice).ok());
  EXPECT_EQ(t.param_elements(Tier::kDevice), 25u);  // counted from the move's start
  ASSERT_TRUE(t.EndMove(1, false).ok());
  EXPECT_EQ(t.param_elements(Tier::kDevice), 0u);
  ASSERT_TRUE(t.BeginMove(1, Tier::kHost, Tier::kDevice).ok());
  ASSERT_TRUE(t.EndMove(1, true).ok());
  ASSERT_TRUE(t.Drop(1, Tier::kHost).ok());
  EXPECT_EQ(t.param_elements(Tier::kDevice), 25u);
  EXPECT_EQ(t.param_elements(Tier::kHost), 0u);
  ASSERT_TRUE(t.CheckInvariants().ok());
  ASSERT_TRUE(t.Unregister(1).ok());
  EXPECT_EQ(t.param_elements(Tier::kDevice), 0u);
}

TEST(ResidencyTest, PinnedCopiesAreNeverDroppedOrLeftStale) {
  ResidencyTable t({1000, 1000, 1000}, /*granule_bytes=*/1);
  ASSERT_TRUE(t.Register(Desc(1)).ok());
  ASSERT_TRUE(t.Materialize(1, Tier::kHost).ok());
  ASSERT_TRUE(t.BeginMove(1, Tier::kHost, Tier::kDevice).ok());
  ASSERT_TRUE(t.EndMove(1, true).ok());
  ASSERT_TRUE(t.Pin(1, Tier::kDevice).ok());
  EXPECT_THAT(t.Drop(1, Tier::kDevice).message(), HasSubstr("pinned"));
  ASSERT_TRUE(t.Pin(1, Tier::kHost).ok());
  EXPECT_THAT(t.MarkWritten(1, Tier::kDevice).status().message(), HasSubstr("would go stale"));
  ASSERT_TRUE(t.Unpin(1, Tier::kHost).ok());
  auto stale = t.MarkWritten(1, Tier::kDevice);
  ASSERT_TRUE(stale.ok());
  EXPECT_THAT(*stale, ElementsAre(Tier::kHost));
  EXPECT_TRUE(t.Get(1)->dirty(Tier::kDevice));
}

TEST(ResidencyTest, BadRegistrationsAreRefused) {
  ResidencyTable t({1000, 1000, 1000}, /*granule_bytes=*/1);
  EXPECT_EQ(t.Register(Desc(1, 0)).code(), absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE(t.Register(Desc(1)).ok());
  EXPECT_EQ(t.Register(Desc(1)).code(), absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(t.Drop(9, Tier::kHost).code(), absl::StatusCode::kNotFound);
}

// A seeded property test: a long random sequence of operations, most of them refused; after every
// one the invariants hold, and a refused operation changed nothing.
TEST(ResidencyTest, InvariantsHoldUnderARandomSequenceOfOperations) {
  for (uint64_t seed : {1, 2, 3, 4, 5}) {
    SCOPED_TRACE(seed);
    std::mt19937_64 rng(seed);
    ResidencyTable t({1000, 3000, 100000}, /*granule_bytes=*/1);
    constexpr int kPartitions = 40;
    for (PartitionId id = 0; id < kPartitions; ++id) {
      ASSERT_TRUE(t.Register(Desc(id, 50 + 25 * (id % 7))).ok());
    }
    int succeeded = 0;
    for (int step = 0; step < 20000; ++step) {
      const PartitionId id = rng() % kPartitions;
      const Tier a = static_cast<Tier>(rng() % 3), b = static_cast<Tier>(rng() % 3);
      const auto before = t.Get(id);
      const std::array<uint64_t, 3> used_before = {
          t.used_bytes(Tier::kDevice), t.used_bytes(Tier::kHost), t.used_bytes(Tier::kNvme)};
      absl::Status s;
      switch (rng() % 10) {
        case 0:
          s = t.Materialize(id, a);
          break;
        case 1:
          s = t.BeginMove(id, a, b);
          break;
        case 2:
          s = t.EndMove(id, rng() % 4 != 0);
          break;  // one in four moves fails
        case 3:
          s = t.MarkWritten(id, a).status();
          break;
        case 4:
        case 5:
          s = t.Drop(id, a);
          break;
        case 6:
          s = t.Pin(id, a);
          break;
        case 7:
          s = t.Unpin(id, a);
          break;
        case 8:
          s = t.Discard(id);
          break;
        case 9:
          s = t.BeginFill(id, a);
          break;
      }
      ASSERT_TRUE(t.CheckInvariants().ok()) << "step " << step << ": " << t.CheckInvariants();
      if (s.ok()) {
        ++succeeded;
        continue;
      }
      const auto after = t.Get(id);
      ASSERT_EQ(before->has_copy, after->has_copy) << "a refused op changed the copies";
      ASSERT_EQ(before->current, after->current);
      ASSERT_EQ(before->pins, after->pins);
      ASSERT_EQ(before->move, after->move);
      ASSERT_EQ(before->written, after->written);
      ASSERT_EQ(used_before[0], t.used_bytes(Tier::kDevice));
      ASSERT_EQ(used_before[2], t.used_bytes(Tier::kNvme));
    }
    EXPECT_GT(succeeded, 2000);  // the sequence did real work, not only refusals
  }
}

TEST(ResidencyTest, ADiscardedPartitionHasNoCurrentCopyUntilAFillGivesItBytes) {
  ResidencyTable t({1000, 1000, 1000}, /*granule_bytes=*/1);
  ASSERT_TRUE(t.Register(Desc(1)).ok());
  ASSERT_TRUE(t.Materialize(1, Tier::kHost).ok());
  ASSERT_TRUE(t.BeginMove(1, Tier::kHost, Tier::kNvme).ok());
  EXPECT_THAT(t.Discard(1).message(), HasSubstr("a move is in flight"));
  ASSERT_TRUE(t.EndMove(1, true).ok());
  ASSERT_TRUE(t.Pin(1, Tier::kHost).ok());
  EXPECT_THAT(t.Discard(1).message(), HasSubstr("pinned in host"));
  ASSERT_TRUE(t.Unpin(1, Tier::kHost).ok());
  EXPECT_THAT(t.BeginFill(1, Tier::kDevice).message(), HasSubstr("has bytes"));
  EXPECT_EQ(t.BeginFill(1, Tier::kNvme).code(), absl::StatusCode::kInvalidArgument);

  ASSERT_TRUE(t.Discard(1).ok());
  EXPECT_THAT(t.BeginFill(1, Tier::kHost).message(), HasSubstr("stale copy is held there"));
  auto r = t.Get(1);
  EXPECT_FALSE(r->written);
  EXPECT_THAT(r->current, ElementsAre(false, false, false));
  EXPECT_THAT(r->has_copy, ElementsAre(false, true, true));  // held until dropped
  // Stale copies drop freely: none is the only current one any more.
  ASSERT_TRUE(t.Drop(1, Tier::kHost).ok());
  EXPECT_EQ(t.used_bytes(Tier::kHost), 0u);
  EXPECT_FALSE(t.Pin(1, Tier::kNvme).ok());  // nothing current to pin

  // A fill reserves the tier, counts as a move until it ends, then the copy is current.
  ASSERT_TRUE(t.BeginFill(1, Tier::kDevice).ok());
  EXPECT_EQ(t.used_bytes(Tier::kDevice), 100u);
  EXPECT_FALSE(t.Pin(1, Tier::kDevice).ok());
  EXPECT_FALSE(t.BeginFill(1, Tier::kHost).ok());
  ASSERT_TRUE(t.EndMove(1, true).ok());
  r = t.Get(1);
  EXPECT_TRUE(r->written);
  EXPECT_THAT(r->current, ElementsAre(true, false, false));
  // The stale NVMe extent is reused by the next write-back.
  ASSERT_TRUE(t.BeginMove(1, Tier::kDevice, Tier::kNvme).ok());
  ASSERT_TRUE(t.EndMove(1, true).ok());
  EXPECT_EQ(t.used_bytes(Tier::kNvme), 100u);

  // A failed fill releases its reservation and leaves the partition without bytes.
  ASSERT_TRUE(t.Discard(1).ok());
  ASSERT_TRUE(t.Drop(1, Tier::kDevice).ok());
  ASSERT_TRUE(t.BeginFill(1, Tier::kHost).ok());
  ASSERT_TRUE(t.EndMove(1, false).ok());
  EXPECT_EQ(t.used_bytes(Tier::kHost), 0u);
  EXPECT_FALSE(t.Get(1)->written);
  // A fill that does not fit is refused, naming the budget.
  ResidencyTable small({50, 1000, 1000}, 1);
  ASSERT_TRUE(small.Register(Desc(2)).ok());
  ASSERT_TRUE(small.Materialize(2, Tier::kHost).ok());
  ASSERT_TRUE(small.Discard(2).ok());
  EXPECT_EQ(small.BeginFill(2, Tier::kDevice).code(), absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(t.CheckInvariants().ok());
  EXPECT_TRUE(small.CheckInvariants().ok());
}

TEST(ResidencyTest, CopiesAreCountedInWholePagesAndHugeSizesAreRefused) {
  ResidencyTable t({3 * 4096, 1 << 20, 1 << 20});  // pages by default
  ASSERT_TRUE(t.Register(Desc(1, 5000)).ok());
  ASSERT_TRUE(t.Materialize(1, Tier::kDevice).ok());
  EXPECT_EQ(t.used_bytes(Tier::kDevice), 8192u);  // 5000 bytes hold two pages
  ASSERT_TRUE(t.Register(Desc(2, 5000)).ok());
  EXPECT_EQ(t.Materialize(2, Tier::kDevice).code(), absl::StatusCode::kResourceExhausted);
  // Sizes whose arithmetic would wrap are refused when registered.
  for (uint64_t bytes : {(uint64_t{1} << 62) + 1, UINT64_MAX}) {
    absl::Status s = t.Register(Desc(9, bytes));
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << bytes;
    EXPECT_THAT(s.message(), HasSubstr("bytes must be in 1..4611686018427387904"));
  }
  // The largest accepted size meets the budget check, which must not wrap either.
  ASSERT_TRUE(t.Register(Desc(10, uint64_t{1} << 62)).ok());
  EXPECT_EQ(t.Materialize(10, Tier::kHost).code(), absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(t.CheckInvariants().ok());
}

}  // namespace
}  // namespace strata::tiering
