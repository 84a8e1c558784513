// The pipelined NVMe optimizer step against the same step in memory: bitwise equal, over several
// steps and partition sizes that are not multiples of the block size; a step that fails (a read, a
// write-back, the commit, the staging buffer) changes nothing, param copies included, and its
// retry matches a clean step; buffers stay within their count; and the order of the backend's ops
// against the optimizer's steps shows the pipeline (a serial step fails those checks).
#include "swap/optimizer_swapper.h"

#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <functional>
#include <limits>
#include <random>
#include <set>
#include <string>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_join.h"
#include "aio/backend.h"
#include "base/mutex.h"
#include "base/status.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/aio/test_util.h"

namespace strata::swap {
namespace {

using ::strata::testing::ScratchDir;
using ::testing::HasSubstr;
using ::testing::Not;

// What happened, in order: an op the engine handed to a backend, or one of the swapper's
// StepEvents.
struct Entry {
  bool io = false;
  aio::OpKind kind = aio::OpKind::kRead;       // io
  bool data_file = false;                      // io: an op on one of the store's swap files
  uint64_t offset = 0, length = 0;             // io
  StepEvent event = StepEvent::kReadLaunched;  // !io
  tiering::PartitionId id = 0;                 // !io
  bool Is(StepEvent e, tiering::PartitionId p) const { return !io && event == e && id == p; }
};

// The shared record of a run, and the one fault it may inject: `fault` sees each op (and what
// came before it) as it is submitted and returns an errno to fail it with, or 0; it fires once
// (`once`), or until it is replaced.
class Trace {
 public:
  using Fault = std::function<int(const Entry& op, const std::vector<Entry>& before)>;
  void SetFault(Fault f, bool once = true) {
    MutexLock lock(&mu_);
    fault_ = std::move(f);
    once_ = once;
  }
  // Records `e`; for an op, returns the errno to fail it with (0: none).
  int Add(const Entry& e) {
    MutexLock lock(&mu_);
    int error = 0;
    if (e.io && fault_) {
      error = fault_(e, entries_);
      if (error != 0 && once_) fault_ = nullptr;
    }
    entries_.push_back(e);
    cv_.SignalAll();
    return error;
  }
  // Waits until `done` holds. A correct swapper always gets there (the waits below are for what
  // it has announced); one that does not is stopped after a minute and recorded as `stuck`.
  void WaitUntil(const std::function<bool(const std::vector<Entry>&)>& done,
                 const std::string& what) {
    MutexLock lock(&mu_);
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::minutes(1);
    while (!done(entries_)) {
      if (!cv_.WaitFor(&mu_, deadline - std::chrono::steady_clock::now())) {
        stuck_.push_back(what);
        return;
      }
    }
  }
  std::vector<Entry> entries() const {
    MutexLock lock(&mu_);
    return entries_;
  }
  std::vector<std::string> stuck() const {
    MutexLock lock(&mu_);
    return stuck_;
  }
  void Clear() {
    MutexLock lock(&mu_);
    entries_.clear();
  }

 private:
  mutable Mutex mu_;
  CondVar cv_;
  std::vector<Entry> entries_ ABSL_GUARDED_BY(mu_);
  std::vector<std::string> stuck_ ABSL_GUARDED_BY(mu_);
  Fault fault_ ABSL_GUARDED_BY(mu_);
  bool once_ ABSL_GUARDED_BY(mu_) = true;
};

bool Any(const std::vector<Entry>& entries, StepEvent e, tiering::PartitionId id) {
  return std::any_of(entries.begin(), entries.end(), [&](const Entry& x) { return x.Is(e, id); });
}

// Whether an op touches one of `extents` (the store in these tests has one swap file).
bool Overlaps(const Entry& op, const std::vector<tiering::StoreExtent>& extents) {
  return std::any_of(extents.begin(), extents.end(), [&](const tiering::StoreExtent& e) {
    return op.offset < e.offset + e.length && e.offset < op.offset + op.length;
  });
}

// A backend that records every op it is given in a Trace (the file it names, from the fd) and
// fails the op the Trace's fault picks, with a result synthesized here (the op never reaches the
// file). It never blocks: an engine worker that waited here would hold up every op queued to it.
class RecordingBackend : public aio::Backend {
 public:
  RecordingBackend(std::unique_ptr<aio::Backend> inner, std::shared_ptr<Trace> trace)
      : inner_(std::move(inner)), trace_(std::move(trace)) {}
  absl::string_view name() const override { return inner_->name(); }
  absl::Status Submit(absl::Span<const aio::Op> ops) override {
    std::vector<aio::Op> forward;
    std::vector<aio::OpResult> failed;
    for (const aio::Op& op : ops) {
      std::error_code ec;
      const std::string file =
          std::filesystem::read_symlink("/proc/self/fd/" + std::to_string(op.fd), ec)
              .filename()
              .string();
      Entry e;
      e.io = true;
      e.kind = op.kind;
      e.data_file = absl::StartsWith(file, "swap-");
      e.offset = op.offset;
      e.length = op.length;
      if (const int error = trace_->Add(e); error != 0) {
        failed.push_back({op.tag, -error});
      } else {
        forward.push_back(op);
      }
    }
    if (!forward.empty()) {
      STRATA_RETURN_IF_ERROR(inner_->Submit(forward));
      inner_in_flight_ += forward.size();
    }
    failed_.insert(failed_.end(), failed.begin(), failed.end());
    return absl::OkStatus();
  }
  absl::StatusOr<size_t> Reap(absl::Span<aio::OpResult> out, size_t min_results) override {
    size_t n = 0;
    while (n < out.size() && !failed_.empty()) {
      out[n++] = failed_.back();
      failed_.pop_back();
    }
    if (n == out.size() || inner_in_flight_ == 0) return n;
    const size_t inner_min = min_results > n ? std::min(min_results - n, inner_in_flight_) : 0;
    STRATA_ASSIGN_OR_RETURN(size_t got, inner_->Reap(out.subspan(n), inner_min));
    inner_in_flight_ -= got;
    return n + got;
  }

 private:
  std::unique_ptr<aio::Backend> inner_;
  std::shared_ptr<Trace> trace_;
  std::vector<aio::OpResult> failed_;
  size_t inner_in_flight_ = 0;
};

// A host memory resource whose allocations fail while `fail` is set.
class FlakyResource final : public tiering::MemoryResource {
 public:
  explicit FlakyResource(tiering::MemoryResource* upstream) : upstream_(upstream) {}
  absl::StatusOr<void*> Allocate(size_t bytes) override {
    if (fail.load()) return absl::ResourceExhaustedError("flaky resource: failing as asked");
    return upstream_->Allocate(bytes);
  }
  void Deallocate(void* p, size_t bytes) override { upstream_->Deallocate(p, bytes); }
  absl::string_view name() const override { return upstream_->name(); }
  std::atomic<bool> fail{false};

 private:
  tiering::MemoryResource* const upstream_;
};

using Parts = std::vector<std::pair<tiering::PartitionId, uint64_t>>;
const Parts kParts = {{10, 1000 + 7}, {11, 16384 + 1}, {12, 65536 * 3 + 5}, {13, 40000}, {14, 3}};

struct Reference {  // the same optimizer on in-memory arrays
  std::vector<std::vector<float>> p, m, v;
  std::vector<std::vector<uint16_t>> copy;
};

struct Fixture {
  Parts parts;
  ScratchDir dir;
  std::shared_ptr<Trace> trace = std::make_shared<Trace>();
  std::unique_ptr<aio::Engine> engine;
  std::unique_ptr<tiering::NvmeStore> store;
  std::unique_ptr<optim_cpu::CpuAdam> adam;
  tiering::HostMemoryResource raw;
  FlakyResource flaky{&raw};
  tiering::StatisticsResource host{&flaky};
  std::unique_ptr<PipelinedOptimizerSwapper> swapper;
  std::vector<std::vector<float>> grads;
  std::vector<std::vector<uint16_t>> copies;  // the caller's param_copy buffers (bf16)
  Reference ref;

  explicit Fixture(OptimizerSwapperConfig config, Parts parts_in = kParts,
                   uint32_t block_size = 64 << 10, uint64_t store_capacity = 32 << 20)
      : parts(std::move(parts_in)) {
    aio::AioConfig ac;
    ac.block_size = block_size;
    ac.intra_op_parallelism = 2;
    aio::EngineOptions eo;
    eo.on_warning = [](absl::string_view) {};
    eo.wrap_backend = [t = trace](std::unique_ptr<aio::Backend> inner, int) {
      return std::make_unique<RecordingBackend>(std::move(inner), t);
    };
    engine = *aio::Engine::Create(ac, eo);
    tiering::NvmeStoreOptions so;
    so.capacity_bytes = store_capacity;
    so.on_warning = [](absl::string_view) {};
    store = *tiering::NvmeStore::Open(dir.File("swap"), so, engine.get());
    optim_cpu::AdamConfig adam_config;
    adam_config.threads = 2;
    adam_config.weight_decay = 0.01f;
    adam = *optim_cpu::CpuAdam::Create(adam_config);
    if (!config.on_event) {  // the step's events go into the trace, beside the ops
      config.on_event = [t = trace](StepEvent event, tiering::PartitionId id) {
        Entry e;
        e.event = event;
        e.id = id;
        t->Add(e);
      };
    }
    auto s = PipelinedOptimizerSwapper::Create(store.get(), adam.get(), &host, config, parts);
    EXPECT_TRUE(s.ok()) << s.status();
    swapper = *std::move(s);
    std::mt19937 rng(1);
    std::normal_distribution<float> d(0, 1);
    for (const auto& [id, n] : parts) {
      std::vector<float> master(n);
      for (float& x : master) x = d(rng);
      EXPECT_TRUE(swapper->Initialize(id, master).ok());
      ref.p.push_back(master);
      ref.m.emplace_back(n, 0.0f);
      ref.v.emplace_back(n, 0.0f);
      ref.copy.emplace_back(n, 0);
      grads.emplace_back(n);
      copies.emplace_back(n, 0xabcd);
    }
  }

