// planner/plan_comm.h: the collectives between the data-parallel ranks of a training step — what
// the trainer's front exchanges (python/strata/ranks.py, docs/ranks.md), one rank's bytes on the
// wire, and their time on the machine's links (planner/plan_hardware.h).
//
// Counted as the front issues them, per rank and step: W ranks (Hardware::ranks), d bytes an
// element of the training dtype. A ring all-gather or reduce-scatter whose whole buffer (every
// rank's shard) is B bytes puts (W - 1) / W x B on the wire from each rank. Gradients are
// reduce-scattered in fp32 (4 bytes an element, whatever the training dtype), a bucket sent once
// it holds Training::ReduceBucket elements or more; weights are all-gathered in the training
// dtype, a module's at a time (Transformer::LayerTensors a layer; a tensor larger than
// Training::AllgatherBucket alone, in one collective). Ψp are the parameters stage 3 partitions
// (the layers' matrices, the embeddings and the output head), Ψs the others (the norms and biases,
// taken to be under stage3_param_persistence_threshold, as planner/plan_memory.h takes them).
//   stage 1: at the step, before the optimizer, every gradient reduce-scattered (once for all the
//     micro-steps of gradient accumulation), the trainer waiting;
//   stage 2: in each micro-step's backward, the gradients reduce-scattered bucket by bucket as
//     their hooks fill the buckets: with overlap_comm (off by default below stage 3) one bucket
//     in flight while backward goes on, else the trainer waiting; the last bucket at backward's
//     end, waited for;
//   stage 3: in each micro-step, each unit's Ψp weights all-gathered before its forward and again
//     before its backward (the embeddings' forward gathers the input embedding and the learned
//     positions, the head's forward the output head; the head's backward the output head, the
//     positions, and the input embedding when it is not tied: as the front lends them), each but
//     the first of a forward issued ahead of need (the next module's gather runs while one
//     computes); Ψp's gradients reduce-scattered as stage 2's (overlap_comm on by default); at the
//     step, Ψs's gradients reduce-scattered, the trainer waiting;
//   after the step: each rank's new weights of the parameters not partitioned (every one at stages
//     1 and 2, Ψs at stage 3) all-gathered, the trainer waiting;
//   each collective follows its ranks' digest exchange (a 20-byte all-gather issued right before
//     it, checked before its result is used: one more latency on the link, none on the trainer's
//     thread), and the ranks meet at it (each collective pays Hardware::RendezvousS, its latency
//     and the link's sync_us, where they reach it from computing); at the step the trainer waits
//     for the ranks to agree that the step staged during backward stands (a rendezvous of its
//     own, at every stage); the reduction at the step first all-reduces a flag a parameter (its
//     latency counted, its bytes not).
// Not counted: gradient clipping's norm (one float all-reduced), the padding of each tensor's last
// shard (fewer than W elements), the collectives of the first step (it records the order the
// later steps prefetch in).
// Time: each collective's digest's latency and its rendezvous plus its bytes on the wire over the
// bus bandwidth (Hardware::CollectiveLatencyS, RendezvousS, CollectiveBusBytesPerS). One rank: no
// collectives.
//
// Thread safety: StepCollectives is not thread-safe (one per step being modelled: it keeps the
// gradient bucket being filled); SumCollectives is a pure function.
#ifndef STRATA_PLANNER_PLAN_COMM_H_
#define STRATA_PLANNER_PLAN_COMM_H_

#include <vector>

#include "planner/plan_hardware.h"
#include "planner/plan_memory.h"
#include "planner/plan_model.h"
#include "planner/step_bound.h"

namespace strata::plan {

class StepCollectives {
 public:
  StepCollectives(const Transformer& model, const Hardware& hardware, const Training& training);

  // Before a layer unit's forward or backward (stage 3): its Ψp gathered; `ahead`: prefetched.
  std::vector<Exchange> GatherUnit(bool ahead) const;
  // Before the embeddings' forward, the head's forward and the head's backward (stage 3).
  std::vector<Exchange> GatherEmbeddings() const;
  std::vector<Exchange> GatherHead(bool backward) const;
  // As backward makes a layer unit's gradients, or the embeddings' and head's (stages 2 and 3:
  // the parameters the hooks reduce): the reduce-scatters of the buckets they fill, after its
  // group.
  std::vector<Exchange> UnitGradients();
  std::vector<Exchange> OuterGradients();
  // Backward's end: the open bucket's reduce-scatter, the trainer waiting (finish_gradients).
  std::vector<Exchange> EndBackward();
  // At the step before the optimizer (the gradients reduced there, then the ranks' agreement on
  // the staged step), and after it (the new weights of the parameters not partitioned).
  std::vector<Exchange> AtStep() const;
  std::vector<Exchange> AfterStep() const;

 private:
  // `count` collectives of one kind over whole buffers of `whole_bytes` together.
  Exchange Make(Exchange::Kind kind, double whole_bytes, int count, bool ahead) const;
  std::vector<Exchange> Gather(double elements, int count, bool ahead) const;
  std::vector<Exchange> Filled(double elements);

  int ranks_;
  int stage_;
  double dtype_bytes_;
  double bus_bytes_per_s_, latency_s_, rendezvous_s_;
  double reduce_bucket_, allgather_bucket_;
  bool overlap_;
  int64_t tensors_;  // a layer unit's modules
  bool tied_;
  double vocab_hidden_, positions_;  // elements
  double unit_ = 0, outer_ = 0, partitioned_ = 0, kept_whole_ = 0;
  double pending_ = 0;  // elements in the gradient bucket being filled
};

// A step's collectives, one rank's, summed over its groups.
struct CommTotals {
  double gathered_bytes = 0, scattered_bytes = 0;  // on the wire
  int gathers = 0, scatters = 0;                   // collectives (the agreements not counted)
  double seconds = 0;                              // on their lane
  double agree_s = 0;                              // the trainer's, agreeing on them
  double bytes() const { return gathered_bytes + scattered_bytes; }
};
CommTotals SumCollectives(const std::vector<Group>& groups);

}  // namespace strata::plan

#endif  // STRATA_PLANNER_PLAN_COMM_H_
