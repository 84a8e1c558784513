// comm/communicator.h: the collectives ZeRO needs across ranks, asynchronous with completion, so
// the scheduler can overlap them with compute and with the tiers' traffic.
//
// Every rank must issue the same collectives in the same order (as with NCCL, Gloo and
// torch.distributed); each call returns at once with a Work, and the collectives of one
// communicator run in the order they were issued. A collective that does not complete within the
// communicator's timeout — a rank died or stopped answering — fails with DeadlineExceeded or
// Unavailable naming the collective and the timeout; it never hangs. After a failure the
// communicator is broken: every later collective fails at once with the first error (the ranks can
// no longer be assumed to agree on what was exchanged).
//
// Buffers belong to the caller and must stay valid, and not be touched, until the Work is done.
// A call refused on the spot (a bad shape or root: its Work failed at once) issues nothing: the
// other ranks learn of it only at their next collective, or at the timeout.
//
// Thread safety: a Communicator may be called from any thread, but the order of issue across
// ranks is the caller's to keep; Work is thread-safe.
#ifndef STRATA_COMM_COMMUNICATOR_H_
#define STRATA_COMM_COMMUNICATOR_H_

#include <chrono>
#include <cstddef>
#include <memory>

#include "absl/status/status.h"
#include "absl/types/span.h"

namespace strata::comm {

class Work {
 public:
  virtual ~Work() = default;
  // Blocks until the collective is done; its outcome.
  virtual absl::Status Wait() = 0;
  // Blocks until the collective is done or `timeout` has passed; whether it is done (a caller
  // that must stay responsive, to a signal say, waits in such steps).
  virtual bool WaitFor(std::chrono::milliseconds timeout) = 0;
  virtual bool done() const = 0;
};

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;

  // out = every rank's `in`, in rank order (out.size() == size() * in.size()).
  virtual std::shared_ptr<Work> AllGather(absl::Span<const std::byte> in,
                                          absl::Span<std::byte> out) = 0;
  // `in` is size() shards of out.size() floats; out = the sum over ranks of their shard rank().
  // A ring: each rank sends and receives (size() - 1) / size() of `in`.
  virtual std::shared_ptr<Work> ReduceScatter(absl::Span<const float> in,
                                              absl::Span<float> out) = 0;
  // data = the sum over ranks of data, in place.
  virtual std::shared_ptr<Work> AllReduce(absl::Span<float> data) = 0;
  // data = root's data, in place.
  virtual std::shared_ptr<Work> Broadcast(absl::Span<std::byte> data, int root) = 0;
  virtual std::shared_ptr<Work> Barrier() = 0;
  // Breaks the communicator at once, for a caller that gives up waiting (Ctrl-C): the peers'
  // collectives fail (they see the connections close) and every later one here fails at once; one
  // of this rank's in flight may stay blocked until the timeout (Gloo's cannot be woken), so the
  // communicator must outlive it.
  virtual void Abort() = 0;
};

}  // namespace strata::comm

#endif  // STRATA_COMM_COMMUNICATOR_H_
