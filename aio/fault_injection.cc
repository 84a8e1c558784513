#include "aio/fault_injection.h"

#include <thread>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"

namespace strata::aio {
namespace {

class FaultInjectingBackend final : public Backend {
 public:
  FaultInjectingBackend(std::shared_ptr<FaultInjector> injector, std::unique_ptr<Backend> inner)
      : injector_(std::move(injector)),
        inner_(std::move(inner)),
        name_(absl::StrCat("faulty ", inner_->name())) {}

  absl::string_view name() const override { return name_; }

  absl::Status Submit(absl::Span<const Op> ops) override {
    std::vector<Op> forward;
    forward.reserve(ops.size());
    for (const Op& op : ops) {
      const FaultInjector::Decision d = injector_->Decide(op);
      if (d.latency.count() > 0) std::this_thread::sleep_for(d.latency);
      if (d.error != 0) {
        synthesized_.push_back(OpResult{op.tag, -static_cast<int64_t>(d.error)});
        continue;
      }
      if (d.short_length != 0) shortened_[op.tag] = d.short_length;
      forward.push_back(op);
    }
    if (forward.empty()) return absl::OkStatus();
    absl::Status s = inner_->Submit(forward);
    if (s.ok()) inner_in_flight_ += forward.size();
    return s;
  }

  absl::StatusOr<size_t> Reap(absl::Span<OpResult> out, size_t min_results) override {
    size_t n = 0;
    while (n < out.size() && !synthesized_.empty()) {
      out[n++] = synthesized_.back();
      synthesized_.pop_back();
    }
    if (n == out.size() || inner_in_flight_ == 0) return n;
    const size_t inner_min = min_results > n ? std::min(min_results - n, inner_in_flight_) : 0;
    absl::StatusOr<size_t> got = inner_->Reap(out.subspan(n), inner_min);
    if (!got.ok()) return got.status();
    inner_in_flight_ -= *got;
    for (size_t i = n; i < n + *got; ++i) {
      auto it = shortened_.find(out[i].tag);
      if (it == shortened_.end()) continue;
      if (out[i].result > static_cast<int64_t>(it->second)) out[i].result = it->second;
      shortened_.erase(it);
    }
    return n + *got;
  }

  absl::Status RegisterBufferTable(int count) override {
    return inner_->RegisterBufferTable(count);
  }
  absl::Status UpdateBuffer(int index, iovec iov) override {
    return inner_->UpdateBuffer(index, iov);
  }
  absl::Status RegisterFileTable(int count) override { return inner_->RegisterFileTable(count); }
  absl::Status UpdateFile(int slot, int fd) override { return inner_->UpdateFile(slot, fd); }

 private:
  std::shared_ptr<FaultInjector> injector_;
  std::unique_ptr<Backend> inner_;
  std::string name_;
  std::vector<OpResult> synthesized_;
  absl::flat_hash_map<uint64_t, uint32_t> shortened_;
  size_t inner_in_flight_ = 0;
};

}  // namespace

FaultInjector::FaultInjector(uint64_t seed, std::vector<FaultRule> rules)
    : rng_(seed), rules_(std::move(rules)), matched_(rules_.size()), hits_(rules_.size()) {}

std::unique_ptr<Backend> FaultInjector::Wrap(std::shared_ptr<FaultInjector> injector,
                                             std::unique_ptr<Backend> inner) {
  return std::make_unique<FaultInjectingBackend>(std::move(injector), std::move(inner));
}

std::function<std::unique_ptr<Backend>(std::unique_ptr<Backend>, int)> FaultInjector::ForEngine(
    std::shared_ptr<FaultInjector> injector) {
  return
      [injector](std::unique_ptr<Backend> inner, int) { return Wrap(injector, std::move(inner)); };
}

uint64_t FaultInjector::hits(size_t rule) const {
  MutexLock lock(&mu_);
  return hits_.at(rule);
}

uint64_t FaultInjector::total_hits() const {
  MutexLock lock(&mu_);
  uint64_t total = 0;
  for (uint64_t h : hits_) total += h;
  return total;
}

FaultInjector::Decision FaultInjector::Decide(const Op& op) {
  Decision d;
  if (!armed_.load()) return d;
  MutexLock lock(&mu_);
  for (size_t i = 0; i < rules_.size(); ++i) {
    const FaultRule& r = rules_[i];
    if (r.only && *r.only != op.kind) continue;
    if (op.offset + op.length <= r.offset_begin || op.offset >= r.offset_end) continue;
    if (++matched_[i] <= r.skip || hits_[i] >= r.max_hits) continue;
    if (r.probability < 1.0 &&
        std::uniform_real_distribution<double>(0, 1)(rng_) >= r.probability) {
      continue;
    }
    switch (r.kind) {
      case FaultRule::Kind::kLatency:
        ++hits_[i];
        d.latency += r.latency;
        break;
      case FaultRule::Kind::kShortTransfer:
        if (op.length < 2 || d.short_length != 0) break;
        ++hits_[i];
        d.short_length = std::uniform_int_distribution<uint32_t>(1, op.length - 1)(rng_);
        break;
      case FaultRule::Kind::kError:
        ++hits_[i];
        d.error = r.error;
        return d;  // An error ends the decision: the op never runs.
    }
  }
  return d;
}

}  // namespace strata::aio