  void NewGrads(int seed) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> d(0, 0.1f);
    for (auto& g : grads) {
      for (float& x : g) x = d(rng);
    }
  }
  // Every partition, in order; with a bf16 param copy each unless `with_copies` is false.
  std::vector<StepInput> Inputs(bool with_copies = true) {
    std::vector<StepInput> in;
    for (size_t i = 0; i < parts.size(); ++i) {
      StepInput s;
      s.id = parts[i].first;
      s.grad = grads[i].data();
      if (with_copies) s.param_copy = copies[i].data();
      in.push_back(s);
    }
    return in;
  }
  void StepReference(int64_t t, const optim_cpu::StepOptions& options = {}) {
    for (size_t i = 0; i < parts.size(); ++i) {
      optim_cpu::AdamChunk c;
      c.param = ref.p[i].data();
      c.grad = grads[i].data();
      c.exp_avg = ref.m[i].data();
      c.exp_avg_sq = ref.v[i].data();
      c.param_copy = ref.copy[i].data();
      c.size = parts[i].second;
      ASSERT_TRUE(adam->Step(t, c, options).ok());
    }
  }
  // Partition i's master weights and moments, as ReadState gives them.
  std::array<std::vector<float>, 3> Read(size_t i) {
    const uint64_t n = parts[i].second;
    std::array<std::vector<float>, 3> s{std::vector<float>(n), std::vector<float>(n),
                                        std::vector<float>(n)};
    EXPECT_TRUE(swapper
                    ->ReadState(parts[i].first, absl::MakeSpan(s[0]), absl::MakeSpan(s[1]),
                                absl::MakeSpan(s[2]))
                    .ok());
    return s;
  }
  // The first `stepped` partitions' master weights are the reference's, the others `before`'s.
  void ExpectMastersStepped(size_t stepped, const Reference& before) {
    for (size_t i = 0; i < parts.size(); ++i) {
      const std::vector<float>& want = i < stepped ? ref.p[i] : before.p[i];
      EXPECT_EQ(0, std::memcmp(Read(i)[0].data(), want.data(), parts[i].second * 4))
          << "partition " << parts[i].first;
    }
  }
  void ExpectMatchesReference() {
    for (size_t i = 0; i < parts.size(); ++i) {
      const uint64_t n = parts[i].second;
      const auto [p, m, v] = Read(i);
      EXPECT_EQ(0, std::memcmp(p.data(), ref.p[i].data(), n * 4)) << "master of " << parts[i].first;
      EXPECT_EQ(0, std::memcmp(m.data(), ref.m[i].data(), n * 4))
          << "exp_avg of " << parts[i].first;
      EXPECT_EQ(0, std::memcmp(v.data(), ref.v[i].data(), n * 4))
          << "exp_avg_sq of " << parts[i].first;
    }
  }
  // Steps 1..`steps` with new gradients each, every one bitwise the reference's, copies too.
  void StepMatchingTheReference(int64_t steps) {
    for (int64_t t = 1; t <= steps; ++t) {
      NewGrads(static_cast<int>(t));
      auto r = swapper->Step(t, Inputs());
      ASSERT_TRUE(r.ok()) << r.status();
      StepReference(t);
      ExpectMatchesReference();
      ExpectCopiesMatchReference();
    }
  }
  void ExpectCopiesMatchReference() {
    for (size_t i = 0; i < parts.size(); ++i) {
      EXPECT_EQ(copies[i], ref.copy[i]) << "param_copy of " << parts[i].first;
    }
  }
};

class SwapperModes : public ::testing::TestWithParam<OptimizerSwapperConfig> {};

TEST_P(SwapperModes, AStepOverNvmeStateIsBitwiseTheStepInMemory) {
  Fixture f(GetParam());
  const uint64_t max_blob = (65536 * 3 + 5) * 12;
  ASSERT_NO_FATAL_FAILURE(f.StepMatchingTheReference(4));
  // Pinned buffers: never more than the ring (three with pipelining unless set, one without), plus
  // the host-resident state, plus the staged param copies of the NVMe-resident partitions (bf16).
  uint64_t in_cpu = 0, on_nvme = 0;
  for (const auto& [id, n] : kParts) {
    if (f.swapper->on_nvme(id)) {
      on_nvme += n;
    } else {
      in_cpu += n * 12;
    }
  }
  EXPECT_EQ(f.swapper->copy_staging_bytes(), on_nvme * 2);
  EXPECT_LE(f.host.counts().peak_bytes,
            f.swapper->buffer_count() * max_blob + in_cpu + f.swapper->copy_staging_bytes());
  const bool pipelined = GetParam().pipeline_read || GetParam().pipeline_write;
  EXPECT_EQ(f.swapper->buffer_count(), GetParam().ring_buffers > 0 ? GetParam().ring_buffers
                                       : pipelined                 ? 3u
                                                                   : 1u);
}

INSTANTIATE_TEST_SUITE_P(Configs, SwapperModes,
                         ::testing::Values(OptimizerSwapperConfig{true, true, 0},
                                           OptimizerSwapperConfig{false, false, 0},
                                           OptimizerSwapperConfig{true, false, 0},
                                           OptimizerSwapperConfig{false, true, 0},
                                           OptimizerSwapperConfig{true, true, 220000},  // 10,
                                           // 11 and 14 stay in host memory
                                           OptimizerSwapperConfig{true, true, 0, 5}),  // a ring
                                                                                       // of 5
                         [](const auto& info) {
                           return absl::StrCat(info.param.pipeline_read ? "read" : "noread", "_",
                                               info.param.pipeline_write ? "write" : "nowrite",
                                               "_cpu", info.param.max_in_cpu_bytes, "_ring",
                                               info.param.ring_buffers);
                         });

TEST(SwapperTest, HostResidentStateNeverTouchesTheDisk) {
  Fixture f({true, true, 220000});
  EXPECT_FALSE(f.swapper->on_nvme(10));
  EXPECT_FALSE(f.swapper->on_nvme(11));
  EXPECT_TRUE(f.swapper->on_nvme(12));
  EXPECT_FALSE(f.store->Find(10).ok());
  EXPECT_TRUE(f.store->Find(12).ok());
  EXPECT_FALSE(f.swapper->on_nvme(14));  // placement is greedy: a small one after a big one fits
}

// Runs step 1 cleanly (with param copies unless `copies_in_step_1` is false), then step 2 with
// `arm` having set up one fault, and checks that the failed step changed nothing the caller can
// see (the state of host- and NVMe-resident partitions, every param copy, NVMe's bytes), then that
// the retry gives the bits of a clean step. Over a pipelined and a serial configuration, with
// partitions in host memory (10, 11, 14) and on NVMe (12, 13) alike.
// The step's error must carry `expected_errno`, or (0) be ResourceExhausted.
void FailThenRetry(const std::function<void(Fixture&)>& arm, int expected_errno,
                   bool copies_in_step_1 = true) {
  for (OptimizerSwapperConfig config :
       {OptimizerSwapperConfig{true, true, 220000}, OptimizerSwapperConfig{false, false, 220000}}) {
    SCOPED_TRACE(config.pipeline_read ? "pipelined" : "serial");
    Fixture f(config);
    ASSERT_FALSE(f.swapper->on_nvme(10));
    ASSERT_TRUE(f.swapper->on_nvme(12));
    f.NewGrads(1);
    ASSERT_TRUE(f.swapper->Step(1, f.Inputs(copies_in_step_1)).ok());
    f.StepReference(1);
    const auto copies_before = f.copies;
    const uint64_t generation = f.store->generation();
    f.NewGrads(2);
    arm(f);
    auto failed = f.swapper->Step(2, f.Inputs());
    f.trace->SetFault(nullptr);
    f.flaky.fail = false;
    ASSERT_FALSE(failed.ok());
    if (expected_errno != 0) {
      EXPECT_EQ(StatusErrno(failed.status()), expected_errno) << failed.status();
    } else {
      EXPECT_EQ(failed.status().code(), absl::StatusCode::kResourceExhausted) << failed.status();
    }
    EXPECT_THAT(failed.status().message(), HasSubstr("nothing was changed"));
    EXPECT_EQ(f.store->generation(), generation);
    f.ExpectMatchesReference();  // still step 1's state, NVMe and host alike
    EXPECT_EQ(f.copies, copies_before) << "a failed step wrote a param copy";
    // Every partition's bytes on NVMe match their checksums (reread from the disk).
    auto corrupt = f.store->Verify();
    ASSERT_TRUE(corrupt.ok()) << corrupt.status();
    EXPECT_TRUE(corrupt->empty());
    // Retrying the step succeeds and matches the in-memory result.
    auto retried = f.swapper->Step(2, f.Inputs());
    ASSERT_TRUE(retried.ok()) << retried.status();
    f.StepReference(2);
    f.ExpectMatchesReference();
    f.ExpectCopiesMatchReference();
  }
}

// The first read of partition 13 fails: partition 12 (NVMe) has been stepped by then.
TEST(SwapperTest, AReadThatFailsChangesNothingAndARetryMatches) {
  FailThenRetry(
      [](Fixture& f) {
        auto record = f.store->Find(13);
        ASSERT_TRUE(record.ok()) << record.status();
        const std::vector<tiering::StoreExtent> extents = record->extents;
        f.trace->SetFault([extents](const Entry& op, const std::vector<Entry>&) {
          return op.kind == aio::OpKind::kRead && op.data_file && Overlaps(op, extents) ? EIO : 0;
        });
      },
      EIO);
}

// The write-back of partition 13 (the second NVMe-resident one) fails.
TEST(SwapperTest, AWriteBackThatFailsChangesNothingAndARetryMatches) {
  FailThenRetry(
      [](Fixture& f) {
        f.trace->SetFault([](const Entry& op, const std::vector<Entry>& before) {
          return op.kind == aio::OpKind::kWrite && op.data_file &&
                         Any(before, StepEvent::kWriteStarted, 13)
                     ? ENOSPC
                     : 0;
        });
      },
      ENOSPC);
}

// Everything is staged; the commit's manifest record cannot be written.
TEST(SwapperTest, ACommitThatFailsChangesNothingAndARetryMatches) {
  FailThenRetry(
      [](Fixture& f) {
        f.trace->SetFault([](const Entry& op, const std::vector<Entry>&) {
          return op.kind == aio::OpKind::kWrite && !op.data_file ? EIO : 0;
        });
      },
      EIO);
}

// Step 1 asks for no param copies; step 2 does, and the host memory to stage them cannot be had.
TEST(SwapperTest, AStagingBufferThatCannotBeHadChangesNothingAndARetryMatches) {
  FailThenRetry([](Fixture& f) { f.flaky.fail = true; }, 0, /*copies_in_step_1=*/false);
}

TEST(SwapperTest, AnOverflowSkipsTheStepWithoutTouchingState) {
  Fixture f({true, true, 0});
  f.NewGrads(1);
  f.grads[3][17] = std::numeric_limits<float>::infinity();
  auto r = f.swapper->Step(1, f.Inputs(), {.check_overflow = true});
  ASSERT_TRUE(r.ok());
  EXPECT_TRUE(r->overflow);
  EXPECT_EQ(r->bytes_read, 0u);
  f.ExpectMatchesReference();
}

TEST(SwapperTest, BadInputIsRefused) {
  Fixture f({true, true, 0});
  std::vector<float> wrong(5);
  EXPECT_EQ(f.swapper->Initialize(10, wrong).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(f.swapper->Initialize(99, wrong).code(), absl::StatusCode::kNotFound);
  StepInput bad;
  bad.id = 10;
  EXPECT_THAT(f.swapper->Step(1, {&bad, 1}).status().message(), HasSubstr("grad is null"));
  f.NewGrads(1);
  auto in = f.Inputs();
  in[0].id = 99;
  EXPECT_THAT(f.swapper->Step(1, in).status().message(),
              HasSubstr("partition 99: not one of the swapper's partitions"));
  in = f.Inputs();
  EXPECT_EQ(f.swapper->Step(0, in).status().code(), absl::StatusCode::kInvalidArgument);
  tiering::HostMemoryResource raw;
  EXPECT_THAT(PipelinedOptimizerSwapper::Create(nullptr, f.adam.get(), &raw, {}, {{1, 100}})
                  .status()
                  .message(),
              HasSubstr("there is no NVMe store"));
  // A size whose state bytes would wrap around (it once passed the max_in_cpu check).
  auto huge = PipelinedOptimizerSwapper::Create(f.store.get(), f.adam.get(), &raw,
                                                {.max_in_cpu_bytes = 1 << 20}, {{1, 1ull << 62}});
  EXPECT_EQ(huge.status().code(), absl::StatusCode::kInvalidArgument) << huge.status();
  EXPECT_THAT(huge.status().message(), HasSubstr("elements (accepted: 1 to"));
  for (int ring : {-1, 2, 65}) {
    auto bad_ring = PipelinedOptimizerSwapper::Create(f.store.get(), f.adam.get(), &raw,
                                                      {.pipeline_read = true, .ring_buffers = ring},
                                                      {{1, 100}});
    EXPECT_THAT(bad_ring.status().message(), HasSubstr("accepted: 0 (the default), or 3..64"))
        << ring;
  }
}

// Inputs that are refused must be refused before anything changes: a bad input at the end of the
// list (after NVMe-resident partitions that would already have been stepped and committed, on a
// host-resident partition that is stepped last) changes neither NVMe nor host state, and a
// duplicate id is refused rather than stepped twice.
TEST(SwapperTest, EveryInputIsValidatedBeforeAnythingChanges) {
  Fixture f({true, true, 220000});  // 10 and 11 in host memory, the rest on NVMe
  ASSERT_FALSE(f.swapper->on_nvme(10));
  ASSERT_TRUE(f.swapper->on_nvme(12));
  f.NewGrads(1);
  const uint64_t generation = f.store->generation();
  std::vector<uint16_t> copy(kParts[0].second, 0xabcd);
  auto in = f.Inputs();
  std::rotate(in.begin(), in.begin() + 2, in.end());  // NVMe partitions first, host ones last
  in.back().param_copy = copy.data();
  in.back().grad = nullptr;  // an input CpuAdam refuses
  auto r = f.swapper->Step(1, in);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
  EXPECT_THAT(r.status().message(), HasSubstr("grad is null"));
  EXPECT_THAT(r.status().message(), HasSubstr("nothing was changed"));
  EXPECT_EQ(f.store->generation(), generation);
  f.ExpectMatchesReference();
  EXPECT_EQ(copy[0], 0xabcd);
  // A duplicate id.
  in = f.Inputs();
  in.push_back(in[3]);
  r = f.swapper->Step(1, in);
  EXPECT_THAT(r.status().message(), HasSubstr("partition 13: listed twice"));
  EXPECT_EQ(f.store->generation(), generation);
  f.ExpectMatchesReference();
  // And then a good step is the step in memory.
  ASSERT_TRUE(f.swapper->Step(1, f.Inputs()).ok());
  f.StepReference(1);
  f.ExpectMatchesReference();
}

// The pipeline, seen from outside. Trace records the backend's ops and the swapper's StepEvents
// in one order; the hook paces the step so that a pipelined implementation leaves a deterministic
// record, whatever the machine's load:
//  - an I/O thread about to read partition k+1 is held until k starts stepping (or until the step
//    awaits that read), and one about to write k-1 until k starts stepping (or that write is
//    awaited);
//  - when k has stepped, the hook waits for the read of k+1 and the write of k-1 to reach the
//    backend, if the swapper announced them as launched on I/O threads (waiting for an I/O it runs
//    itself would deadlock; for the rest the swapper promises that nothing it waits for needs it).
// So with pipeline_read the read of k+1 is submitted while k steps, and with pipeline_write the
// write of k-1 is; a step that reads k+1 after stepping k, or writes k-1 before stepping k, leaves
// the opposite order, and these same checks fail on it (asserted below on the serial modes).
struct Interleaving {
  // Per partition k in step order: the positions in the trace of its first read op, its first
  // write op, and its kStepStarted and kStepFinished.
  std::vector<size_t> read, write, step_started, step_finished;
  std::vector<std::string> stuck;
  std::string trace;  // the whole record, one entry a line, for a failure's message
};

Interleaving RecordAStep(OptimizerSwapperConfig config) {
  // 20480 elements: 240 KiB of state, a whole number of 4 KiB blocks, under one block of the
  // engine: one op per read and per write.
  Parts parts;
  for (tiering::PartitionId id = 0; id < 6; ++id) parts.emplace_back(id, 20480);
  std::shared_ptr<Trace> trace;
  std::vector<std::vector<tiering::StoreExtent>> before(parts.size());  // extents before the step
  config.on_event = [&trace, &parts, &before](StepEvent event, tiering::PartitionId id) {
    const size_t k = id;  // ids are the step order
    const auto started = [](size_t j) {
      return [j](const std::vector<Entry>& e) {
        return Any(e, StepEvent::kStepStarted, static_cast<tiering::PartitionId>(j));
      };
    };
    Entry e;
    e.event = event;
    e.id = id;
    if (event != StepEvent::kStepFinished) trace->Add(e);
    if (event == StepEvent::kReadStarted && k > 0) {
      trace->WaitUntil(
          [&](const std::vector<Entry>& x) {
            return started(k - 1)(x) || Any(x, StepEvent::kReadAwaited, id);
          },
          absl::StrCat("read ", id, " held for step ", k - 1));
    } else if (event == StepEvent::kWriteStarted) {
      trace->WaitUntil(
          [&](const std::vector<Entry>& x) {
            return (k + 1 < parts.size() && started(k + 1)(x)) ||
                   Any(x, StepEvent::kWriteAwaited, id);
          },
          absl::StrCat("write ", id, " held for step ", k + 1));
    } else if (event == StepEvent::kStepFinished) {
      const std::vector<Entry> now = trace->entries();
      // The read of k+1, by its offsets (its extents from before the step).
      if (k + 1 < parts.size() && Any(now, StepEvent::kReadLaunched, id + 1)) {
        trace->WaitUntil(
            [&](const std::vector<Entry>& x) {
              return std::any_of(x.begin(), x.end(), [&](const Entry& op) {
                return op.io && op.data_file && op.kind == aio::OpKind::kRead &&
                       Overlaps(op, before[k + 1]);
              });
            },
            absl::StrCat("read ", id + 1, " to reach the backend"));
      }
      // Writes are staged one after another: a data write after kWriteStarted of k-1 is k-1's.
      if (k > 0 && Any(now, StepEvent::kWriteLaunched, id - 1)) {
        trace->WaitUntil(
            [&](const std::vector<Entry>& x) {
              auto it = std::find_if(x.begin(), x.end(), [&](const Entry& y) {
                return y.Is(StepEvent::kWriteStarted, id - 1);
              });
              return std::any_of(it, x.end(), [](const Entry& op) {
                return op.io && op.data_file && op.kind == aio::OpKind::kWrite;
              });
            },
            absl::StrCat("write ", id - 1, " to reach the backend"));
      }
      trace->Add(e);
    }
  };
  Fixture f(config, parts, 4 << 20);
  trace = f.trace;
  for (size_t k = 0; k < parts.size(); ++k) before[k] = f.store->Find(parts[k].first)->extents;
  f.NewGrads(1);
  trace->Clear();
  auto r = f.swapper->Step(1, f.Inputs());
  EXPECT_TRUE(r.ok()) << r.status();
  const std::vector<Entry> x = trace->entries();
  Interleaving out;
  out.stuck = trace->stuck();
  for (size_t i = 0; i < x.size(); ++i) {
    absl::StrAppend(
        &out.trace, i, ": ",
        x[i].io ? absl::StrCat(x[i].kind == aio::OpKind::kRead ? "read " : "write ",
                               x[i].data_file ? "swap file @" : "other file @", x[i].offset, " +",
                               x[i].length)
                : absl::StrCat("event ", static_cast<int>(x[i].event), " partition ", x[i].id),
        "\n");
  }
  auto first_op = [&x](aio::OpKind kind, const std::vector<tiering::StoreExtent>& extents) {
    for (size_t i = 0; i < x.size(); ++i) {
      if (x[i].io && x[i].data_file && x[i].kind == kind && Overlaps(x[i], extents)) return i;
    }
    ADD_FAILURE() << "no op on the partition's extents";
    return x.size();
  };
  auto position = [&x](StepEvent ev, tiering::PartitionId p) {
    for (size_t i = 0; i < x.size(); ++i) {
      if (x[i].Is(ev, p)) return i;
    }
    ADD_FAILURE() << "no event " << static_cast<int>(ev) << " for " << p;
    return x.size();
  };
  for (size_t k = 0; k < parts.size(); ++k) {
    const tiering::PartitionId id = parts[k].first;
    out.read.push_back(first_op(aio::OpKind::kRead, before[k]));
    out.write.push_back(first_op(aio::OpKind::kWrite, f.store->Find(id)->extents));
    out.step_started.push_back(position(StepEvent::kStepStarted, id));
    out.step_finished.push_back(position(StepEvent::kStepFinished, id));
  }
  return out;
}

// Whether the read of k+1 reached the backend while k stepped, for every k.
bool ReadsAheadWhileStepping(const Interleaving& s) {
  for (size_t k = 0; k + 1 < s.read.size(); ++k) {
    if (!(s.step_started[k] < s.read[k + 1] && s.read[k + 1] < s.step_finished[k])) return false;
  }
  return true;
}
// Whether the write of k-1 reached the backend while k stepped, for every k.
bool WritesBehindWhileStepping(const Interleaving& s) {
  for (size_t k = 1; k < s.write.size(); ++k) {
    if (!(s.step_started[k] < s.write[k - 1] && s.write[k - 1] < s.step_finished[k])) return false;
  }
  return true;
}

TEST(SwapperTest, APipelinedStepReadsKPlus1AndWritesKMinus1WhileKSteps) {
  for (OptimizerSwapperConfig config :
       {OptimizerSwapperConfig{true, true, 0}, OptimizerSwapperConfig{true, false, 0},
        OptimizerSwapperConfig{false, true, 0}, OptimizerSwapperConfig{false, false, 0}}) {
    SCOPED_TRACE(absl::StrCat("pipeline_read ", config.pipeline_read, " pipeline_write ",
                              config.pipeline_write));
    const Interleaving s = RecordAStep(config);
    EXPECT_THAT(s.stuck, ::testing::IsEmpty());
    // Whatever the mode: each partition is read before it steps and written after.
    for (size_t k = 0; k < s.read.size(); ++k) {
      EXPECT_LT(s.read[k], s.step_started[k]) << k;
      EXPECT_LT(s.step_finished[k], s.write[k]) << k;
    }
    // The checks can fail: without pipelining, the read of k+1 comes after k has stepped and the
    // write of k-1 before k steps, and they say so.
    EXPECT_EQ(ReadsAheadWhileStepping(s), config.pipeline_read) << s.trace;
    EXPECT_EQ(WritesBehindWhileStepping(s), config.pipeline_write) << s.trace;
  }
}

// Adagrad and Lion through the swapper (their one state where Adam keeps exp_avg): the state on
// NVMe and in host memory steps as the optimizer does directly on arrays in memory.
TEST(SwapperTest, AdagradAndLionStepTheirStateAsTheyDoInMemory) {
  for (optim_cpu::OptimizerKind kind :
       {optim_cpu::OptimizerKind::kAdagrad, optim_cpu::OptimizerKind::kLion}) {
    SCOPED_TRACE(optim_cpu::OptimizerKindName(kind));
    ScratchDir dir;
    aio::EngineOptions eo;
    eo.on_warning = [](absl::string_view) {};
    auto engine = aio::Engine::Create(aio::AioConfig{}, eo);
    ASSERT_TRUE(engine.ok()) << engine.status();
    tiering::NvmeStoreOptions so;
    so.capacity_bytes = 8 << 20;
    so.on_warning = [](absl::string_view) {};
    auto store = tiering::NvmeStore::Open(dir.File("swap"), so, engine->get());
    ASSERT_TRUE(store.ok()) << store.status();
    optim_cpu::OptimizerConfig oc;
    oc.kind = kind;
    oc.adagrad.lr = 5e-2f;
    oc.adagrad.lr_decay = 0.01f;
    oc.adagrad.weight_decay = 0.02f;
    oc.lion.weight_decay = 0.1f;
    auto optimizer = optim_cpu::MakeChunkOptimizer(oc);
    ASSERT_TRUE(optimizer.ok()) << optimizer.status();
    auto direct = optim_cpu::MakeChunkOptimizer(oc);
    ASSERT_TRUE(direct.ok()) << direct.status();
    constexpr uint64_t kN = 1000;
    const Parts parts = {{1, kN}, {2, kN}};
    tiering::HostMemoryResource host;
    OptimizerSwapperConfig config;
    config.max_in_cpu_bytes = 12 * kN;  // partition 1 in host memory, 2 on NVMe
    auto swapper =
        PipelinedOptimizerSwapper::Create(store->get(), optimizer->get(), &host, config, parts);
    ASSERT_TRUE(swapper.ok()) << swapper.status();
    ASSERT_FALSE((*swapper)->on_nvme(1));
    ASSERT_TRUE((*swapper)->on_nvme(2));
    std::mt19937_64 rng(5);
    std::normal_distribution<float> d(0, 1);
    std::vector<std::vector<float>> master(2, std::vector<float>(kN)), state(2);
    for (int k = 0; k < 2; ++k) {
      for (float& x : master[k]) x = d(rng);
      state[k].assign(kN, 0.25f);  // Adagrad's initial accumulator; Lion's first moment
      ASSERT_TRUE((*swapper)->Initialize(k + 1, master[k], 0.25f).ok());
    }
    std::vector<float> unused(kN);
    for (int64_t t = 1; t <= 3; ++t) {
      std::vector<std::vector<float>> grads(2, std::vector<float>(kN));
      std::vector<StepInput> inputs;
      for (int k = 0; k < 2; ++k) {
        for (float& g : grads[k]) g = 0.1f * d(rng);
        inputs.push_back({static_cast<tiering::PartitionId>(k + 1), grads[k].data()});
        optim_cpu::AdamChunk c;
        c.param = master[k].data();
        c.grad = grads[k].data();
        c.exp_avg = state[k].data();
        c.size = kN;
        ASSERT_TRUE((*direct)->Step(t, c, {}).ok());
      }
      auto r = (*swapper)->Step(t, inputs);
      ASSERT_TRUE(r.ok()) << r.status();
    }
    for (int k = 0; k < 2; ++k) {
      std::vector<float> m(kN), s1(kN), s2(kN);
      ASSERT_TRUE((*swapper)
                      ->ReadState(k + 1, absl::MakeSpan(m), absl::MakeSpan(s1), absl::MakeSpan(s2))
                      .ok());
      EXPECT_EQ(m, master[k]) << "partition " << k + 1;
      EXPECT_EQ(s1, state[k]) << "partition " << k + 1;
    }
  }
}

}  // namespace
}  // namespace strata::swap

