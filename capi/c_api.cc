// capi/c_api.cc: the C API (include/strata/c_api.h) over sched::Runtime.
//
// Each entry point checks its arguments, calls the Runtime inside Guard (which turns a Status into
// a code and the thread's last error, and catches any exception so none crosses into C), and
// copies results into the caller's structs.
#include "strata/c_api.h"

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <exception>
#include <fstream>
#include <future>
#include <memory>
#include <new>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "base/mutex.h"
#include "base/status.h"
#include "sched/runtime.h"
#include "tiering/runtime_config.h"

struct strata_runtime {
  std::unique_ptr<strata::sched::Runtime> runtime;
  std::vector<std::string> config_warnings;  // from reading the config, before the Runtime
  strata::Mutex mu;
  std::string last_report_json ABSL_GUARDED_BY(mu);
  bool has_report ABSL_GUARDED_BY(mu) = false;
};

namespace strata::capi {
namespace {

using sched::Runtime;
using tiering::ElementType;
using tiering::PartitionDesc;
using tiering::Role;
using tiering::Tier;

thread_local std::string t_last_message;
thread_local int t_last_errno = 0;

int Record(const absl::Status& s) {
  if (s.ok()) return STRATA_OK;
  t_last_message = std::string(s.message());
  t_last_errno = StatusErrno(s);
  return static_cast<int>(s.code());
}

// Runs `f` (returning absl::Status) and gives its code; records the failure for the thread. An
// exception becomes INTERNAL (RESOURCE_EXHAUSTED for bad_alloc) naming the call.
template <typename F>
int Guard(const char* call, F&& f) {
  try {
    return Record(f());
  } catch (const std::bad_alloc&) {
    return Record(absl::ResourceExhaustedError(absl::StrCat(call, ": out of memory")));
  } catch (const std::exception& e) {
    return Record(absl::InternalError(absl::StrCat(call, ": ", e.what())));
  } catch (...) {
    return Record(absl::InternalError(absl::StrCat(call, ": an unknown exception")));
  }
}

absl::Status CheckHandle(const char* call, const strata_runtime* rt) {
  if (rt == nullptr || rt->runtime == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat(call, ": the runtime handle is NULL (make one with strata_runtime_create)"));
  }
  return absl::OkStatus();
}

absl::Status CheckPointer(const char* call, const void* p, const char* name) {
  if (p == nullptr) return absl::InvalidArgumentError(absl::StrCat(call, ": ", name, " is NULL"));
  return absl::OkStatus();
}

// The int a C caller stored in an enum-typed argument or field. Loading the enum itself is
// undefined in C++ for a value outside its enumerators' range (C lets a caller pass any int), so
// its bytes are read as an int instead.
template <typename E>
int RawValue(const E& e) {
  static_assert(sizeof(E) == sizeof(int), "the C API's enums are int-sized (their *_MAX_ENUM)");
  int v;
  std::memcpy(&v, &e, sizeof v);
  return v;
}

absl::StatusOr<Tier> TierOf(const char* call, const strata_tier& given, bool memory_only) {
  const int tier = RawValue(given);
  if (tier == STRATA_TIER_DEVICE) return Tier::kDevice;
  if (tier == STRATA_TIER_HOST) return Tier::kHost;
  if (tier == STRATA_TIER_NVME && !memory_only) return Tier::kNvme;
  return absl::InvalidArgumentError(absl::StrCat(
      call, ": tier ", tier, " is not accepted here; accepted: STRATA_TIER_DEVICE (0), ",
      "STRATA_TIER_HOST (1)", memory_only ? "" : ", STRATA_TIER_NVME (2)"));
}

absl::StatusOr<PartitionDesc> DescOf(const char* call, const strata_partition_desc* d) {
  STRATA_RETURN_IF_ERROR(CheckPointer(call, d, "desc"));
  const int role = RawValue(d->role);
  const int dtype = RawValue(d->dtype);
  if (role < STRATA_ROLE_PARAM || role > STRATA_ROLE_OTHER) {
    return absl::InvalidArgumentError(absl::StrCat(
        call, ": desc.role ", role, " is not a strata_role (accepted: 0..5, STRATA_ROLE_PARAM ",
        "to STRATA_ROLE_OTHER)"));
  }
  if (dtype < STRATA_DTYPE_F32 || dtype > STRATA_DTYPE_OTHER) {
    return absl::InvalidArgumentError(absl::StrCat(
        call, ": desc.dtype ", dtype, " is not a strata_dtype (accepted: 0..3, STRATA_DTYPE_F32 ",
        "to STRATA_DTYPE_OTHER)"));
  }
  PartitionDesc desc;
  desc.id = d->id;
  desc.role = static_cast<Role>(role);
  desc.dtype = static_cast<ElementType>(dtype);
  desc.elements = d->elements;
  desc.bytes = d->bytes;
  desc.owner_rank = d->owner_rank;
  desc.group = d->group;
  return desc;
}

absl::Status CheckBuffer(const char* call, const char* buffer, size_t capacity) {
  if (buffer == nullptr && capacity > 0) {
    return absl::InvalidArgumentError(absl::StrCat(call, ": buffer is NULL with a capacity of ",
                                                   capacity, " bytes; accepted: NULL with 0"));
  }
  return absl::OkStatus();
}

// Copies `text` as the header says: NUL-terminated, cut to capacity - 1, whole length reported.
// The caller has checked the buffer (CheckBuffer).
void CopyOut(const std::string& text, char* buffer, size_t capacity, size_t* length) {
  if (length != nullptr) *length = text.size();
  if (capacity > 0) {
    const size_t n = std::min(text.size(), capacity - 1);
    std::memcpy(buffer, text.data(), n);
    buffer[n] = '\0';
  }
}

void CopyMatrix(const swap::TierMatrix& from, uint64_t (*to)[STRATA_TIER_COUNT]) {
  for (int f = 0; f < STRATA_TIER_COUNT; ++f) {
    for (int t = 0; t < STRATA_TIER_COUNT; ++t) to[f][t] = from[f][t];
  }
}

absl::StatusOr<sched::RuntimeOptions> OptionsOf(const char* call, const strata_runtime_options* o) {
  strata_runtime_options given;
  strata_runtime_options_init(&given);
  if (o != nullptr) given = *o;
  if (given.workers < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat(call, ": options.workers is ", given.workers, "; accepted: 1 or more"));
  }
  if (given.rank < -1 || given.device_index < -1) {
    return absl::InvalidArgumentError(absl::StrCat(
        call, ": options.rank ", given.rank, " and options.device_index ", given.device_index,
        ": each is accepted as -1 (from the environment) or 0 and more"));
  }
  sched::RuntimeOptions options;
  options.rank = given.rank;
  options.device_index = given.device_index;
  options.workers = given.workers;
  if (given.on_warning != nullptr) {
    options.on_warning = [cb = given.on_warning, user = given.user](absl::string_view w) {
      const std::string message(w);
      cb(message.c_str(), user);
    };
  }
  return options;
}

