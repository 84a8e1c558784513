#include "comm/tcp_store.h"

#include <cstring>
#include <map>
#include <thread>

#include "absl/strings/str_cat.h"
#include "base/mutex.h"
#include "base/status.h"
#include "boost/asio.hpp"

namespace strata::comm {
namespace {

namespace asio = boost::asio;
using asio::ip::tcp;

// A request: magic, op, key length, value length, then the key and the value. A reply: status,
// value length, then the value.
constexpr uint32_t kMagic = 0x53545231;  // "STR1"
constexpr char kGreeting[] = "strata-store-1";
enum Op : uint8_t { kHello = 0, kSet = 1, kGet = 2, kAdd = 3 };
constexpr uint64_t kMaxValue = uint64_t{1} << 30;
constexpr uint32_t kMaxKey = 1 << 16;

#pragma pack(push, 1)
struct RequestHeader {
  uint32_t magic;
  uint8_t op;
  uint32_t key_bytes;
  uint64_t value_bytes;
};
struct ReplyHeader {
  uint32_t magic;
  uint8_t status;  // 0: ok
  uint64_t value_bytes;
};
#pragma pack(pop)

std::vector<char> Int64Bytes(int64_t v) {
  std::vector<char> out(sizeof v);
  std::memcpy(out.data(), &v, sizeof v);
  return out;
}

}  // namespace

// --- the server ----------------------------------------------------------------------------------

class TcpStoreServer::Impl {
 public:
  Impl() : acceptor_(io_) {}

  absl::Status Listen(const std::string& host, uint16_t port) {
    boost::system::error_code ec;
    const auto address = asio::ip::make_address(host, ec);
    if (ec) {
      return absl::InvalidArgumentError(
          absl::StrCat("rendezvous store: \"", host, "\" is not an IP address: ", ec.message()));
    }
    const tcp::endpoint at(address, port);
    acceptor_.open(at.protocol(), ec);
    if (!ec) acceptor_.set_option(tcp::acceptor::reuse_address(true), ec);
    if (!ec) acceptor_.bind(at, ec);
    if (!ec) acceptor_.listen(asio::socket_base::max_listen_connections, ec);
    if (ec) {
      return absl::UnavailableError(
          absl::StrCat("rendezvous store: cannot listen on ", host, ":", port, ": ", ec.message(),
                       ec == asio::error::address_in_use
                           ? " (another job, or torch.distributed's own store, holds the port)"
                           : ""));
    }
    port_ = acceptor_.local_endpoint().port();
    Accept();
    thread_ = std::thread([this] { io_.run(); });
    return absl::OkStatus();
  }

  ~Impl() {
    io_.stop();
    if (thread_.joinable()) thread_.join();
  }

  uint16_t port() const { return port_; }

 private:
  struct Session : std::enable_shared_from_this<Session> {
    explicit Session(tcp::socket s, Impl* o) : socket(std::move(s)), owner(o) {}
    tcp::socket socket;
    Impl* owner;
    RequestHeader header{};
    std::string key;
    std::vector<char> value;
    ReplyHeader reply{};
    std::vector<char> reply_value;

    void ReadHeader() {
      auto self = shared_from_this();
      asio::async_read(socket, asio::buffer(&header, sizeof header),
                       [self](boost::system::error_code ec, size_t) {
                         if (ec) return;
                         if (self->header.magic != kMagic || self->header.key_bytes > kMaxKey ||
                             self->header.value_bytes > kMaxValue) {
                           return;  // not one of ours: the connection is dropped
                         }
                         self->key.resize(self->header.key_bytes);
                         self->value.resize(self->header.value_bytes);
                         std::array<asio::mutable_buffer, 2> body = {asio::buffer(self->key),
                                                                     asio::buffer(self->value)};
                         asio::async_read(self->socket, body,
                                          [self](boost::system::error_code ec2, size_t) {
                                            if (!ec2) self->owner->Handle(self);
                                          });
                       });
    }

    void Reply(uint8_t status, std::vector<char> data) {
      auto self = shared_from_this();
      reply = {kMagic, status, data.size()};
      reply_value = std::move(data);
      std::array<asio::const_buffer, 2> out = {asio::buffer(&reply, sizeof reply),
                                               asio::buffer(reply_value)};
      asio::async_write(socket, out, [self](boost::system::error_code ec, size_t) {
        if (!ec) self->ReadHeader();
      });
    }
  };

  void Accept() {
    acceptor_.async_accept([this](boost::system::error_code ec, tcp::socket socket) {
      if (ec) return;
      std::make_shared<Session>(std::move(socket), this)->ReadHeader();
      Accept();
    });
  }