namespace strata::swap {
namespace {

// The step in parts: partitions staged a few at a time (their gradients from the caller or from a
// source, as a trainer stages them during backward), each call with its own t and learning rate,
// give the bits of the same partitions stepped in memory; and nothing the caller can see changes
// before Commit (the param copies included). Over host- (10, 11, 14) and NVMe-resident partitions.
TEST(SwapperTransactionTest, StagedInPartsIsBitwiseTheStepInMemoryAndChangesNothingBeforeCommit) {
  for (OptimizerSwapperConfig config :
       {OptimizerSwapperConfig{true, true, 220000}, OptimizerSwapperConfig{false, false, 220000},
        OptimizerSwapperConfig{true, true, 0}}) {
    SCOPED_TRACE(absl::StrCat(config.pipeline_read, " ", config.max_in_cpu_bytes));
    Fixture f(config);
    std::vector<tiering::PartitionId> sourced;  // the source's calls, on whichever thread
    std::vector<tiering::PartitionId> let_go;   // its gradients let go
    Mutex mu;
    for (int64_t t = 1; t <= 3; ++t) {
      f.NewGrads(static_cast<int>(t));
      f.trace->Clear();  // the waits below look at this step's events only
      const std::vector<StepInput> in = f.Inputs();
      const auto copies_before = f.copies;
      ASSERT_TRUE(f.swapper->Begin(f.swapper->copy_staging_bytes() + (1 << 20)).ok());
      EXPECT_TRUE(f.swapper->staging());
      // First half with their gradients, the rest through a source (null grads), at another lr.
      const size_t half = in.size() / 2;
      ASSERT_TRUE(f.swapper->Stage(t, absl::MakeConstSpan(in).subspan(0, half)).ok());
      std::vector<StepInput> rest(in.begin() + half, in.end());
      for (StepInput& s : rest) s.grad = nullptr;
      PipelinedOptimizerSwapper::GradSource source;
      source.get = [&f, &mu, &sourced](tiering::PartitionId id) -> absl::StatusOr<const void*> {
        MutexLock lock(&mu);
        sourced.push_back(id);
        for (size_t i = 0; i < f.parts.size(); ++i) {
          if (f.parts[i].first == id) return static_cast<const void*>(f.grads[i].data());
        }
        return absl::NotFoundError("no such partition");
      };
      source.done = [&mu, &let_go](tiering::PartitionId id) {
        MutexLock lock(&mu);
        let_go.push_back(id);
      };
      ASSERT_TRUE(f.swapper->Stage(t, rest, {.lr = 5e-4f}, source).ok());
      // The worker steps and writes every NVMe-resident partition before Commit is asked for...
      for (const auto& [id, n] : f.parts) {
        if (!f.swapper->on_nvme(id)) continue;
        f.trace->WaitUntil(
            [id = id](const std::vector<Entry>& x) { return Any(x, StepEvent::kWriteStarted, id); },
            absl::StrCat("partition ", id, " written before Commit"));
      }
      EXPECT_THAT(f.trace->stuck(), ::testing::IsEmpty());
      {
        // Each NVMe-resident partition's gradient was let go once it had stepped, before Commit.
        MutexLock lock(&mu);
        for (const StepInput& r : rest) {
          if (!f.swapper->on_nvme(r.id)) continue;
          EXPECT_EQ(std::count(let_go.begin(), let_go.end(), r.id), t) << r.id;
        }
      }
      // ...and nothing the caller can see has changed: the param copies, the committed state.
      EXPECT_EQ(f.copies, copies_before) << "a param copy changed before the commit";
      f.ExpectMatchesReference();
      auto r = f.swapper->Commit();
      ASSERT_TRUE(r.ok()) << r.status();
      EXPECT_FALSE(f.swapper->staging());
      EXPECT_FALSE(r->overflow);
      // The reference: the first half at the config's lr, the rest at 5e-4.
      for (size_t i = 0; i < f.parts.size(); ++i) {
        optim_cpu::AdamChunk c;
        c.param = f.ref.p[i].data();
        c.grad = f.grads[i].data();
        c.exp_avg = f.ref.m[i].data();
        c.exp_avg_sq = f.ref.v[i].data();
        c.param_copy = f.ref.copy[i].data();
        c.size = f.parts[i].second;
        optim_cpu::StepOptions o;
        if (i >= half) o.lr = 5e-4f;
        ASSERT_TRUE(f.adam->Step(t, c, o).ok());
      }
      f.ExpectMatchesReference();
      f.ExpectCopiesMatchReference();
    }
    MutexLock lock(&mu);
    EXPECT_EQ(sourced.size(), 3 * (f.parts.size() - f.parts.size() / 2));
    std::sort(sourced.begin(), sourced.end());
    std::sort(let_go.begin(), let_go.end());
    EXPECT_EQ(let_go, sourced) << "every gradient had is let go once";
  }
}

// Abort, and a Commit that finds an overflow or a source's failure, change nothing; the swapper
// then steps as if they had never been.
TEST(SwapperTransactionTest, AbortOverflowAndAFailingSourceChangeNothing) {
  for (int how = 0; how < 3; ++how) {
    SCOPED_TRACE(how);
    Fixture f({true, true, 220000});
    f.NewGrads(1);
    ASSERT_TRUE(f.swapper->Step(1, f.Inputs()).ok());
    f.StepReference(1);
    const auto copies_before = f.copies;
    const uint64_t generation = f.store->generation();
    f.NewGrads(2);
    ASSERT_TRUE(f.swapper->Begin(f.swapper->copy_staging_bytes()).ok());
    std::vector<StepInput> in = f.Inputs();
    if (how == 0) {
      ASSERT_TRUE(f.swapper->Stage(2, in).ok());
      f.swapper->Abort();
    } else if (how == 1) {
      f.grads[4][2] = std::numeric_limits<float>::quiet_NaN();  // partition 14: host-resident
      ASSERT_TRUE(f.swapper->Stage(2, in, {.check_overflow = true}).ok());
      auto r = f.swapper->Commit();
      ASSERT_TRUE(r.ok()) << r.status();
      EXPECT_TRUE(r->overflow);
      f.NewGrads(2);
    } else {
      in[3].grad = nullptr;  // partition 13, NVMe-resident
      PipelinedOptimizerSwapper::GradSource failing;
      failing.get = [](tiering::PartitionId) -> absl::StatusOr<const void*> {
        return absl::DataLossError("the gradient's copy failed");
      };
      ASSERT_TRUE(f.swapper->Stage(2, in, {}, failing).ok());
      auto r = f.swapper->Commit();
      ASSERT_FALSE(r.ok());
      EXPECT_THAT(r.status().message(), HasSubstr("the gradient's copy failed"));
      EXPECT_THAT(r.status().message(), HasSubstr("nothing was changed"));
    }
    EXPECT_FALSE(f.swapper->staging());
    EXPECT_EQ(f.store->generation(), generation);
    f.ExpectMatchesReference();
    EXPECT_EQ(f.copies, copies_before);
    auto retried = f.swapper->Step(2, f.Inputs());
    ASSERT_TRUE(retried.ok()) << retried.status();
    f.StepReference(2);
    f.ExpectMatchesReference();
    f.ExpectCopiesMatchReference();
  }
}

// An overflow in an NVMe-resident partition staged last, after the others have been stepped and
// written to fresh extents: Commit drops them.
TEST(SwapperTransactionTest, AnOverflowFoundLateDropsWhatWasStaged) {
  Fixture f({true, true, 0});
  f.NewGrads(1);
  const uint64_t generation = f.store->generation();
  const auto copies_before = f.copies;
  ASSERT_TRUE(f.swapper->Begin(8 << 20).ok());
  std::vector<StepInput> in = f.Inputs();
  ASSERT_TRUE(
      f.swapper->Stage(1, absl::MakeConstSpan(in).subspan(0, 4), {.check_overflow = true}).ok());
  // The four are stepped and written to fresh extents before the fifth is staged.
  f.trace->WaitUntil(
      [&](const std::vector<Entry>& x) {
        return std::all_of(in.begin(), in.begin() + 4, [&x](const StepInput& s) {
          return Any(x, StepEvent::kWriteStarted, s.id);
        });
      },
      "the first four written");
  EXPECT_THAT(f.trace->stuck(), ::testing::IsEmpty());
  f.grads[4][0] = -std::numeric_limits<float>::infinity();
  ASSERT_TRUE(
      f.swapper->Stage(1, absl::MakeConstSpan(in).subspan(4), {.check_overflow = true}).ok());
  auto r = f.swapper->Commit();
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(r->overflow);
  EXPECT_EQ(f.store->generation(), generation);
  f.ExpectMatchesReference();
  EXPECT_EQ(f.copies, copies_before);
}

// host_early: with every partition in host memory, each steps in place as it is staged, before
// Commit (during the trainer's backward), bit for bit the step in memory; one not staged yet is
// untouched until it is.
TEST(SwapperTransactionTest, HostEarlyStepsEachHostResidentPartitionAsItIsStaged) {
  Fixture f({true, true, 1 << 30});
  for (const auto& [id, n] : f.parts) ASSERT_FALSE(f.swapper->on_nvme(id)) << id;
  for (int64_t t = 1; t <= 2; ++t) {
    f.NewGrads(static_cast<int>(t));
    const Reference before = f.ref;
    f.StepReference(t);
    f.trace->Clear();
    ASSERT_TRUE(f.swapper->Begin(0, /*host_early=*/true).ok());
    std::vector<StepInput> in = f.Inputs();
    ASSERT_TRUE(f.swapper->Stage(t, absl::MakeConstSpan(in).subspan(0, 4)).ok());
    f.trace->WaitUntil(
        [&](const std::vector<Entry>& x) {
          return std::all_of(in.begin(), in.begin() + 4, [&x](const StepInput& s) {
            return Any(x, StepEvent::kStepFinished, s.id);
          });
        },
        "the first four stepped");
    ASSERT_THAT(f.trace->stuck(), ::testing::IsEmpty());
    // Stepped before Commit: the first four hold the new state, the fifth its old one.
    f.ExpectMastersStepped(4, before);
    ASSERT_TRUE(f.swapper->Stage(t, absl::MakeConstSpan(in).subspan(4)).ok());
    auto r = f.swapper->Commit();
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_FALSE(r->overflow);
    EXPECT_GT(r->compute_seconds, 0);
    f.ExpectMatchesReference();
    f.ExpectCopiesMatchReference();
  }
}

// Dropping a host_early step leaves those that had stepped stepped (Abort names them) and the
// others as they were; a gradient that cannot be had fails Commit naming who stepped.
TEST(SwapperTransactionTest, HostEarlyAbortAndFailureSayWhatHadStepped) {
  Fixture f({true, true, 1 << 30});
  f.NewGrads(1);
  const Reference before = f.ref;
  f.StepReference(1);
  ASSERT_TRUE(f.swapper->Begin(0, /*host_early=*/true).ok());
  std::vector<StepInput> in = f.Inputs();
  ASSERT_TRUE(f.swapper->Stage(1, absl::MakeConstSpan(in).subspan(0, 2)).ok());
  f.trace->WaitUntil(
      [&](const std::vector<Entry>& x) {
        return Any(x, StepEvent::kStepFinished, in[0].id) &&
               Any(x, StepEvent::kStepFinished, in[1].id);
      },
      "the first two stepped");
  EXPECT_THAT(f.swapper->Abort(), ::testing::ElementsAre(in[0].id, in[1].id));
  EXPECT_FALSE(f.swapper->staging());
  f.ExpectMastersStepped(2, before);
  // A gradient source that fails on the third partition: the first two step, Commit says so.
  ASSERT_TRUE(f.swapper->Begin(0, /*host_early=*/true).ok());
  in[2].grad = nullptr;
  PipelinedOptimizerSwapper::GradSource failing;
  failing.get = [](tiering::PartitionId) -> absl::StatusOr<const void*> {
    return absl::DataLossError("the gradient's copy failed");
  };
  ASSERT_TRUE(f.swapper->Stage(2, in, {}, failing).ok());
  auto r = f.swapper->Commit();
  ASSERT_FALSE(r.ok());
  EXPECT_THAT(r.status().message(), HasSubstr("the gradient's copy failed"));
  EXPECT_THAT(r.status().message(),
              HasSubstr(absl::StrCat("2 of them had stepped (", in[0].id, ", ", in[1].id, ")")));
  // The caller learns which, as from an Abort (once).
  EXPECT_THAT(f.swapper->Abort(), ::testing::ElementsAre(in[0].id, in[1].id));
  EXPECT_THAT(f.swapper->Abort(), ::testing::IsEmpty());
}

// A gradient's copy to host memory still in flight when it is staged (StepInput::grad_ready):
// here the copy "lands" inside the fence's Wait, so a step that read the gradient before waiting
// would read the NaNs left in its place and fail to match the reference, whichever thread steps
// it: the early worker (host_early), Commit (host-resident), the NVMe worker.
class LandingFence : public tiering::Fence {
 public:
  LandingFence(std::vector<std::pair<float*, std::vector<float>>> lands, absl::Status result)
      : lands_(std::move(lands)), result_(std::move(result)) {}
  absl::Status Wait() override {
    MutexLock lock(&mu_);
    if (!landed_) {
      for (auto& [into, values] : lands_) std::copy(values.begin(), values.end(), into);
      landed_ = true;
    }
    ++waits_;
    return result_;
  }
  bool Passed() override {
    MutexLock lock(&mu_);
    return landed_;
  }
  int waits() {
    MutexLock lock(&mu_);
    return waits_;
  }

