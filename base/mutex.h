// base/mutex.h: strata::Mutex, MutexLock and CondVar.
//
// Why not absl::Mutex: Debian's prebuilt Abseil is not built with ThreadSanitizer, so the
// happens-before edges of absl::Mutex are invisible to TSan and every access it guards is reported
// as a race (checked here: a counter incremented under absl::MutexLock from two threads). These
// wrappers sit on std::mutex, which TSan intercepts, and keep Abseil's thread-safety annotations
// (ABSL_GUARDED_BY, ABSL_EXCLUSIVE_LOCKS_REQUIRED) so clang's analysis still checks the locking.
//
// Thread safety: these are the synchronization primitives; all methods are safe from any thread.
#ifndef STRATA_BASE_MUTEX_H_
#define STRATA_BASE_MUTEX_H_

#include <chrono>
#include <condition_variable>
#include <mutex>

#include "absl/base/thread_annotations.h"

namespace strata {

class ABSL_LOCKABLE Mutex {
 public:
  Mutex() = default;
  Mutex(const Mutex&) = delete;
  Mutex& operator=(const Mutex&) = delete;

  void Lock() ABSL_EXCLUSIVE_LOCK_FUNCTION() { mu_.lock(); }
  void Unlock() ABSL_UNLOCK_FUNCTION() { mu_.unlock(); }
  bool TryLock() ABSL_EXCLUSIVE_TRYLOCK_FUNCTION(true) { return mu_.try_lock(); }
  void AssertHeld() const ABSL_ASSERT_EXCLUSIVE_LOCK() {}

 private:
  friend class CondVar;
  std::mutex mu_;
};

class ABSL_SCOPED_LOCKABLE MutexLock {
 public:
  explicit MutexLock(Mutex* mu) ABSL_EXCLUSIVE_LOCK_FUNCTION(mu) : mu_(mu) { mu_->Lock(); }
  ~MutexLock() ABSL_UNLOCK_FUNCTION() { mu_->Unlock(); }
  MutexLock(const MutexLock&) = delete;
  MutexLock& operator=(const MutexLock&) = delete;

 private:
  Mutex* const mu_;
};

// A condition variable used with a held strata::Mutex. Always wait in a loop on a predicate.
class CondVar {
 public:
  void Wait(Mutex* mu) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    std::unique_lock<std::mutex> lock(mu->mu_, std::adopt_lock);
    cv_.wait(lock);
    lock.release();
  }
  // Returns false on timeout.
  bool WaitFor(Mutex* mu, std::chrono::nanoseconds timeout) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    std::unique_lock<std::mutex> lock(mu->mu_, std::adopt_lock);
    const bool signalled = cv_.wait_for(lock, timeout) == std::cv_status::no_timeout;
    lock.release();
    return signalled;
  }
  void Signal() { cv_.notify_one(); }
  void SignalAll() { cv_.notify_all(); }

 private:
  std::condition_variable cv_;
};

}  // namespace strata

#endif  // STRATA_BASE_MUTEX_H_
