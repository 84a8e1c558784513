// comm/tcp_store.h: the rendezvous store of a job's ranks, a small key-value service over TCP
// (Boost.Asio), on the model of torch.distributed's TCPStore.
//
// Rank 0 serves it (TcpStoreServer, a thread of its own); every rank, rank 0 included, talks to it
// through a TcpStore client. Keys are set once per value and read by waiting for them: Get blocks
// until the key is set or the timeout passes, so ranks that arrive at different times meet without
// polling. Nothing here is a collective: it carries the few bytes that let the ranks find one
// another (Gloo's and NCCL's addresses), and the checks that they agree.
//
// Never a hang: connecting retries until the timeout (rank 0's server may start after the others),
// and every request has the timeout; an error names the address, what was asked and how long it
// waited. A client's StopCheck, polled while it waits, ends a wait early (Ctrl-C in the Python
// front, which would otherwise wait for the whole timeout). A service on the port that is not this
// store (torch.distributed's own TCPStore on MASTER_PORT, say) is recognised by the greeting and
// named as such.
//
// Thread safety: TcpStoreServer is thread-safe (it runs on its own thread). A TcpStore client is
// used by one thread at a time.
#ifndef STRATA_COMM_TCP_STORE_H_
#define STRATA_COMM_TCP_STORE_H_

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace strata::comm {

using Duration = std::chrono::milliseconds;

// Polled on the waiting thread, every 100 ms at most, while a client waits for an answer or
// retries its connection: a status that is not OK ends the wait with that status (the connection
// is then closed, as on a timeout). Empty: never polled.
using StopCheck = std::function<absl::Status()>;

class TcpStoreServer {
 public:
  // Listens on host:port (port 0: any free port, see port()). The error names the address when it
  // cannot be bound (in use: is another job, or torch.distributed, on it?).
  static absl::StatusOr<std::unique_ptr<TcpStoreServer>> Start(const std::string& host,
                                                               uint16_t port);
  ~TcpStoreServer();  // stops serving; clients still connected see their requests fail
  TcpStoreServer(const TcpStoreServer&) = delete;
  TcpStoreServer& operator=(const TcpStoreServer&) = delete;
  uint16_t port() const;

  class Impl;

 private:
  explicit TcpStoreServer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

class TcpStore {
 public:
  // Connects to the server at host:port, retrying until `timeout` (the server may not be up yet)
  // or until `stop` says to stop; the client keeps `stop` for its requests (set_stop changes it).
  static absl::StatusOr<std::unique_ptr<TcpStore>> Connect(const std::string& host, uint16_t port,
                                                           Duration timeout,
                                                           StopCheck stop = nullptr);
  ~TcpStore();
  TcpStore(const TcpStore&) = delete;
  TcpStore& operator=(const TcpStore&) = delete;

  absl::Status Set(const std::string& key, const std::vector<char>& value);
  // The key's value, once it is set; DeadlineExceeded naming the key after `timeout`.
  absl::StatusOr<std::vector<char>> Get(const std::string& key, Duration timeout);
  // Adds `delta` to the integer counter `key` (absent: 0) and returns the new value.
  absl::StatusOr<int64_t> Add(const std::string& key, int64_t delta);

  const std::string& address() const { return address_; }
  void set_stop(StopCheck stop);

  class Impl;

 private:
  TcpStore(std::unique_ptr<Impl> impl, std::string address);
  std::unique_ptr<Impl> impl_;
  std::string address_;
};

}  // namespace strata::comm

#endif  // STRATA_COMM_TCP_STORE_H_