 private:
  Mutex mu_;
  std::vector<std::pair<float*, std::vector<float>>> lands_ ABSL_GUARDED_BY(mu_);
  bool landed_ ABSL_GUARDED_BY(mu_) = false;
  int waits_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Status result_;
};

// Every gradient of `f` replaced by NaNs, its values landing when the fence returned is waited.
std::shared_ptr<LandingFence> GradientsInFlight(Fixture& f, absl::Status result = {}) {
  std::vector<std::pair<float*, std::vector<float>>> lands;
  for (auto& g : f.grads) {
    lands.emplace_back(g.data(), g);
    std::fill(g.begin(), g.end(), std::numeric_limits<float>::quiet_NaN());
  }
  return std::make_shared<LandingFence>(std::move(lands), std::move(result));
}

TEST(SwapperTransactionTest, AGradientInFlightIsReadOnlyOnceItsFenceHasPassed) {
  struct Mode {
    const char* name;
    uint64_t max_in_cpu;
    bool host_early;
  };
  for (const Mode& mode :
       {Mode{"host-resident, early", 1 << 30, true},
        Mode{"host-resident, at Commit", 1 << 30, false}, Mode{"NVMe-resident", 0, false}}) {
    SCOPED_TRACE(mode.name);
    Fixture f({true, true, mode.max_in_cpu});
    for (int64_t t = 1; t <= 2; ++t) {
      f.NewGrads(static_cast<int>(t));
      f.StepReference(t);
      auto fence = GradientsInFlight(f);
      ASSERT_TRUE(f.swapper->Begin(1 << 20, mode.host_early).ok());
      std::vector<StepInput> in = f.Inputs();
      for (StepInput& s : in) s.grad_ready = fence;
      ASSERT_TRUE(f.swapper->Stage(t, in).ok());
      auto r = f.swapper->Commit();
      ASSERT_TRUE(r.ok()) << r.status();
      EXPECT_FALSE(r->overflow);
      EXPECT_GE(fence->waits(), static_cast<int>(in.size()));
      f.ExpectMatchesReference();
      f.ExpectCopiesMatchReference();
    }
  }
}

// A fence that fails (the copy to host memory failed) fails the step, naming the partition, with
// nothing changed; Step alike.
TEST(SwapperTransactionTest, AGradientWhoseCopyFailedFailsTheStepChangingNothing) {
  for (uint64_t max_in_cpu : {uint64_t{1} << 30, uint64_t{0}}) {
    Fixture f({true, true, max_in_cpu});
    f.NewGrads(1);
    const Reference before = f.ref;
    auto fence = GradientsInFlight(f, absl::InternalError("cudaEventSynchronize: an illegal "
                                                          "memory access"));
    ASSERT_TRUE(f.swapper->Begin(1 << 20).ok());
    std::vector<StepInput> in = f.Inputs();
    for (StepInput& s : in) s.grad_ready = fence;
    ASSERT_TRUE(f.swapper->Stage(1, in).ok());
    auto r = f.swapper->Commit();
    ASSERT_FALSE(r.ok());
    EXPECT_THAT(r.status().message(), HasSubstr("an illegal memory access"));
    EXPECT_THAT(r.status().message(), HasSubstr("on its way to host memory"));
    f.ExpectMastersStepped(0, before);
    auto step = f.swapper->Step(1, in);
    ASSERT_FALSE(step.ok());
    EXPECT_THAT(step.status().message(), HasSubstr("nothing was changed"));
    f.ExpectMastersStepped(0, before);
  }
}

// What steps while the transaction is open (the trainer's backward still runs) takes
// threads_while_staging of the pool; what steps once Commit waits for it, the whole pool.
class ThreadsRecorder : public optim_cpu::ChunkOptimizer {
 public:
  explicit ThreadsRecorder(optim_cpu::CpuAdam* adam) : inner_(optim_cpu::BorrowAdam(adam)) {}
  absl::Status Validate(int64_t t, const optim_cpu::AdamChunk& chunk,
                        const optim_cpu::StepOptions& options) const override {
    return inner_->Validate(t, chunk, options);
  }
  absl::StatusOr<optim_cpu::StepResult> Step(int64_t t, const optim_cpu::AdamChunk& chunk,
                                             const optim_cpu::StepOptions& options) override {
    {
      MutexLock lock(&mu_);
      threads_.push_back(options.threads);
    }
    return inner_->Step(t, chunk, options);
  }
  bool HasNonFinite(const void* grad, optim_cpu::DType dtype, size_t n) override {
    return inner_->HasNonFinite(grad, dtype, n);
  }
  optim_cpu::OptimizerKind kind() const override { return inner_->kind(); }
  optim_cpu::Isa isa() const override { return inner_->isa(); }
  std::vector<int> Take() {
    MutexLock lock(&mu_);
    return std::exchange(threads_, {});
  }

