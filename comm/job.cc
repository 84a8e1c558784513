#include "comm/job.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "base/status.h"
#include "comm/gloo_communicator.h"
#include "comm/in_order.h"
#include "comm/shm_communicator.h"

namespace strata::comm {
namespace {

absl::Status Bad(const char* var, const char* value, const std::string& accepted) {
  return absl::InvalidArgumentError(
      absl::StrCat("the environment: ", var, "=\"", value, "\": accepted: ", accepted));
}

absl::StatusOr<int64_t> IntVar(const GetEnv& get, const char* var, int64_t lo, int64_t hi) {
  const char* v = get(var);
  if (v == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the environment: ", var,
        " is not set; a launched job needs MASTER_ADDR, MASTER_PORT, "
        "RANK, WORLD_SIZE and LOCAL_RANK (as torchrun and DeepSpeed's launcher set them)"));
  }
  int64_t n;
  if (!absl::SimpleAtoi(v, &n) || n < lo || n > hi) {
    return Bad(var, v, absl::StrCat("an integer in [", lo, ", ", hi, "]"));
  }
  return n;
}

// The local address this host reaches `peer` by (a UDP socket's route; nothing is sent).
absl::StatusOr<std::string> LocalAddressToward(const std::string& peer, uint16_t port) {
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* found = nullptr;
  if (int e = getaddrinfo(peer.c_str(), std::to_string(port).c_str(), &hints, &found); e != 0) {
    return absl::InvalidArgumentError(absl::StrCat("the environment: MASTER_ADDR=\"", peer,
                                                   "\" cannot be resolved: ", gai_strerror(e)));
  }
  const int fd = socket(AF_INET, SOCK_DGRAM, 0);
  sockaddr_in local{};
  socklen_t len = sizeof local;
  const bool ok = fd >= 0 && connect(fd, found->ai_addr, found->ai_addrlen) == 0 &&
                  getsockname(fd, reinterpret_cast<sockaddr*>(&local), &len) == 0;
  const int err = errno;
  if (fd >= 0) close(fd);
  freeaddrinfo(found);
  if (!ok) {
    return absl::UnavailableError(
        absl::StrCat("no route from this host to MASTER_ADDR ", peer, ": ", std::strerror(err)));
  }
  char text[INET_ADDRSTRLEN];
  inet_ntop(AF_INET, &local.sin_addr, text, sizeof text);
  return std::string(text);
}

// strata.comm_transport's values (JoinJob, job.h).
enum class Transport { kAuto, kShm, kTcp };

const char* TransportName(Transport t) {
  switch (t) {
    case Transport::kAuto:
      return "auto";
    case Transport::kShm:
      return "shm";
    case Transport::kTcp:
      return "tcp";
  }
  return "?";
}

absl::StatusOr<Transport> ParseTransport(absl::string_view text) {
  for (Transport t : {Transport::kAuto, Transport::kShm, Transport::kTcp}) {
    if (text == TransportName(t)) return t;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("strata.comm_transport: \"", text,
                   "\" is not accepted; accepted: \"auto\" (shared memory when every rank is on "
                   "this host, else TCP), \"shm\", \"tcp\""));
}

// Each rank's transport beside every other's, exchanged before any is checked, so that none
// waits for a segment the others never make, nor for a rank that refused its own value: a value
// not accepted, or one that differs, is named on every rank.
absl::StatusOr<Transport> AgreeOnTransport(TcpStore& store, const JobEnv& env,
                                           absl::string_view mine, Duration timeout) {
  auto all = Exchange(store, "transport/", env.rank, env.world_size, std::string(mine), timeout);
  if (!all.ok()) return all.status();
  auto transport = ParseTransport(mine);
  if (!transport.ok()) return transport.status();
  for (int j = 0; j < env.world_size; ++j) {
    if ((*all)[j] != mine) {
      return absl::FailedPreconditionError(
          absl::StrCat("this rank (", env.rank, ") was given the transport \"", mine,
                       "\" (strata.comm_transport) but rank ", j, " was given \"", (*all)[j], "\"",
                       ParseTransport((*all)[j]).ok() ? "" : ", which is not accepted",
                       ": it must be the same on every rank"));
    }
  }
  return transport;
}

}  // namespace

