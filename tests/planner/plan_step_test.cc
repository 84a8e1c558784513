// The step replay (planner/plan_step.h) on traces small enough to check by hand.
#include "planner/plan_step.h"

#include <algorithm>
#include <random>

#include "gtest/gtest.h"

namespace strata::plan {
namespace {

constexpr uint64_t kMB = 1000000;

StepTrace Homed(int n, uint64_t bytes, Tier home) {
  StepTrace t;
  for (int i = 0; i < n; ++i) {
    tiering::PartitionDesc d;
    d.id = i;
    d.bytes = bytes;
    d.elements = bytes / 2;
    t.partitions.push_back(d);
    t.home.push_back(home);
  }
  return t;
}

// One group per partition, in order, each reading it in its tier and computing `compute_s`.
std::vector<Group> Reads(std::initializer_list<std::pair<PartitionId, Tier>> order,
                         double compute_s) {
  std::vector<Group> groups;
  for (const auto& [id, tier] : order) groups.push_back({{{id, tier, false}}, compute_s});
  return groups;
}

// One group that holds `id` on the device (written when `dirty`) for `compute_s`, then hands it to
// GradientReady.
Group SentDown(PartitionId id, bool dirty, double compute_s) {
  Group g{{{id, Tier::kDevice, dirty}}, compute_s};
  g.gradient_ready = id;
  return g;
}

Lanes Link(double bps) {
  Lanes l;
  l.to_device = l.to_host = bps;
  l.nvme_read = l.nvme_write = bps;
  return l;
}

// A sched_step-shaped trace: per layer a parameter, a gradient and an optimizer state (3x), all
// homed on NVMe; forward, then backward with the optimizer interleaved on the trainer.
StepTrace LayerTrace(int layers, uint64_t bytes) {
  StepTrace t;
  for (int l = 0; l < layers; ++l) {
    for (int k = 0; k < 3; ++k) {
      tiering::PartitionDesc d;
      d.id = 3 * l + k;
      d.role = k == 0   ? tiering::Role::kParam
               : k == 1 ? tiering::Role::kGrad
                        : tiering::Role::kMaster;
      d.bytes = k == 2 ? 3 * bytes : bytes;
      d.elements = bytes / 2;
      t.partitions.push_back(d);
      t.home.push_back(Tier::kNvme);
    }
  }
  auto P = [](int l) { return PartitionId(3 * l); };
  auto G = [](int l) { return PartitionId(3 * l + 1); };
  auto S = [](int l) { return PartitionId(3 * l + 2); };
  for (int l = 0; l < layers; ++l) t.groups.push_back({{{P(l), Tier::kDevice, false}}, 0.001});
  for (int l = layers - 1; l >= 0; --l) {
    t.groups.push_back(
        {{{P(l), Tier::kDevice, false}, {G(l), Tier::kDevice, true}}, 0.002, kBackward, G(l)});
    t.groups.push_back(
        {{{S(l), Tier::kHost, true}, {G(l), Tier::kHost, false}, {P(l), Tier::kHost, true}},
         0.002,
         kBackward,
         std::nullopt,
         G(l)});
  }
  return t;
}

TEST(PlanStepTest, WithPlentifulBandwidthTheReplayIsExactlyTheLowerBound) {
  const StepTrace t = LayerTrace(24, kMB);
  const Budgets tight{6 * kMB, 60 * kMB};  // a quarter of the parameters; half of everything
  auto p = PredictStep(t, Link(1e18), tight);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_NEAR(p->bound.seconds(), 24 * (0.001 + 0.002 + 0.002), 1e-9);  // the compute
  EXPECT_NEAR(p->step_s, p->bound.seconds(), 1e-9);
  EXPECT_NEAR(p->busy_s[kGpu], p->step_s, 1e-9);
  // The bytes still moved (the budgets are tight), each at no cost.
  EXPECT_GT(p->bytes[kNvmeRead], 0);
  EXPECT_GT(p->bytes[kToDevice], 0);
}

TEST(PlanStepTest, ALinkBoundStepTakesItsBytesOverTheLink) {
  // Two 1 MB partitions in the host, room for one on the device, no compute: each step loads both,
  // 2 MB at 1 MB/s, and the trainer waits for all of it on the link.
  StepTrace t = Homed(2, kMB, Tier::kHost);
  t.groups = {{{{0, Tier::kDevice, false}}, 0}, {{{1, Tier::kDevice, false}}, 0}};
  auto p = PredictStep(t, Link(1e6), {kMB, 0});
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_NEAR(p->step_s, 2.0, 1e-9);
  EXPECT_NEAR(p->bound.seconds(), 2.0, 1e-9);
  EXPECT_NEAR(p->waits_s[kToDevice], 2.0, 1e-9);
  EXPECT_NEAR(p->bytes[kToDevice], 2e6, 1);
}

TEST(PlanStepTest, TheDiskDoesNotReadAndWriteAtOnce) {
  // Two partitions written in the host each step, room for one: each access writes the other back
  // (1 s) and then reads its own (1 s): 4 s a step, as the bound counts 2 MB read and 2 written.
  StepTrace t = Homed(2, kMB, Tier::kNvme);
  t.groups = {{{{0, Tier::kHost, true}}, 0}, {{{1, Tier::kHost, true}}, 0}};
  auto p = PredictStep(t, Link(1e6), {0, kMB});
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_NEAR(p->step_s, 4.0, 1e-9);
  EXPECT_NEAR(p->bound.seconds(), 4.0, 1e-9);
  EXPECT_NEAR(p->waits_s[kNvmeRead] + p->waits_s[kNvmeWrite], 4.0, 1e-9);
  EXPECT_NEAR(p->bytes[kNvmeWrite], 2e6, 1);
}

TEST(PlanStepTest, AWriteBackEndsOnceItsCommitFollowsItsBytes) {
  // As above, each write-back then commits (the store's syncs) for 0.5 s before its room is free
  // for the read behind it: 2 x (1 + 0.5) + 2 x 1 = 5 s a step, all of it waited for. The bound
  // counts bytes only.
  StepTrace t = Homed(2, kMB, Tier::kNvme);
  t.groups = {{{{0, Tier::kHost, true}}, 0}, {{{1, Tier::kHost, true}}, 0}};
  Lanes lanes = Link(1e6);
  lanes.nvme_commit_s = 0.5;
  auto p = PredictStep(t, lanes, {0, kMB});
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_NEAR(p->step_s, 5.0, 1e-9);
  EXPECT_NEAR(p->waits_s[kNvmeWrite] + p->waits_s[kNvmeRead], 5.0, 1e-9);
  EXPECT_NEAR(p->bound.seconds(), 4.0, 1e-9);
  EXPECT_NEAR(p->bytes[kNvmeWrite], 2e6, 1);
}

TEST(PlanStepTest, AHostCopyTheHostCannotKeepIsWrittenBackAsSoonAsItIsReleased) {
  // Partition 0 is written in the host, then a 5 s group on the device (partition 1, homed there),
  // then partition 2 wants the host's only room. As the Runtime does, 0 goes down to NVMe as soon
  // as it is released (the plan evicts it before its next use), under the 5 s, so that 2 waits
  // only for its own read (1 s), not for 0's write-back too.
  StepTrace t = Homed(3, kMB, Tier::kNvme);
  t.home[1] = Tier::kDevice;
  t.groups = {{{{0, Tier::kHost, true}}, 1},
              {{{1, Tier::kDevice, false}}, 5},
              {{{2, Tier::kHost, false}}, 1}};
  auto p = PredictStep(t, Link(1e6), {0, kMB});
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_NEAR(p->waits_s[kNvmeRead] + p->waits_s[kNvmeWrite], 2.0, 1e-9);  // 0's read and 2's
  EXPECT_NEAR(p->step_s, 9.0, 1e-9);
  bool written_under_the_device_group = false;
  for (const Prediction::Span& s : p->timeline) {
    if (s.lane == kNvmeWrite && s.id == 0) {
      written_under_the_device_group = s.start >= 1 - 1e-9 && s.end <= 6 + 1e-9;
    }
  }
  EXPECT_TRUE(written_under_the_device_group);
}

TEST(PlanStepTest, AnAcquireWaitsForAMoveStillReadingItsCopy) {
  // Partition 0 is written in the host, then again after a 0.1 s group on the device. The plan's
  // estimate counts the device's access against the host's room, so 0 is written back early as it
  // is released (1 s); the second acquire, to write it, waits for that write-back to end, as the
  // Runtime's Acquire does (0.9 s).
  StepTrace t = Homed(2, kMB, Tier::kNvme);
  t.home[1] = Tier::kDevice;
  t.groups = {{{{0, Tier::kHost, true}}, 1},
              {{{1, Tier::kDevice, false}}, 0.1},
              {{{0, Tier::kHost, true}}, 1}};
  auto p = PredictStep(t, Link(1e6), {0, kMB});
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_NEAR(p->waits_s[kNvmeWrite], 0.9, 1e-9);
  EXPECT_NEAR(p->step_s, 3.0, 1e-9);
}

TEST(PlanStepTest, APrefetchDoesNotQueueBehindEarlyWriteBacks) {
  // Partitions 0 and 1 are written in the host together, and each is written back early as the
  // group ends (1 s each on the disk, one after the other). Partition 2 (homed in the host, written
  // by the same group) is prefetched to the device as the next group starts: as in the Runtime,
  // which runs early write-backs on at most workers - 1 threads and the other jobs first, it finds
  // a worker at once (1 s over the link), rather than one freed by a write-back.
  StepTrace t = Homed(4, kMB, Tier::kNvme);
  t.home[2] = Tier::kHost;
  t.home[3] = Tier::kDevice;
  t.groups = {{{{0, Tier::kHost, true}, {1, Tier::kHost, true}, {2, Tier::kHost, true}}, 1},
              {{{3, Tier::kDevice, false}}, 0.1},
              {{{2, Tier::kDevice, false}}, 1}};
  Lanes lanes = Link(1e6);
  lanes.workers = 2;
  auto p = PredictStep(t, lanes, {kMB, 2 * kMB});
  ASSERT_TRUE(p.ok()) << p.status();
  for (const Prediction::Span& s : p->timeline) {
    if (s.lane == kToDevice && s.id == 2) EXPECT_NEAR(s.start, 1.0, 1e-9) << "prefetch of 2";
  }
  EXPECT_NEAR(p->waits_s[kToDevice], 0.9, 1e-9);
}

TEST(PlanStepTest, ThePlannedPrefetchHidesTheLinkBehindCompute) {
  // Eight 1 MB layers read on the device, room for three, 1 s of compute each, 0.5 s to bring one
  // down: from the second step the next layer comes while one computes, so the step is its
  // compute and the trainer waits no more than the one layer the plan cannot start early.
  StepTrace t = Homed(8, kMB, Tier::kHost);
  for (int l = 0; l < 8; ++l) t.groups.push_back({{{PartitionId(l), Tier::kDevice, false}}, 1.0});
  auto p = PredictStep(t, Link(2e6), {3 * kMB, 0});
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_NEAR(p->bound.seconds(), 8.0, 1e-9);
  EXPECT_LE(p->step_s, 8.0 + 0.5 + 1e-9);
  EXPECT_LE(p->waits_s[kToDevice], 0.5 + 1e-9);
  // Without a plan (least recently used, on demand) every layer is waited for.
  SchedulerConfig lru;
  lru.policy = Policy::kLru;
  auto slow = PredictStep(t, Link(2e6), {3 * kMB, 0}, lru);
  ASSERT_TRUE(slow.ok());
  EXPECT_NEAR(slow->step_s, 12.0, 1e-9);
}

TEST(PlanStepTest, ACpuGroupDoesNotHoldTheTrainerButTheStepWaitsForIt) {
  StepTrace t = Homed(2, kMB, Tier::kHost);
  Group cpu{{{1, Tier::kHost, true}}, 3.0};
  cpu.on_cpu = true;
  t.groups = {cpu, {{{0, Tier::kHost, false}}, 1.0}};
  auto p = PredictStep(t, Link(1e6), {0, 0});
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_NEAR(p->step_s, 3.0, 1e-9);  // the trainer's 1 s ran beside the CPU's 3 s
  EXPECT_NEAR(p->waits_s[kCpu], 2.0, 1e-9);
  EXPECT_NEAR(p->bound.seconds(), 3.0, 1e-9);
}

// Three trainer groups of 1 s on partitions homed on the device (no link, no disk), each with a
// collective of `comm_s` (`agree_s` of it the trainer's) before it (gathers) or after it
// (reduce-scatters); `ahead` for all but the first gather, or for all but the last reduce-scatter.
StepTrace Collectives(bool before, double comm_s, double agree_s, bool ahead) {
  StepTrace t = Homed(3, kMB, Tier::kDevice);
  t.groups = Reads({{0, Tier::kDevice}, {1, Tier::kDevice}, {2, Tier::kDevice}}, 1.0);
  for (size_t i = 0; i < t.groups.size(); ++i) {
    Exchange x;
    x.kind = before ? Exchange::kAllGather : Exchange::kReduceScatter;
    x.seconds = comm_s;
    x.bytes = kMB;
    x.agree_s = agree_s;
    x.ahead = ahead && (before ? i > 0 : i + 1 < t.groups.size());
    (before ? t.groups[i].before : t.groups[i].after).push_back(x);
  }
  return t;
}

TEST(PlanStepTest, GathersAheadRunWhileTheGroupBeforeComputes) {
  // The first gather is waited for (0.5 s); each next one runs during the group before it: the
  // step is 0.5 + 3 x 1 s.
  auto p = PredictStep(Collectives(true, 0.5, 0, true), Link(1e6), {0, 0});
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_NEAR(p->step_s, 3.5, 1e-9);
  EXPECT_NEAR(p->busy_s[kComm], 1.5, 1e-9);
  EXPECT_NEAR(p->bytes[kComm], 3 * kMB, 1e-6);
  EXPECT_NEAR(p->waits_s[kComm], 0.5, 1e-9);
  // Not ahead: each waited for, 3 x (0.5 + 1 s).
  p = PredictStep(Collectives(true, 0.5, 0, false), Link(1e6), {0, 0});
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_NEAR(p->step_s, 4.5, 1e-9);
}

TEST(PlanStepTest, CollectivesOnTheComputeCoresNeverOverlapCompute) {
  // Gloo on loopback (comm_shares_cores): ahead or not, the gathers take the cores' time.
  Lanes loopback = Link(1e6);
  loopback.comm_shares_cores = true;
  auto p = PredictStep(Collectives(true, 0.5, 0, true), loopback, {0, 0});
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_NEAR(p->step_s, 4.5, 1e-9);
  // Its bound adds them to the compute.
  EXPECT_NEAR(p->bound.seconds(), 4.5, 1e-9);
  EXPECT_EQ(p->bound.limit, kGpu);
  EXPECT_NEAR(PredictStep(Collectives(true, 0.5, 0, true), Link(1e6), {0, 0})->bound.seconds(), 3.0,
              1e-9);
}

TEST(PlanStepTest, ReduceScattersOverlapBackwardOneInFlightWithOverlapComm) {
  // overlap_comm: group 1 0-1 s, its reduce-scatter 1-1.8 s in flight; group 2 1-2 s, its
  // reduce-scatter once the first has ended, 2-2.8; group 3 2-3 s, the last waited for: 3.8 s.
  auto p = PredictStep(Collectives(false, 0.8, 0, true), Link(1e6), {0, 0});
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_NEAR(p->step_s, 3.8, 1e-9);
  // Without: each waited for, 3 x 1.8 s.
  p = PredictStep(Collectives(false, 0.8, 0, false), Link(1e6), {0, 0});
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_NEAR(p->step_s, 5.4, 1e-9);
  EXPECT_NEAR(p->waits_s[kComm], 2.4, 1e-9);
  // A reduce-scatter slower than the group after it holds up the next one's issue: 1 + 2 + 2 + 2.
  p = PredictStep(Collectives(false, 2.0, 0, true), Link(1e6), {0, 0});
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_NEAR(p->step_s, 7.0, 1e-9);
}

TEST(PlanStepTest, TheRanksAgreementOnACollectiveIsTheTrainersTimeEvenAhead) {
  // Gathers ahead, each agreed on first (0.1 s on the trainer): 3 x 0.1 + 0.5 + 3 x 1 s.
  auto p = PredictStep(Collectives(true, 0.5, 0.1, true), Link(1e6), {0, 0});
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_NEAR(p->step_s, 3.8, 1e-9);
  EXPECT_NEAR(p->bound.seconds(), 3.3, 1e-9);  // the trainer's compute and its agreeing
  // On the compute cores the gather agreed on runs only after the agreement, and before the
  // group computes: 3 x (0.1 + 0.5 + 1 s), its bound too.
  Lanes loopback = Link(1e6);
  loopback.comm_shares_cores = true;
  p = PredictStep(Collectives(true, 0.5, 0.1, true), loopback, {0, 0});
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_NEAR(p->step_s, 4.8, 1e-9);
  EXPECT_NEAR(p->bound.seconds(), 4.8, 1e-9);
}

TEST(PlanStepTest, AGroupAfterTheStepWaitsForTheCpuOptimizer) {
  StepTrace t = Homed(2, kMB, Tier::kHost);
  Group cpu{{{1, Tier::kHost, true}}, 3.0};
  cpu.on_cpu = true;
  Group gather;
  gather.phase = kOptimizer;
  gather.waits_for_cpu = true;
  gather.before.push_back(Exchange{Exchange::kAllGather, 0.5, kMB, 1, 0, false});
  t.groups = {cpu, {{{0, Tier::kHost, false}}, 1.0}, gather};
  auto p = PredictStep(t, Link(1e6), {0, 0});
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_NEAR(p->step_s, 3.5, 1e-9);  // the CPU's 3 s, then the gather of its new weights
  EXPECT_NEAR(p->waits_s[kComm], 0.5, 1e-9);
}

SchedulerConfig Lru() {
  SchedulerConfig c;
  c.policy = Policy::kLru;
  return c;
}

TEST(PlanStepTest, ACopyBeingSentDownKeepsItsRoomUntilTheMoveReadingItEnds) {
  // Found by an audit: a gradient sent to the host left the device's room free while its copy was
  // still being read. Room for one partition on the device; a gradient written there and sent
  // down (1 s to the host), then a parameter read from NVMe (1 s) and brought up (1 s), which may
  // start only once the gradient's copy is read: 1 + 1 + 2 s a step, not 3.
  StepTrace t = Homed(2, kMB, Tier::kNvme);
  const Group grad = SentDown(0, true, 0);
  t.groups = {grad, {{{1, Tier::kDevice, false}}, 0}};
  auto p = PredictStep(t, Link(1e6), {kMB, kMB}, Lru());
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_NEAR(p->step_s, 4.0, 1e-9);
  EXPECT_NEAR(p->bytes[kToHost], 1e6, 1);
}

TEST(PlanStepTest, AGradientTheHostAlreadyHoldsIsNotCopiedBack) {
  // Found by an audit: a device copy brought from a newer host copy and handed to GradientReady was
  // copied to the host again, into room reserved twice. The Runtime drops it: the host has it.
  StepTrace t = Homed(1, kMB, Tier::kNvme);
  const Group read = SentDown(0, false, 0);
  t.groups = {{{{0, Tier::kHost, true}}, 0}, read};
  auto p = PredictStep(t, Link(1e6), {kMB, 10 * kMB}, Lru());
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->bytes[kToHost], 0);
  EXPECT_NEAR(p->bytes[kToDevice], 1e6, 1);
  EXPECT_NEAR(p->step_s, 1.0, 1e-9);
}

TEST(PlanStepTest, AGradientNeededOnTheDeviceWithinTheLookaheadStays) {
  // As the Runtime's GradientReady: planned, a copy needed again within the window is not sent.
  StepTrace t = Homed(1, kMB, Tier::kHost);
  const Group grad = SentDown(0, true, 1.0);
  t.groups = {grad};
  auto p = PredictStep(t, Link(1e6), {kMB, 0});
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->bytes[kToHost], 0);  // on demand (the first step) it went; planned, it stays
  EXPECT_NEAR(p->step_s, 1.0, 1e-9);
  auto lru = PredictStep(t, Link(1e6), {kMB, 0}, Lru());
  ASSERT_TRUE(lru.ok()) << lru.status();
  EXPECT_NEAR(lru->bytes[kToHost], 1e6, 1);  // written back to its home, then read again
  EXPECT_NEAR(lru->step_s, 3.0, 1e-9);
}