 private:
  std::unique_ptr<optim_cpu::ChunkOptimizer> inner_;
  Mutex mu_;
  std::vector<int> threads_ ABSL_GUARDED_BY(mu_);
};

TEST(SwapperTransactionTest, WhatStepsDuringStagingTakesItsShareOfThePoolAndTheRestAll) {
  Fixture f({true, true, 1 << 30});
  ThreadsRecorder recorder(f.adam.get());
  OptimizerSwapperConfig config{true, true, 1 << 30};
  config.threads_while_staging = 1;
  config.on_event = [t = f.trace](StepEvent event, tiering::PartitionId id) {
    Entry e;
    e.event = event;
    e.id = id;
    t->Add(e);
  };
  auto s = PipelinedOptimizerSwapper::Create(f.store.get(), &recorder, &f.host, config, f.parts);
  ASSERT_TRUE(s.ok()) << s.status();
  auto& swapper = *s;
  for (const auto& [id, n] : f.parts) {
    ASSERT_TRUE(swapper->Initialize(id, std::vector<float>(n, 1.0f)).ok());
  }
  f.NewGrads(1);
  std::vector<StepInput> in = f.Inputs();
  // Early: staged and stepped before Commit, on its share.
  ASSERT_TRUE(swapper->Begin(0, /*host_early=*/true).ok());
  ASSERT_TRUE(swapper->Stage(1, absl::MakeConstSpan(in).subspan(0, 2)).ok());
  f.trace->WaitUntil(
      [&](const std::vector<Entry>& x) {
        return Any(x, StepEvent::kStepFinished, in[0].id) &&
               Any(x, StepEvent::kStepFinished, in[1].id);
      },
      "the first two stepped");
  EXPECT_THAT(recorder.Take(), ::testing::ElementsAre(1, 1));
  ASSERT_TRUE(swapper->Commit().ok());
  recorder.Take();
  // Not early: the host-resident partitions step in Commit, on the whole pool.
  ASSERT_TRUE(swapper->Begin(0).ok());
  ASSERT_TRUE(swapper->Stage(2, in).ok());
  ASSERT_TRUE(swapper->Commit().ok());
  EXPECT_THAT(recorder.Take(), ::testing::Each(0));
}

// ReadState (and WaitForEarlySteps) wait for the early steps staged so far: the state read is
// the stepped one, never one being written.
TEST(SwapperTransactionTest, HostEarlyStateIsReadOnlyOnceItHasStepped) {
  Fixture f({true, true, 1 << 30});
  f.NewGrads(1);
  f.StepReference(1);
  ASSERT_TRUE(f.swapper->Begin(0, /*host_early=*/true).ok());
  ASSERT_TRUE(f.swapper->Stage(1, f.Inputs()).ok());
  f.swapper->WaitForEarlySteps();
  for (const auto& [id, n] : f.parts) {
    EXPECT_TRUE(Any(f.trace->entries(), StepEvent::kStepFinished, id)) << id;
  }
  f.ExpectMatchesReference();  // ReadState, before Commit
  ASSERT_TRUE(f.swapper->Commit().ok());
  f.ExpectMatchesReference();
  f.ExpectCopiesMatchReference();
}

TEST(SwapperTransactionTest, HostEarlyMisuseIsRefused) {
  {
    Fixture f({true, true, 220000});  // 12 and 13 on NVMe
    absl::Status s = f.swapper->Begin(0, /*host_early=*/true);
    EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
    EXPECT_THAT(s.message(), HasSubstr("NVMe-resident"));
    EXPECT_FALSE(f.swapper->staging());
  }
  Fixture f({true, true, 1 << 30});
  f.NewGrads(1);
  ASSERT_TRUE(f.swapper->Begin(0, /*host_early=*/true).ok());
  absl::Status s = f.swapper->Stage(1, f.Inputs(), {.check_overflow = true});
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(s.message(), HasSubstr("check_overflow"));
  EXPECT_THAT(f.swapper->Abort(), ::testing::IsEmpty());
  f.ExpectMatchesReference();  // nothing stepped
}

OptimizerSwapperConfig CommitEach(bool pipelined, uint64_t max_in_cpu) {
  OptimizerSwapperConfig c{pipelined, pipelined, max_in_cpu};
  c.commit_each = true;
  return c;
}

// commit_each: a store with room for the state once and one partition more steps (bitwise the
// step in memory, param copies included), where the whole step's second copy does not fit.
TEST(SwapperCommitEachTest, StepsInAStoreWithRoomForOnePartitionMoreThanTheState) {
  auto aligned = [](uint64_t n) { return (n * 12 + 4095) / 4096 * 4096; };
  uint64_t state = 0, largest = 0;
  for (const auto& [id, n] : kParts) {
    state += aligned(n);
    largest = std::max(largest, aligned(n));
  }
  for (bool pipelined : {true, false}) {
    SCOPED_TRACE(pipelined ? "pipelined" : "serial");
    Fixture f(CommitEach(pipelined, 0), kParts, 64 << 10, state + largest);
    ASSERT_NO_FATAL_FAILURE(f.StepMatchingTheReference(3));
    EXPECT_EQ(f.swapper->copy_staging_bytes(), 0u);  // the copies go out from the ring
  }
  // The same store without commit_each: the step's second copy does not fit.
  Fixture whole({true, true, 0}, kParts, 64 << 10, state + largest);
  whole.NewGrads(1);
  auto r = whole.swapper->Step(1, whole.Inputs());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted) << r.status();
  whole.ExpectMastersStepped(0, whole.ref);
}

// commit_each: partition 13's write fails after 12's landed. 12 keeps its step (state and param
// copy), the others do not; Commit and then Abort say which; stepping the rest gives the bits of
// a step that never failed. Host-resident partitions (10, 11, 14) step at Commit: not reached.
TEST(SwapperCommitEachTest, AWriteThatFailsLeavesWhatLandedAndTheRestStepAfter) {
  for (bool pipelined : {true, false}) {
    SCOPED_TRACE(pipelined ? "pipelined" : "serial");
    Fixture f(CommitEach(pipelined, 220000));
    ASSERT_TRUE(f.swapper->on_nvme(12) && f.swapper->on_nvme(13) && !f.swapper->on_nvme(10));
    f.NewGrads(1);
    ASSERT_TRUE(f.swapper->Step(1, f.Inputs()).ok());
    f.StepReference(1);
    const Reference before = f.ref;
    const auto copies_before = f.copies;
    f.NewGrads(2);
    f.StepReference(2);
    f.trace->Clear();  // step 1's events: the fault fires at 13's first write of step 2 (once)
    f.trace->SetFault([](const Entry& op, const std::vector<Entry>& seen) {
      return op.kind == aio::OpKind::kWrite && op.data_file &&
                     Any(seen, StepEvent::kWriteStarted, 13)
                 ? ENOSPC
                 : 0;
    });
    auto failed = f.swapper->Step(2, f.Inputs());
    f.trace->SetFault(nullptr);
    ASSERT_FALSE(failed.ok());
    EXPECT_EQ(StatusErrno(failed.status()), ENOSPC) << failed.status();
    EXPECT_THAT(failed.status().message(), HasSubstr("1 partition had stepped (12)"));
    EXPECT_THAT(f.swapper->Abort(), ::testing::ElementsAre(12));
    EXPECT_THAT(f.swapper->Abort(), ::testing::IsEmpty());  // said once
    for (size_t i = 0; i < f.parts.size(); ++i) {
      const bool landed = f.parts[i].first == 12;
      const Reference& want = landed ? f.ref : before;
      const auto [p, m, v] = f.Read(i);
      EXPECT_EQ(0, std::memcmp(p.data(), want.p[i].data(), p.size() * 4)) << f.parts[i].first;
      EXPECT_EQ(0, std::memcmp(v.data(), want.v[i].data(), v.size() * 4)) << f.parts[i].first;
      EXPECT_EQ(f.copies[i], landed ? f.ref.copy[i] : copies_before[i]) << f.parts[i].first;
    }
    auto corrupt = f.store->Verify();
    ASSERT_TRUE(corrupt.ok()) << corrupt.status();
    EXPECT_TRUE(corrupt->empty());
    // The caller steps the others; together, the step that never failed.
    std::vector<StepInput> rest;
    for (const StepInput& in : f.Inputs()) {
      if (in.id != 12) rest.push_back(in);
    }
    ASSERT_TRUE(f.swapper->Step(2, rest).ok());
    f.ExpectMatchesReference();
    f.ExpectCopiesMatchReference();
  }
}

// commit_each: an overflow could not be undone once a partition landed, so Stage refuses
// check_overflow (Step checks every gradient first); host_early goes with NVMe-resident
// partitions; Abort reports what had landed.
TEST(SwapperCommitEachTest, CheckOverflowIsRefusedAndHostEarlyIsAcceptedWithNvmeState) {
  Fixture f(CommitEach(true, 220000));
  f.NewGrads(1);
  ASSERT_TRUE(f.swapper->Begin(0).ok());
  absl::Status s = f.swapper->Stage(1, f.Inputs(), {.check_overflow = true});
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(s.message(), HasSubstr("check_overflow with commit_each"));
  EXPECT_THAT(f.swapper->Abort(), ::testing::IsEmpty());
  f.ExpectMastersStepped(0, f.ref);
  // Step's own check: an inf in the last gradient skips the step, nothing landed.
  f.grads.back()[0] = std::numeric_limits<float>::infinity();
  auto r = f.swapper->Step(1, f.Inputs(), {.check_overflow = true});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(r->overflow);
  f.ExpectMastersStepped(0, f.ref);
  f.NewGrads(1);
  const Reference before = f.ref;
  f.StepReference(1);
  ASSERT_TRUE(f.swapper->Begin(0, /*host_early=*/true).ok());
  std::vector<StepInput> in = f.Inputs();
  ASSERT_TRUE(f.swapper->Stage(1, absl::MakeConstSpan(in).subspan(0, 3)).ok());  // 10, 11, 12
  f.trace->WaitUntil(
      [&](const std::vector<Entry>& x) {
        return Any(x, StepEvent::kStepFinished, 10) && Any(x, StepEvent::kStepFinished, 11) &&
               Any(x, StepEvent::kStepFinished, 12);
      },
      "10, 11 and 12 stepped");  // 12's write is under way: Abort waits for it
  EXPECT_THAT(f.swapper->Abort(), ::testing::UnorderedElementsAre(10, 11, 12));
  f.ExpectMastersStepped(3, before);
}

// commit_each: a CopySink takes each NVMe-resident partition's param copy once its state has
// landed (the Runtime's way to write a parameter homed on NVMe without holding every copy); one
// whose state did not land gets none, and a sink that cannot place one leaves the step standing.
TEST(SwapperCommitEachTest, ACopySinkTakesEachCopyOnceItsStateLanded) {
  Fixture f(CommitEach(true, 220000));  // 12 and 13 on NVMe
  f.NewGrads(1);
  f.StepReference(1);
  std::vector<StepInput> in = f.Inputs();
  Mutex mu;
  std::vector<std::pair<tiering::PartitionId, tiering::PartitionId>> placed;  // (id, target)
  std::atomic<bool> refuse13{false};
  PipelinedOptimizerSwapper::CopySink sink;
  sink.get = [&](tiering::PartitionId id, tiering::PartitionId target) -> absl::StatusOr<void*> {
    EXPECT_EQ(target, id + 100);
    EXPECT_TRUE(Any(f.trace->entries(), StepEvent::kWriteStarted, id)) << "before its write";
    if (id == 13 && refuse13) return absl::ResourceExhaustedError("no room for 13's weights");
    for (size_t i = 0; i < f.parts.size(); ++i) {
      if (f.parts[i].first == id) return static_cast<void*>(f.copies[i].data());
    }
    return absl::NotFoundError("unknown partition");
  };
  sink.done = [&](tiering::PartitionId id, tiering::PartitionId target, bool) {
    MutexLock lock(&mu);
    placed.emplace_back(id, target);
  };
  for (StepInput& s : in) {
    if (!f.swapper->on_nvme(s.id)) continue;
    s.param_copy = nullptr;
    s.copy_to_sink = true;
    s.sink_target = s.id + 100;
  }
  ASSERT_TRUE(f.swapper->Begin(0).ok());
  ASSERT_TRUE(f.swapper->Stage(1, in, {}, {}, sink).ok());
  ASSERT_TRUE(f.swapper->Commit().ok());
  f.ExpectMatchesReference();
  f.ExpectCopiesMatchReference();  // the host-resident ones' as before, the NVMe ones' by the sink
  {
    MutexLock lock(&mu);
    EXPECT_THAT(placed, ::testing::ElementsAre(
                            std::pair<tiering::PartitionId, tiering::PartitionId>{12, 112},
                            std::pair<tiering::PartitionId, tiering::PartitionId>{13, 113}));
    placed.clear();
  }
  // Step 2: the sink cannot place 13's copy; the step stands (13's state landed), 13's copy is
  // step 1's, and done is not called for it.
  const auto copies_before = f.copies;
  f.NewGrads(2);
  f.StepReference(2);
  refuse13 = true;
  ASSERT_TRUE(f.swapper->Begin(0).ok());
  ASSERT_TRUE(f.swapper->Stage(2, in, {}, {}, sink).ok());
  ASSERT_TRUE(f.swapper->Commit().ok());
  f.ExpectMatchesReference();
  for (size_t i = 0; i < f.parts.size(); ++i) {
    EXPECT_EQ(f.copies[i], f.parts[i].first == 13 ? copies_before[i] : f.ref.copy[i])
        << f.parts[i].first;
  }
  {
    MutexLock lock(&mu);
    EXPECT_THAT(placed, ::testing::ElementsAre(
                            std::pair<tiering::PartitionId, tiering::PartitionId>{12, 112}));
  }
  // Misuse: a sink input without a sink, or host-resident, or without commit_each.
  ASSERT_TRUE(f.swapper->Begin(0).ok());
  absl::Status no_sink = f.swapper->Stage(3, in);
  EXPECT_THAT(no_sink.message(), HasSubstr("no CopySink was given"));
  std::vector<StepInput> host_one = {in[0]};
  host_one[0].param_copy = nullptr;
  host_one[0].copy_to_sink = true;
  EXPECT_THAT(f.swapper->Stage(3, host_one, {}, {}, sink).message(),
              HasSubstr("its state is host-resident"));
  EXPECT_THAT(f.swapper->Abort(), ::testing::IsEmpty());
  Fixture whole({true, true, 220000});
  ASSERT_TRUE(whole.swapper->Begin(0).ok());
  EXPECT_THAT(whole.swapper->Stage(1, in, {}, {}, sink).message(),
              HasSubstr("the swapper has no commit_each"));
  whole.swapper->Abort();
}

// commit_each: a load writes each NVMe-resident partition at once; one that fails part way leaves
// those written, and a second load puts everything right.
TEST(SwapperCommitEachTest, ALoadWritesEachPartitionAsItComes) {
  Fixture f(CommitEach(true, 0));
  f.NewGrads(1);
  f.StepReference(1);  // the state to load: the reference's after one step
  auto load = [&](size_t upto) {
    EXPECT_TRUE(f.swapper->BeginLoad().ok());
    for (size_t i = 0; i < upto; ++i) {
      EXPECT_TRUE(f.swapper->Load(f.parts[i].first, f.ref.p[i], f.ref.m[i], f.ref.v[i]).ok());
    }
  };
  Fixture fresh(CommitEach(true, 0));  // the initial state, to compare with
  load(2);
  f.swapper->AbortLoad();
  for (size_t i = 0; i < f.parts.size(); ++i) {
    const auto got = f.Read(i)[0];
    const auto& want = i < 2 ? f.ref.p[i] : fresh.ref.p[i];
    EXPECT_EQ(0, std::memcmp(got.data(), want.data(), got.size() * 4)) << f.parts[i].first;
  }
  load(f.parts.size());
  ASSERT_TRUE(f.swapper->CommitLoad().ok());
  f.ExpectMatchesReference();
}

// sub_group_elements: partitions larger than a sub-group are read, stepped and written in pieces
// of it (12: 40 pieces of 5000, the last 1613; 13: 8; 11: 4), each its own blob: the results are
// the bits of whole partitions, in every mode; the ring is as large as a sub-group, not the
// largest partition; loads and reads go piece by piece.
OptimizerSwapperConfig SubGroups(OptimizerSwapperConfig c, uint64_t elements = 5000) {
  c.sub_group_elements = elements;
  return c;
}

TEST(SwapperSubGroupTest, CutPartitionsStepBitwiseAsWholeOnesWithTheRingASubGroup) {
  for (OptimizerSwapperConfig c :
       {OptimizerSwapperConfig{true, true, 0}, OptimizerSwapperConfig{false, false, 0},
        OptimizerSwapperConfig{true, true, 220000}, CommitEach(true, 0), CommitEach(false, 0)}) {
    c = SubGroups(c);
    SCOPED_TRACE(absl::StrCat(c.pipeline_read ? "pipelined" : "serial", " max_in_cpu ",
                              c.max_in_cpu_bytes, c.commit_each ? " commit_each" : ""));
    Fixture f(c);
    ASSERT_NO_FATAL_FAILURE(f.StepMatchingTheReference(3));
    uint64_t in_cpu = 0;
    for (const auto& [id, n] : kParts) in_cpu += f.swapper->on_nvme(id) ? 0 : n * 12;
    // The ring's buffers (and commit_each's copy buffers) hold a sub-group.
    const uint64_t slot = 5000 * 12 + (c.commit_each ? 5000 * 4 : 0);
    EXPECT_LE(f.host.counts().peak_bytes,
              f.swapper->buffer_count() * slot + in_cpu + f.swapper->copy_staging_bytes());
    // Each piece a blob: no read or write of the store's data larger than one.
    for (const Entry& e : f.trace->entries()) {
      if (e.io && e.data_file) {
        EXPECT_LE(e.length, (5000u * 12 + 4095) / 4096 * 4096) << e.offset;
      }
    }
    std::set<tiering::PartitionId> keys;
    for (const tiering::PartitionRecord& r : f.store->List()) keys.insert(r.id);
    EXPECT_TRUE(keys.contains(12) && keys.contains(12 | (uint64_t{39} << 40)));
    EXPECT_FALSE(keys.contains(12 | (uint64_t{40} << 40)));
    // A load goes piece by piece too: the reference's state, loaded, reads back as it was.
    Fixture other(c);
    ASSERT_TRUE(other.swapper->BeginLoad().ok());
    for (size_t i = 0; i < f.parts.size(); ++i) {
      ASSERT_TRUE(other.swapper->Load(f.parts[i].first, f.ref.p[i], f.ref.m[i], f.ref.v[i]).ok());
    }
    ASSERT_TRUE(other.swapper->CommitLoad().ok());
    other.ref = f.ref;
    other.ExpectMatchesReference();
  }
}

// A staged step with its gradients from a GradSource and its copies to a CopySink: each
// partition's gradient is asked for once and let go once, after its last piece stepped; each
// sink target asked for once and given back once, after its last piece landed.
TEST(SwapperSubGroupTest, ASourceAndASinkAreAskedOnceAPartition) {
  Fixture f(SubGroups(CommitEach(true, 220000)));  // 12 (40 pieces) and 13 (8) on NVMe
  f.NewGrads(1);
  f.StepReference(1);
  Mutex mu;
  std::vector<std::string> calls;
  auto add = [&](std::string s) {
    MutexLock lock(&mu);
    calls.push_back(std::move(s));
  };
  PipelinedOptimizerSwapper::GradSource source;
  source.get = [&](tiering::PartitionId id) -> absl::StatusOr<const void*> {
    add(absl::StrCat("grad ", id));
    for (size_t i = 0; i < f.parts.size(); ++i) {
      if (f.parts[i].first == id) return static_cast<const void*>(f.grads[i].data());
    }
    return absl::NotFoundError("no such gradient");
  };
  source.done = [&](tiering::PartitionId id) { add(absl::StrCat("let go ", id)); };
  PipelinedOptimizerSwapper::CopySink sink;
  sink.get = [&](tiering::PartitionId id, tiering::PartitionId) -> absl::StatusOr<void*> {
    add(absl::StrCat("sink ", id));
    for (size_t i = 0; i < f.parts.size(); ++i) {
      if (f.parts[i].first == id) return static_cast<void*>(f.copies[i].data());
    }
    return absl::NotFoundError("no such partition");
  };
  sink.done = [&](tiering::PartitionId id, tiering::PartitionId, bool whole) {
    add(absl::StrCat("sink done ", id, whole ? "" : " in part"));
  };
  std::vector<StepInput> in = f.Inputs();
  for (StepInput& s : in) {
    if (!f.swapper->on_nvme(s.id)) continue;
    s.grad = nullptr;
    s.param_copy = nullptr;
    s.copy_to_sink = true;
    s.sink_target = s.id;
  }
  ASSERT_TRUE(f.swapper->Begin(0).ok());
  ASSERT_TRUE(f.swapper->Stage(1, in, {}, source, sink).ok());
  ASSERT_TRUE(f.swapper->Commit().ok());
  f.ExpectMatchesReference();
  f.ExpectCopiesMatchReference();
  MutexLock lock(&mu);
  for (tiering::PartitionId id : {12, 13}) {
    for (const char* what : {"grad ", "let go ", "sink ", "sink done "}) {
      EXPECT_EQ(std::count(calls.begin(), calls.end(), absl::StrCat(what, id)), 1)
          << what << id << ": " << absl::StrJoin(calls, "; ");
    }
  }
  auto at = [&](const std::string& s) { return std::find(calls.begin(), calls.end(), s); };
  EXPECT_LT(at("grad 12"), at("let go 12"));
  EXPECT_LT(at("let go 12"), at("grad 13"));  // one gradient held at a time
  EXPECT_LT(at("sink 12"), at("sink done 12"));
}

// commit_each: a write fails in the middle of partition 12 (its 3rd piece). 12 is not reported
// stepped; its first two pieces are (state and copy), the rest not; a step of 12 at another t is
// refused; stepping it again at the same t steps only the others and remakes the whole param copy
// (the caller's buffer given anew, garbage): together, the bits of a step that never failed.
TEST(SwapperSubGroupTest, AWriteThatFailsInsideAPartitionLeavesItsPiecesAndTheRetryEndsIt) {
  for (bool pipelined : {true, false}) {
    SCOPED_TRACE(pipelined ? "pipelined" : "serial");
    Fixture f(SubGroups(CommitEach(pipelined, 220000)));
    ASSERT_TRUE(f.swapper->Step(1, f.Inputs()).ok());
    f.StepReference(1);
    const Reference before = f.ref;
    f.NewGrads(2);
    f.StepReference(2);
    f.trace->Clear();
    f.trace->SetFault([](const Entry& op, const std::vector<Entry>& seen) {
      const auto writes = std::count_if(seen.begin(), seen.end(), [](const Entry& e) {
        return e.Is(StepEvent::kWriteStarted, 12);
      });
      return op.kind == aio::OpKind::kWrite && op.data_file && writes == 3 ? ENOSPC : 0;
    });
    auto failed = f.swapper->Step(2, f.Inputs());
    f.trace->SetFault(nullptr);
    ASSERT_FALSE(failed.ok());
    EXPECT_EQ(StatusErrno(failed.status()), ENOSPC) << failed.status();
    EXPECT_THAT(failed.status().message(), HasSubstr("had stepped in part (12: "));
    EXPECT_THAT(failed.status().message(), Not(HasSubstr("nothing was changed")));
    const std::vector<tiering::PartitionId> stepped = f.swapper->Abort();
    EXPECT_THAT(stepped, ::testing::Not(::testing::Contains(12)));
    const size_t i12 = 2;
    ASSERT_EQ(f.parts[i12].first, 12u);
    // Its state is not of one step: ReadState refuses it (a checkpoint would be torn).
    std::vector<float> p(196613), m(196613), v(196613);
    absl::Status torn =
        f.swapper->ReadState(12, absl::MakeSpan(p), absl::MakeSpan(m), absl::MakeSpan(v));
    EXPECT_EQ(torn.code(), absl::StatusCode::kFailedPrecondition) << torn;
    EXPECT_THAT(torn.message(), HasSubstr("its state is not of one step"));
    // Each piece, read from the store, is step 2's or step 1's whole (state and copy): 0 and 1
    // step 2's, 2 step 1's; later ones either (pipelined, their writes may have been under way).
    int landed = 0;
    for (uint64_t j = 0; j < 40; ++j) {
      const uint64_t at = j * 5000, n = std::min<uint64_t>(5000, 196613 - at);
      std::vector<float> blob(3 * n);
      ASSERT_TRUE(
          f.store
              ->Get(12 | (j << 40),
                    absl::MakeSpan(reinterpret_cast<std::byte*>(blob.data()), blob.size() * 4))
              .ok());
      std::copy(blob.begin(), blob.begin() + n, p.begin() + at);
      std::copy(blob.begin() + n, blob.begin() + 2 * n, m.begin() + at);
      std::copy(blob.begin() + 2 * n, blob.end(), v.begin() + at);
      auto same = [&](const std::vector<float>& a, const std::vector<float>& b) {
        return std::memcmp(a.data() + at, b.data() + at, n * 4) == 0;
      };
      const bool now = same(p, f.ref.p[i12]) && same(m, f.ref.m[i12]) && same(v, f.ref.v[i12]);
      const bool then = same(p, before.p[i12]) && same(m, before.m[i12]) && same(v, before.v[i12]);
      EXPECT_NE(now, then) << "piece " << j;
      EXPECT_TRUE(j >= 2 || now) << "piece " << j;
      EXPECT_TRUE(j != 2 || then) << "piece " << j;
      const auto& copy = now ? f.ref.copy[i12] : before.copy[i12];
      EXPECT_TRUE(std::equal(copy.begin() + at, copy.begin() + at + n, f.copies[i12].begin() + at))
          << "piece " << j;
      landed += now;
    }
    auto corrupt = f.store->Verify();
    ASSERT_TRUE(corrupt.ok()) << corrupt.status();
    EXPECT_TRUE(corrupt->empty());
    // Another t is refused, naming the one accepted.
    std::vector<StepInput> only12 = {f.Inputs()[i12]};
    auto wrong = f.swapper->Step(3, only12);
    EXPECT_EQ(wrong.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(failed.status().message(),
                HasSubstr(absl::StrCat("12: ", landed, " of its 40 sub-groups stepped to step 2")));
    EXPECT_THAT(wrong.status().message(),
                HasSubstr(absl::StrCat(landed, " of its 40 sub-groups stepped to step 2")));
    // The retry at t 2 of every partition but those that stepped, 12's into a fresh copy buffer.
    std::fill(f.copies[i12].begin(), f.copies[i12].end(), 0x7777);
    std::vector<StepInput> rest;
    for (const StepInput& s : f.Inputs()) {
      if (std::find(stepped.begin(), stepped.end(), s.id) == stepped.end()) rest.push_back(s);
    }
    // A retry whose first write fails too says 12 is still stepped in part, not that nothing
    // changed.
    f.trace->Clear();
    f.trace->SetFault([](const Entry& op, const std::vector<Entry>&) {
      return op.kind == aio::OpKind::kWrite && op.data_file ? ENOSPC : 0;
    });
    auto again = f.swapper->Step(2, rest);
    f.trace->SetFault(nullptr);
    ASSERT_FALSE(again.ok());
    EXPECT_THAT(again.status().message(),
                HasSubstr(absl::StrCat("12: ", landed, " of its 40 sub-groups stepped to step 2")));
    EXPECT_THAT(again.status().message(), Not(HasSubstr("nothing was changed")));
    std::vector<tiering::PartitionId> stepped_again = f.swapper->Abort();
    rest.erase(std::remove_if(rest.begin(), rest.end(),
                              [&](const StepInput& s) {
                                return std::find(stepped_again.begin(), stepped_again.end(),
                                                 s.id) != stepped_again.end();
                              }),
               rest.end());
    f.trace->Clear();
    auto retried = f.swapper->Step(2, rest);
    ASSERT_TRUE(retried.ok()) << retried.status();
    // The pieces that had stepped only remade their copies: the others written.
    int writes = 0;
    for (const Entry& e : f.trace->entries()) writes += e.Is(StepEvent::kWriteStarted, 12);
    EXPECT_LE(writes, 40 - landed);  // (the failed retry may have landed one more)
    EXPECT_GT(writes, 0);
    const auto after = f.Read(i12);
    EXPECT_EQ(0, std::memcmp(after[0].data(), f.ref.p[i12].data(), after[0].size() * 4));
    EXPECT_EQ(0, std::memcmp(after[1].data(), f.ref.m[i12].data(), after[1].size() * 4));
    EXPECT_EQ(0, std::memcmp(after[2].data(), f.ref.v[i12].data(), after[2].size() * 4));
    EXPECT_EQ(f.copies[i12], f.ref.copy[i12]);
    // 12 is whole at step 2: step 3 is taken as any other.
    f.NewGrads(3);
    f.StepReference(3);
    ASSERT_TRUE(f.swapper->Step(3, f.Inputs()).ok());
    f.ExpectMatchesReference();
    f.ExpectCopiesMatchReference();
  }
}

// A CopySink with a write failing inside partition 12: the sink is given back once, "in part"
// (the landed pieces' copies are there, not the rest), so the Runtime does not count it copied;
// the retry at the same t fills the whole target (landed pieces' copies remade) and gives it
// back whole.
TEST(SwapperSubGroupTest, ASinkGivenPartOfACopyIsToldSoAndTheRetryMakesItWhole) {
  Fixture f(SubGroups(CommitEach(true, 220000)));
  f.NewGrads(1);
  f.StepReference(1);
  Mutex mu;
  std::vector<std::string> calls;
  PipelinedOptimizerSwapper::CopySink sink;
  sink.get = [&](tiering::PartitionId id, tiering::PartitionId) -> absl::StatusOr<void*> {
    for (size_t i = 0; i < f.parts.size(); ++i) {
      if (f.parts[i].first == id) return static_cast<void*>(f.copies[i].data());
    }
    return absl::NotFoundError("no such partition");
  };
  sink.done = [&](tiering::PartitionId id, tiering::PartitionId, bool whole) {
    MutexLock lock(&mu);
    calls.push_back(absl::StrCat(id, whole ? " whole" : " in part"));
  };
  std::vector<StepInput> in = f.Inputs();
  for (StepInput& s : in) {
    if (!f.swapper->on_nvme(s.id)) continue;
    s.param_copy = nullptr;
    s.copy_to_sink = true;
    s.sink_target = s.id;
  }
  f.trace->SetFault([](const Entry& op, const std::vector<Entry>& seen) {
    const auto writes = std::count_if(seen.begin(), seen.end(), [](const Entry& e) {
      return e.Is(StepEvent::kWriteStarted, 12);
    });
    return op.kind == aio::OpKind::kWrite && op.data_file && writes == 3 ? ENOSPC : 0;
  });
  ASSERT_TRUE(f.swapper->Begin(0).ok());
  ASSERT_TRUE(f.swapper->Stage(1, in, {}, {}, sink).ok());
  ASSERT_FALSE(f.swapper->Commit().ok());
  f.trace->SetFault(nullptr);
  const std::vector<tiering::PartitionId> stepped = f.swapper->Abort();
  {
    MutexLock lock(&mu);
    EXPECT_THAT(calls, ::testing::Contains("12 in part"));
    EXPECT_THAT(calls, ::testing::Not(::testing::Contains("12 whole")));
    calls.clear();
  }
  std::fill(f.copies[2].begin(), f.copies[2].end(), 0x7777);  // 12's target, anew
  std::vector<StepInput> rest;
  for (const StepInput& s : in) {
    if (std::find(stepped.begin(), stepped.end(), s.id) == stepped.end()) rest.push_back(s);
  }
  ASSERT_TRUE(f.swapper->Begin(0).ok());
  ASSERT_TRUE(f.swapper->Stage(1, rest, {}, {}, sink).ok());
  ASSERT_TRUE(f.swapper->Commit().ok());
  f.ExpectMatchesReference();
  f.ExpectCopiesMatchReference();
  MutexLock lock(&mu);
  EXPECT_EQ(std::count(calls.begin(), calls.end(), "12 whole"), 1) << absl::StrJoin(calls, "; ");
}

TEST(SwapperSubGroupTest, IdsThatCannotKeyTheirPiecesAreRefused) {
  ScratchDir dir;
  aio::EngineOptions eo;
  eo.on_warning = [](absl::string_view) {};
  auto engine = *aio::Engine::Create(aio::AioConfig{}, eo);
  tiering::NvmeStoreOptions so;
  so.capacity_bytes = 1 << 20;
  so.on_warning = [](absl::string_view) {};
  auto store = *tiering::NvmeStore::Open(dir.File("swap"), so, engine.get());
  auto adam = *optim_cpu::CpuAdam::Create(optim_cpu::AdamConfig{});
  tiering::HostMemoryResource host;
  auto cut = PipelinedOptimizerSwapper::Create(
      store.get(), adam.get(), &host, SubGroups({true, true, 0}, 100), {{uint64_t{1} << 40, 1000}});
  EXPECT_EQ(cut.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(cut.status().message(), HasSubstr("ids below 2^40"));
  // Not cut, but with sub-groups on: refused too (its key could be a cut partition's piece: 5's
  // second piece is 5 | 1 << 40).
  auto whole = PipelinedOptimizerSwapper::Create(store.get(), adam.get(), &host,
                                                 SubGroups({true, true, 0}, 100),
                                                 {{5, 200}, {(uint64_t{1} << 40) | 5, 100}});
  EXPECT_EQ(whole.status().code(), absl::StatusCode::kInvalidArgument);
  // Without sub-groups, any id; and store_key_bits among the pieces' bits is refused.
  EXPECT_TRUE(PipelinedOptimizerSwapper::Create(store.get(), adam.get(), &host, {true, true, 0},
                                                {{(uint64_t{1} << 40) | 5, 100}})
                  .ok());
  OptimizerSwapperConfig keyed = SubGroups({true, true, 0}, 100);
  keyed.store_key_bits = uint64_t{1} << 50;
  auto bits = PipelinedOptimizerSwapper::Create(store.get(), adam.get(), &host, keyed, {{5, 200}});
  EXPECT_THAT(bits.status().message(), HasSubstr("store_key_bits"));
}

OptimizerSwapperConfig ReadAhead(OptimizerSwapperConfig c, uint64_t bytes = uint64_t{1} << 40) {
  c.read_ahead_bytes = bytes;
  return c;
}

// A held step (clipping learnt after backward): the NVMe-resident state is read ahead as it is
// staged, nothing steps, lands or is written before Release, and the step then is bitwise the
// step in memory at Release's scale (the staged inputs' own grad_scale replaced), param copies
// included; in every mode (pipelined or not, commit_each, sub-groups). Room for everything.
TEST(SwapperHeldTest, AHeldStepReadsAheadStepsNothingBeforeReleaseAndIsTheStepAtItsScale) {
  for (OptimizerSwapperConfig config :
       {ReadAhead({true, true, 220000}), ReadAhead({false, false, 0}), ReadAhead({true, true, 0}),
        ReadAhead(CommitEach(true, 220000)), ReadAhead(SubGroups({true, true, 0}))}) {
    SCOPED_TRACE(absl::StrCat(config.pipeline_read, " ", config.max_in_cpu_bytes, " ",
                              config.commit_each, " ", config.sub_group_elements));
    Fixture f(config);
    // The room is capped at what every NVMe-resident sub-group takes.
    uint64_t most = 0;
    for (const auto& [id, n] : f.parts) {
      if (!f.swapper->on_nvme(id)) continue;
      const uint64_t g = config.sub_group_elements > 0 ? config.sub_group_elements : n;
      for (uint64_t at = 0; at < n; at += g) {
        const uint64_t k = std::min(g, n - at);
        most +=
            (k * 12 + 4095) / 4096 * 4096 + (config.commit_each ? (k * 4 + 4095) / 4096 * 4096 : 0);
      }
    }
    EXPECT_EQ(f.swapper->read_ahead_bytes(), most);
    for (int64_t t = 1; t <= 3; ++t) {
      f.NewGrads(static_cast<int>(t));
      f.trace->Clear();
      const std::vector<StepInput> in = f.Inputs();
      const auto copies_before = f.copies;
      ASSERT_TRUE(f.swapper->Begin(f.swapper->copy_staging_bytes() + (1 << 20), false, true).ok());
      const size_t half = in.size() / 2;
      // Staged at a scale Release replaces (not multiplies).
      ASSERT_TRUE(
          f.swapper->Stage(t, absl::MakeConstSpan(in).subspan(0, half), {.grad_scale = 0.5f}).ok());
      ASSERT_TRUE(
          f.swapper->Stage(t, absl::MakeConstSpan(in).subspan(half), {.grad_scale = 0.5f}).ok());
      // From step 2 on (not with commit_each) the room holds the state step t-1 committed: read
      // again nothing.
      const bool reuse = t > 1 && !config.commit_each;
      for (const auto& [id, n] : f.parts) {
        if (!f.swapper->on_nvme(id)) continue;
        const StepEvent event = reuse ? StepEvent::kReadReused : StepEvent::kReadStarted;
        f.trace->WaitUntil(
            [id = id, event](const std::vector<Entry>& x) { return Any(x, event, id); },
            absl::StrCat("partition ", id, reuse ? " reused" : " read", " before Release"));
      }
      EXPECT_THAT(f.trace->stuck(), ::testing::IsEmpty());
      for (const Entry& e : f.trace->entries()) {
        EXPECT_FALSE(!e.io &&
                     (e.event == StepEvent::kStepStarted || e.event == StepEvent::kWriteStarted))
            << "partition " << e.id << " stepped or was written before Release";
        EXPECT_FALSE(e.io && e.kind == aio::OpKind::kWrite) << "a write before Release";
      }
      EXPECT_EQ(f.copies, copies_before);
      f.ExpectMatchesReference();
      const float scale = 0.37f / static_cast<float>(t);
      ASSERT_TRUE(f.swapper->Release(scale).ok());
      auto r = f.swapper->Commit();
      ASSERT_TRUE(r.ok()) << r.status();
      if (reuse) {
        EXPECT_EQ(r->bytes_read, 0u);
        EXPECT_GT(r->bytes_reused, 0u);
        for (const auto& [id, n] : f.parts) {
          EXPECT_FALSE(Any(f.trace->entries(), StepEvent::kReadStarted, id))
              << "partition " << id << " read again";
        }
      } else {
        EXPECT_GT(r->bytes_read, 0u);
        EXPECT_EQ(r->bytes_reused, 0u);
      }
      f.StepReference(t, {.grad_scale = scale});
      f.ExpectMatchesReference();
      f.ExpectCopiesMatchReference();
    }
  }
}

// Partitions 12, 13, 15 and 16 NVMe-resident (past 220000 bytes of host memory), with a read-ahead
// room of `room` bytes.
const Parts kHeldParts = {{10, 1000 + 7}, {11, 16384 + 1}, {12, 65536 * 3 + 5},
                          {13, 40000},    {15, 30000},     {16, 20000},
                          {14, 3}};
uint64_t StateSlot(uint64_t n) { return (n * 12 + 4095) / 4096 * 4096; }

// A held step 1 over every partition: the reads of `ahead` start before Release, those of `after`
// do not (a worker that read them ahead would have started them within 200 ms); then it is
// released at scale 1 and is the step in memory.
void ExpectReadAheadThenTheStep(Fixture& f, std::vector<tiering::PartitionId> ahead,
                                std::vector<tiering::PartitionId> after) {
  f.NewGrads(1);
  ASSERT_TRUE(f.swapper->Begin(f.swapper->copy_staging_bytes() + (1 << 20), false, true).ok());
  ASSERT_TRUE(f.swapper->Stage(1, f.Inputs()).ok());
  for (tiering::PartitionId id : ahead) {
    f.trace->WaitUntil(
        [id](const std::vector<Entry>& x) { return Any(x, StepEvent::kReadStarted, id); },
        absl::StrCat("partition ", id, " read before Release"));
  }
  EXPECT_THAT(f.trace->stuck(), ::testing::IsEmpty());
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  for (tiering::PartitionId id : after) {
    EXPECT_FALSE(Any(f.trace->entries(), StepEvent::kReadStarted, id))
        << "partition " << id << " read ahead without room";
  }
  ASSERT_TRUE(f.swapper->Release(1.0f).ok());
  auto r = f.swapper->Commit();
  ASSERT_TRUE(r.ok()) << r.status();
  f.StepReference(1);
  f.ExpectMatchesReference();
  f.ExpectCopiesMatchReference();
}

// The read-ahead room holds the first two NVMe-resident partitions: those are read before
// Release, the others after it, through the ring; the step is the same.
TEST(SwapperHeldTest, WhatTheRoomDoesNotHoldIsReadAfterRelease) {
  const uint64_t room = StateSlot(65536 * 3 + 5) + StateSlot(40000);
  Fixture f(ReadAhead({true, true, 220000}, room), kHeldParts);
  ASSERT_TRUE(f.swapper->on_nvme(15) && f.swapper->on_nvme(16));
  EXPECT_EQ(f.swapper->read_ahead_bytes(), room);
  ExpectReadAheadThenTheStep(f, {12, 13}, {15, 16});
}

// A sub-group the room cannot hold is left to the ring and a later one that fits is still read
// ahead: the room holds 13 and 16, not 15 (12, the first, and 13 are read as the step begins).
TEST(SwapperHeldTest, ASubGroupTooLargeForTheRoomIsLeftToTheRingAndLaterOnesReadAhead) {
  Fixture f(ReadAhead({true, true, 220000}, StateSlot(40000) + StateSlot(20000)), kHeldParts);
  ExpectReadAheadThenTheStep(f, {12, 13, 16}, {15});
}

// Abort before Release changes nothing (commit_each too: nothing has landed); a read that fails
// ahead fails the Commit with nothing changed; the retry is the step that never failed.
TEST(SwapperHeldTest, AbortAndAFailedReadAheadChangeNothing) {
  for (OptimizerSwapperConfig config :
       {ReadAhead({true, true, 220000}), ReadAhead(CommitEach(true, 220000))}) {
    SCOPED_TRACE(config.commit_each ? "commit_each" : "step");
    Fixture f(config);
    f.NewGrads(1);
    const auto copies_before = f.copies;
    const uint64_t generation = f.store->generation();
    ASSERT_TRUE(f.swapper->Begin(f.swapper->copy_staging_bytes() + (1 << 20), false, true).ok());
    ASSERT_TRUE(f.swapper->Stage(1, f.Inputs()).ok());
    f.trace->WaitUntil(
        [](const std::vector<Entry>& x) { return Any(x, StepEvent::kReadStarted, 13); },
        "partition 13 read ahead");
    EXPECT_THAT(f.swapper->Abort(), ::testing::IsEmpty());
    EXPECT_EQ(f.store->generation(), generation);
    f.ExpectMatchesReference();
    EXPECT_EQ(f.copies, copies_before);
    // (With commit_each, once Released, each partition lands as it steps, as in any of its steps:
    // a read failing then leaves what landed before it, AWriteThatFailsLeavesWhatLanded... above.)
    if (config.commit_each) continue;
    auto record = f.store->Find(13);
    ASSERT_TRUE(record.ok()) << record.status();
    const std::vector<tiering::StoreExtent> extents = record->extents;
    f.trace->SetFault([extents](const Entry& op, const std::vector<Entry>&) {
      return op.kind == aio::OpKind::kRead && op.data_file && Overlaps(op, extents) ? EIO : 0;
    });
    ASSERT_TRUE(f.swapper->Begin(f.swapper->copy_staging_bytes() + (1 << 20), false, true).ok());
    ASSERT_TRUE(f.swapper->Stage(1, f.Inputs()).ok());
    ASSERT_TRUE(f.swapper->Release(1.0f).ok());
    auto failed = f.swapper->Commit();
    ASSERT_FALSE(failed.ok());
    EXPECT_EQ(StatusErrno(failed.status()), EIO) << failed.status();
    EXPECT_THAT(f.swapper->Abort(), ::testing::IsEmpty()) << "a partition landed";
    f.ExpectMatchesReference();
    EXPECT_EQ(f.copies, copies_before);
    ASSERT_TRUE(f.swapper->Begin(f.swapper->copy_staging_bytes() + (1 << 20), false, true).ok());
    ASSERT_TRUE(f.swapper->Stage(1, f.Inputs()).ok());
    ASSERT_TRUE(f.swapper->Release(1.0f).ok());
    ASSERT_TRUE(f.swapper->Commit().ok());
    f.StepReference(1);
    f.ExpectMatchesReference();
    f.ExpectCopiesMatchReference();
  }
}

TEST(SwapperHeldTest, MisuseIsRefusedNamingWhatIsWrong) {
  Fixture f(ReadAhead({true, true, 220000}));
  f.NewGrads(1);
  EXPECT_EQ(f.swapper->Release(1).code(), absl::StatusCode::kFailedPrecondition);
  absl::Status s = f.swapper->Begin(0, true, true);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(s.message(), HasSubstr("hold and host_early"));
  EXPECT_FALSE(f.swapper->staging());
  ASSERT_TRUE(f.swapper->Begin(0).ok());  // not held
  EXPECT_EQ(f.swapper->Release(1).code(), absl::StatusCode::kFailedPrecondition);
  f.swapper->Abort();
  ASSERT_TRUE(f.swapper->Begin(f.swapper->copy_staging_bytes() + (1 << 20), false, true).ok());
  ASSERT_TRUE(f.swapper->Stage(1, f.Inputs()).ok());
  auto early = f.swapper->Commit();
  EXPECT_EQ(early.status().code(), absl::StatusCode::kFailedPrecondition) << early.status();
  EXPECT_THAT(early.status().message(), HasSubstr("before its Release"));
  EXPECT_TRUE(f.swapper->staging()) << "the held step stays open";
  s = f.swapper->Prepare();
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_THAT(s.message(), HasSubstr("Prepare of a held step before its Release"));
  EXPECT_TRUE(f.swapper->staging()) << "the held step stays open";
  for (float bad : {0.0f, -1.0f, std::numeric_limits<float>::infinity(),
                    std::numeric_limits<float>::quiet_NaN()}) {
    s = f.swapper->Release(bad);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_THAT(s.message(), HasSubstr("accepted: finite and above 0"));
  }
  ASSERT_TRUE(f.swapper->Release(0.5f).ok());
  EXPECT_EQ(f.swapper->Release(0.5f).code(), absl::StatusCode::kFailedPrecondition);
  ASSERT_TRUE(f.swapper->Commit().ok());
  f.StepReference(1, {.grad_scale = 0.5f});
  f.ExpectMatchesReference();
}

TEST(SwapperTransactionTest, MisuseIsRefusedNamingWhatIsWrong) {
  Fixture f({true, true, 220000});
  f.NewGrads(1);
  std::vector<StepInput> in = f.Inputs();
  EXPECT_EQ(f.swapper->Stage(1, in).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(f.swapper->Commit().status().code(), absl::StatusCode::kFailedPrecondition);
  f.swapper->Abort();  // nothing open: a no-op
  ASSERT_TRUE(f.swapper->Begin(0).ok());
  EXPECT_EQ(f.swapper->Begin(0).code(), absl::StatusCode::kFailedPrecondition);
  // No room was set aside for the NVMe-resident partitions' param copies.
  absl::Status s = f.swapper->Stage(1, in);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_THAT(s.message(), HasSubstr("param copies"));
  // Staged twice, across calls; a null gradient without a source.
  ASSERT_TRUE(f.swapper->Stage(1, absl::MakeConstSpan(in).subspan(0, 1)).ok());
  s = f.swapper->Stage(1, absl::MakeConstSpan(in).subspan(0, 2));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("listed twice"));
  StepInput no_grad = in[1];
  no_grad.grad = nullptr;
  EXPECT_EQ(f.swapper->Stage(1, {no_grad}).code(), absl::StatusCode::kInvalidArgument);
  // The state cannot be set while a step is staged; it can be read (the committed state).
  std::vector<float> x(f.parts[0].second);
  EXPECT_EQ(f.swapper->Initialize(f.parts[0].first, x).code(),
            absl::StatusCode::kFailedPrecondition);
  f.ExpectMatchesReference();
  EXPECT_EQ(f.swapper->Step(1, in).status().code(), absl::StatusCode::kFailedPrecondition);
  auto r = f.swapper->Commit();  // what was staged (partition 10) commits
  ASSERT_TRUE(r.ok()) << r.status();
}

}  // namespace
}  // namespace strata::swap

namespace strata::swap {
namespace {

// Loading a checkpoint's state: all or none. Nothing changes before CommitLoad (host- and
// NVMe-resident alike); AbortLoad and a CommitLoad whose manifest record fails change nothing;
// a committed load reads back as loaded and steps from there as the same state in memory does.
TEST(SwapperLoadTest, ALoadIsAllOrNone) {
  for (int how = 0; how < 3; ++how) {
    SCOPED_TRACE(how);
    Fixture f({true, true, 220000});
    std::vector<std::vector<float>> p, m, v;
    for (size_t i = 0; i < f.parts.size(); ++i) {
      const uint64_t n = f.parts[i].second;
      p.emplace_back(n, 0.5f + i);
      m.emplace_back(n, 0.25f);
      v.emplace_back(n, 0.125f);
    }
    const uint64_t generation = f.store->generation();
    ASSERT_TRUE(f.swapper->BeginLoad().ok());
    EXPECT_EQ(f.swapper->Begin(0).code(), absl::StatusCode::kFailedPrecondition);
    for (size_t i = 0; i < f.parts.size(); ++i) {
      ASSERT_TRUE(f.swapper->Load(f.parts[i].first, p[i], m[i], v[i]).ok());
    }
    f.ExpectMatchesReference();  // nothing visible yet
    if (how == 0) {
      f.swapper->AbortLoad();
    } else if (how == 1) {
      f.trace->SetFault([](const Entry& op, const std::vector<Entry>&) {
        return op.kind == aio::OpKind::kWrite && !op.data_file ? EIO : 0;
      });
      absl::Status s = f.swapper->CommitLoad();
      f.trace->SetFault(nullptr);
      EXPECT_FALSE(s.ok());
      EXPECT_THAT(s.message(), HasSubstr("nothing was changed"));
    } else {
      ASSERT_TRUE(f.swapper->CommitLoad().ok());
      f.ref.p = p;
      f.ref.m = m;
      f.ref.v = v;
    }
    EXPECT_EQ(f.store->generation(), how == 2 ? generation + 1 : generation);
    f.ExpectMatchesReference();
    f.NewGrads(3);
    ASSERT_TRUE(f.swapper->Step(1, f.Inputs()).ok());
    f.StepReference(1);
    f.ExpectMatchesReference();
  }
}

TEST(SwapperLoadTest, BadLoadsAreNamed) {
  Fixture f({true, true, 0});
  std::vector<float> x(f.parts[0].second), short_one(3);
  EXPECT_EQ(f.swapper->Load(f.parts[0].first, x, x, x).code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(f.swapper->CommitLoad().code(), absl::StatusCode::kFailedPrecondition);
  ASSERT_TRUE(f.swapper->BeginLoad().ok());
  EXPECT_EQ(f.swapper->BeginLoad().code(), absl::StatusCode::kFailedPrecondition);
  absl::Status s = f.swapper->Load(f.parts[0].first, x, short_one, x);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("given 1007, 3 and 1007"));
  EXPECT_EQ(f.swapper->Load(99, x, x, x).code(), absl::StatusCode::kNotFound);
  f.swapper->AbortLoad();
}

OptimizerSwapperConfig WriteBehind(OptimizerSwapperConfig c) {
  c.write_behind = true;
  return c;
}

// Write-behind: every step, plain or held (its state read ahead), is bitwise the step in memory
// (the state as ReadState gives it once the writes behind are in, and the param copies as Commit
// returns), in every mode that takes it; the writes are reported behind the step, their bytes in
// the next step's report.
TEST(SwapperWriteBehindTest, StepsWrittenBehindAreBitwiseTheStepInMemory) {
  for (OptimizerSwapperConfig config :
       {WriteBehind({true, true, 0}), WriteBehind({false, false, 0}),
        WriteBehind({true, true, 220000}), WriteBehind({true, true, 0, 5}),
        WriteBehind(SubGroups({true, true, 0})), WriteBehind(ReadAhead({true, true, 220000}))}) {
    SCOPED_TRACE(absl::StrCat(config.pipeline_read, " ", config.max_in_cpu_bytes, " ",
                              config.ring_buffers, " ", config.sub_group_elements, " ",
                              config.read_ahead_bytes));
    Fixture f(config);
    uint64_t nvme_bytes = 0;
    for (const auto& [id, n] : f.parts) nvme_bytes += f.swapper->on_nvme(id) ? n * 12 : 0;
    for (int64_t t = 1; t <= 3; ++t) {
      f.NewGrads(static_cast<int>(t));
      const std::vector<StepInput> in = f.Inputs();
      const bool held = config.read_ahead_bytes > 0;
      ASSERT_TRUE(f.swapper->Begin(f.swapper->copy_staging_bytes() + (1 << 20), false, held).ok());
      ASSERT_TRUE(f.swapper->Stage(t, in).ok());
      if (held) {
        ASSERT_TRUE(f.swapper->Release(1.0f).ok());
      }
      auto r = f.swapper->Commit();
      ASSERT_TRUE(r.ok()) << r.status();
      EXPECT_TRUE(r->written_behind);
      EXPECT_EQ(r->behind_bytes_written, t == 1 ? 0 : nvme_bytes);  // the last step's
      f.StepReference(t);
      f.ExpectCopiesMatchReference();  // as Commit returns
      f.ExpectMatchesReference();      // ReadState: once the writes behind are in
      EXPECT_FALSE(f.swapper->writing_behind());
    }
  }
}

// A hook that holds partition `id`'s write (its kWriteStarted) until `go` is set, at most 20 s.
struct HeldWrite {
  tiering::PartitionId id;
  Mutex mu;
  CondVar cv;
  bool go ABSL_GUARDED_BY(mu) = false;
  bool waited_out ABSL_GUARDED_BY(mu) = false;  // the hook gave up waiting
  void operator()(StepEvent e, tiering::PartitionId p) {
    if (e != StepEvent::kWriteStarted || p != id) return;
    MutexLock lock(&mu);
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
    while (!go) {
      if (!cv.WaitFor(&mu, deadline - std::chrono::steady_clock::now())) {
        waited_out = true;
        return;
      }
    }
  }
  void Go() {
    MutexLock lock(&mu);
    go = true;
    cv.SignalAll();
  }
  bool WaitedOut() {
    MutexLock lock(&mu);
    return waited_out;
  }
};

OptimizerSwapperConfig Holding(OptimizerSwapperConfig c, const std::shared_ptr<HeldWrite>& h) {
  c.on_event = [h](StepEvent e, tiering::PartitionId p) { (*h)(e, p); };
  return c;
}

// Commit returns while the last partitions' writes have not started (a swapper that waited for
// them would sit out the hook's 20 s); the store keeps the last step's state until they are in.
TEST(SwapperWriteBehindTest, CommitReturnsBeforeTheWritesAndTheStoreKeepsTheLastStepUntilThen) {
  auto hold = std::make_shared<HeldWrite>();
  hold->id = 13;
  Fixture f(Holding(WriteBehind({true, true, 0}), hold));
  f.NewGrads(1);
  const uint64_t generation = f.store->generation();
  auto r = f.swapper->Step(1, f.Inputs());
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_FALSE(hold->WaitedOut()) << "Commit waited for the held write";
  EXPECT_TRUE(f.swapper->writing_behind());
  EXPECT_EQ(f.store->generation(), generation);  // no record yet
  f.StepReference(1);
  f.ExpectCopiesMatchReference();
  hold->Go();
  ASSERT_TRUE(f.swapper->Flush().ok());
  EXPECT_EQ(f.store->generation(), generation + 1);
  f.ExpectMatchesReference();
}

// A write, or the record, that fails behind a committed step drops nothing: every call that needs
// the state fails, naming it, while writing it again fails, and the store keeps the last step's
// state; once the disk takes it, the state is the step's, bit for bit, and training goes on.
TEST(SwapperWriteBehindTest, AFailureBehindTheStepKeepsItsStateUntilItIsWritten) {
  for (int how = 0; how < 3; ++how) {
    const bool data = how != 1, held = how == 2;
    SCOPED_TRACE(held   ? "a data write from the read-ahead room fails"
                 : data ? "a data write fails"
                        : "the record fails");
    auto hold = std::make_shared<HeldWrite>();
    hold->id = 13;
    OptimizerSwapperConfig config = WriteBehind({true, true, 0});
    if (held) config = ReadAhead(config);
    Fixture f(Holding(config, hold));
    f.NewGrads(1);
    const uint64_t generation = f.store->generation();
    const std::vector<float> master_before = f.ref.p[3];
    ASSERT_TRUE(f.swapper->Begin(f.swapper->copy_staging_bytes() + (1 << 20), false, held).ok());
    ASSERT_TRUE(f.swapper->Stage(1, f.Inputs()).ok());
    if (held) {
      ASSERT_TRUE(f.swapper->Release(1.0f).ok());
    }
    ASSERT_TRUE(f.swapper->Commit().ok());
    f.StepReference(1);
    // Behind the step, every data write (or every write to the manifest: the record and the
    // compactions that would replace the log) fails, until the fault is cleared.
    f.trace->SetFault(
        [data](const Entry& op, const std::vector<Entry>&) {
          return op.kind == aio::OpKind::kWrite && op.data_file == data ? EIO : 0;
        },
        /*once=*/false);
    hold->Go();
    for (int i = 0; i < 2; ++i) {
      absl::Status s = f.swapper->Flush();
      EXPECT_EQ(StatusErrno(s), EIO) << s;
      EXPECT_THAT(s.message(), HasSubstr("optimizer step 1: its new state, written behind"));
      EXPECT_THAT(s.message(), HasSubstr("kept in host memory"));
    }
    EXPECT_TRUE(f.swapper->writing_behind());
    EXPECT_EQ(StatusErrno(f.swapper->Begin(0)), EIO);
    std::vector<float> x(f.parts[3].second), m(x.size()), v(x.size());
    EXPECT_EQ(StatusErrno(f.swapper->ReadState(13, absl::MakeSpan(x), absl::MakeSpan(m),
                                               absl::MakeSpan(v))),
              EIO);
    EXPECT_EQ(StatusErrno(f.swapper->Initialize(13, x)), EIO);
    EXPECT_EQ(StatusErrno(f.swapper->BeginLoad()), EIO);
    EXPECT_EQ(f.store->generation(), generation);
    ASSERT_TRUE(f.store->Find(13).ok());
    {
      std::vector<float> old(3 * x.size());
      ASSERT_TRUE(
          f.store->Get(13, absl::MakeSpan(reinterpret_cast<std::byte*>(old.data()), old.size() * 4))
              .ok());
      EXPECT_EQ(0, std::memcmp(old.data(), master_before.data(), x.size() * 4));
    }
    f.trace->SetFault(nullptr);
    ASSERT_TRUE(f.swapper->Flush().ok());
    EXPECT_FALSE(f.swapper->writing_behind());
    f.ExpectMatchesReference();
    f.NewGrads(2);
    ASSERT_TRUE(f.swapper->Step(2, f.Inputs()).ok());
    f.StepReference(2);
    f.ExpectMatchesReference();
    f.ExpectCopiesMatchReference();
  }
}

// Step 1, its writes behind it waited for; step 2's gradients. Returns the store's generation.
uint64_t StepOneWrittenThenGradsOfTwo(Fixture& f) {
  f.NewGrads(1);
  EXPECT_TRUE(f.swapper->Step(1, f.Inputs()).ok());
  f.StepReference(1);
  EXPECT_TRUE(f.swapper->Flush().ok());
  f.NewGrads(2);
  return f.store->generation();
}

// The commit in two phases (the ranks of a job commit only if every one can): Prepare waits for
// the staged work and returns what Commit would fail with before anything stands, the step left
// open; then Commit gives the step in memory, or Abort leaves everything as it was. Writes behind
// or not.
TEST(SwapperTransactionTest, APreparedStepIsCommittedWholeOrAbortedWithNothingChanged) {
  for (bool behind : {false, true}) {
    for (bool fail : {false, true}) {
      SCOPED_TRACE(absl::StrCat(behind ? "written behind" : "written before Commit",
                                fail ? ", a read fails" : ""));
      OptimizerSwapperConfig config{true, true, 220000};
      config.write_behind = behind;
      Fixture f(config);
      const uint64_t generation = StepOneWrittenThenGradsOfTwo(f);
      const auto copies = f.copies;
      if (fail) {
        auto record = f.store->Find(13);
        ASSERT_TRUE(record.ok()) << record.status();
        const std::vector<tiering::StoreExtent> extents = record->extents;
        f.trace->SetFault([extents](const Entry& op, const std::vector<Entry>&) {
          return op.kind == aio::OpKind::kRead && op.data_file && Overlaps(op, extents) ? EIO : 0;
        });
      }
      ASSERT_TRUE(f.swapper->Begin(f.swapper->copy_staging_bytes()).ok());
      ASSERT_TRUE(f.swapper->Stage(2, f.Inputs()).ok());
      const absl::Status prepared = f.swapper->Prepare();
      f.trace->SetFault(nullptr);
      EXPECT_TRUE(f.swapper->staging()) << "the step stays open";
      EXPECT_EQ(f.store->generation(), generation) << "nothing is committed by Prepare";
      EXPECT_EQ(f.copies, copies) << "no param copy goes out before Commit";
      if (fail) {
        ASSERT_FALSE(prepared.ok());
        EXPECT_EQ(StatusErrno(prepared), EIO) << prepared;
        EXPECT_THAT(prepared.message(), HasSubstr("optimizer step 2 (prepared to commit)"));
        EXPECT_THAT(f.swapper->Abort(), ::testing::IsEmpty());
        ASSERT_TRUE(f.swapper->Flush().ok());
        EXPECT_EQ(f.store->generation(), generation);
        EXPECT_EQ(f.copies, copies);
        f.ExpectMatchesReference();  // step 1's state
        continue;
      }
      ASSERT_TRUE(prepared.ok()) << prepared;
      auto committed = f.swapper->Commit();
      ASSERT_TRUE(committed.ok()) << committed.status();
      EXPECT_FALSE(f.swapper->staging());
      ASSERT_TRUE(f.swapper->Flush().ok());
      EXPECT_NE(f.store->generation(), generation);
      f.StepReference(2);
      f.ExpectMatchesReference();
      f.ExpectCopiesMatchReference();
    }
  }
}

// A host-resident partition's gradient asked of its source (a gradient partition the Runtime
// acquires): Prepare asks for it, and a failure then is Prepare's, not Commit's once every rank
// has prepared (an audit's finding); what it gave is held until Commit or Abort ends the step.
TEST(SwapperTransactionTest, PrepareTakesTheGradientsOfHostResidentPartitionsFromTheirSource) {
  for (int how = 0; how < 3; ++how) {  // 0: the source fails; 1: then Commit; 2: then Abort
    SCOPED_TRACE(how);
    Fixture f({true, true, 220000});
    const uint64_t generation = StepOneWrittenThenGradsOfTwo(f);
    const auto copies = f.copies;
    std::vector<StepInput> in = f.Inputs();
    ASSERT_FALSE(f.swapper->on_nvme(in[4].id));
    in[4].grad = nullptr;  // partition 14, host-resident: from the source
    int asked = 0, given_back = 0;
    PipelinedOptimizerSwapper::GradSource source;
    source.get = [&](tiering::PartitionId) -> absl::StatusOr<const void*> {
      ++asked;
      if (how == 0) return absl::ResourceExhaustedError("no room for the gradient");
      return static_cast<const void*>(f.grads[4].data());
    };
    source.done = [&](tiering::PartitionId) { ++given_back; };
    ASSERT_TRUE(f.swapper->Begin(f.swapper->copy_staging_bytes()).ok());
    ASSERT_TRUE(f.swapper->Stage(2, in, {}, source).ok());
    const absl::Status prepared = f.swapper->Prepare();
    EXPECT_EQ(asked, 1);
    EXPECT_EQ(given_back, 0) << "held until the step ends";
    if (how == 0) {
      ASSERT_FALSE(prepared.ok());
      EXPECT_THAT(prepared.message(), HasSubstr("no room for the gradient"));
      EXPECT_THAT(prepared.message(), HasSubstr("the gradient of partition 14"));
    } else {
      ASSERT_TRUE(prepared.ok()) << prepared;
    }
    if (how == 1) {
      auto committed = f.swapper->Commit();
      ASSERT_TRUE(committed.ok()) << committed.status();
      EXPECT_EQ(asked, 1) << "not asked again by Commit";
      EXPECT_EQ(given_back, 1);
      f.StepReference(2);
      f.ExpectMatchesReference();
      f.ExpectCopiesMatchReference();
      continue;
    }
    f.swapper->Abort();
    EXPECT_EQ(given_back, how == 0 ? 0 : 1);
    EXPECT_EQ(f.store->generation(), generation);
    EXPECT_EQ(f.copies, copies);
    f.ExpectMatchesReference();
  }
}

// A step that fails before Commit returns is dropped whole, writes behind or not: a read that
// fails, or an overflow, changes nothing (the writes already made are not committed).
TEST(SwapperWriteBehindTest, AStepThatFailsBeforeCommitReturnsChangesNothing) {
  Fixture f(WriteBehind({true, true, 0}));
  const uint64_t generation = StepOneWrittenThenGradsOfTwo(f);
  const auto copies = f.copies;
  // The last partition's read fails: every other one has stepped and been written by then.
  f.trace->SetFault([](const Entry& op, const std::vector<Entry>& before) {
    return op.kind == aio::OpKind::kRead && op.data_file && Any(before, StepEvent::kReadStarted, 14)
               ? EIO
               : 0;
  });
  auto failed = f.swapper->Step(2, f.Inputs());
  ASSERT_FALSE(failed.ok());
  EXPECT_THAT(failed.status().message(), HasSubstr("nothing was changed"));
  EXPECT_FALSE(f.swapper->writing_behind());
  EXPECT_EQ(f.store->generation(), generation);
  EXPECT_EQ(f.copies, copies);
  f.ExpectMatchesReference();
  f.grads[1][5] = std::numeric_limits<float>::infinity();
  auto overflow = f.swapper->Step(2, f.Inputs(), {.check_overflow = true});
  ASSERT_TRUE(overflow.ok());
  EXPECT_TRUE(overflow->overflow);
  EXPECT_EQ(f.store->generation(), generation);
  f.ExpectMatchesReference();
}

// The worker stops on its own (an overflow found as a partition is about to step): Abort, or
// Commit, ends the step with nothing changed (neither waits forever for the worker, which waits
// for the step's decision).
TEST(SwapperWriteBehindTest, AStepTheWorkerStoppedEndsByAbortOrCommit) {
  for (bool commit : {false, true}) {
    SCOPED_TRACE(commit ? "Commit" : "Abort");
    Fixture f(WriteBehind({true, true, 0}));
    const uint64_t generation = StepOneWrittenThenGradsOfTwo(f);
    f.grads[1][5] = std::numeric_limits<float>::infinity();
    f.trace->Clear();
    ASSERT_TRUE(f.swapper->Begin(f.swapper->copy_staging_bytes()).ok());
    ASSERT_TRUE(f.swapper->Stage(2, f.Inputs(), {.check_overflow = true}).ok());
    f.trace->WaitUntil(
        [](const std::vector<Entry>& x) { return Any(x, StepEvent::kReadAwaited, 11); },
        "partition 11's read awaited");
    std::this_thread::sleep_for(std::chrono::milliseconds(100));  // the worker has stopped
    if (commit) {
      auto r = f.swapper->Commit();
      ASSERT_TRUE(r.ok()) << r.status();
      EXPECT_TRUE(r->overflow);
    } else {
      EXPECT_THAT(f.swapper->Abort(), ::testing::IsEmpty());
    }
    EXPECT_FALSE(f.swapper->writing_behind());
    EXPECT_EQ(f.store->generation(), generation);
    f.ExpectMatchesReference();
  }
}

// The next step begins while the last one's writes are still behind it: Begin waits for them
// (the report of the next step that commits says how long), and both steps are the steps in
// memory.
TEST(SwapperWriteBehindTest, TheNextStepWaitsForTheWritesBehindTheLast) {
  auto hold = std::make_shared<HeldWrite>();
  hold->id = 13;
  Fixture f(Holding(WriteBehind({true, true, 0}), hold));
  f.NewGrads(1);
  ASSERT_TRUE(f.swapper->Step(1, f.Inputs()).ok());
  f.StepReference(1);
  std::thread later([hold] {
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    hold->Go();
  });
  f.NewGrads(2);
  auto r = f.swapper->Step(2, f.Inputs());
  later.join();
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_FALSE(hold->WaitedOut());
  EXPECT_GE(r->behind_wait_seconds, 0.2);
  uint64_t nvme_bytes = 0;
  for (const auto& [id, n] : f.parts) nvme_bytes += n * 12;
  EXPECT_EQ(r->behind_bytes_written, nvme_bytes);
  f.StepReference(2);
  f.ExpectCopiesMatchReference();
  f.ExpectMatchesReference();
}

// The figures of writes behind a step are not lost with a step begun after it and dropped: the
// next step that commits reports them.
TEST(SwapperWriteBehindTest, TheWritesBehindAreReportedByTheNextStepThatCommits) {
  Fixture f(WriteBehind({true, true, 0}));
  uint64_t nvme_bytes = 0;
  for (const auto& [id, n] : f.parts) nvme_bytes += n * 12;
  f.NewGrads(1);
  ASSERT_TRUE(f.swapper->Step(1, f.Inputs()).ok());
  f.StepReference(1);
  ASSERT_TRUE(f.swapper->Begin(f.swapper->copy_staging_bytes()).ok());  // waits for them
  f.swapper->Abort();
  f.NewGrads(2);
  auto r = f.swapper->Step(2, f.Inputs());
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->behind_bytes_written, nvme_bytes);
  f.StepReference(2);
  f.ExpectMatchesReference();
}

TEST(SwapperWriteBehindTest, NotWithCommitEach) {
  ScratchDir dir;
  auto engine = *aio::Engine::Create({}, {});
  tiering::NvmeStoreOptions so;
  so.capacity_bytes = 1 << 20;
  auto store = *tiering::NvmeStore::Open(dir.File("s"), so, engine.get());
  auto adam = *optim_cpu::CpuAdam::Create({});
  tiering::HostMemoryResource host;
  auto s = PipelinedOptimizerSwapper::Create(store.get(), adam.get(), &host,
                                             WriteBehind(CommitEach(true, 0)), {{1, 100}});
  EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.status().message(), HasSubstr("write_behind with commit_each"));
}

// ---- The read-ahead room keeps what a step committed there ----

uint64_t NvmeStateBytes(Fixture& f) {
  uint64_t bytes = 0;
  for (const auto& [id, n] : f.parts) bytes += f.swapper->on_nvme(id) ? n * 12 : 0;
  return bytes;
}

// Step t over every partition, after one that left nothing known in the room: it reads every
// partition's state and is the step in memory.
void ExpectTheStepReadsEverything(Fixture& f, int64_t t) {
  auto r = f.swapper->Step(t, f.Inputs());
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->bytes_read, NvmeStateBytes(f));
  EXPECT_EQ(r->bytes_reused, 0u);
  f.StepReference(t);
  f.ExpectMatchesReference();
  f.ExpectCopiesMatchReference();
}

