// aio/config.h: the knobs of an aio Engine, with DeepSpeed's names, meanings and defaults.
//
// DeepSpeed's "aio" block: block_size (1 MiB), queue_depth (8), intra_op_parallelism (1; the older
// name thread_count is accepted with a warning), single_submit (false), overlap_events (true),
// use_gds (only false is accepted). strata's own aio knobs live in the "strata": {"aio": {...}}
// block: engine ("io_uring" | "libaio" | "posix"), registered_buffers, registered_files, sqpoll,
// sqpoll_idle_ms, direct (O_DIRECT, true).
//
// Thread safety: plain values and pure functions.
#ifndef STRATA_AIO_CONFIG_H_
#define STRATA_AIO_CONFIG_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "nlohmann/json_fwd.hpp"

namespace strata::aio {

enum class EngineKind { kIoUring, kLibAio, kPosix };

absl::string_view EngineKindName(EngineKind kind);
absl::StatusOr<EngineKind> ParseEngineKind(absl::string_view name);

struct AioConfig {
  EngineKind engine = EngineKind::kIoUring;
  // A request is split into block_size pieces (at file offsets that are multiples of block_size).
  // Must be a power of two between 4 KiB and 64 MiB, and a multiple of the file's O_DIRECT
  // alignment.
  uint64_t block_size = 1 << 20;
  // Pieces each thread keeps in flight: 1..1024.
  int queue_depth = 8;
  // Threads that share the pieces of each request: 1..256.
  int intra_op_parallelism = 1;
  // true: one submission call per piece; false: pieces are submitted in batches.
  bool single_submit = false;
  // true: a completed piece is replaced at once; false: a batch of queue_depth pieces is submitted
  // and all of it reaped before the next batch (DeepSpeed's meaning).
  bool overlap_events = true;
  // io_uring only: staging buffers and buffers given to Engine::RegisterBuffer are registered
  // (READ_FIXED / WRITE_FIXED); files opened through the engine are registered.
  bool registered_buffers = false;
  bool registered_files = false;
  // io_uring only: a kernel thread polls the submission queue (IORING_SETUP_SQPOLL).
  bool sqpoll = false;
  int sqpoll_idle_ms = 1000;
  // Open files with O_DIRECT. A filesystem that refuses it (tmpfs) is an error unless false.
  bool direct = true;
};

// Checks every field; the message names the key and the accepted range.
absl::Status Validate(const AioConfig& config);

// Reads DeepSpeed's "aio" block and strata's "strata": {"aio": {...}} block out of a whole config
// object (either block may be absent; missing keys keep their defaults). Unknown keys, wrong types
// and out-of-range values are errors naming the key and what is accepted. Notices (such as the
// deprecated thread_count) are appended to `warnings` when it is not null.
absl::StatusOr<AioConfig> AioConfigFromJson(const nlohmann::json& root,
                                            std::vector<std::string>* warnings = nullptr);
absl::StatusOr<AioConfig> AioConfigFromJsonText(absl::string_view text,
                                                std::vector<std::string>* warnings = nullptr);

// The config as {"aio": {...DeepSpeed keys...}, "strata": {"aio": {...}}}, the shape
// AioConfigFromJson reads and DeepSpeed accepts (it reads "aio" and ignores "strata").
nlohmann::json AioConfigToJson(const AioConfig& config);

}  // namespace strata::aio

#endif  // STRATA_AIO_CONFIG_H_
