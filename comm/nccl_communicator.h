// comm/nccl_communicator.h: the Communicator on NCCL, for device buffers (every Span a Work is
// given points to memory of this rank's GPU).
//
// The ranks meet through the rendezvous store: rank 0 makes NCCL's unique id and publishes it, the
// others read it. The communicator is made non-blocking (NCCL's config.blocking = 0), so that a
// rank that never arrives ends the others' wait at the timeout instead of hanging them, and each
// Work is a CUDA event on the communicator's own stream: Wait polls it together with NCCL's
// asynchronous error, and aborts the communicator (ncclCommAbort) when the timeout passes. As with
// Gloo's, a failure breaks the communicator. Barrier is an all-reduce of one float.
//
// Built when strata is built with CUDA (the toolkit ships NCCL); otherwise, and on a machine
// without a GPU, CreateNcclCommunicator says why it cannot make one.
//
// Thread safety: as Communicator.
#ifndef STRATA_COMM_NCCL_COMMUNICATOR_H_
#define STRATA_COMM_NCCL_COMMUNICATOR_H_

#include <memory>

#include "absl/status/statusor.h"
#include "comm/communicator.h"
#include "comm/tcp_store.h"

namespace strata::comm {

struct NcclOptions {
  int rank = 0;
  int size = 1;
  int device = 0;  // the CUDA device of this rank (LOCAL_RANK, as launchers arrange it)
  Duration timeout = Duration(60000);
  std::string prefix = "nccl";  // of the store's keys
};

// Unimplemented when strata was built without CUDA; FailedPrecondition naming the reason when no
// device can be used.
absl::StatusOr<std::unique_ptr<Communicator>> CreateNcclCommunicator(TcpStore& store,
                                                                     const NcclOptions& options);

}  // namespace strata::comm

#endif  // STRATA_COMM_NCCL_COMMUNICATOR_H_