TEST(PlanStepTest, BringingAGroupsPartitionNeverEvictsAnotherOfTheSameGroup) {
  // Found by an audit: room for two; the third group needs 0 and 1 with 1 already there. Least
  // recently used, 1 was the victim of 0's fetch and came back evicting 2: three moves a step
  // instead of two.
  StepTrace t = Homed(3, kMB, Tier::kHost);
  t.groups = {{{{1, Tier::kDevice, false}}, 1.0},
              {{{2, Tier::kDevice, false}}, 1.0},
              {{{0, Tier::kDevice, false}, {1, Tier::kDevice, false}}, 1.0}};
  auto p = PredictStep(t, Link(1e9), {2 * kMB, 0}, Lru());
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_NEAR(p->bytes[kToDevice], 2e6, 1);
}

TEST(PlanStepTest, PartitionsOnNvmeUsedOnlyInTheHostNeedNoLink) {
  StepTrace t = Homed(1, kMB, Tier::kNvme);
  t.groups = {{{{0, Tier::kHost, true}}, 0}};
  Lanes disk_only = Link(1e6);
  disk_only.to_device = disk_only.to_host = 0;
  auto p = PredictStep(t, disk_only, {0, kMB});
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_NEAR(p->step_s, 0.0, 1e-9);  // it stays in the host's room
}