absl::StatusOr<JobEnv> JobEnvFromEnvironment(const GetEnv& getenv_fn) {
  const GetEnv get =
      getenv_fn ? getenv_fn : [](const char* k) -> const char* { return std::getenv(k); };
  JobEnv env;
  bool any = false;
  for (const char* var : {"MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK"}) {
    any = any || get(var) != nullptr;
  }
  if (!any) return env;  // a job of one process
  env.launched = true;
  const char* addr = get("MASTER_ADDR");
  if (addr == nullptr || *addr == '\0') {
    return absl::InvalidArgumentError(
        absl::StrCat("the environment: MASTER_ADDR is ", addr == nullptr ? "not set" : "empty",
                     "; a launched job needs MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE and "
                     "LOCAL_RANK (as torchrun and DeepSpeed's launcher set them)"));
  }
  env.master_addr = addr;
  auto port = IntVar(get, "MASTER_PORT", 1, 65534);
  if (!port.ok()) return port.status();
  env.master_port = static_cast<uint16_t>(*port);
  auto size = IntVar(get, "WORLD_SIZE", 1, 1 << 20);
  if (!size.ok()) return size.status();
  env.world_size = static_cast<int>(*size);
  auto rank = IntVar(get, "RANK", 0, 1 << 20);
  if (!rank.ok()) return rank.status();
  if (*rank >= *size) {
    return Bad("RANK", get("RANK"), absl::StrCat("0..WORLD_SIZE-1 (WORLD_SIZE is ", *size, ")"));
  }
  env.rank = static_cast<int>(*rank);
  auto local = IntVar(get, "LOCAL_RANK", 0, 1 << 20);
  if (!local.ok()) return local.status();
  if (*local > *rank) {
    return Bad("LOCAL_RANK", get("LOCAL_RANK"),
               absl::StrCat("at most RANK (", *rank, "): ranks on one host are numbered from 0"));
  }
  env.local_rank = static_cast<int>(*local);
  env.store_port = static_cast<uint16_t>(env.master_port + 1);
  if (get("STRATA_STORE_PORT") != nullptr) {
    auto store = IntVar(get, "STRATA_STORE_PORT", 1, 65535);
    if (!store.ok()) return store.status();
    if (*store == env.master_port) {
      return Bad("STRATA_STORE_PORT", get("STRATA_STORE_PORT"),
                 "a port other than MASTER_PORT (torch.distributed's store is there)");
    }
    env.store_port = static_cast<uint16_t>(*store);
  }
  if (const char* iface = get("GLOO_SOCKET_IFNAME"); iface != nullptr) env.gloo_iface = iface;
  return env;
}

absl::StatusOr<Job> JoinJob(const JobEnv& env, Duration timeout, absl::string_view transport_text,
                            const StopCheck& stop) {
  Job job;
  job.env = env;
  std::string host = "127.0.0.1";
  std::string master = env.master_addr;
  if (env.launched) {
    if (env.rank == 0) {
      auto server = TcpStoreServer::Start("0.0.0.0", env.store_port);
      if (!server.ok()) {
        return absl::Status(
            server.status().code(),
            absl::StrCat(server.status().message(), "; STRATA_STORE_PORT names another port"));
      }
      job.server = std::move(*server);
    }
    if (env.gloo_iface.empty()) {
      auto local = LocalAddressToward(env.master_addr, env.store_port);
      if (!local.ok()) return local.status();
      host = *local;
    }
  } else {
    auto server = TcpStoreServer::Start("127.0.0.1", 0);  // a job of one: its own, on any port
    if (!server.ok()) return server.status();
    job.server = std::move(*server);
    master = "127.0.0.1";
  }
  const uint16_t port = env.launched ? env.store_port : job.server->port();
  auto store = TcpStore::Connect(master, port, timeout, stop);
  if (!store.ok()) return store.status();
  job.store = std::move(*store);
  // The world size first: every exchange below waits for that many ranks.
  STRATA_RETURN_IF_ERROR(
      AgreeOnWorldSize(*job.store, "job/", env.rank, env.world_size, timeout, "the job"));
  auto agreed = AgreeOnTransport(*job.store, env, transport_text, timeout);
  if (!agreed.ok()) return agreed.status();
  const Transport transport = *agreed;
  if (transport != Transport::kTcp && env.world_size > 1) {
    for (auto [prefix, out] : {std::pair{"shm", &job.comm}, std::pair{"shm-side", &job.side}}) {
      auto comm = CreateShmCommunicator(
          *job.store,
          {.rank = env.rank, .size = env.world_size, .timeout = timeout, .prefix = prefix});
      if (!comm.ok()) {
        // The same on every rank (one could not make or map a segment: the second's, say, where
        // /dev/shm has room for one): all take TCP together, the first let go.
        if (transport == Transport::kAuto &&
            comm.status().code() == absl::StatusCode::kFailedPrecondition) {
          job.comm.reset();
          break;
        }
        return comm.status();
      }
      *out = std::move(*comm);
    }
    if (job.side != nullptr) {
      job.transport = "shared memory";
      job.store->set_stop(nullptr);
      return job;
    }
  }
  for (auto [prefix, out] : {std::pair{"gloo", &job.comm}, std::pair{"gloo-side", &job.side}}) {
    auto comm = CreateGlooCommunicator(*job.store, {.rank = env.rank,
                                                    .size = env.world_size,
                                                    .host = host,
                                                    .iface = env.gloo_iface,
                                                    .timeout = timeout,
                                                    .prefix = prefix});
    if (!comm.ok()) return comm.status();
    *out = std::move(*comm);
  }
  job.transport = "tcp";
  job.store->set_stop(nullptr);
  return job;
}

}  // namespace strata::comm