int Create(const char* call, const std::string& config_text, const strata_runtime_options* o,
           strata_runtime** out) {
  return Guard(call, [&]() -> absl::Status {
    auto options = OptionsOf(call, o);
    if (!options.ok()) return options.status();
    auto handle = std::make_unique<strata_runtime>();
    auto config = tiering::RuntimeConfigFromJsonText(config_text, &handle->config_warnings);
    if (!config.ok()) return Annotate(config.status(), absl::StrCat(call, ": the config"));
    for (const std::string& w : handle->config_warnings) {
      if (options->on_warning) {
        options->on_warning(w);
      } else {
        std::fprintf(stderr, "strata: warning: %s\n", w.c_str());
      }
    }
    auto runtime = Runtime::Create(*config, std::move(*options));
    if (!runtime.ok()) return Annotate(runtime.status(), call);
    handle->runtime = std::move(*runtime);
    *out = handle.release();
    return absl::OkStatus();
  });
}

}  // namespace
}  // namespace strata::capi

using strata::capi::CheckHandle;
using strata::capi::CheckPointer;
using strata::capi::Guard;
using strata::capi::TierOf;

extern "C" {

int strata_c_api_version(void) { return STRATA_C_API_VERSION; }

const char* strata_last_error_message(void) { return strata::capi::t_last_message.c_str(); }

int strata_last_errno(void) { return strata::capi::t_last_errno; }

const char* strata_code_name(int code) {
  static constexpr const char* kNames[] = {"OK",
                                           "CANCELLED",
                                           "UNKNOWN",
                                           "INVALID_ARGUMENT",
                                           "DEADLINE_EXCEEDED",
                                           "NOT_FOUND",
                                           "ALREADY_EXISTS",
                                           "PERMISSION_DENIED",
                                           "RESOURCE_EXHAUSTED",
                                           "FAILED_PRECONDITION",
                                           "ABORTED",
                                           "OUT_OF_RANGE",
                                           "UNIMPLEMENTED",
                                           "INTERNAL",
                                           "UNAVAILABLE",
                                           "DATA_LOSS",
                                           "UNAUTHENTICATED"};
  if (code < 0 || code >= static_cast<int>(sizeof(kNames) / sizeof(kNames[0]))) {
    return "UNKNOWN_CODE";
  }
  return kNames[code];
}

void strata_runtime_options_init(strata_runtime_options* options) {
  if (options == nullptr) return;
  options->rank = -1;
  options->device_index = -1;
  options->workers = 4;
  options->on_warning = nullptr;
  options->user = nullptr;
}

int strata_runtime_create(const char* config_json, const strata_runtime_options* options,
                          strata_runtime** out) {
  constexpr const char* kCall = "strata_runtime_create";
  if (out == nullptr) return Guard(kCall, [&] { return CheckPointer(kCall, out, "out"); });
  *out = nullptr;
  if (config_json == nullptr) {
    return Guard(kCall, [&] { return CheckPointer(kCall, config_json, "config_json"); });
  }
  return strata::capi::Create(kCall, config_json, options, out);
}

int strata_runtime_create_from_file(const char* config_path, const strata_runtime_options* options,
                                    strata_runtime** out) {
  constexpr const char* kCall = "strata_runtime_create_from_file";
  if (out == nullptr) return Guard(kCall, [&] { return CheckPointer(kCall, out, "out"); });
  *out = nullptr;
  std::string text;
  const int code = Guard(kCall, [&]() -> absl::Status {
    STRATA_RETURN_IF_ERROR(CheckPointer(kCall, config_path, "config_path"));
    std::ifstream in(config_path);
    if (!in) return strata::ErrnoStatus(errno, absl::StrCat(kCall, ": open"), config_path);
    std::stringstream s;
    s << in.rdbuf();
    text = s.str();
    return absl::OkStatus();
  });
  if (code != STRATA_OK) return code;
  return strata::capi::Create(kCall, text, options, out);
}

void strata_runtime_destroy(strata_runtime* runtime) {
  try {
    delete runtime;
  } catch (...) {
    // A destructor that threw: nothing more can be done for the handle; never into C.
  }
}

int strata_register(strata_runtime* runtime, const strata_partition_desc* desc, strata_tier tier,
                    const void* initial, size_t initial_bytes) {
  constexpr const char* kCall = "strata_register";
  return Guard(kCall, [&]() -> absl::Status {
    STRATA_RETURN_IF_ERROR(CheckHandle(kCall, runtime));
    STRATA_ASSIGN_OR_RETURN(auto d, strata::capi::DescOf(kCall, desc));
    STRATA_ASSIGN_OR_RETURN(auto t, TierOf(kCall, tier, /*memory_only=*/false));
    if (initial == nullptr && initial_bytes != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(kCall, ": initial is NULL with initial_bytes ", initial_bytes,
                       "; accepted: NULL and 0 (zeros), or desc.bytes bytes"));
    }
    if (initial != nullptr && initial_bytes != d.bytes) {
      return absl::InvalidArgumentError(absl::StrCat(
          kCall, ": initial_bytes is ", initial_bytes, " for a partition of desc.bytes ", d.bytes,
          "; accepted: 0 (zeros) or exactly desc.bytes"));
    }
    return runtime->runtime->Register(
        d, t, {static_cast<const std::byte*>(initial), initial == nullptr ? 0 : initial_bytes});
  });
}