  // Runs on the server's thread only, so the map needs no lock.
  void Handle(const std::shared_ptr<Session>& s) {
    switch (s->header.op) {
      case kHello:
        s->Reply(0, std::vector<char>(kGreeting, kGreeting + sizeof kGreeting - 1));
        return;
      case kSet: {
        values_[s->key] = s->value;
        auto waiting = waiters_.extract(s->key);
        if (!waiting.empty()) {
          for (auto& w : waiting.mapped()) w->Reply(0, s->value);
        }
        s->Reply(0, {});
        return;
      }
      case kGet: {
        auto it = values_.find(s->key);
        if (it != values_.end()) {
          s->Reply(0, it->second);
        } else {
          waiters_[s->key].push_back(s);  // answered by the Set
        }
        return;
      }
      case kAdd: {
        int64_t delta = 0;
        if (s->value.size() != sizeof delta) return;
        std::memcpy(&delta, s->value.data(), sizeof delta);
        int64_t now = 0;
        auto it = values_.find(s->key);
        if (it != values_.end() && it->second.size() == sizeof now) {
          std::memcpy(&now, it->second.data(), sizeof now);
        }
        now += delta;
        values_[s->key] = Int64Bytes(now);
        s->Reply(0, Int64Bytes(now));
        return;
      }
      default:
        return;  // unknown op: dropped
    }
  }

  asio::io_context io_;
  tcp::acceptor acceptor_;
  std::thread thread_;
  uint16_t port_ = 0;
  std::map<std::string, std::vector<char>> values_;
  std::map<std::string, std::vector<std::shared_ptr<Session>>> waiters_;
};

absl::StatusOr<std::unique_ptr<TcpStoreServer>> TcpStoreServer::Start(const std::string& host,
                                                                      uint16_t port) {
  auto impl = std::make_unique<Impl>();
  absl::Status s = impl->Listen(host, port);
  if (!s.ok()) return s;
  return std::unique_ptr<TcpStoreServer>(new TcpStoreServer(std::move(impl)));
}

TcpStoreServer::TcpStoreServer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
TcpStoreServer::~TcpStoreServer() = default;
uint16_t TcpStoreServer::port() const { return impl_->port(); }

// --- the client ----------------------------------------------------------------------------------

class TcpStore::Impl {
 public:
  Impl() : socket_(io_) {}

  // Runs the asynchronous operations started on io_ until they are done (OK), `timeout` passes
  // (DeadlineExceeded) or stop_ says to stop (its status); the socket is closed on either (a
  // request left half-answered breaks the stream).
  absl::Status RunFor(Duration timeout) {
    io_.restart();
    stopped_ = false;
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    absl::Status why;
    while (true) {
      const auto left =
          std::chrono::duration_cast<Duration>(deadline - std::chrono::steady_clock::now());
      if (left > Duration(0)) io_.run_for(stop_ ? std::min(left, kStopPoll) : left);
      if (io_.stopped()) return absl::OkStatus();
      if (std::chrono::steady_clock::now() >= deadline) {
        why = absl::DeadlineExceededError("timed out");
        break;
      }
      if (stop_) {
        why = stop_();
        stopped_ = !why.ok();
        if (stopped_) break;
      }
    }
    boost::system::error_code ignored;
    socket_.close(ignored);
    io_.run();  // lets the cancelled handlers finish
    broken_ = true;
    return why;
  }

  absl::Status Connect(const tcp::endpoint& at, Duration timeout) {
    boost::system::error_code ec = asio::error::would_block;
    socket_.async_connect(at, [&ec](boost::system::error_code e) { ec = e; });
    if (absl::Status s = RunFor(timeout); !s.ok()) {
      return absl::IsDeadlineExceeded(s) ? absl::DeadlineExceededError("connecting timed out") : s;
    }
    if (ec) {
      boost::system::error_code ignored;
      socket_.close(ignored);
      return absl::UnavailableError(ec.message());
    }
    socket_.set_option(tcp::no_delay(true), ec);
    broken_ = false;
    return absl::OkStatus();
  }

  // One request and its reply.
  absl::StatusOr<std::vector<char>> Call(Op op, const std::string& key,
                                         const std::vector<char>& value, Duration timeout,
                                         bool* foreign) {
    if (broken_) {
      return absl::FailedPreconditionError(
          "an earlier request timed out or failed; the connection was closed");
    }
    RequestHeader h{kMagic, op, static_cast<uint32_t>(key.size()), value.size()};
    std::array<asio::const_buffer, 3> out = {asio::buffer(&h, sizeof h), asio::buffer(key),
                                             asio::buffer(value)};
    boost::system::error_code write_ec = asio::error::would_block;
    boost::system::error_code read_ec = asio::error::would_block;
    ReplyHeader r{};
    std::vector<char> data;
    asio::async_write(socket_, out, [&](boost::system::error_code ec, size_t) {
      write_ec = ec;
      if (ec) return;
      asio::async_read(
          socket_, asio::buffer(&r, sizeof r), [&](boost::system::error_code ec2, size_t) {
            if (ec2 || r.magic != kMagic || r.value_bytes > kMaxValue) {
              read_ec = ec2 ? ec2 : asio::error::invalid_argument;
              if (!ec2 && foreign != nullptr) *foreign = true;
              return;
            }
            data.resize(r.value_bytes);
            asio::async_read(socket_, asio::buffer(data),
                             [&](boost::system::error_code ec3, size_t) { read_ec = ec3; });
          });
    });
    if (absl::Status s = RunFor(timeout); !s.ok()) {
      return absl::IsDeadlineExceeded(s) ? absl::DeadlineExceededError(absl::StrCat(
                                               "no answer within ", timeout.count(), " ms"))
                                         : s;
    }
    if (write_ec || read_ec) {
      broken_ = true;
      return absl::UnavailableError((write_ec ? write_ec : read_ec).message());
    }
    if (r.status != 0) return absl::InternalError("the store refused the request");
    return data;
  }