// The NVMe optimizer's state (streamed): whatever room the host has, each step reads it from the
// disk and writes it back, in the replay and in the bound; the same partition not streamed stays
// in the host's room after the first step.
TEST(PlanStepTest, AStreamedPartitionCrossesTheDiskEveryStepWhateverTheHostHolds) {
  StepTrace t = Homed(2, kMB, Tier::kNvme);
  t.groups = {{{{0, Tier::kHost, true}}, 0.001}, {{{1, Tier::kHost, false}}, 0.001}};
  Lanes disk = Link(1e6);  // 1 s a partition each way
  disk.to_device = disk.to_host = 0;
  auto kept = PredictStep(t, disk, {0, 4 * kMB});
  ASSERT_TRUE(kept.ok()) << kept.status();
  EXPECT_EQ(kept->bytes[kNvmeRead], 0u);
  EXPECT_EQ(kept->bound.disk.loaded + kept->bound.disk.written, 0u);
  t.streamed = {true, true};
  auto streamed = PredictStep(t, disk, {0, 4 * kMB});
  ASSERT_TRUE(streamed.ok()) << streamed.status();
  EXPECT_EQ(streamed->bytes[kNvmeRead], 2 * kMB);  // both read, every step
  EXPECT_EQ(streamed->bytes[kNvmeWrite], kMB);     // the one dirtied written back
  EXPECT_EQ(streamed->bound.disk.loaded, 2 * kMB);
  EXPECT_EQ(streamed->bound.disk.written, kMB);
  EXPECT_GE(streamed->step_s, 2.0);  // the two reads, one after the other on the disk
  EXPECT_GE(streamed->step_s, streamed->bound.seconds() - 1e-9);
  t.home[1] = Tier::kHost;  // streamed, but not homed on NVMe
  EXPECT_NE(PredictStep(t, disk, {0, 4 * kMB}).status().message().find("streamed but homed"),
            std::string::npos);
}

