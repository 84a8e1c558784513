// comm/gloo_communicator.h: the Communicator on Gloo (Debian's libgloo), over TCP, for host
// buffers: what ZeRO's offloaded shards move through, and what every test runs on without a GPU.
//
// The ranks meet through the rendezvous store (comm/tcp_store.h): each publishes its Gloo address
// and reads the others' (Gloo's full mesh). Collectives run on a thread of the communicator's own,
// in the order issued; all-gather, all-reduce, broadcast and barrier are Gloo's, reduce-scatter a
// ring over Gloo's point-to-point buffers (Gloo 0.5 has none with a timeout). Gloo reports a peer
// that died as an I/O error, and one that stopped answering by its timeout; both end the
// collective with an error naming it (communicator.h). Gloo writes to its sockets without
// MSG_NOSIGNAL, so making a communicator sets SIGPIPE to be ignored when the program left it at
// its default (which would end the process when a peer dies); a handler of the program's own is
// kept.
//
// Thread safety: as Communicator.
#ifndef STRATA_COMM_GLOO_COMMUNICATOR_H_
#define STRATA_COMM_GLOO_COMMUNICATOR_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "comm/communicator.h"
#include "comm/tcp_store.h"

namespace strata::comm {

struct GlooOptions {
  int rank = 0;
  int size = 1;
  // The address this rank's Gloo listens on, as an IP (the interface the others reach it by).
  std::string host = "127.0.0.1";
  std::string iface;  // when set, the network interface to listen on instead of `host`
  Duration timeout = Duration(60000);  // of the rendezvous and of each collective
  std::string prefix = "gloo";         // of the store's keys, so several communicators can meet
};

// Meets the other ranks through `store` (which it does not keep) and connects to each of them.
absl::StatusOr<std::unique_ptr<Communicator>> CreateGlooCommunicator(TcpStore& store,
                                                                     const GlooOptions& options);

}  // namespace strata::comm

#endif  // STRATA_COMM_GLOO_COMMUNICATOR_H_
