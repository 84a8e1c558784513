#include "comm/shm_communicator.h"

#include <fcntl.h>
#include <linux/futex.h>
#include <pthread.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cstdint>
#include <cstring>
#include <future>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "base/status.h"
#include "comm/in_order.h"

namespace strata::comm {
namespace {

using Clock = std::chrono::steady_clock;

constexpr uint64_t kMagic = 0x7374726174617368;  // "stratash"
constexpr size_t kPage = 4096;
constexpr int kSpins = 256;  // polls before sleeping on a counter
constexpr auto kLivenessEvery = std::chrono::milliseconds(100);

// What a rank is doing in a round: ranks must agree on it.
struct Desc {
  uint32_t op = 0;  // Op
  int32_t root = -1;
  uint64_t bytes = 0;  // the collective's bytes from each rank
};

enum Op : uint32_t { kAllGather = 1, kReduceScatter, kAllReduce, kBroadcast, kBarrier };

const char* OpName(uint32_t op) {
  switch (op) {
    case kAllGather:
      return "all-gather";
    case kReduceScatter:
      return "reduce-scatter";
    case kAllReduce:
      return "all-reduce";
    case kBroadcast:
      return "broadcast";
    case kBarrier:
      return "barrier";
    default:
      return "nothing known";
  }
}

std::string Describe(const Desc& d) {
  std::string s = absl::StrCat(OpName(d.op), " of ", d.bytes, " bytes");
  if (d.op == kBroadcast) absl::StrAppend(&s, " from rank ", d.root);
  return s;
}

// One rank's page of the segment.
struct alignas(kPage) RankControl {
  alignas(64) std::atomic<uint32_t> posted;    // the last round it wrote
  alignas(64) std::atomic<uint32_t> consumed;  // the last round it has read
  Desc desc[2];                                // each slot's round's, written before posting
  pthread_mutex_t alive;                       // held by its collectives' thread (robust)
};
static_assert(std::atomic<uint32_t>::is_always_lock_free, "a futex word");
static_assert(sizeof(std::atomic<uint32_t>) == sizeof(uint32_t), "a futex word");

struct alignas(kPage) Header {
  uint64_t magic;
  uint64_t token;
  uint32_t size;
  uint64_t slot_bytes;
  std::atomic<int32_t> aborted_by;  // 0, or 1 + the rank that aborted
};

// Whether counter value `v` has reached round `target` (both wrap at 2^32).
bool Reached(uint32_t v, uint32_t target) { return static_cast<int32_t>(v - target) >= 0; }

void FutexWake(std::atomic<uint32_t>* word) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

// Sleeps while *word == seen, at most `for_time` (woken early by FutexWake or a signal).
void FutexWait(std::atomic<uint32_t>* word, uint32_t seen, std::chrono::nanoseconds for_time) {
  timespec ts{};
  ts.tv_sec = static_cast<time_t>(for_time.count() / 1000000000);
  ts.tv_nsec = static_cast<long>(for_time.count() % 1000000000);  // NOLINT(runtime/int)
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT, seen, &ts, nullptr, 0);
}

// 16 MiB a segment over the ranks' two slots, from 64 KiB to 4 MiB a slot, and at least a page a
// rank (a reduce-scatter's round holds a piece for each): the job's two segments fit the 64 MiB
// /dev/shm of a container's default up to 63 ranks (16 MiB and a page a rank each up to 45).
size_t DefaultSlotBytes(int size) {
  const size_t share = (size_t{16} << 20) / (2 * static_cast<size_t>(size));
  return std::max(std::clamp<size_t>(share / kPage * kPage, size_t{64} << 10, size_t{4} << 20),
                  kPage * static_cast<size_t>(size));
}

// memcpy (memmove where `may_overlap`) of `n` bytes; nothing when n is 0, where an empty
// collective's pointers may be null (which memcpy may not be handed).
void Copy(void* to, const void* from, size_t n, bool may_overlap = false) {
  if (n == 0) return;
  if (may_overlap) {
    std::memmove(to, from, n);
  } else {
    std::memcpy(to, from, n);
  }
}

// The rounds a collective of `n` elements takes at `per_round` a round: at least one, so that
// ranks whose collectives differ meet and are named even where one of them moves nothing.
size_t Rounds(size_t n, size_t per_round) {
  return std::max<size_t>(1, (n + per_round - 1) / per_round);
}

uint64_t RandomWord() {
  std::random_device device;
  return (static_cast<uint64_t>(device()) << 32) ^ device();
}

// The mapped segment (its file descriptor already closed): unmapped when dropped.
class Segment {
 public:
  Segment(void* base, size_t bytes) : base_(base), bytes_(bytes) {}
  ~Segment() {
    if (base_ != nullptr) munmap(base_, bytes_);
  }
  Segment(const Segment&) = delete;
  Segment& operator=(const Segment&) = delete;
  std::byte* base() const { return static_cast<std::byte*>(base_); }