TEST(PlanStepTest, APrefetchWithNoRoomOnTheDeviceIsStagedInTheHost) {
  // As the Runtime does: room for one partition on the device, three read there in turn, homed on
  // NVMe (1 s to read each), the host with room for all. A prefetch that finds the device full
  // reads its partition into the host meanwhile, so from the second step the host keeps all
  // three and each step is its compute and three quick copies up, not three NVMe reads.
  StepTrace t = Homed(3, kMB, Tier::kNvme);
  for (int l = 0; l < 3; ++l) t.groups.push_back({{{PartitionId(l), Tier::kDevice, false}}, 1.0});
  Lanes lanes = Link(1e6);
  lanes.to_device = lanes.to_host = 1e9;
  auto p = PredictStep(t, lanes, {kMB, 3 * kMB});
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->bytes[kNvmeRead], 0);
  EXPECT_NEAR(p->step_s, 3.0 + 3 * 1e-3, 1e-9);
}

TEST(PlanStepTest, AGroupsAcquiresRunOneAfterAnother) {
  // As the trainer's thread acquires: the second partition's fetch starts once the first has its
  // bytes. Room for two on the device, least recently used, each group evicting the other's: 0
  // comes up (1 s), then 1 is read from NVMe (1 s) and comes up (1 s), then 2 and 3 (1 s each):
  // 5 s a step, not the 4 s of fetching a group's partitions all at once.
  StepTrace t = Homed(4, kMB, Tier::kHost);
  t.home[1] = Tier::kNvme;
  t.groups = {{{{0, Tier::kDevice, false}, {1, Tier::kDevice, false}}, 0},
              {{{2, Tier::kDevice, false}, {3, Tier::kDevice, false}}, 0}};
  auto p = PredictStep(t, Link(1e6), {2 * kMB, 0}, Lru());
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_NEAR(p->step_s, 5.0, 1e-9);
}