// Step t (held when `held`) over every partition in `in`, at scale 1.
absl::StatusOr<StepReport> StepThrough(Fixture& f, int64_t t, const std::vector<StepInput>& in,
                                       bool held) {
  STRATA_RETURN_IF_ERROR(
      f.swapper->Begin(f.swapper->copy_staging_bytes() + (1 << 20), false, held));
  STRATA_RETURN_IF_ERROR(f.swapper->Stage(t, in));
  if (held) STRATA_RETURN_IF_ERROR(f.swapper->Release(1.0f));
  return f.swapper->Commit();
}

// With a room as large as the NVMe-resident state, each step finds there the state the last one
// committed and reads none of it: from step 2 on no partition's state is read (its bytes counted
// reused), and every step is the step in memory, bit for bit, param copies too; plain steps and
// held ones alternating, pipelined or not, host-resident partitions beside, in sub-groups, written
// behind.
TEST(SwapperRoomTest, AStepFindsTheStateTheLastCommittedInTheRoomAndReadsNone) {
  for (OptimizerSwapperConfig config :
       {ReadAhead({true, true, 0}), ReadAhead({false, false, 0}), ReadAhead({true, true, 220000}),
        ReadAhead(SubGroups({true, true, 0})), WriteBehind(ReadAhead({true, true, 0}))}) {
    SCOPED_TRACE(absl::StrCat(config.pipeline_read, " ", config.max_in_cpu_bytes, " ",
                              config.sub_group_elements, " ", config.write_behind));
    Fixture f(config);
    const uint64_t nvme = NvmeStateBytes(f);
    ASSERT_GT(nvme, 0u);
    for (int64_t t = 1; t <= 4; ++t) {
      f.NewGrads(static_cast<int>(t));
      f.trace->Clear();
      auto r = StepThrough(f, t, f.Inputs(), /*held=*/t % 2 == 0);
      ASSERT_TRUE(r.ok()) << r.status();
      EXPECT_EQ(r->bytes_read, t == 1 ? nvme : 0) << "step " << t;
      EXPECT_EQ(r->bytes_reused, t == 1 ? 0 : nvme) << "step " << t;
      for (const auto& [id, n] : f.parts) {
        if (!f.swapper->on_nvme(id)) continue;
        EXPECT_EQ(Any(f.trace->entries(), StepEvent::kReadStarted, id), t == 1)
            << "partition " << id << " at step " << t;
        EXPECT_EQ(Any(f.trace->entries(), StepEvent::kReadReused, id), t > 1)
            << "partition " << id << " at step " << t;
      }
      f.StepReference(t);
      f.ExpectMatchesReference();
      f.ExpectCopiesMatchReference();
    }
  }
}