int strata_adopt(strata_runtime* runtime, const strata_partition_desc* desc) {
  constexpr const char* kCall = "strata_adopt";
  return Guard(kCall, [&]() -> absl::Status {
    STRATA_RETURN_IF_ERROR(CheckHandle(kCall, runtime));
    STRATA_ASSIGN_OR_RETURN(auto d, strata::capi::DescOf(kCall, desc));
    return runtime->runtime->Adopt(d);
  });
}

int strata_stored_partitions(strata_runtime* runtime, uint64_t* ids, size_t capacity,
                             size_t* count) {
  constexpr const char* kCall = "strata_stored_partitions";
  return Guard(kCall, [&]() -> absl::Status {
    STRATA_RETURN_IF_ERROR(CheckHandle(kCall, runtime));
    STRATA_RETURN_IF_ERROR(CheckPointer(kCall, count, "count"));
    if (ids == nullptr && capacity > 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(kCall, ": ids is NULL with a capacity of ", capacity));
    }
    const auto stored = runtime->runtime->StoredPartitions();
    *count = stored.size();
    for (size_t i = 0; i < stored.size() && i < capacity; ++i) ids[i] = stored[i].id;
    return absl::OkStatus();
  });
}

int strata_unregister(strata_runtime* runtime, uint64_t id) {
  constexpr const char* kCall = "strata_unregister";
  return Guard(kCall, [&]() -> absl::Status {
    STRATA_RETURN_IF_ERROR(CheckHandle(kCall, runtime));
    return runtime->runtime->Unregister(id);
  });
}