TEST(PlanStepTest, AHostAcquireCopiesACleanDeviceCopyRatherThanReadNvme) {
  // As the Runtime's BringLocked: the other memory tier's current copy is the source. Room for one
  // partition in each tier; 0 read on the device, then in the host, then 1 the same way round.
  // The host's 0 comes down from the device (1 s), not from NVMe (2 s at half the rate): 3 s for
  // 0 brought up from NVMe (2 s read, 1 s up), 1 s down, 2 s to read 1, 1 s up: 7 s, 2 MB read.
  StepTrace t = Homed(2, kMB, Tier::kNvme);
  t.groups = Reads({{0, Tier::kDevice}, {0, Tier::kHost}, {1, Tier::kHost}, {1, Tier::kDevice}}, 0);
  Lanes lanes = Link(1e6);
  lanes.nvme_read = lanes.nvme_write = 0.5e6;
  auto p = PredictStep(t, lanes, {kMB, kMB}, Lru());
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_NEAR(p->bytes[kNvmeRead], 2e6, 1);
  EXPECT_NEAR(p->step_s, 7.0, 1e-9);
}

TEST(PlanStepTest, ACopyStagedInTheHostForTheDeviceIsKeptForItsNextUse) {
  // Found by an audit: a copy counted as needed only in its own tier, so the host copy staged for
  // a device access looked never needed and went first. As the Runtime: a copy in either memory
  // tier serves an access in the other. Room for one on the device and three in the host; two
  // partitions read on the device in turn, two in the host: the staged copies stay, and each step
  // reads one partition from NVMe, not two.
  StepTrace t = Homed(4, kMB, Tier::kNvme);
  t.groups = Reads({{0, Tier::kDevice}, {1, Tier::kDevice}, {2, Tier::kHost}, {3, Tier::kHost}}, 1);
  auto p = PredictStep(t, Link(1e6), {kMB, 3 * kMB});
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_NEAR(p->bytes[kNvmeRead], 1e6, 1);
}

