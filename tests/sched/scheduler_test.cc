// The Scheduler's plan on its own (no I/O): recording, following the trace, next-use distances with
// the wrap into the next step, the window and its bounds, divergence and re-recording.
#include "sched/scheduler.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace strata::sched {
namespace {

using ::testing::HasSubstr;
using tiering::Role;

PartitionDesc P(PartitionId id, uint64_t elements = 1000, Role role = Role::kParam) {
  PartitionDesc d;
  d.id = id;
  d.role = role;
  d.elements = elements;
  d.bytes = 4 * elements;
  return d;
}

// One step: acquire and release each id in order on the device.
void Step(Scheduler& s, const std::vector<PartitionId>& ids, Tier tier = Tier::kDevice) {
  double t = 0;
  for (PartitionId id : ids) {
    s.OnAcquire(P(id), tier, t += 0.001);
    s.OnRelease(P(id), tier, false, t += 0.001);
  }
}

std::vector<PartitionId> Ids(const std::vector<Scheduler::Upcoming>& w) {
  std::vector<PartitionId> out;
  for (const auto& u : w) out.push_back(u.id);
  return out;
}

TEST(SchedulerTest, TheFirstStepRecordsAndTheSecondIsPlannedFromIt) {
  SchedulerConfig c;
  c.initial_lookahead = 3;
  Scheduler s(c);
  EXPECT_EQ(s.mode(), Scheduler::Mode::kRecording);
  EXPECT_TRUE(s.Window().empty());
  EXPECT_EQ(s.NextUse(1, Tier::kDevice), Scheduler::kNever);
  Step(s, {1, 2, 3, 4, 5});
  EXPECT_EQ(s.EndStep(), std::nullopt);
  EXPECT_EQ(s.mode(), Scheduler::Mode::kPlanned);
  EXPECT_EQ(s.plan().size(), 10u);  // acquires and releases
  EXPECT_THAT(Ids(s.Window()), ::testing::ElementsAre(1, 2, 3));
  EXPECT_TRUE(s.OnAcquire(P(1), Tier::kDevice, 0));
  EXPECT_THAT(Ids(s.Window()), ::testing::ElementsAre(2, 3, 4));
  EXPECT_EQ(s.NextUse(2, Tier::kDevice), 0u);
  EXPECT_EQ(s.NextUse(5, Tier::kDevice), 3u);
  // Partition 1 was just used: its next use is the first access of the next step.
  EXPECT_EQ(s.NextUse(1, Tier::kDevice), 4u);
  EXPECT_EQ(s.NextUse(1, Tier::kHost), Scheduler::kNever);
  EXPECT_EQ(s.NextUse(9, Tier::kDevice), Scheduler::kNever);
}

TEST(SchedulerTest, TheWindowWrapsIntoTheNextStep) {
  SchedulerConfig c;
  c.initial_lookahead = 3;
  Scheduler s(c);
  Step(s, {1, 2, 3, 4});
  s.EndStep();
  for (PartitionId id : {1, 2, 3}) ASSERT_TRUE(s.OnAcquire(P(id), Tier::kDevice, 0));
  EXPECT_THAT(Ids(s.Window()), ::testing::ElementsAre(4, 1, 2));
}

TEST(SchedulerTest, AForwardAndBackwardTraceGivesNextUsesFromTheCursor) {
  Scheduler s(SchedulerConfig{});
  Step(s, {1, 2, 3, 3, 2, 1});  // forward, then backward
  s.EndStep();
  ASSERT_TRUE(s.OnAcquire(P(1), Tier::kDevice, 0));
  ASSERT_TRUE(s.OnAcquire(P(2), Tier::kDevice, 0));
  EXPECT_EQ(s.NextUse(2, Tier::kDevice), 2u);  // at position 4, cursor at 2
  EXPECT_EQ(s.NextUse(1, Tier::kDevice), 3u);
  EXPECT_EQ(s.NextUse(3, Tier::kDevice), 0u);
}

TEST(SchedulerTest, ADifferentAccessEndsThePlanForTheStepAndTheNextStepIsPlannedAgain) {
  Scheduler s(SchedulerConfig{});
  Step(s, {1, 2, 3});
  s.EndStep();
  EXPECT_TRUE(s.OnAcquire(P(1), Tier::kDevice, 0));
  EXPECT_FALSE(s.OnAcquire(P(3), Tier::kDevice, 0));  // 2 expected
  EXPECT_EQ(s.mode(), Scheduler::Mode::kFallback);
  ASSERT_TRUE(s.divergence().has_value());
  EXPECT_THAT(*s.divergence(), HasSubstr("access 2 is partition 3 in the device tier; the "
                                         "recorded step had partition 2 in the device tier"));
  EXPECT_TRUE(s.Window().empty());
  EXPECT_EQ(s.NextUse(2, Tier::kDevice), Scheduler::kNever);
  EXPECT_FALSE(s.OnAcquire(P(2), Tier::kDevice, 0));
  const auto ended = s.EndStep();
  ASSERT_TRUE(ended.has_value());
  // The diverged step (1, 3, 2) is the new plan.
  EXPECT_EQ(s.mode(), Scheduler::Mode::kPlanned);
  EXPECT_TRUE(s.OnAcquire(P(1), Tier::kDevice, 0));
  EXPECT_TRUE(s.OnAcquire(P(3), Tier::kDevice, 0));
  EXPECT_TRUE(s.OnAcquire(P(2), Tier::kDevice, 0));
  EXPECT_EQ(s.EndStep(), std::nullopt);
}

TEST(SchedulerTest, AStepThatEndsShortKeepsThePlanAndOneThatRunsLongIsADivergence) {
  Scheduler s(SchedulerConfig{});
  Step(s, {1, 2, 3});
  s.EndStep();
  // A prefix of the plan (a trainer's short last window): not a divergence, and the whole step
  // after it is planned by the whole recorded one.
  Step(s, {1, 2});
  EXPECT_EQ(s.EndStep(), std::nullopt);
  EXPECT_EQ(s.mode(), Scheduler::Mode::kPlanned);
  Step(s, {1, 2, 3});
  EXPECT_EQ(s.EndStep(), std::nullopt);
  Step(s, {1, 2, 3, 7});
  const auto ended = s.EndStep();
  ASSERT_TRUE(ended.has_value());
  EXPECT_THAT(*ended, HasSubstr("after the 3 accesses of the recorded step"));
}

TEST(SchedulerTest, TheWindowWidensWhileTheTrainerWaitsAndNarrowsWhenABudgetIsTight) {
  SchedulerConfig c;
  c.initial_lookahead = 2;
  c.max_lookahead = 5;
  Scheduler s(c);
  EXPECT_EQ(s.lookahead(), 2);
  s.OnLateOrMiss();  // the recording step's misses are not late prefetches: no change
  EXPECT_EQ(s.lookahead(), 2);
  Step(s, {1, 2, 3});
  s.EndStep();
  s.OnLateOrMiss();
  EXPECT_EQ(s.lookahead(), 3);
  s.OnLateOrMiss();
  s.OnLateOrMiss();
  EXPECT_EQ(s.lookahead(), 5);  // capped
  s.OnBudgetTight(1);
  EXPECT_EQ(s.lookahead(), 2);  // narrowed to the prefetch that found no room
  s.OnLateOrMiss();
  EXPECT_EQ(s.lookahead(), 2);  // held once after a prefetch found no room
  s.OnLateOrMiss();
  EXPECT_EQ(s.lookahead(), 3);  // then widened again
}

// The window after one recorded step of `ids` (1000 elements each) with `bucket` elements.
std::vector<PartitionId> WindowWithBucket(uint64_t bucket, const std::vector<PartitionId>& ids) {
  SchedulerConfig c;
  c.initial_lookahead = 10;
  c.prefetch_bucket_elements = bucket;
  Scheduler s(c);
  Step(s, ids);
  s.EndStep();
  return Ids(s.Window());
}

TEST(SchedulerTest, ThePrefetchBucketBoundsTheParameterElementsAhead) {
  // The access due now (1) is not ahead of its use; 2 and 3 are 2000 elements ahead.
  EXPECT_THAT(WindowWithBucket(2500, {1, 2, 3, 4, 5}), ::testing::ElementsAre(1, 2, 3));
}

TEST(SchedulerTest, OnePartitionAheadIsPrefetchedEvenWhenItIsLargerThanTheBucket) {
  // Layers of a large model hold more parameters than DeepSpeed's default bucket (5e7): the next
  // one is still prefetched (found by the planner: without it nothing was ever prefetched).
  EXPECT_THAT(WindowWithBucket(500, {1, 2, 3, 4, 5}), ::testing::ElementsAre(1, 2));
}

TEST(SchedulerTest, APartitionTwiceInTheWindowIsCountedOnceAgainstTheBucket) {
  EXPECT_THAT(WindowWithBucket(2500, {1, 2, 1, 2, 3, 4}), ::testing::ElementsAre(1, 2, 3));
}

TEST(SchedulerTest, IdsThatDifferOnlyInTheirTopBitsAreDifferentPartitions) {
  Scheduler s{SchedulerConfig{}};
  const PartitionId far = (uint64_t{1} << 62) + 1;
  Step(s, {1, 2, far});
  s.EndStep();
  EXPECT_EQ(s.NextUse(1, Tier::kDevice), 0u);
  EXPECT_EQ(s.NextUse(far, Tier::kDevice), 2u);
  EXPECT_EQ(s.NextUse(far + 1, Tier::kDevice), Scheduler::kNever);
}

TEST(SchedulerTest, GradientsAreOrderedAsTheyWereReleasedDirtyInTheRecordedStep) {
  Scheduler s{SchedulerConfig{}};
  EXPECT_TRUE(s.GradientOrder().empty());
  double t = 0;
  for (PartitionId id : {1, 2, 3}) {  // forward: parameters
    s.OnAcquire(P(id), Tier::kDevice, t);
    s.OnRelease(P(id), Tier::kDevice, false, t);
  }
  for (PartitionId id : {13, 12, 11}) {  // backward: gradients, written
    s.OnAcquire(P(id, 1000, Role::kGrad), Tier::kDevice, t);
    s.OnRelease(P(id, 1000, Role::kGrad), Tier::kDevice, true, t);
  }
  s.OnAcquire(P(12, 1000, Role::kGrad), Tier::kHost, t);  // read again, clean: not counted
  s.OnRelease(P(12, 1000, Role::kGrad), Tier::kHost, false, t);
  s.EndStep();
  EXPECT_THAT(s.GradientOrder(), ::testing::ElementsAre(13, 12, 11));
}

// The optimizer step reads each gradient written in the step from the host tier after the trace's
// last access: a host eviction must see that use, not the gradient's next backward a step away.
TEST(SchedulerTest, AGradientWrittenInThisStepIsNeededAtTheStepsEnd) {
  Scheduler s{SchedulerConfig{}};
  auto trace = [&s] {
    double t = 0;
    for (PartitionId id : {1, 2}) {  // forward
      s.OnAcquire(P(id), Tier::kDevice, t);
      s.OnRelease(P(id), Tier::kDevice, false, t);
    }
    for (PartitionId id : {2, 1}) {  // backward: each parameter, then its gradient written
      s.OnAcquire(P(id), Tier::kDevice, t);
      s.OnRelease(P(id), Tier::kDevice, false, t);
      s.OnAcquire(P(id + 10, 1000, Role::kGrad), Tier::kDevice, t);
      s.OnRelease(P(id + 10, 1000, Role::kGrad), Tier::kDevice, true, t);
    }
  };
  trace();
  EXPECT_EQ(s.StepUse(12), Scheduler::kNever);  // recorded, not planned: nothing to say
  s.EndStep();
  EXPECT_EQ(s.StepUse(12), Scheduler::kNever);  // not written in this step yet
  trace();                                      // the planned step: 6 accesses, all made
  EXPECT_EQ(s.StepUse(12), 0u);                 // the step comes now
  EXPECT_EQ(s.StepUse(11), 0u);
  EXPECT_EQ(s.StepUse(1), Scheduler::kNever);  // a parameter
  // Its next access in the trace is the next step's backward; parameter 1 comes sooner.
  EXPECT_EQ(s.NextUse(12, Tier::kDevice), 3u);
  EXPECT_EQ(s.NextUse(1, Tier::kDevice), 0u);
  // A host copy of 12 (4000 bytes) is kept until the step: it is not evicted before its use.
  auto none = [](PartitionId) { return false; };
  EXPECT_FALSE(s.EvictedBeforeNextUse(12, 4000, none));
  s.OnDiscard(11);  // stepped and dropped: nothing needs it any more
  EXPECT_EQ(s.StepUse(11), Scheduler::kNever);
  s.EndStep();
  EXPECT_EQ(s.StepUse(12), Scheduler::kNever);  // the next step writes it anew
  s.OnAcquire(P(1), Tier::kDevice, 0);
  s.OnRelease(P(1), Tier::kDevice, false, 0);
  s.OnAcquire(P(2), Tier::kDevice, 0);
  s.OnRelease(P(2), Tier::kDevice, false, 0);
  s.OnAcquire(P(2), Tier::kDevice, 0);
  s.OnRelease(P(2), Tier::kDevice, false, 0);
  s.OnAcquire(P(12, 1000, Role::kGrad), Tier::kDevice, 0);
  s.OnRelease(P(12, 1000, Role::kGrad), Tier::kDevice, true, 0);
  EXPECT_EQ(s.StepUse(12), 2u);  // parameter 1 and gradient 11 still to come
}

TEST(SchedulerTest, ACopyIsEvictedBeforeItsNextUseWhenWhatIsNeededSoonerDoesNotFitBesideIt) {
  Scheduler s{SchedulerConfig{}};
  auto none = [](PartitionId) { return false; };
  auto all = [](PartitionId) { return true; };
  EXPECT_FALSE(s.EvictedBeforeNextUse(1, 0, none));  // no plan
  Step(s, {1, 2, 3, 4, 5});                          // 4000 bytes each
  s.EndStep();
  EXPECT_FALSE(s.EvictedBeforeNextUse(1, 0, none));  // it comes first
  s.OnAcquire(P(1), Tier::kDevice, 0);
  // 2, 3, 4 and 5 come before 1 again, each once: brought in one at a time, none held beside 1
  // for long: 1 and the one in use, 8000 bytes.
  EXPECT_TRUE(s.EvictedBeforeNextUse(1, 7999, none));
  EXPECT_FALSE(s.EvictedBeforeNextUse(1, 8000, none));
  // Resident already and needed before 1: held from now to their use, 16000 bytes beside it.
  EXPECT_TRUE(s.EvictedBeforeNextUse(1, 19999, all));
  EXPECT_FALSE(s.EvictedBeforeNextUse(1, 20000, all));
  EXPECT_FALSE(s.EvictedBeforeNextUse(9, 0, all));  // not in the plan
}

TEST(SchedulerTest, ACopyNeededAgainBeforeTheOneInQuestionIsHeldBetweenItsUses) {
  Scheduler s{SchedulerConfig{}};
  auto none = [](PartitionId) { return false; };
  Step(s, {1, 2, 3, 2, 4});  // 4000 bytes each
  s.EndStep();
  s.OnAcquire(P(1), Tier::kDevice, 0);
  // Before 1 again: 2 (held from its first use to its second), 3 beside it, then 4.
  EXPECT_TRUE(s.EvictedBeforeNextUse(1, 11999, none));
  EXPECT_FALSE(s.EvictedBeforeNextUse(1, 12000, none));
}

TEST(SchedulerTest, ReuseDistanceCountsTheParameterElementsAcquiredInBetween) {
  Scheduler s{SchedulerConfig{}};
  EXPECT_EQ(s.ParamElementsBeforeNextUse(1, Tier::kDevice), Scheduler::kNever);
  double t = 0;
  s.OnAcquire(P(1, 100), Tier::kDevice, t);
  s.OnAcquire(P(2, 200), Tier::kDevice, t);
  s.OnAcquire(P(3, 300, Role::kGrad), Tier::kDevice, t);  // not a parameter: not counted
  s.OnAcquire(P(4, 400), Tier::kDevice, t);
  s.EndStep();
  EXPECT_EQ(s.ParamElementsBeforeNextUse(1, Tier::kDevice), 0u);
  EXPECT_EQ(s.ParamElementsBeforeNextUse(4, Tier::kDevice), 300u);  // 1 and 2
  s.OnAcquire(P(1, 100), Tier::kDevice, t);
  s.OnAcquire(P(2, 200), Tier::kDevice, t);
  // 1's next use is in the next step: 3 (a gradient) and 4 come first.
  EXPECT_EQ(s.ParamElementsBeforeNextUse(1, Tier::kDevice), 400u);
  EXPECT_EQ(s.ParamElementsBeforeNextUse(2, Tier::kDevice), 500u);  // 4, then 1
  EXPECT_EQ(s.ParamElementsBeforeNextUse(2, Tier::kHost), Scheduler::kNever);
}

TEST(SchedulerTest, LruPolicyNeverPlans) {
  SchedulerConfig c;
  c.policy = Policy::kLru;
  Scheduler s(c);
  Step(s, {1, 2});
  s.EndStep();
  Step(s, {1, 2});
  EXPECT_EQ(s.mode(), Scheduler::Mode::kOnDemand);
  EXPECT_TRUE(s.Window().empty());
  EXPECT_EQ(s.NextUse(1, Tier::kDevice), Scheduler::kNever);
}

TEST(SchedulerTest, DeepSpeedLikePolicyPrefetchesDeviceAccessesOnly) {
  SchedulerConfig c;
  c.policy = Policy::kDeepSpeedLike;
  c.prefetch_bucket_elements = 100000;
  Scheduler s(c);
  double t = 0;
  s.OnAcquire(P(1), Tier::kDevice, t);
  s.OnAcquire(P(2, 1000, Role::kMaster), Tier::kHost, t);
  s.OnAcquire(P(3), Tier::kDevice, t);
  s.EndStep();
  EXPECT_THAT(Ids(s.Window()), ::testing::ElementsAre(1, 3));
  EXPECT_EQ(s.max_in_flight(), 2);
  EXPECT_FALSE(s.reads_ahead_from_nvme());
}

}  // namespace
}  // namespace strata::sched