// A partition whose record changed since the last step (given new master weights, or a loaded
// state) is read again, the others still found in the room; the step is the step in memory from
// the new state.
TEST(SwapperRoomTest, AStateChangedSinceTheLastStepIsReadAgain) {
  for (bool load : {false, true}) {
    SCOPED_TRACE(load ? "loaded" : "initialized");
    Fixture f(ReadAhead({true, true, 0}));
    f.NewGrads(1);
    ASSERT_TRUE(f.swapper->Step(1, f.Inputs()).ok());
    f.StepReference(1);
    const size_t i = 3;  // partition 13
    ASSERT_EQ(f.parts[i].first, 13u);
    const uint64_t n = f.parts[i].second;
    std::vector<float> master(n, 0.25f), m(n, load ? 0.125f : 0.0f), v(n, load ? 0.5f : 0.0f);
    if (load) {
      ASSERT_TRUE(f.swapper->BeginLoad().ok());
      ASSERT_TRUE(f.swapper->Load(13, master, m, v).ok());
      ASSERT_TRUE(f.swapper->CommitLoad().ok());
    } else {
      ASSERT_TRUE(f.swapper->Initialize(13, master).ok());
    }
    f.ref.p[i] = master;
    f.ref.m[i] = m;
    f.ref.v[i] = v;
    f.NewGrads(2);
    f.trace->Clear();
    auto r = f.swapper->Step(2, f.Inputs());
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_TRUE(Any(f.trace->entries(), StepEvent::kReadStarted, 13));
    EXPECT_EQ(r->bytes_read, f.parts[i].second * 12);
    EXPECT_EQ(r->bytes_reused, NvmeStateBytes(f) - f.parts[i].second * 12);
    f.StepReference(2);
    f.ExpectMatchesReference();
    f.ExpectCopiesMatchReference();
  }
}

