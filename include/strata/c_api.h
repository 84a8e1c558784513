/* strata/c_api.h: the C API over strata's Runtime (sched/runtime.h), for trainers and languages
 * that cannot link C++.
 *
 * A strata_runtime is an opaque handle over one Runtime: made from a DeepSpeed-style JSON config
 * (tiering/runtime_config.h says which keys), it keeps partitions in the device tier, pinned host
 * memory or NVMe and moves them ahead of need. The calls mirror the Runtime's and keep its
 * meanings (register, acquire, release, evict, discard, prefetch, gradient ready, flush, the step
 * boundary with its report, statistics); read sched/runtime.h for what each does at the edges.
 *
 * Errors: every call returns a strata_code. STRATA_OK is 0; the others are the canonical codes
 * that absl::Status uses (their numbers are fixed here). A failing call records its message (what
 * was wrong and what is accepted, naming the file, offset and errno where there is one) and its
 * errno (0 when none) for the calling thread: strata_last_error_message and strata_last_errno
 * read them, and they hold until the next failing call on that thread. No C++ exception and no
 * abort crosses this API on a bad input: a null handle or pointer, an unknown tier, role or dtype,
 * an unregistered id are each an error with its message.
 *
 * Memory: strata_acquire gives the address of the partition's copy in the tier, owned by the
 * runtime and valid until the matching strata_release. Strings returned as const char* are owned
 * by strata (see each call). strata_runtime_destroy frees the handle and everything it holds.
 *
 * Thread safety: a strata_runtime may be used from many threads at once, as the Runtime may (a
 * partition pinned by one thread's strata_acquire is released by the caller);
 * strata_runtime_destroy must not run beside any other call on the same handle. The warning
 * callback is called from the runtime's own threads as well as the caller's, never under a lock of
 * the runtime.
 */
#ifndef STRATA_C_API_H_
#define STRATA_C_API_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(__GNUC__)
#define STRATA_C_EXPORT __attribute__((visibility("default")))
#else
#define STRATA_C_EXPORT
#endif

/* The version of this API; strata_c_api_version returns the library's. */
#define STRATA_C_API_VERSION 1

/* Each enum ends on a *_MAX_ENUM of INT32_MAX so that it is int-sized with every compiler. A
 * value that is none of an enum's is refused (INVALID_ARGUMENT naming what is accepted). */
typedef enum strata_code {
  STRATA_OK = 0,
  STRATA_CANCELLED = 1,
  STRATA_UNKNOWN = 2,
  STRATA_INVALID_ARGUMENT = 3,
  STRATA_DEADLINE_EXCEEDED = 4,
  STRATA_NOT_FOUND = 5,
  STRATA_ALREADY_EXISTS = 6,
  STRATA_PERMISSION_DENIED = 7,
  STRATA_RESOURCE_EXHAUSTED = 8,
  STRATA_FAILED_PRECONDITION = 9,
  STRATA_ABORTED = 10,
  STRATA_OUT_OF_RANGE = 11,
  STRATA_UNIMPLEMENTED = 12,
  STRATA_INTERNAL = 13,
  STRATA_UNAVAILABLE = 14,
  STRATA_DATA_LOSS = 15,
  STRATA_UNAUTHENTICATED = 16,
  STRATA_CODE_MAX_ENUM = 0x7fffffff
} strata_code;

typedef enum strata_tier {
  STRATA_TIER_DEVICE = 0,
  STRATA_TIER_HOST = 1,
  STRATA_TIER_NVME = 2,
  STRATA_TIER_MAX_ENUM = 0x7fffffff
} strata_tier;

typedef enum strata_role {
  STRATA_ROLE_PARAM = 0,
  STRATA_ROLE_GRAD = 1,
  STRATA_ROLE_MASTER = 2,
  STRATA_ROLE_EXP_AVG = 3,
  STRATA_ROLE_EXP_AVG_SQ = 4,
  STRATA_ROLE_OTHER = 5,
  STRATA_ROLE_MAX_ENUM = 0x7fffffff
} strata_role;