int strata_acquire(strata_runtime* runtime, uint64_t id, strata_tier tier, void** address) {
  constexpr const char* kCall = "strata_acquire";
  return Guard(kCall, [&]() -> absl::Status {
    STRATA_RETURN_IF_ERROR(CheckHandle(kCall, runtime));
    STRATA_RETURN_IF_ERROR(CheckPointer(kCall, address, "address"));
    *address = nullptr;
    STRATA_ASSIGN_OR_RETURN(auto t, TierOf(kCall, tier, /*memory_only=*/true));
    STRATA_ASSIGN_OR_RETURN(std::byte * p, runtime->runtime->Acquire(id, t));
    *address = p;
    return absl::OkStatus();
  });
}

int strata_release(strata_runtime* runtime, uint64_t id, strata_tier tier, int dirty,
                   void* stream) {
  constexpr const char* kCall = "strata_release";
  return Guard(kCall, [&]() -> absl::Status {
    STRATA_RETURN_IF_ERROR(CheckHandle(kCall, runtime));
    STRATA_ASSIGN_OR_RETURN(auto t, TierOf(kCall, tier, /*memory_only=*/true));
    return runtime->runtime->Release(id, t, dirty != 0,
                                     static_cast<strata::tiering::StreamHandle>(stream));
  });
}

int strata_evict(strata_runtime* runtime, uint64_t id, strata_tier tier) {
  constexpr const char* kCall = "strata_evict";
  return Guard(kCall, [&]() -> absl::Status {
    STRATA_RETURN_IF_ERROR(CheckHandle(kCall, runtime));
    STRATA_ASSIGN_OR_RETURN(auto t, TierOf(kCall, tier, /*memory_only=*/true));
    return runtime->runtime->Evict(id, t);
  });
}

int strata_discard(strata_runtime* runtime, uint64_t id) {
  constexpr const char* kCall = "strata_discard";
  return Guard(kCall, [&]() -> absl::Status {
    STRATA_RETURN_IF_ERROR(CheckHandle(kCall, runtime));
    return runtime->runtime->Discard(id);
  });
}

int strata_prefetch(strata_runtime* runtime, uint64_t id, strata_tier tier, int wait) {
  constexpr const char* kCall = "strata_prefetch";
  return Guard(kCall, [&]() -> absl::Status {
    STRATA_RETURN_IF_ERROR(CheckHandle(kCall, runtime));
    STRATA_ASSIGN_OR_RETURN(auto t, TierOf(kCall, tier, /*memory_only=*/true));
    std::future<absl::Status> done = runtime->runtime->Prefetch(id, t);
    if (wait == 0) return absl::OkStatus();
    return done.get();
  });
}

int strata_gradient_ready(strata_runtime* runtime, uint64_t id) {
  constexpr const char* kCall = "strata_gradient_ready";
  return Guard(kCall, [&]() -> absl::Status {
    STRATA_RETURN_IF_ERROR(CheckHandle(kCall, runtime));
    runtime->runtime->GradientReady(id);
    return absl::OkStatus();
  });
}

int strata_flush(strata_runtime* runtime) {
  constexpr const char* kCall = "strata_flush";
  return Guard(kCall, [&]() -> absl::Status {
    STRATA_RETURN_IF_ERROR(CheckHandle(kCall, runtime));
    return runtime->runtime->Flush();
  });
}