TEST(PlanStepTest, AGradientSentDownEvictsForItsHostRoomAsTheRuntimeDoes) {
  // Found by an audit: the replay made the gradient's host room by a prefetch's rules (and with no
  // plan evicted nothing), sending it to NVMe. The Runtime's GradientReady evicts the least
  // recently used host copy and keeps the gradient in the host. Room for one in each tier, homes
  // on NVMe, 1 s per MB on every lane: 0 read in the host, then 1 written on the device and sent
  // down. Each step: 1's host copy written back (1 s) and 0 read (1 s); 1 read (1 s) and brought
  // up (1 s); 1 sent down (1 s), evicting 0: 5 s, 2 MB read, 1 MB written.
  StepTrace t = Homed(2, kMB, Tier::kNvme);
  const Group grad = SentDown(1, true, 0);
  t.groups = {{{{0, Tier::kHost, false}}, 0}, grad};
  auto p = PredictStep(t, Link(1e6), {kMB, kMB}, Lru());
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_NEAR(p->bytes[kToHost], 1e6, 1);
  EXPECT_NEAR(p->bytes[kNvmeRead], 2e6, 1);
  EXPECT_NEAR(p->bytes[kNvmeWrite], 1e6, 1);
  EXPECT_NEAR(p->step_s, 5.0, 1e-9);
}

