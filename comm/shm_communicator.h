// comm/shm_communicator.h: the Communicator for ranks on one host, through a POSIX shared memory
// segment they all map: a collective's bytes are copied into the segment and out of it, never
// through the kernel's TCP stack (Gloo's loopback path costs both ranks' cores a copy into and out
// of socket buffers, and reached about a quarter of memcpy's rate here: docs/performance.md).
//
// The segment holds two slots of `slot_bytes` per rank and each rank's two counters. A collective
// runs in rounds: in each, every rank copies its next piece into one of its slots and posts the
// round; once every rank has posted it, each reads the pieces it needs from the others' slots
// and says so; a rank writes a slot again only once every rank has read it (two slots: a rank
// writes the next round while the others read the last). Sums are taken in rank order on every
// rank, so an all-reduce's result is the same bits on every rank. Each round also carries what
// the rank is doing (the collective, its root and its bytes): ranks that issued different
// collectives are named, not left reading each other's bytes.
//
// Waits spin briefly, then sleep on the counter (a futex on the shared page). A rank that stopped
// answering fails the waiting collective with DeadlineExceeded after `timeout`; one whose process
// (or communicator) ended fails it with Unavailable within about 100 ms: each rank's collectives
// thread holds a robust process-shared mutex of its own in the segment, which the kernel hands
// on, marked, when its holder dies. Abort marks the segment: every rank's waiting collective
// fails at once.
//
// Rank 0 makes the segment once every rank has arrived (shm_open under a random name, its room
// reserved by posix_fallocate, so a full /dev/shm is an error here rather than a SIGBUS later),
// the others map it by the name and a random token read from the store, and rank 0 unlinks it
// once every rank has said whether it mapped it (on its every path; every rank that mapped it
// unlinks it then too, so rank 0's death after another has mapped it leaves nothing): nothing is
// left in /dev/shm when the ranks end, unless rank 0 is killed after making it and before any
// other rank has mapped it. Where any rank cannot make or map it (another host, another IPC
// namespace, no room), every rank gets the same FailedPrecondition naming that rank and why, so
// that all of them can take another transport. A collective that moves nothing takes a round all
// the same, so ranks whose collectives differ meet and are named there too.
//
// Thread safety: as Communicator.
#ifndef STRATA_COMM_SHM_COMMUNICATOR_H_
#define STRATA_COMM_SHM_COMMUNICATOR_H_

#include <cstddef>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "comm/communicator.h"
#include "comm/tcp_store.h"

namespace strata::comm {

struct ShmOptions {
  int rank = 0;
  int size = 1;
  Duration timeout = Duration(60000);  // of the rendezvous and of each wait for another rank
  std::string prefix = "shm";          // of the store's keys, so several communicators can meet
  // Bytes of one slot (0: 16 MiB over 2 x size, from 64 KiB to 4 MiB, and at least 4096 x size);
  // the segment holds two a rank, 2 x size x slot_bytes in all, plus a page a rank. Accepted: 0,
  // or a multiple of 64 of 4096 x size and up.
  size_t slot_bytes = 0;
};

// Meets the other ranks through `store` (which it does not keep) and maps the segment.
absl::StatusOr<std::unique_ptr<Communicator>> CreateShmCommunicator(TcpStore& store,
                                                                    const ShmOptions& options);

}  // namespace strata::comm

#endif  // STRATA_COMM_SHM_COMMUNICATOR_H_
