#include "planner/plan_comm.h"

#include <algorithm>
#include <cmath>

namespace strata::plan {

StepCollectives::StepCollectives(const Transformer& m, const Hardware& hw, const Training& t)
    : ranks_(hw.ranks()),
      stage_(t.StageRun(hw.ranks())),
      dtype_bytes_(t.dtype_bytes),
      bus_bytes_per_s_(hw.CollectiveBusBytesPerS()),
      latency_s_(hw.CollectiveLatencyS()),
      rendezvous_s_(hw.RendezvousS()),
      reduce_bucket_(static_cast<double>(t.ReduceBucket())),
      allgather_bucket_(static_cast<double>(t.AllgatherBucket())),
      overlap_(t.OverlapComm()),
      tensors_(m.LayerTensors()),
      tied_(m.tied_embeddings),
      vocab_hidden_(static_cast<double>(m.vocab) * static_cast<double>(m.hidden)),
      positions_(static_cast<double>(m.learned_positions) * static_cast<double>(m.hidden)) {
  const double tiles = static_cast<double>(m.LayerUnits());
  const double embeddings = (tied_ ? 1 : 2) * vocab_hidden_ + positions_;
  partitioned_ =
      static_cast<double>(m.layers) * static_cast<double>(m.LayerMatrixParams()) + embeddings;
  kept_whole_ = static_cast<double>(m.TotalParams()) - partitioned_;
  if (stage_ >= 3) {
    unit_ = static_cast<double>(m.LayerMatrixParams()) / tiles;
    outer_ = embeddings;
  } else {
    unit_ = static_cast<double>(m.LayerParams()) / tiles;
    outer_ = static_cast<double>(m.OuterParams());
  }
}

Exchange StepCollectives::Make(Exchange::Kind kind, double whole_bytes, int count,
                               bool ahead) const {
  Exchange x;
  x.kind = kind;
  x.count = count;
  x.bytes = whole_bytes * (ranks_ - 1) / ranks_;
  // Each: its digest's all-gather just before it, then the ranks meeting at it.
  x.seconds = count * (latency_s_ + rendezvous_s_) + x.bytes / bus_bytes_per_s_;
  x.ahead = ahead;
  return x;
}

std::vector<Exchange> StepCollectives::Gather(double elements, int count, bool ahead) const {
  if (ranks_ == 1 || stage_ < 3 || elements <= 0) return {};
  // (A tensor larger than a bucket is gathered alone, in one collective, as the front does.)
  return {Make(Exchange::kAllGather, dtype_bytes_ * elements, count, ahead)};
}

std::vector<Exchange> StepCollectives::GatherUnit(bool ahead) const {
  return Gather(unit_, static_cast<int>(tensors_), ahead);
}

std::vector<Exchange> StepCollectives::GatherEmbeddings() const {
  return Gather(vocab_hidden_ + positions_, positions_ > 0 ? 2 : 1, /*ahead=*/false);
}

std::vector<Exchange> StepCollectives::GatherHead(bool backward) const {
  if (!backward) return Gather(vocab_hidden_, 1, /*ahead=*/true);
  // The output head's, the positions' and, untied, the input embedding's (its own tensor).
  const int untied = tied_ ? 0 : 1;
  return Gather((1 + untied) * vocab_hidden_ + positions_, 1 + untied + (positions_ > 0 ? 1 : 0),
                /*ahead=*/true);
}

std::vector<Exchange> StepCollectives::Filled(double elements) {
  if (ranks_ == 1 || stage_ < 2) return {};
  // The hooks add each gradient to the open bucket; once it holds a bucket's elements or more,
  // all it holds is reduce-scattered in one collective.
  pending_ += elements;
  if (pending_ < reduce_bucket_) return {};
  const double all = pending_;
  pending_ = 0;
  return {Make(Exchange::kReduceScatter, 4 * all, 1, overlap_)};
}

std::vector<Exchange> StepCollectives::UnitGradients() { return Filled(unit_); }
std::vector<Exchange> StepCollectives::OuterGradients() { return Filled(outer_); }

std::vector<Exchange> StepCollectives::EndBackward() {
  if (ranks_ == 1 || stage_ < 2 || pending_ <= 0) return {};
  const double rest = pending_;
  pending_ = 0;
  return {Make(Exchange::kReduceScatter, 4 * rest, 1, /*ahead=*/false)};
}

std::vector<Exchange> StepCollectives::AtStep() const {
  if (ranks_ == 1 || stage_ < 1) return {};
  std::vector<Exchange> out;
  const double reduced = stage_ == 2 ? 0 : stage_ >= 3 ? kept_whole_ : partitioned_ + kept_whole_;
  if (reduced > 0) {
    // Its buckets, and the flags all-reduced first.
    const int buckets = static_cast<int>(std::ceil(reduced / reduce_bucket_));
    out.push_back(Make(Exchange::kReduceScatter, 4 * reduced, buckets + 1, /*ahead=*/false));
  }
  Exchange stands;  // whether every rank's step staged during backward stands
  stands.kind = Exchange::kAgreement;
  stands.agree_s = rendezvous_s_;
  out.push_back(stands);
  return out;
}

std::vector<Exchange> StepCollectives::AfterStep() const {
  if (ranks_ == 1 || stage_ < 1) return {};
  const double whole = stage_ >= 3 ? kept_whole_ : partitioned_ + kept_whole_;
  if (whole <= 0) return {};
  const int buckets = static_cast<int>(std::ceil(whole / allgather_bucket_));
  return {Make(Exchange::kAllGather, dtype_bytes_ * whole, buckets, /*ahead=*/false)};
}

CommTotals SumCollectives(const std::vector<Group>& groups) {
  CommTotals t;
  for (const Group& g : groups) {
    t.seconds += g.comm_s();
    t.agree_s += g.agree_s();
    for (const auto* run : {&g.before, &g.after}) {
      for (const Exchange& x : *run) {
        if (x.kind == Exchange::kAgreement) continue;
        const bool gather = x.kind == Exchange::kAllGather;
        (gather ? t.gathered_bytes : t.scattered_bytes) += x.bytes;
        (gather ? t.gathers : t.scatters) += x.count;
      }
    }
  }
  return t;
}

}  // namespace strata::plan