 private:
  void* base_;
  size_t bytes_;
};

size_t SegmentBytes(int size, size_t slot_bytes) {
  return sizeof(Header) + static_cast<size_t>(size) * (sizeof(RankControl) + 2 * slot_bytes);
}

// Rank 0's: a new segment under `name`, its room reserved, its header and controls set.
absl::StatusOr<std::unique_ptr<Segment>> MakeSegment(const std::string& name, int size,
                                                     size_t slot_bytes, uint64_t token) {
  const size_t bytes = SegmentBytes(size, slot_bytes);
  const int fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  if (fd < 0) return ErrnoStatus(errno, "shm_open", name);
  // Reserved now: a /dev/shm without room is an error here, not a SIGBUS at the first write.
  if (int e = posix_fallocate(fd, 0, static_cast<off_t>(bytes)); e != 0) {
    close(fd);
    shm_unlink(name.c_str());
    return ErrnoStatus(e, "posix_fallocate (room for the ranks' slots)", name, 0, bytes);
  }
  void* base = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  const int mmap_errno = errno;
  close(fd);
  if (base == MAP_FAILED) {
    shm_unlink(name.c_str());
    return ErrnoStatus(mmap_errno, "mmap", name, 0, bytes);
  }
  auto segment = std::make_unique<Segment>(base, bytes);
  auto* header = new (segment->base()) Header{};
  header->magic = kMagic;
  header->token = token;
  header->size = static_cast<uint32_t>(size);
  header->slot_bytes = slot_bytes;
  header->aborted_by.store(0);
  pthread_mutexattr_t attr;
  pthread_mutexattr_init(&attr);
  pthread_mutexattr_setpshared(&attr, PTHREAD_PROCESS_SHARED);
  pthread_mutexattr_setrobust(&attr, PTHREAD_MUTEX_ROBUST);
  for (int r = 0; r < size; ++r) {
    auto* control = new (segment->base() + sizeof(Header) + r * sizeof(RankControl)) RankControl;
    control->posted.store(0);
    control->consumed.store(0);
    pthread_mutex_init(&control->alive, &attr);
  }
  pthread_mutexattr_destroy(&attr);
  return segment;
}

// Another rank's: rank 0's segment under `name`, checked to be the one `token` names.
absl::StatusOr<std::unique_ptr<Segment>> MapSegment(const std::string& name, int size,
                                                    size_t slot_bytes, uint64_t token) {
  const size_t bytes = SegmentBytes(size, slot_bytes);
  const int fd = shm_open(name.c_str(), O_RDWR, 0);
  if (fd < 0) return ErrnoStatus(errno, "shm_open (rank 0's segment)", name);
  struct stat st {};
  if (fstat(fd, &st) != 0 || static_cast<size_t>(st.st_size) != bytes) {
    close(fd);
    return absl::FailedPreconditionError(
        absl::StrCat(name, ": ", st.st_size, " bytes, where ", bytes, " were expected"));
  }
  void* base = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  const int mmap_errno = errno;
  close(fd);
  if (base == MAP_FAILED) return ErrnoStatus(mmap_errno, "mmap", name, 0, bytes);
  auto segment = std::make_unique<Segment>(base, bytes);
  const auto* header = reinterpret_cast<const Header*>(segment->base());
  if (header->magic != kMagic || header->token != token ||
      header->size != static_cast<uint32_t>(size) || header->slot_bytes != slot_bytes) {
    return absl::FailedPreconditionError(
        absl::StrCat(name, " is not the segment rank 0 made (another IPC namespace?)"));
  }
  return segment;
}

class ShmCommunicator final : public Communicator {
 public:
  ShmCommunicator(std::unique_ptr<Segment> segment, int rank, int size, size_t slot_bytes,
                  Duration timeout)
      : segment_(std::move(segment)),
        rank_(rank),
        size_(size),
        slot_bytes_(slot_bytes),
        timeout_(timeout),
        in_order_(
            absl::StrCat("rank ", rank, " of ", size),
            [this] {
              pthread_mutex_lock(&Control(rank_).alive);
              holding_.set_value();
            },
            [this] { pthread_mutex_unlock(&Control(rank_).alive); }) {}

