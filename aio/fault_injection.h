// aio/fault_injection.h: a Backend that wraps another and injects faults, seeded and reproducible.
//
// Faults: an error result (-EIO, -ENOSPC, -EAGAIN, -EINTR, any errno) instead of the transfer (the
// op never reaches the file, so nothing outside the failed request is touched); a short transfer
// (the op runs whole but reports fewer bytes, so the engine must resubmit the rest); added latency
// (the submitting worker sleeps before handing the op on). Rules select ops by kind and file
// offset, can let the first `skip` matching ops through and stop after `max_hits`.
//
// The decisions come from one seeded generator shared by all the backends a FaultInjector wraps,
// so a run with one worker thread is reproducible op for op; with several, the interleaving of the
// workers decides which op meets which draw.
//
// Thread safety: a FaultInjectingBackend is a Backend (one thread); the FaultInjector it shares is
// thread-safe.
#ifndef STRATA_AIO_FAULT_INJECTION_H_
#define STRATA_AIO_FAULT_INJECTION_H_

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <optional>
#include <random>
#include <vector>

#include "aio/backend.h"
#include "base/mutex.h"

namespace strata::aio {

struct FaultRule {
  enum class Kind { kError, kShortTransfer, kLatency };
  Kind kind = Kind::kError;
  int error = 5;                         // EIO; for kError.
  std::chrono::microseconds latency{0};  // for kLatency.
  double probability = 1.0;
  std::optional<OpKind> only;  // Reads or writes only.
  // Ops overlapping [offset_begin, offset_end) of the file.
  uint64_t offset_begin = 0;
  uint64_t offset_end = std::numeric_limits<uint64_t>::max();
  uint64_t skip = 0;  // Matching ops let through before the rule may fire.
  uint64_t max_hits = std::numeric_limits<uint64_t>::max();

  static FaultRule Error(int error_number) {
    FaultRule r;
    r.error = error_number;
    return r;
  }
  static FaultRule Short() {
    FaultRule r;
    r.kind = Kind::kShortTransfer;
    return r;
  }
  static FaultRule Latency(std::chrono::microseconds us) {
    FaultRule r;
    r.kind = Kind::kLatency;
    r.latency = us;
    return r;
  }
};

// The shared state of a fault plan: rules, the seeded generator, per-rule counters.
class FaultInjector {
 public:
  FaultInjector(uint64_t seed, std::vector<FaultRule> rules);

  // Wraps `inner`; the result consults this injector. The injector must outlive it (the wrapper
  // holds a shared_ptr).
  static std::unique_ptr<Backend> Wrap(std::shared_ptr<FaultInjector> injector,
                                       std::unique_ptr<Backend> inner);

  // A function for EngineOptions::wrap_backend that wraps every worker's backend.
  static std::function<std::unique_ptr<Backend>(std::unique_ptr<Backend>, int)> ForEngine(
      std::shared_ptr<FaultInjector> injector);

  // Disarmed, no rule matches or counts (tests arm the faults for the part they exercise).
  void Arm(bool armed) { armed_.store(armed); }

  uint64_t hits(size_t rule) const;  // Times rule `rule` fired.
  uint64_t total_hits() const;

  struct Decision {
    int error = 0;              // != 0: fail the op with -error.
    uint32_t short_length = 0;  // != 0: report this many bytes instead.
    std::chrono::microseconds latency{0};
  };
  Decision Decide(const Op& op);

 private:
  std::atomic<bool> armed_{true};
  mutable Mutex mu_;
  std::mt19937_64 rng_ ABSL_GUARDED_BY(mu_);
  std::vector<FaultRule> rules_;
  std::vector<uint64_t> matched_ ABSL_GUARDED_BY(mu_);
  std::vector<uint64_t> hits_ ABSL_GUARDED_BY(mu_);
};

}  // namespace strata::aio

#endif  // STRATA_AIO_FAULT_INJECTION_H_
