// comm/job.h: joining the job a launcher started (torchrun, DeepSpeed's launcher, mpirun with
// the usual variables): who this rank is, where rank 0 is, and the communicators among all ranks.
//
// The environment, as the launchers set it: MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE and
// LOCAL_RANK. None of them set: a job of one process (rank 0 of 1, nothing listened on). Some set:
// all five are required, and a missing or malformed one is an error naming it and what is accepted.
//
// The rendezvous store listens on MASTER_PORT + 1 (STRATA_STORE_PORT names another), never on
// MASTER_PORT itself: torchrun's agent, or a trainer that has already called
// torch.distributed.init_process_group, holds that one, and both keep working beside strata. Rank 0
// serves the store on every interface; each rank's Gloo listens on GLOO_SOCKET_IFNAME when set
// (as torch's Gloo does), else on the address by which this host reaches MASTER_ADDR.
//
// Thread safety: the functions are thread-safe; a Job is used as its parts say.
#ifndef STRATA_COMM_JOB_H_
#define STRATA_COMM_JOB_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "comm/communicator.h"
#include "comm/tcp_store.h"

namespace strata::comm {

struct JobEnv {
  std::string master_addr = "127.0.0.1";
  uint16_t master_port = 0;
  uint16_t store_port = 0;  // MASTER_PORT + 1 unless STRATA_STORE_PORT
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  std::string gloo_iface;  // GLOO_SOCKET_IFNAME, or empty
  bool launched = false;   // false: no launcher's variables (a job of one process)
};

// `getenv` is the seam tests use (default: the process's environment).
using GetEnv = std::function<const char*(const char*)>;
absl::StatusOr<JobEnv> JobEnvFromEnvironment(const GetEnv& getenv = nullptr);

struct Job {
  JobEnv env;
  std::string transport;  // what the collectives travel by: "shared memory" or "tcp"
  std::unique_ptr<TcpStoreServer> server;  // rank 0's
  std::unique_ptr<TcpStore> store;
  std::unique_ptr<Communicator> comm;  // over host buffers
  // A second communicator over the same ranks, whose collectives run beside the first's rather
  // than after them (each keeps its own order): the engine's gradient reduce-scatters, so that a
  // bucket being reduced never holds up the next module's weight all-gather.
  std::unique_ptr<Communicator> side;
};

// Meets the other ranks (each waits up to `timeout` for the others, never longer) and connects
// the communicators. `transport` says how the collectives travel between the ranks: "auto",
// through shared memory when every rank is on this host (comm/shm_communicator.h), else on Gloo
// over TCP; "shm", shared memory or an error naming the rank that could not map it; "tcp", Gloo
// over TCP always. The ranks first exchange it and then check it (as strata.comm_transport gives
// it): a value not accepted, or one that differs, is named on every rank. `stop` (tcp_store.h) is
// polled while the ranks wait for one another in the store, and ends the joining with its status
// (the Python front's Ctrl-C); the Job's store keeps none.
absl::StatusOr<Job> JoinJob(const JobEnv& env, Duration timeout,
                            absl::string_view transport = "auto", const StopCheck& stop = nullptr);

}  // namespace strata::comm

#endif  // STRATA_COMM_JOB_H_