  int rank() const override { return rank_; }
  int size() const override { return size_; }

  // Returns once its thread holds its mutex: a peer's look sees it alive from then on.
  void WaitHolding() { held_.wait(); }

  void Abort() override {
    in_order_.Abort();
    int32_t none = 0;
    header()->aborted_by.compare_exchange_strong(none, rank_ + 1);
    for (int j = 0; j < size_; ++j) {  // every waiter, here and in the other ranks, looks again
      FutexWake(&Control(j).posted);
      FutexWake(&Control(j).consumed);
    }
  }

  std::shared_ptr<Work> AllGather(absl::Span<const std::byte> in,
                                  absl::Span<std::byte> out) override {
    if (out.size() != in.size() * static_cast<size_t>(size_)) {
      return FailedWork(absl::InvalidArgumentError(
          absl::StrCat("all-gather: the output holds ", out.size(), " bytes; accepted: size (",
                       size_, ") x the input's ", in.size())));
    }
    const Desc desc{kAllGather, -1, in.size()};
    return in_order_.Issue("all-gather", [this, in, out, desc] {
      const size_t n = in.size();
      Copy(out.data() + rank_ * n, in.data(), n, /*may_overlap=*/true);
      for (size_t r = 0, rounds = Rounds(n, slot_bytes_); r < rounds; ++r) {
        const size_t at = r * slot_bytes_, piece = std::min(slot_bytes_, n - at);
        STRATA_RETURN_IF_ERROR(Round(
            desc, [&](std::byte* slot) { Copy(slot, in.data() + at, piece); },
            [&](int j, const std::byte* slot) {
              if (j != rank_) Copy(out.data() + j * n + at, slot, piece);
            }));
      }
      return absl::OkStatus();
    });
  }

  std::shared_ptr<Work> ReduceScatter(absl::Span<const float> in, absl::Span<float> out) override {
    if (in.size() != out.size() * static_cast<size_t>(size_)) {
      return FailedWork(absl::InvalidArgumentError(
          absl::StrCat("reduce-scatter: the input holds ", in.size(), " floats; accepted: size (",
                       size_, ") x the output's ", out.size())));
    }
    const Desc desc{kReduceScatter, -1, in.size() * sizeof(float)};
    return in_order_.Issue("reduce-scatter", [this, in, out, desc] {
      // Each round: every rank's piece of each shard; this rank sums the pieces of its own.
      const size_t m = out.size();
      const size_t per_round = slot_bytes_ / sizeof(float) / size_;
      for (size_t r = 0, rounds = Rounds(m, per_round); r < rounds; ++r) {
        const size_t at = r * per_round, piece = std::min(per_round, m - at);
        STRATA_RETURN_IF_ERROR(Round(
            desc,
            [&](std::byte* slot) {
              for (int d = 0; d < size_; ++d) {
                Copy(slot + d * piece * sizeof(float), in.data() + d * m + at,
                     piece * sizeof(float));
              }
            },
            [&](int j, const std::byte* slot) {
              Accumulate(j, reinterpret_cast<const float*>(slot) + rank_ * piece, out.data() + at,
                         piece);
            }));
      }
      return absl::OkStatus();
    });
  }

