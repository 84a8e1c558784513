#include "comm/gloo_communicator.h"

#include <chrono>
#include <csignal>
#include <cstring>
#include <functional>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/status.h"
#include "comm/in_order.h"
#include "gloo/allgather.h"
#include "gloo/allreduce.h"
#include "gloo/barrier.h"
#include "gloo/broadcast.h"
#include "gloo/common/error.h"
#include "gloo/math.h"
#include "gloo/rendezvous/context.h"
#include "gloo/rendezvous/store.h"
#include "gloo/transport/tcp/device.h"

namespace strata::comm {
namespace {

// Gloo's store interface over the rendezvous store, under a prefix. Gloo expects exceptions.
class StoreAdapter final : public gloo::rendezvous::Store {
 public:
  StoreAdapter(TcpStore& store, std::string prefix, Duration timeout)
      : store_(store), prefix_(std::move(prefix)), timeout_(timeout) {}
  void set(const std::string& key, const std::vector<char>& data) override {
    absl::Status s = store_.Set(prefix_ + key, data);
    if (!s.ok()) throw gloo::IoException(std::string(s.message()));
  }
  std::vector<char> get(const std::string& key) override {
    auto v = store_.Get(prefix_ + key, timeout_);
    if (!v.ok()) throw gloo::IoException(std::string(v.status().message()));
    return *std::move(v);
  }
  void wait(const std::vector<std::string>& keys) override { wait(keys, timeout_); }
  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& t) override {
    for (const std::string& k : keys) {
      auto v = store_.Get(prefix_ + k, std::chrono::duration_cast<Duration>(t));
      if (!v.ok()) throw gloo::IoException(std::string(v.status().message()));
    }
  }

 private:
  TcpStore& store_;
  const std::string prefix_;
  const Duration timeout_;
};

class GlooCommunicator final : public Communicator {
 public:
  GlooCommunicator(std::shared_ptr<gloo::Context> context, Duration timeout)
      : context_(std::move(context)),
        timeout_(timeout),
        in_order_(absl::StrCat("rank ", context_->rank, " of ", context_->size)) {}

  int rank() const override { return context_->rank; }
  int size() const override { return context_->size; }

  // The peers' collectives fail at once (the connections close). One of this rank's that waits for
  // a peer's bytes stays blocked until the timeout (Gloo's algorithms cannot be woken): later
  // collectives are refused at once rather than queued behind it, and the communicator must not
  // be destroyed before it ends (the destructor joins its thread).
  void Abort() override {
    in_order_.Abort();
    context_->closeConnections();
  }

  std::shared_ptr<Work> AllGather(absl::Span<const std::byte> in,
                                  absl::Span<std::byte> out) override {
    if (out.size() != in.size() * static_cast<size_t>(size())) {
      return FailedWork(absl::InvalidArgumentError(
          absl::StrCat("all-gather: the output holds ", out.size(), " bytes; accepted: size (",
                       size(), ") x the input's ", in.size())));
    }
    return Issue("all-gather", [this, in, out] {
      gloo::AllgatherOptions o(context_);
      o.setInput(const_cast<uint8_t*>(reinterpret_cast<const uint8_t*>(in.data())), in.size());
      o.setOutput(reinterpret_cast<uint8_t*>(out.data()), out.size());
      o.setTimeout(timeout_);
      gloo::allgather(o);
    });
  }

  std::shared_ptr<Work> ReduceScatter(absl::Span<const float> in, absl::Span<float> out) override {
    if (in.size() != out.size() * static_cast<size_t>(size())) {
      return FailedWork(absl::InvalidArgumentError(
          absl::StrCat("reduce-scatter: the input holds ", in.size(), " floats; accepted: size (",
                       size(), ") x the output's ", out.size())));
    }
    return Issue("reduce-scatter", [this, in, out] { RingReduceScatter(in, out); });
  }

  std::shared_ptr<Work> AllReduce(absl::Span<float> data) override {
    return Issue("all-reduce", [this, data] {
      gloo::AllreduceOptions o(context_);
      o.setInput(data.data(), data.size());
      o.setOutput(data.data(), data.size());
      o.setReduceFunction(
          static_cast<void (*)(void*, const void*, const void*, size_t)>(&gloo::sum<float>));
      o.setTimeout(timeout_);
      gloo::allreduce(o);
    });
  }

  std::shared_ptr<Work> Broadcast(absl::Span<std::byte> data, int root) override {
    if (root < 0 || root >= size()) {
      return FailedWork(absl::InvalidArgumentError(
          absl::StrCat("broadcast: root ", root, "; accepted: 0..", size() - 1)));
    }
    return Issue("broadcast", [this, data, root] {
      gloo::BroadcastOptions o(context_);
      // The root sends from its output when given no input. Given the same buffer as both, Gloo
      // copied it onto itself while its I/O thread was sending from it (TSan saw the race).
      o.setOutput(reinterpret_cast<uint8_t*>(data.data()), data.size());
      o.setRoot(root);
      o.setTimeout(timeout_);
      gloo::broadcast(o);
    });
  }

  std::shared_ptr<Work> Barrier() override {
    return Issue("barrier", [this] {
      gloo::BarrierOptions o(context_);
      o.setTimeout(timeout_);
      gloo::barrier(o);
    });
  }

