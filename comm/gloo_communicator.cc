#include "comm/gloo_communicator.h"

#include <atomic>
#include <chrono>
#include <csignal>
#include <cstring>
#include <deque>
#include <functional>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/mutex.h"
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

class WorkImpl final : public Work {
 public:
  absl::Status Wait() override {
    MutexLock lock(&mu_);
    while (!done_) cv_.Wait(&mu_);
    return status_;
  }
  bool WaitFor(std::chrono::milliseconds timeout) override {
    const auto until = std::chrono::steady_clock::now() + timeout;
    MutexLock lock(&mu_);
    while (!done_) {
      const auto left = until - std::chrono::steady_clock::now();
      if (left <= std::chrono::nanoseconds(0)) return false;
      cv_.WaitFor(&mu_, left);
    }
    return true;
  }
  bool done() const override {
    MutexLock lock(&mu_);
    return done_;
  }
  void Complete(absl::Status s) {
    {
      MutexLock lock(&mu_);
      status_ = std::move(s);
      done_ = true;
    }
    cv_.SignalAll();
  }

 private:
  mutable Mutex mu_;
  CondVar cv_;
  bool done_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status status_ ABSL_GUARDED_BY(mu_);
};

class GlooCommunicator final : public Communicator {
 public:
  GlooCommunicator(std::shared_ptr<gloo::Context> context, Duration timeout)
      : context_(std::move(context)), timeout_(timeout) {
    thread_ = std::thread([this] { Run(); });
  }
  ~GlooCommunicator() override {
    {
      MutexLock lock(&mu_);
      stopping_ = true;
    }
    cv_.SignalAll();
    thread_.join();
  }

  int rank() const override { return context_->rank; }
  int size() const override { return context_->size; }

  // The peers' collectives fail at once (the connections close). One of this rank's that waits for
  // a peer's bytes stays blocked until the timeout (Gloo's algorithms cannot be woken): later
  // collectives are refused at once rather than queued behind it, and the communicator must not
  // be destroyed before it ends (the destructor joins its thread).
  void Abort() override {
    aborted_.store(true);
    context_->closeConnections();
  }

  std::shared_ptr<Work> AllGather(absl::Span<const std::byte> in,
                                  absl::Span<std::byte> out) override {
    if (out.size() != in.size() * static_cast<size_t>(size())) {
      return Failed(absl::InvalidArgumentError(
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
      return Failed(absl::InvalidArgumentError(
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
      return Failed(absl::InvalidArgumentError(
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
  struct Task {
    std::string what;
    std::function<void()> run;
    std::shared_ptr<WorkImpl> work;
  };

  static std::shared_ptr<Work> Failed(absl::Status s) {
    auto w = std::make_shared<WorkImpl>();
    w->Complete(std::move(s));
    return w;
  }

  std::shared_ptr<Work> Issue(std::string what, std::function<void()> run) {
    if (aborted_.load()) {  // not queued behind a collective the abort left blocked
      return Failed(Aborted(what));
    }
    auto work = std::make_shared<WorkImpl>();
    {
      MutexLock lock(&mu_);
      queue_.push_back({std::move(what), std::move(run), work});
    }
    cv_.Signal();
    return work;
  }

  void Run() {
    while (true) {
      Task task;
      {
        MutexLock lock(&mu_);
        while (queue_.empty() && !stopping_) cv_.Wait(&mu_);
        if (queue_.empty()) return;
        task = std::move(queue_.front());
        queue_.pop_front();
      }
      if (broken_.ok() && aborted_.load()) broken_ = Aborted(task.what);
      if (!broken_.ok()) {
        task.work->Complete(broken_);
        continue;
      }
      absl::Status s;
      try {
        task.run();
      } catch (const gloo::IoException& e) {
        s = absl::UnavailableError(Describe(task.what, e.what()));
      } catch (const std::exception& e) {
        s = absl::InternalError(Describe(task.what, e.what()));
      }
      if (!s.ok()) {
        broken_ = absl::Status(
            s.code(), absl::StrCat(s.message(), " (the communicator is broken from here)"));
      }
      task.work->Complete(std::move(s));
    }
  }

  absl::Status Aborted(const std::string& what) const {
    return absl::CancelledError(
        absl::StrCat("rank ", rank(), " of ", size(), ": ", what,
                     ": the communicator was aborted (a wait for a collective was interrupted)"));
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
  Mutex mu_;
  CondVar cv_;
  std::deque<Task> queue_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status broken_;  // the collectives' thread only
  std::atomic<bool> aborted_{false};
  std::vector<float> ring_;  // RingReduceScatter's buffers (the collectives' thread only)
  std::unique_ptr<gloo::transport::UnboundBuffer> ring_buffer_;
  std::thread thread_;
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
  const std::string size = std::to_string(options.size);
  absl::Status s =
      store.Set(absl::StrCat(prefix, "size/", options.rank), {size.begin(), size.end()});
  if (!s.ok()) return s;
  auto zero = store.Get(absl::StrCat(prefix, "size/0"), options.timeout);
  if (!zero.ok()) return zero.status();
  const std::string zero_size(zero->begin(), zero->end());
  if (zero_size != size) {
    return absl::FailedPreconditionError(absl::StrCat("gloo: this rank (", options.rank,
                                                      ") was given world size ", options.size,
                                                      " but rank 0 was given ", zero_size,
                                                      ": WORLD_SIZE must be the same on every "
                                                      "rank"));
  }
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