// A step that stepped partitions in the room and then failed (a write) or was aborted leaves
// nothing known there: the room holds state that was never committed, so the next step reads
// every partition again, and is the step that never failed.
TEST(SwapperRoomTest, AStepThatFailsOrIsAbortedLeavesNothingKnownInTheRoom) {
  for (bool abort : {false, true}) {
    SCOPED_TRACE(abort ? "aborted" : "a write failed");
    Fixture f(ReadAhead({true, true, 0}));
    StepOneWrittenThenGradsOfTwo(f);
    f.trace->Clear();
    if (abort) {
      ASSERT_TRUE(f.swapper->Begin(f.swapper->copy_staging_bytes() + (1 << 20), false).ok());
      ASSERT_TRUE(f.swapper->Stage(2, f.Inputs()).ok());
      f.trace->WaitUntil(
          [](const std::vector<Entry>& x) { return Any(x, StepEvent::kStepFinished, 13); },
          "partition 13 stepped");
      EXPECT_THAT(f.trace->stuck(), ::testing::IsEmpty());
      EXPECT_THAT(f.swapper->Abort(), ::testing::IsEmpty());
    } else {
      f.trace->SetFault([](const Entry& op, const std::vector<Entry>& before) {
        return op.kind == aio::OpKind::kWrite && op.data_file &&
                       Any(before, StepEvent::kWriteStarted, 13)
                   ? EIO
                   : 0;
      });
      auto failed = f.swapper->Step(2, f.Inputs());
      ASSERT_FALSE(failed.ok());
      EXPECT_EQ(StatusErrno(failed.status()), EIO) << failed.status();
    }
    EXPECT_TRUE(Any(f.trace->entries(), StepEvent::kStepFinished, 12));  // stepped in the room
    f.ExpectMatchesReference();                                          // step 1's
    ExpectTheStepReadsEverything(f, 2);
  }
}

// The room is given in the order staged: a step staging the partitions in another order finds
// none where the last step left it and reads them (nothing taken from the wrong place); staged
// in that order again, it finds them.
TEST(SwapperRoomTest, PartitionsStagedInAnotherOrderAreReadAgain) {
  Fixture f(ReadAhead({true, true, 0}));
  const uint64_t nvme = NvmeStateBytes(f);
  f.NewGrads(1);
  ASSERT_TRUE(f.swapper->Step(1, f.Inputs()).ok());
  f.StepReference(1);
  for (int64_t t = 2; t <= 3; ++t) {
    f.NewGrads(static_cast<int>(t));
    std::vector<StepInput> in = f.Inputs();
    std::reverse(in.begin(), in.end());
    auto r = f.swapper->Step(t, in);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->bytes_read, t == 2 ? nvme : 0) << "step " << t;
    EXPECT_EQ(r->bytes_reused, t == 2 ? 0 : nvme) << "step " << t;
    f.StepReference(t);
    f.ExpectMatchesReference();
    f.ExpectCopiesMatchReference();
  }
}

// A room smaller than the state holds what fits (12 here): that is reused, the rest read through
// the ring each step.
TEST(SwapperRoomTest, ARoomSmallerThanTheStateReusesWhatItHolds) {
  Fixture f(ReadAhead({true, true, 220000}, StateSlot(65536 * 3 + 5)), kHeldParts);
  const uint64_t nvme = NvmeStateBytes(f);
  const uint64_t held = (65536 * 3 + 5) * 12;
  for (int64_t t = 1; t <= 3; ++t) {
    f.NewGrads(static_cast<int>(t));
    auto r = StepThrough(f, t, f.Inputs(), /*held=*/t == 2);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->bytes_reused, t == 1 ? 0 : held) << "step " << t;
    EXPECT_EQ(r->bytes_read, t == 1 ? nvme : nvme - held) << "step " << t;
    f.StepReference(t);
    f.ExpectMatchesReference();
    f.ExpectCopiesMatchReference();
  }
}

// A step whose record fails (written behind or not) leaves nothing known in the room, though
// what it stepped there is what a retry writes: the record the room's bytes are known by is the
// one committed, and a retried record is not looked at. The next step reads everything and is the
// step in memory.
TEST(SwapperRoomTest, AStepWhoseRecordFailedLeavesNothingKnownInTheRoom) {
  for (bool behind : {false, true}) {
    SCOPED_TRACE(behind ? "written behind" : "not behind");
    OptimizerSwapperConfig config = ReadAhead({true, true, 0});
    if (behind) config = WriteBehind(config);
    Fixture f(config);
    StepOneWrittenThenGradsOfTwo(f);
    f.trace->SetFault(
        [](const Entry& op, const std::vector<Entry>&) {
          return op.kind == aio::OpKind::kWrite && !op.data_file ? EIO : 0;
        },
        /*once=*/false);
    auto failed = f.swapper->Step(2, f.Inputs());
    int64_t t = 2;
    if (behind) {  // it stands; its record is written again until the disk takes it
      ASSERT_TRUE(failed.ok()) << failed.status();
      EXPECT_FALSE(f.swapper->Flush().ok());
      f.trace->SetFault(nullptr);
      ASSERT_TRUE(f.swapper->Flush().ok());
      f.StepReference(2);
      f.NewGrads(3);
      t = 3;
    } else {
      ASSERT_FALSE(failed.ok());
      f.trace->SetFault(nullptr);
      f.ExpectMatchesReference();  // step 1's
    }
    ExpectTheStepReadsEverything(f, t);
  }
}

// A step written behind that is dropped after partitions stepped in the room (an overflow found
// in the last one staged, or Abort) leaves nothing known there: the step again reads everything
// and is the step in memory.
TEST(SwapperRoomTest, ADroppedStepWrittenBehindLeavesNothingKnownInTheRoom) {
  for (bool overflow : {true, false}) {
    SCOPED_TRACE(overflow ? "overflow" : "aborted");
    Fixture f(WriteBehind(ReadAhead({true, true, 0})));
    StepOneWrittenThenGradsOfTwo(f);
    ASSERT_TRUE(f.swapper->Begin(f.swapper->copy_staging_bytes() + (1 << 20), false).ok());
    if (overflow) {  // 13's gradient not finite, 13 staged last: 12 stepped in the room by then
      const auto clean = f.grads;
      f.grads[3][0] = std::numeric_limits<float>::quiet_NaN();
      std::vector<StepInput> in = f.Inputs();
      ASSERT_EQ(in[3].id, 13u);
      std::swap(in[3], in.back());
      ASSERT_TRUE(f.swapper->Stage(2, in, {.check_overflow = true}).ok());
      auto r = f.swapper->Commit();
      ASSERT_TRUE(r.ok()) << r.status();
      EXPECT_TRUE(r->overflow);
      f.grads = clean;
    } else {
      ASSERT_TRUE(f.swapper->Stage(2, f.Inputs()).ok());
      f.trace->WaitUntil(
          [](const std::vector<Entry>& x) { return Any(x, StepEvent::kStepFinished, 13); },
          "partition 13 stepped");
      EXPECT_THAT(f.trace->stuck(), ::testing::IsEmpty());
      EXPECT_THAT(f.swapper->Abort(), ::testing::IsEmpty());
    }
    EXPECT_TRUE(Any(f.trace->entries(), StepEvent::kStepFinished, 12));
    ASSERT_TRUE(f.swapper->Flush().ok());
    f.ExpectMatchesReference();  // step 1's
    ExpectTheStepReadsEverything(f, 2);
  }
}

}  // namespace
}  // namespace strata::swap