  std::shared_ptr<Work> AllReduce(absl::Span<float> data) override {
    const Desc desc{kAllReduce, -1, data.size() * sizeof(float)};
    return in_order_.Issue("all-reduce", [this, data, desc] {
      const size_t m = data.size(), per_round = slot_bytes_ / sizeof(float);
      for (size_t r = 0, rounds = Rounds(m, per_round); r < rounds; ++r) {
        const size_t at = r * per_round, piece = std::min(per_round, m - at);
        // This rank's piece is read back from its slot: data is overwritten by the sum.
        STRATA_RETURN_IF_ERROR(Round(
            desc, [&](std::byte* slot) { Copy(slot, data.data() + at, piece * sizeof(float)); },
            [&](int j, const std::byte* slot) {
              Accumulate(j, reinterpret_cast<const float*>(slot), data.data() + at, piece);
            }));
      }
      return absl::OkStatus();
    });
  }

  std::shared_ptr<Work> Broadcast(absl::Span<std::byte> data, int root) override {
    if (root < 0 || root >= size_) {
      return FailedWork(absl::InvalidArgumentError(
          absl::StrCat("broadcast: root ", root, "; accepted: 0..", size_ - 1)));
    }
    const Desc desc{kBroadcast, root, data.size()};
    return in_order_.Issue("broadcast", [this, data, root, desc] {
      for (size_t r = 0, rounds = Rounds(data.size(), slot_bytes_); r < rounds; ++r) {
        const size_t at = r * slot_bytes_, piece = std::min(slot_bytes_, data.size() - at);
        STRATA_RETURN_IF_ERROR(Round(
            desc,
            [&](std::byte* slot) {
              if (rank_ == root) Copy(slot, data.data() + at, piece);
            },
            [&](int j, const std::byte* slot) {
              if (j == root && rank_ != root) Copy(data.data() + at, slot, piece);
            }));
      }
      return absl::OkStatus();
    });
  }

  std::shared_ptr<Work> Barrier() override {
    return in_order_.Issue("barrier", [this] {
      return Round(
          Desc{kBarrier, -1, 0}, [](std::byte*) {}, [](int, const std::byte*) {});
    });
  }

 private:
  Header* header() const { return reinterpret_cast<Header*>(segment_->base()); }
  RankControl& Control(int j) const {
    return *reinterpret_cast<RankControl*>(segment_->base() + sizeof(Header) +
                                           j * sizeof(RankControl));
  }
  std::byte* Slot(int j, uint32_t round) const {
    return segment_->base() + sizeof(Header) + size_ * sizeof(RankControl) +
           (2 * static_cast<size_t>(j) + (round & 1)) * slot_bytes_;
  }

  // out = the sum of the pieces in rank order: rank 0's copied, each later one's added.
  static void Accumulate(int j, const float* piece, float* out, size_t n) {
    if (j == 0) {
      Copy(out, piece, n * sizeof(float));
    } else {
      for (size_t i = 0; i < n; ++i) out[i] += piece[i];
    }
  }