 private:
  // Gloo's collectives throw: each ends in a Status naming it.
  std::shared_ptr<Work> Issue(std::string what, std::function<void()> run) {
    return in_order_.Issue(what, [this, what, run = std::move(run)]() -> absl::Status {
      try {
        run();
      } catch (const gloo::IoException& e) {
        return absl::UnavailableError(Describe(what, e.what()));
      } catch (const std::exception& e) {
        return absl::InternalError(Describe(what, e.what()));
      }
      return absl::OkStatus();
    });
  }

  std::string Describe(const std::string& what, const char* error) const {
    return absl::StrCat("rank ", rank(), " of ", size(), ": ", what, " failed (timeout ",
                        timeout_.count(), " ms; a rank died or stopped answering?): ", error);
  }

  // The ring: at step s this rank sends to the next rank the partial sum of shard
  // (rank - s - 1) mod n (at step 0 its own input's shard) and receives from the previous rank
  // its partial sum of shard (rank - s - 2) mod n, which it adds to its input's shard; after
  // n - 1 steps that sum is shard `rank`'s over every rank, made in `out`. Three shard-sized
  // buffers, kept from call to call (fresh memory would be paid for in page faults each time).
  void RingReduceScatter(absl::Span<const float> in, absl::Span<float> out) {
    const int n = size(), r = rank();
    const size_t chunk = out.size();
    const size_t bytes = chunk * sizeof(float);
    if (n == 1 || chunk == 0) {
      if (chunk > 0) std::memcpy(out.data(), in.data(), bytes);
      return;
    }
    if (ring_.size() < 3 * chunk) {
      ring_.assign(3 * chunk, 0.0f);
      ring_buffer_ = context_->createUnboundBuffer(ring_.data(), ring_.size() * sizeof(float));
    }
    auto input = context_->createUnboundBuffer(const_cast<float*>(in.data()), in.size() * 4);
    const int next = (r + 1) % n, prev = (r - 1 + n) % n;
    // ring_: [incoming | partial sum A | partial sum B]; the sum made at step s is sent at s + 1.
    float* incoming = ring_.data();
    for (int s = 0; s < n - 1; ++s) {
      const uint64_t slot = static_cast<uint64_t>(context_->nextSlot());
      const size_t send_idx = static_cast<size_t>((r - s - 1 + 2 * n) % n);
      const size_t recv_idx = static_cast<size_t>((r - s - 2 + 2 * n) % n);
      const size_t sent_sum = 1 + static_cast<size_t>((s + 1) % 2);  // made at step s - 1
      const size_t made_sum = 1 + static_cast<size_t>(s % 2);
      ring_buffer_->recv(prev, slot, 0, bytes);
      if (s == 0) {
        input->send(next, slot, send_idx * bytes, bytes);
      } else {
        ring_buffer_->send(next, slot, sent_sum * bytes, bytes);
      }
      if (!ring_buffer_->waitRecv(timeout_)) throw gloo::IoException("the ring's receive aborted");
      const float* mine = in.data() + recv_idx * chunk;
      float* sum = s == n - 2 ? out.data() : ring_.data() + made_sum * chunk;
      for (size_t i = 0; i < chunk; ++i) sum[i] = mine[i] + incoming[i];
      if (!(s == 0 ? input : ring_buffer_)->waitSend(timeout_)) {
        throw gloo::IoException("the ring's send aborted");
      }
    }
  }

  std::shared_ptr<gloo::Context> context_;
  const Duration timeout_;
  std::vector<float> ring_;  // RingReduceScatter's buffers (the collectives' thread only)
  std::unique_ptr<gloo::transport::UnboundBuffer> ring_buffer_;
  InOrder in_order_;  // last: its thread, joined first, uses the members above
};

}  // namespace

absl::StatusOr<std::unique_ptr<Communicator>> CreateGlooCommunicator(TcpStore& store,
                                                                     const GlooOptions& options) {
  if (options.size < 1 || options.rank < 0 || options.rank >= options.size) {
    return absl::InvalidArgumentError(absl::StrCat("gloo: rank ", options.rank, " of world size ",
                                                   options.size, "; accepted: 0 <= rank < size"));
  }
  // The ranks agree on the world size before Gloo waits for ranks that will never come.
  const std::string prefix = options.prefix + "/";
  STRATA_RETURN_IF_ERROR(
      AgreeOnWorldSize(store, prefix, options.rank, options.size, options.timeout, "gloo"));
  // Gloo writes to its peers' sockets without MSG_NOSIGNAL: a peer that died would end this
  // process by SIGPIPE instead of failing the collective with an error. Ignored here unless the
  // program has a handler of its own (Python already ignores it).
  struct sigaction current {};
  if (sigaction(SIGPIPE, nullptr, &current) == 0 && current.sa_handler == SIG_DFL) {
    signal(SIGPIPE, SIG_IGN);
  }
  try {
    gloo::transport::tcp::attr attr;
    if (options.iface.empty()) {
      attr.hostname = options.host;
    } else {
      attr.iface = options.iface;
    }
    auto device = gloo::transport::tcp::CreateDevice(attr);
    auto context = std::make_shared<gloo::rendezvous::Context>(options.rank, options.size);
    context->setTimeout(options.timeout);
    StoreAdapter adapter(store, prefix + "mesh/", options.timeout);
    context->connectFullMesh(adapter, device);
    return std::unique_ptr<Communicator>(new GlooCommunicator(context, options.timeout));
  } catch (const std::exception& e) {
    return absl::UnavailableError(absl::StrCat("gloo: rank ", options.rank, " of ", options.size,
                                               " could not connect to the others: ", e.what()));
  }
}

}  // namespace strata::comm