  static constexpr Duration kStopPoll{100};

  asio::io_context io_;
  tcp::socket socket_;
  bool broken_ = false;
  StopCheck stop_;
  bool stopped_ = false;  // the last RunFor ended because stop_ said so
};

absl::StatusOr<std::unique_ptr<TcpStore>> TcpStore::Connect(const std::string& host, uint16_t port,
                                                            Duration timeout, StopCheck stop) {
  const std::string address = absl::StrCat(host, ":", port);
  boost::system::error_code ec;
  auto ip = asio::ip::make_address(host, ec);
  if (ec) {
    // A name: resolved once.
    asio::io_context io;
    tcp::resolver resolver(io);
    auto found = resolver.resolve(host, std::to_string(port), ec);
    if (ec || found.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("rendezvous store: cannot resolve \"", host, "\": ", ec.message()));
    }
    ip = found.begin()->endpoint().address();
  }
  const tcp::endpoint at(ip, port);
  auto impl = std::make_unique<Impl>();
  impl->stop_ = std::move(stop);
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  std::string last = "nothing tried";
  while (true) {
    const auto left =
        std::chrono::duration_cast<Duration>(deadline - std::chrono::steady_clock::now());
    if (left <= Duration(0)) {
      return absl::DeadlineExceededError(absl::StrCat("rendezvous store at ", address,
                                                      ": not reached within ", timeout.count(),
                                                      " ms (last attempt: ", last,
                                                      "); is rank 0 running, and are MASTER_ADDR "
                                                      "and the port right?"));
    }
    if (impl->stop_) STRATA_RETURN_IF_ERROR(impl->stop_());  // (refused at once: RunFor polls not)
    absl::Status s = impl->Connect(at, std::min(left, Duration(1000)));
    if (impl->stopped_) return s;
    if (s.ok()) {
      bool foreign = false;
      auto hello = impl->Call(kHello, kGreeting, {}, std::min(left, Duration(5000)), &foreign);
      if (impl->stopped_) return hello.status();
      if (hello.ok() && std::string(hello->begin(), hello->end()) == kGreeting) break;
      return absl::FailedPreconditionError(absl::StrCat(
          "the service at ", address, " is not strata's rendezvous store (",
          hello.ok() ? "it answered something else" : hello.status().message(),
          "): is torch.distributed's store on that port? strata's store uses MASTER_PORT + 1 "
          "unless STRATA_STORE_PORT names another"));
    }
    last = std::string(s.message());
    std::this_thread::sleep_for(std::min(left, Duration(50)));
  }
  return std::unique_ptr<TcpStore>(new TcpStore(std::move(impl), address));
}

TcpStore::TcpStore(std::unique_ptr<Impl> impl, std::string address)
    : impl_(std::move(impl)), address_(std::move(address)) {}
TcpStore::~TcpStore() = default;
void TcpStore::set_stop(StopCheck stop) { impl_->stop_ = std::move(stop); }

absl::Status TcpStore::Set(const std::string& key, const std::vector<char>& value) {
  auto r = impl_->Call(kSet, key, value, Duration(60000), nullptr);
  if (!r.ok()) {
    return absl::Status(r.status().code(),
                        absl::StrCat("rendezvous store at ", address_, ": set \"", key,
                                     "\": ", r.status().message()));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<char>> TcpStore::Get(const std::string& key, Duration timeout) {
  auto r = impl_->Call(kGet, key, {}, timeout, nullptr);
  if (!r.ok()) {
    return absl::Status(r.status().code(),
                        absl::StrCat("rendezvous store at ", address_, ": waiting for \"", key,
                                     "\": ", r.status().message()));
  }
  return r;
}

absl::StatusOr<int64_t> TcpStore::Add(const std::string& key, int64_t delta) {
  auto r = impl_->Call(kAdd, key, Int64Bytes(delta), Duration(60000), nullptr);
  if (!r.ok() || r->size() != sizeof(int64_t)) {
    return absl::UnavailableError(
        absl::StrCat("rendezvous store at ", address_, ": add \"", key,
                     "\": ", r.ok() ? "bad reply" : r.status().message()));
  }
  int64_t v;
  std::memcpy(&v, r->data(), sizeof v);
  return v;
}

}  // namespace strata::comm