  // One round (the collectives' thread only): `write` fills this rank's slot, and once every
  // rank has posted the round `read` is handed each rank's slot, in rank order.
  absl::Status Round(const Desc& desc, absl::FunctionRef<void(std::byte*)> write,
                     absl::FunctionRef<void(int, const std::byte*)> read) {
    const char* what = OpName(desc.op);
    // Aborted by a rank, which may have posted this round before it did: nothing more is read.
    STRATA_RETURN_IF_ERROR(CheckAborted(what));
    const uint32_t round = ++round_;
    // This slot was last written two rounds ago: every rank has read it before it is written.
    STRATA_RETURN_IF_ERROR(WaitForAll(&RankControl::consumed, round - 2, what, "read"));
    RankControl& mine = Control(rank_);
    mine.desc[round & 1] = desc;
    write(Slot(rank_, round));
    mine.posted.store(round, std::memory_order_release);
    FutexWake(&mine.posted);
    STRATA_RETURN_IF_ERROR(WaitForAll(&RankControl::posted, round, what, "issued"));
    for (int j = 0; j < size_; ++j) {
      const Desc& theirs = Control(j).desc[round & 1];
      if (theirs.op != desc.op || theirs.root != desc.root || theirs.bytes != desc.bytes) {
        return absl::InvalidArgumentError(
            absl::StrCat("rank ", rank_, " of ", size_, ": ", Describe(desc), ": rank ", j,
                         " issued ", Describe(theirs),
                         " in its place: every rank must issue the same collectives, of "
                         "the same sizes, in the same order"));
      }
    }
    for (int j = 0; j < size_; ++j) read(j, Slot(j, round));
    mine.consumed.store(round, std::memory_order_release);
    FutexWake(&mine.consumed);
    return absl::OkStatus();
  }

  // Waits until every rank's `counter` has reached `round`: spins a little, then sleeps on it,
  // looking every kLivenessEvery whether the rank waited for is still there.
  absl::Status WaitForAll(std::atomic<uint32_t> RankControl::*counter, uint32_t round,
                          const char* what, const char* done) {
    const auto deadline = Clock::now() + timeout_;
    for (int j = 0; j < size_; ++j) {
      std::atomic<uint32_t>& word = Control(j).*counter;
      int polls = 0;
      auto next_look = Clock::now() + kLivenessEvery;
      while (true) {
        const uint32_t seen = word.load(std::memory_order_acquire);
        if (Reached(seen, round)) break;
        STRATA_RETURN_IF_ERROR(CheckAborted(what));
        if (++polls < kSpins) continue;
        const auto now = Clock::now();
        if (now >= deadline) {
          return absl::DeadlineExceededError(absl::StrCat(
              "rank ", rank_, " of ", size_, ": ", what, " failed: rank ", j, " had not ", done,
              " its part within the timeout (", timeout_.count(),
              " ms; a rank stopped answering, or the ranks issued different collectives?)"));
        }
        if (now >= next_look) {
          STRATA_RETURN_IF_ERROR(CheckAlive(j, what));
          next_look = now + kLivenessEvery;
        }
        FutexWait(&word, seen, std::min(next_look, deadline) - now);
      }
    }
    return absl::OkStatus();
  }

  absl::Status CheckAborted(const char* what) const {
    const int32_t by = header()->aborted_by.load(std::memory_order_acquire);
    if (by == 0) return absl::OkStatus();
    if (by - 1 == rank_) return in_order_.Aborted(what);
    return absl::UnavailableError(absl::StrCat("rank ", rank_, " of ", size_, ": ", what,
                                               " failed: rank ", by - 1,
                                               " aborted its collectives"));
  }

  // Whether rank j's collectives thread still holds its mutex: the kernel hands a robust mutex
  // whose holder died to the next taker, marked EOWNERDEAD; one free means its communicator ended.
  absl::Status CheckAlive(int j, const char* what) {
    pthread_mutex_t* alive = &Control(j).alive;
    const int e = pthread_mutex_trylock(alive);
    if (e == EBUSY) return absl::OkStatus();
    if (e == 0 || e == EOWNERDEAD) {
      // Left unrecoverable (not marked consistent): every later look, here or by another rank,
      // fails (ENOTRECOVERABLE).
      pthread_mutex_unlock(alive);
    }
    return absl::UnavailableError(
        absl::StrCat("rank ", rank_, " of ", size_, ": ", what, " failed: rank ", j, " ",
                     e == 0 ? "closed its communicator" : "has died (its process ended)",
                     " in the middle of the collectives"));
  }

