#include "sched/scheduler.h"

#include <algorithm>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"

namespace strata::sched {

Scheduler::Scheduler(const SchedulerConfig& config)
    : config_(config),
      mode_(config.policy == Policy::kLru ? Mode::kOnDemand : Mode::kRecording),
      lookahead_(std::clamp(config.initial_lookahead, 1, std::max(1, config.max_lookahead))) {}

bool Scheduler::OnAcquire(const PartitionDesc& desc, Tier tier, double at_seconds) {
  recording_.push_back(
      {desc.id, tier, desc.role, desc.bytes, desc.elements, true, false, at_seconds});
  if (mode_ != Mode::kPlanned) return false;
  if (cursor_ >= plan_acquires_.size()) {
    Diverge(absl::StrCat("access ", cursor_ + 1, " (partition ", desc.id, " in the ",
                         TierName(tier), " tier) comes after the ", plan_acquires_.size(),
                         " accesses of the recorded step"));
    return false;
  }
  const TraceEvent& want = plan_[plan_acquires_[cursor_]];
  if (want.id != desc.id || want.tier != tier) {
    Diverge(absl::StrCat("access ", cursor_ + 1, " is partition ", desc.id, " in the ",
                         TierName(tier), " tier; the recorded step had partition ", want.id,
                         " in the ", TierName(want.tier), " tier"));
    return false;
  }
  ++cursor_;
  return true;
}

void Scheduler::OnRelease(const PartitionDesc& desc, Tier tier, bool dirty, double at_seconds) {
  recording_.push_back(
      {desc.id, tier, desc.role, desc.bytes, desc.elements, false, dirty, at_seconds});
  if (dirty && desc.role == tiering::Role::kGrad) for_step_.insert(desc.id);
}

void Scheduler::Diverge(std::string why) {
  divergence_ = std::move(why);
  mode_ = Mode::kFallback;
}

std::optional<std::string> Scheduler::EndStep() {
  if (mode_ == Mode::kPlanned && cursor_ != plan_acquires_.size()) {
    // A step that ended early with every access as planned (a trainer's short last window of an
    // epoch: fewer micro-batches) keeps the plan for the next whole step; made the plan, the
    // shorter step would make the next whole one diverge where it ended.
    cursor_ = 0;
    for_step_.clear();
    tight_ = false;
    recording_.clear();
    return std::nullopt;
  }
  std::optional<std::string> ended = std::move(divergence_);
  divergence_.reset();
  cursor_ = 0;
  for_step_.clear();
  tight_ = false;  // each step tries widening again
  if (mode_ == Mode::kOnDemand) {
    recording_.clear();
    return ended;
  }
  // The step just run is the plan of the next (a planned step that matched refreshes the times).
  plan_ = std::move(recording_);
  recording_.clear();
  plan_acquires_.clear();
  uses_.clear();
  param_prefix_.assign(1, 0);
  for (uint32_t i = 0; i < plan_.size(); ++i) {
    if (!plan_[i].acquire) continue;
    uses_[{plan_[i].id, plan_[i].tier}].push_back(static_cast<uint32_t>(plan_acquires_.size()));
    plan_acquires_.push_back(i);
    param_prefix_.push_back(param_prefix_.back() +
                            (plan_[i].role == tiering::Role::kParam ? plan_[i].elements : 0));
  }
  mode_ = plan_acquires_.empty() ? Mode::kRecording : Mode::kPlanned;
  return ended;
}

std::vector<Scheduler::Upcoming> Scheduler::Window() const {
  std::vector<Upcoming> out;
  if (mode_ != Mode::kPlanned) return out;
  const uint64_t n = plan_acquires_.size();
  const bool ds = config_.policy == Policy::kDeepSpeedLike;
  const uint64_t span = ds ? n : std::min<uint64_t>(static_cast<uint64_t>(lookahead_), n);
  uint64_t param_elements = 0;
  absl::flat_hash_set<std::pair<PartitionId, Tier>> seen;
  for (uint64_t d = 0; d < span; ++d) {
    const TraceEvent& e = plan_[plan_acquires_[(cursor_ + d) % n]];
    if (ds && e.tier != Tier::kDevice) continue;
    if (seen.contains(std::make_pair(e.id, e.tier))) continue;  // counted once
    if (e.role == tiering::Role::kParam && d > 0) {
      // The bucket bounds the parameter elements ahead of the access due now; the first partition
      // ahead is always allowed (a layer may hold more than the bucket).
      const bool first_ahead = param_elements == 0;
      param_elements += e.elements;
      if (param_elements > config_.prefetch_bucket_elements && !first_ahead) break;
    }
    seen.insert({e.id, e.tier});
    out.push_back({e.id, e.tier});
  }
  return out;
}

uint64_t Scheduler::NextUse(PartitionId id, Tier tier) const {
  if (mode_ != Mode::kPlanned) return kNever;
  auto it = uses_.find(std::make_pair(id, tier));
  if (it == uses_.end()) return kNever;
  const std::vector<uint32_t>& at = it->second;
  auto next = std::lower_bound(at.begin(), at.end(), cursor_);
  if (next != at.end()) return *next - cursor_;
  return at.front() + plan_acquires_.size() - cursor_;  // in the next step
}

uint64_t Scheduler::StepUse(PartitionId id) const {
  if (mode_ != Mode::kPlanned || !for_step_.contains(id)) return kNever;
  const uint64_t n = plan_acquires_.size();
  return n - std::min(cursor_, n);
}

uint64_t Scheduler::ParamElementsBeforeNextUse(PartitionId id, Tier tier) const {
  const uint64_t next = NextUse(id, tier);
  if (next == kNever) return kNever;
  // The acquires at positions cursor_ .. cursor_ + next - 1, wrapping into the next step.
  const uint64_t n = plan_acquires_.size();
  const uint64_t from = cursor_ % n, to = from + next;
  if (to <= n) return param_prefix_[to] - param_prefix_[from];
  return (param_prefix_[n] - param_prefix_[from]) + param_prefix_[to - n];
}

bool Scheduler::EvictedBeforeNextUse(PartitionId id, uint64_t capacity,
                                     const std::function<bool(PartitionId)>& resident) const {
  if (mode_ != Mode::kPlanned) return false;
  const uint64_t d = std::min({NextUse(id, Tier::kDevice), NextUse(id, Tier::kHost), StepUse(id)});
  if (d == kNever) return false;  // not in the plan: nothing to say
  const uint64_t n = plan_acquires_.size();
  uint64_t own = 0;
  // Each other partition accessed before that use is held from its first access there (from now,
  // when it is resident already) to its last: Belady's rule keeps it over `id` meanwhile.
  struct Span {
    uint64_t first, last, bytes;
  };
  absl::flat_hash_map<PartitionId, Span> spans;
  for (uint64_t k = 0; k < d; ++k) {
    const TraceEvent& e = plan_[plan_acquires_[(cursor_ + k) % n]];
    auto [it, added] = spans.try_emplace(e.id, Span{k, k, e.bytes});
    if (!added) it->second.last = k;
  }
  for (uint64_t k = 0; k < n && own == 0; ++k) {
    const TraceEvent& e = plan_[plan_acquires_[k]];
    if (e.id == id) own = e.bytes;
  }
  std::vector<int64_t> delta(d + 1, 0);
  for (const auto& [other, span] : spans) {
    const uint64_t from = resident(other) ? 0 : span.first;
    delta[from] += static_cast<int64_t>(span.bytes);
    delta[span.last + 1] -= static_cast<int64_t>(span.bytes);
  }
  int64_t held = 0;
  for (uint64_t k = 0; k < d; ++k) {
    held += delta[k];
    if (static_cast<uint64_t>(held) + own > capacity) return true;
  }
  return false;
}

std::vector<PartitionId> Scheduler::GradientOrder() const {
  std::vector<PartitionId> order;
  if (mode_ == Mode::kOnDemand) return order;
  absl::flat_hash_set<PartitionId> seen;
  for (const TraceEvent& e : plan_) {
    if (!e.acquire && e.dirty && e.role == tiering::Role::kGrad && seen.insert(e.id).second) {
      order.push_back(e.id);
    }
  }
  return order;
}

void Scheduler::OnLateOrMiss() {
  if (config_.policy != Policy::kTrace || mode_ != Mode::kPlanned) return;
  if (tight_) {  // a prefetch found no room since the last widening: hold once, then try again
    tight_ = false;
    return;
  }
  lookahead_ = std::min(config_.max_lookahead, lookahead_ + std::max(1, lookahead_ / 2));
}

void Scheduler::OnBudgetTight(uint64_t distance) {
  if (config_.policy != Policy::kTrace) return;
  tight_ = true;
  lookahead_ = std::max<int>(1, std::min<uint64_t>(lookahead_, distance + 1));
}

}  // namespace strata::sched