typedef enum strata_dtype {
  STRATA_DTYPE_F32 = 0,
  STRATA_DTYPE_BF16 = 1,
  STRATA_DTYPE_F16 = 2,
  STRATA_DTYPE_OTHER = 3,
  STRATA_DTYPE_MAX_ENUM = 0x7fffffff
} strata_dtype;

/* Why the trainer waited (StepReport's wait_by_cause is indexed by these). */
typedef enum strata_wait_cause {
  STRATA_WAIT_NVME_READ = 0,
  STRATA_WAIT_COPY = 1,
  STRATA_WAIT_WRITE_BACK = 2,
  STRATA_WAIT_BUDGET_FULL = 3,
  STRATA_WAIT_CAUSE_MAX_ENUM = 0x7fffffff
} strata_wait_cause;
#define STRATA_WAIT_CAUSE_COUNT 4
#define STRATA_TIER_COUNT 3

typedef struct strata_runtime strata_runtime;

typedef struct strata_runtime_options {
  /* This process's rank (its NVMe store is <nvme_path>/rank<rank>); -1: the RANK environment
   * variable, else 0. */
  int rank;
  /* The CUDA device of the device tier; -1: LOCAL_RANK, else 0. */
  int device_index;
  /* Threads that run prefetches and background write-backs (at least 1). */
  int workers;
  /* Called with each warning (a NUL-terminated message, valid during the call) and `user`; NULL:
   * warnings go to stderr. */
  void (*on_warning)(const char* message, void* user);
  void* user;
} strata_runtime_options;

typedef struct strata_partition_desc {
  uint64_t id;
  strata_role role;
  strata_dtype dtype;
  uint64_t elements;
  uint64_t bytes; /* at least 1 */
  int owner_rank;
  int group; /* the layer: a group's partitions are kept together by the scheduler */
} strata_partition_desc;

/* One training step's report (sched/runtime.h StepReport). */
typedef struct strata_step_report {
  uint64_t step; /* 1-based */
  /* "recorded", "planned", "fallback" (the step diverged from the trace) or "on-demand" (lru). */
  char mode[16];
  int diverged; /* 1 when the step's accesses differed from the trace (the JSON says how) */
  double seconds;
  double wait_seconds;
  double wait_by_cause[STRATA_WAIT_CAUSE_COUNT];
  uint64_t bytes_moved[STRATA_TIER_COUNT][STRATA_TIER_COUNT]; /* [from][to] */
  uint64_t acquires, hits, prefetch_hits, late_prefetches, misses, zero_fills;
  uint64_t prefetches, prefetch_failures, prefetches_blocked;
  uint64_t evictions, write_backs, write_back_failures;
  int lookahead;
} strata_step_report;

typedef struct strata_stats {
  double acquire_wait_seconds;
  uint64_t acquires, acquire_hits;
  uint64_t evictions, write_backs, write_back_failures;
  uint64_t steps;
  uint64_t host_held_bytes;
  uint64_t bytes_moved[STRATA_TIER_COUNT][STRATA_TIER_COUNT]; /* [from][to] */
} strata_stats;

STRATA_C_EXPORT int strata_c_api_version(void);

/* The calling thread's last error: its message ("" when no call failed on this thread) and errno
 * (0 when it had none). The message is owned by strata and valid until the thread's next failing
 * call. */
STRATA_C_EXPORT const char* strata_last_error_message(void);
STRATA_C_EXPORT int strata_last_errno(void);
/* The code's name ("OK", "INVALID_ARGUMENT", ...; "UNKNOWN_CODE" for a number that is none). */
STRATA_C_EXPORT const char* strata_code_name(int code);

/* Defaults: rank -1, device_index -1, workers 4, warnings to stderr. */
STRATA_C_EXPORT void strata_runtime_options_init(strata_runtime_options* options);

/* Makes a runtime from a JSON config given as text, or read from the file at `config_path`.
 * `options` may be NULL (the defaults). On success *out holds the handle; on failure it is set to
 * NULL. */
STRATA_C_EXPORT int strata_runtime_create(const char* config_json,
                                          const strata_runtime_options* options,
                                          strata_runtime** out);