  std::unique_ptr<Segment> segment_;
  const int rank_, size_;
  const size_t slot_bytes_;
  const Duration timeout_;
  uint32_t round_ = 0;  // the collectives' thread only
  std::promise<void> holding_;
  std::future<void> held_ = holding_.get_future();
  InOrder in_order_;  // last: its thread, joined first, uses the members above
};

// Every rank's outcome of mapping the segment: OK when all mapped it, else the first that did
// not, named (the same on every rank).
absl::Status AgreeOnMapping(TcpStore& store, const std::string& prefix, int rank, int size,
                            const absl::Status& mine, Duration timeout) {
  auto all = Exchange(store, prefix + "mapped/", rank, size,
                      mine.ok() ? "ok" : std::string(mine.message()), timeout);
  if (!all.ok()) return all.status();
  for (int j = 0; j < size; ++j) {
    if ((*all)[j] != "ok") {
      return absl::FailedPreconditionError(absl::StrCat("shared memory between ranks: rank ", j,
                                                        " could not ", j == 0 ? "make" : "map",
                                                        " the segment: ", (*all)[j]));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<Communicator>> CreateShmCommunicator(TcpStore& store,
                                                                    const ShmOptions& options) {
  const int rank = options.rank, size = options.size;
  if (size < 1 || rank < 0 || rank >= size) {
    return absl::InvalidArgumentError(absl::StrCat("shared memory between ranks: rank ", rank,
                                                   " of world size ", size,
                                                   "; accepted: 0 <= rank < size"));
  }
  const size_t slot_bytes = options.slot_bytes == 0 ? DefaultSlotBytes(size) : options.slot_bytes;
  if (slot_bytes < kPage * static_cast<size_t>(size) || slot_bytes % 64 != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("shared memory between ranks: slot_bytes ", slot_bytes,
                     "; accepted: 0 (the default) or a multiple of 64 bytes, 4096 x size (",
                     kPage * size, ") and up"));
  }
  const std::string prefix = options.prefix + "/";
  STRATA_RETURN_IF_ERROR(
      AgreeOnWorldSize(store, prefix, rank, size, options.timeout, "shared memory between ranks"));
  absl::StatusOr<std::unique_ptr<Segment>> segment;
  std::string name;
  if (rank == 0) {
    const uint64_t token = RandomWord();
    name = absl::StrCat("/strata-", getpid(), "-", absl::Hex(RandomWord()));
    segment = MakeSegment(name, size, slot_bytes, token);
    const std::string said = segment.ok() ? absl::StrCat(name, " ", token)
                                          : absl::StrCat("! ", segment.status().message());
    if (absl::Status s = store.Set(prefix + "segment", {said.begin(), said.end()}); !s.ok()) {
      if (segment.ok()) shm_unlink(name.c_str());
      return s;
    }
  } else {
    auto said = store.Get(prefix + "segment", options.timeout);
    if (!said.ok()) return said.status();
    const std::string text(said->begin(), said->end());
    std::vector<std::string> parts = absl::StrSplit(text, ' ');
    uint64_t token = 0;
    if (text.rfind("! ", 0) == 0) {
      segment = absl::FailedPreconditionError(text.substr(2));  // rank 0 made none: said below
    } else if (parts.size() != 2 || !absl::SimpleAtoi(parts[1], &token)) {
      segment = absl::InternalError(absl::StrCat("rank 0 published \"", text, "\""));
    } else {
      name = parts[0];
      segment = MapSegment(name, size, slot_bytes, token);
    }
  }
  // Every rank has opened it (or failed to) once all have said so: it is unlinked then, by every
  // rank that has it (rank 0 gone, another still does), and lives on while mapped.
  absl::Status agreed =
      AgreeOnMapping(store, prefix, rank, size, segment.status(), options.timeout);
  if (segment.ok()) shm_unlink(name.c_str());  // (ENOENT where another rank was first)
  STRATA_RETURN_IF_ERROR(agreed);
  auto comm = std::make_unique<ShmCommunicator>(*std::move(segment), rank, size, slot_bytes,
                                                options.timeout);
  comm->WaitHolding();
  // The others' threads hold theirs before any collective looks (a free mutex reads as ended).
  auto ready = Exchange(store, prefix + "ready/", rank, size, "ready", options.timeout);
  if (!ready.ok()) return ready.status();
  return std::unique_ptr<Communicator>(std::move(comm));
}

}  // namespace strata::comm