int strata_end_step(strata_runtime* runtime, strata_step_report* report) {
  constexpr const char* kCall = "strata_end_step";
  return Guard(kCall, [&]() -> absl::Status {
    STRATA_RETURN_IF_ERROR(CheckHandle(kCall, runtime));
    const strata::sched::StepReport r = runtime->runtime->EndStep();
    {
      strata::MutexLock lock(&runtime->mu);
      runtime->last_report_json = r.ToJson();
      runtime->has_report = true;
    }
    if (report == nullptr) return absl::OkStatus();
    *report = strata_step_report{};
    report->step = r.step;
    std::snprintf(report->mode, sizeof(report->mode), "%s", r.mode.c_str());
    report->diverged = r.divergence.empty() ? 0 : 1;
    report->seconds = r.seconds;
    report->wait_seconds = r.wait_seconds;
    for (int c = 0; c < STRATA_WAIT_CAUSE_COUNT; ++c) report->wait_by_cause[c] = r.wait_by_cause[c];
    strata::capi::CopyMatrix(r.bytes_moved, report->bytes_moved);
    report->acquires = r.acquires;
    report->hits = r.hits;
    report->prefetch_hits = r.prefetch_hits;
    report->late_prefetches = r.late_prefetches;
    report->misses = r.misses;
    report->zero_fills = r.zero_fills;
    report->prefetches = r.prefetches;
    report->prefetch_failures = r.prefetch_failures;
    report->prefetches_blocked = r.prefetches_blocked;
    report->evictions = r.evictions;
    report->write_backs = r.write_backs;
    report->write_back_failures = r.write_back_failures;
    report->lookahead = r.lookahead;
    return absl::OkStatus();
  });
}

int strata_last_step_report_json(strata_runtime* runtime, char* buffer, size_t capacity,
                                 size_t* length) {
  constexpr const char* kCall = "strata_last_step_report_json";
  return Guard(kCall, [&]() -> absl::Status {
    STRATA_RETURN_IF_ERROR(CheckHandle(kCall, runtime));
    STRATA_RETURN_IF_ERROR(strata::capi::CheckBuffer(kCall, buffer, capacity));
    std::string json;
    {
      strata::MutexLock lock(&runtime->mu);
      if (!runtime->has_report) {
        return absl::NotFoundError(
            absl::StrCat(kCall, ": no step has ended yet (strata_end_step gives the first)"));
      }
      json = runtime->last_report_json;
    }
    strata::capi::CopyOut(json, buffer, capacity, length);
    return absl::OkStatus();
  });
}

int strata_get_stats(strata_runtime* runtime, strata_stats* stats) {
  constexpr const char* kCall = "strata_get_stats";
  return Guard(kCall, [&]() -> absl::Status {
    STRATA_RETURN_IF_ERROR(CheckHandle(kCall, runtime));
    STRATA_RETURN_IF_ERROR(CheckPointer(kCall, stats, "stats"));
    const strata::sched::RuntimeStats s = runtime->runtime->stats();
    *stats = strata_stats{};
    stats->acquire_wait_seconds = s.acquire_wait_seconds;
    stats->acquires = s.acquires;
    stats->acquire_hits = s.acquire_hits;
    stats->evictions = s.evictions;
    stats->write_backs = s.write_backs;
    stats->write_back_failures = s.write_back_failures;
    stats->steps = s.steps;
    stats->host_held_bytes = s.host_held_bytes;
    strata::capi::CopyMatrix(s.bytes_moved, stats->bytes_moved);
    return absl::OkStatus();
  });
}

int strata_warning_count(strata_runtime* runtime, size_t* count) {
  constexpr const char* kCall = "strata_warning_count";
  return Guard(kCall, [&]() -> absl::Status {
    STRATA_RETURN_IF_ERROR(CheckHandle(kCall, runtime));
    STRATA_RETURN_IF_ERROR(CheckPointer(kCall, count, "count"));
    *count = runtime->config_warnings.size() + runtime->runtime->warnings().size();
    return absl::OkStatus();
  });
}

int strata_warning(strata_runtime* runtime, size_t index, char* buffer, size_t capacity,
                   size_t* length) {
  constexpr const char* kCall = "strata_warning";
  return Guard(kCall, [&]() -> absl::Status {
    STRATA_RETURN_IF_ERROR(CheckHandle(kCall, runtime));
    STRATA_RETURN_IF_ERROR(strata::capi::CheckBuffer(kCall, buffer, capacity));
    std::vector<std::string> all = runtime->config_warnings;
    for (std::string& w : runtime->runtime->warnings()) all.push_back(std::move(w));
    if (index >= all.size()) {
      return absl::OutOfRangeError(
          all.empty() ? absl::StrCat(kCall, ": index ", index, "; there are no warnings")
                      : absl::StrCat(kCall, ": index ", index, "; accepted: 0 to ", all.size() - 1,
                                     " (", all.size(), " warnings)"));
    }
    strata::capi::CopyOut(all[index], buffer, capacity, length);
    return absl::OkStatus();
  });
}

}  // extern "C"