STRATA_C_EXPORT int strata_runtime_create_from_file(const char* config_path,
                                                    const strata_runtime_options* options,
                                                    strata_runtime** out);
/* Flushes dirty partitions to NVMe (a failure is a warning; call strata_flush first to see it)
 * and frees everything: the NVMe store's files too, unless the config's strata.nvme_keep_files
 * is true (then a later runtime on the same nvme_path adopts what they hold: strata_adopt). NULL
 * is accepted and does nothing. */
STRATA_C_EXPORT void strata_runtime_destroy(strata_runtime* runtime);

/* Registers a partition placed in `tier` with `initial_bytes` bytes from `initial` (NULL and 0:
 * zeros; otherwise exactly desc->bytes). */
STRATA_C_EXPORT int strata_register(strata_runtime* runtime, const strata_partition_desc* desc,
                                    strata_tier tier, const void* initial, size_t initial_bytes);
/* Takes over a partition an earlier run left in the NVMe store. */
STRATA_C_EXPORT int strata_adopt(strata_runtime* runtime, const strata_partition_desc* desc);
/* The number of partitions in the NVMe store, and their ids (up to `capacity` of them). */
STRATA_C_EXPORT int strata_stored_partitions(strata_runtime* runtime, uint64_t* ids,
                                             size_t capacity, size_t* count);
STRATA_C_EXPORT int strata_unregister(strata_runtime* runtime, uint64_t id);

/* Brings a current copy into `tier` (device or host), pins it and sets *address to it. */
STRATA_C_EXPORT int strata_acquire(strata_runtime* runtime, uint64_t id, strata_tier tier,
                                   void** address);
/* Unpins; `dirty` non-zero: the caller changed the bytes. `stream`: the cudaStream_t the
 * trainer's kernels that use the copy were queued on (NULL when they are done; for CUDA's legacy
 * default stream, whose handle is 0, pass cudaStreamLegacy). */
STRATA_C_EXPORT int strata_release(strata_runtime* runtime, uint64_t id, strata_tier tier,
                                   int dirty, void* stream);
STRATA_C_EXPORT int strata_evict(strata_runtime* runtime, uint64_t id, strata_tier tier);
STRATA_C_EXPORT int strata_discard(strata_runtime* runtime, uint64_t id);
/* Brings a current copy into `tier` on a worker thread, without pinning it. `wait` zero: returns
 * at once, and the outcome is not told (a failed prefetch leaves the next acquire to move the
 * bytes, or to meet the failure); `wait` non-zero: returns when the copy is there, with the
 * prefetch's outcome (RESOURCE_EXHAUSTED when no room can be made without waiting;
 * FAILED_PRECONDITION when the only current copy is pinned in the other memory tier). */
STRATA_C_EXPORT int strata_prefetch(strata_runtime* runtime, uint64_t id, strata_tier tier,
                                    int wait);
STRATA_C_EXPORT int strata_gradient_ready(strata_runtime* runtime, uint64_t id);
STRATA_C_EXPORT int strata_flush(strata_runtime* runtime);

/* Ends the training step; `report` (may be NULL) receives its report. */
STRATA_C_EXPORT int strata_end_step(strata_runtime* runtime, strata_step_report* report);
/* The last step's report as one line of JSON (with what diverged, when something did), copied
 * into `buffer` NUL-terminated and cut to `capacity` - 1 bytes; *length (may be NULL) receives
 * its whole length, so a caller whose buffer was short can call again with *length + 1 bytes.
 * NOT_FOUND before the first strata_end_step. */
STRATA_C_EXPORT int strata_last_step_report_json(strata_runtime* runtime, char* buffer,
                                                 size_t capacity, size_t* length);
STRATA_C_EXPORT int strata_get_stats(strata_runtime* runtime, strata_stats* stats);

/* The warnings so far: their number, and one of them copied as strata_last_step_report_json
 * copies (OUT_OF_RANGE for an index past the last). */
STRATA_C_EXPORT int strata_warning_count(strata_runtime* runtime, size_t* count);
STRATA_C_EXPORT int strata_warning(strata_runtime* runtime, size_t index, char* buffer,
                                   size_t capacity, size_t* length);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* STRATA_C_API_H_ */