TEST(PlanStepTest, APrefetchDoesNotWaitForRoomAnotherMoveIsVacating) {
  // Found by an audit: a prefetch took room a write-back would free only later and held its worker
  // until then; the Runtime's prefetch fails at once (and narrows the window). Ten 1 MB layers of
  // 3 s on the device, then a 10 MB gradient homed on NVMe written there, sent down and
  // discarded; room for 12 MB, none in the host: its write-back (10 s to NVMe) must not hold the
  // next step's first prefetch, and the step is its compute.
  StepTrace t = Homed(11, kMB, Tier::kHost);
  t.partitions[0].bytes = 10 * kMB;
  t.home[0] = Tier::kNvme;
  for (int c = 1; c <= 10; ++c) t.groups.push_back({{{PartitionId(c), Tier::kDevice, false}}, 3.0});
  Group grad = SentDown(0, true, 0);
  grad.discard = 0;
  t.groups.push_back(grad);
  SchedulerConfig config;
  config.initial_lookahead = config.max_lookahead = 2;
  Lanes lanes = Link(1e6);
  lanes.workers = 2;
  auto p = PredictStep(t, lanes, {12 * kMB, 0}, config);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_NEAR(p->step_s, 30.0, 1e-9);
}

TEST(PlanStepTest, NoBudgetIsExceededAtAnyInstantOnRandomTraces) {
  // Found by an audit: room taken back whole from a copy still leaving, and room taken back at a
  // worker's later time, let copies overlap in modelled time beyond the budget (about 1 trace in
  // 75 of these). Small random traces: homes in the host or on NVMe, device and host accesses
  // (some written, some by the CPU), gradients sent down, discards; tight budgets, slow lanes,
  // one to three workers, planned and least recently used.
  std::mt19937 rng(12345);
  auto pick = [&rng](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  int predicted = 0;
  for (int it = 0; it < 3000; ++it) {
    StepTrace t;
    const int n = pick(3, 7);
    uint64_t largest = 0;
    for (int i = 0; i < n; ++i) {
      tiering::PartitionDesc d;
      d.id = i;
      d.bytes = pick(1, 3) * kMB;
      d.elements = d.bytes / 2;
      d.role = pick(0, 2) == 0 ? tiering::Role::kGrad : tiering::Role::kParam;
      t.partitions.push_back(d);
      t.home.push_back(pick(0, 3) == 0 ? Tier::kHost : Tier::kNvme);
      largest = std::max(largest, d.bytes);
    }
    const int groups = pick(3, 9);
    for (int g = 0; g < groups; ++g) {
      Group group;
      group.compute_s = pick(0, 4) * 0.5;
      for (int a = pick(1, 2); a > 0; --a) {
        const PartitionId id = pick(0, n - 1);
        if (std::any_of(group.accesses.begin(), group.accesses.end(),
                        [id](const Access& x) { return x.id == id; })) {
          continue;
        }
        group.accesses.push_back({id, pick(0, 2) ? Tier::kDevice : Tier::kHost, pick(0, 2) == 0});
      }
      group.on_cpu = pick(0, 5) == 0;
      for (const Access& a : group.accesses) {
        if (a.tier == Tier::kDevice && a.dirty && pick(0, 1)) group.gradient_ready = a.id;
      }
      if (pick(0, 8) == 0) group.discard = PartitionId(pick(0, n - 1));
      t.groups.push_back(group);
    }
    Lanes lanes = Link(1e6);
    lanes.workers = pick(1, 3);
    lanes.staging_bytes = kMB;
    lanes.staging_count = pick(1, 2);
    const Budgets budgets{largest + pick(0, 3) * kMB, pick(0, 1) * largest + pick(0, 3) * kMB};
    SchedulerConfig config;
    if (pick(0, 3) == 0) config.policy = Policy::kLru;
    config.initial_lookahead = pick(1, 4);
    auto p = PredictStep(t, lanes, budgets, config);
    if (!p.ok()) {
      // Only a partition larger than its tier's budget is refused.
      ASSERT_EQ(p.status().code(), absl::StatusCode::kInvalidArgument) << p.status();
      ASSERT_NE(p.status().message().find("does not fit"), std::string::npos) << p.status();
      continue;
    }
    ++predicted;
    ASSERT_LE(p->peak_room[0], budgets.device) << "trace " << it;
    ASSERT_LE(p->peak_room[1], budgets.host) << "trace " << it;
  }
  EXPECT_GT(predicted, 1500);  // most traces fit their budgets
}

TEST(PlanStepTest, BadTracesAndBudgetsAreNamed) {
  StepTrace t = Homed(2, kMB, Tier::kHost);
  t.groups = {{{{0, Tier::kDevice, false}}, 0}};
  auto small = PredictStep(t, Link(1e6), {kMB / 2, 0});
  ASSERT_FALSE(small.ok());
  EXPECT_NE(small.status().message().find("partition 0, 1000000 bytes, does not fit the device "
                                          "tier's budget of 500000 bytes"),
            std::string::npos)
      << small.status();
  auto no_link = PredictStep(t, Link(0), {kMB, 0});
  EXPECT_NE(no_link.status().message().find("link's bandwidth is not positive"), std::string::npos);
  StepTrace bad = t;
  bad.groups[0].accesses[0].id = 7;
  EXPECT_NE(PredictStep(bad, Link(1e6), {kMB, 0}).status().message().find("names partition 7 of 2"),
            std::string::npos);
  bad = t;
  bad.groups[0].accesses.push_back({0, Tier::kHost, true});  // found by an audit: lost its bytes
  EXPECT_NE(PredictStep(bad, Link(1e6), {kMB, kMB}).status().message().find("twice"),
            std::string::npos);
  bad = t;
  bad.groups[0].accesses[0].discard = true;
  EXPECT_NE(PredictStep(bad, Link(1e6), {kMB, 0}).status().message().find("Group::discard"),
            std::string::npos);
  Lanes no_workers = Link(1e6);
  no_workers.workers = 0;
  EXPECT_NE(PredictStep(t, no_workers, {kMB, 0}).status().message().find("workers: 0"),
            std::string::npos);
  Lanes negative_commit = Link(1e6);
  negative_commit.nvme_commit_s = -1;
  EXPECT_NE(PredictStep(t, negative_commit, {kMB, 0}).status().message().find("commit time"),
            std::string::npos);
  bad = t;
  bad.groups[0].before.push_back(Exchange{Exchange::kAllGather, -1, kMB, 1, 0, false});
  EXPECT_NE(PredictStep(bad, Link(1e6), {kMB, 0}).status().message().find("a collective of -1 s"),
            std::string::npos);
  bad = t;
  bad.groups[0].on_cpu = true;
  bad.groups[0].after.push_back(Exchange{});
  EXPECT_NE(PredictStep(bad, Link(1e6), {kMB, 0}).status().message().find("trainer's groups"),
            std::string::npos);
  bad = t;
  bad.home.pop_back();
  EXPECT_FALSE(PredictStep(bad, Link(1e6), {kMB, 0}).ok());
  bad = t;
  bad.groups[0].accesses[0].tier = Tier::kNvme;
  EXPECT_FALSE(PredictStep(bad, Link(1e6), {kMB, 0}).ok());
}

}  // namespace
}  // namespace strata::plan
