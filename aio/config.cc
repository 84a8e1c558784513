#include "aio/config.h"

#include <limits>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/config_reader.h"
#include "base/status.h"
#include "nlohmann/json.hpp"

namespace strata::aio {
namespace {

constexpr uint64_t kMinBlockSize = 4096;
constexpr uint64_t kMaxBlockSize = 64ull << 20;

absl::Status Invalid(absl::string_view key, absl::string_view what) {
  return config::Bad(key, what);
}

}  // namespace

absl::string_view EngineKindName(EngineKind kind) {
  switch (kind) {
    case EngineKind::kIoUring:
      return "io_uring";
    case EngineKind::kLibAio:
      return "libaio";
    case EngineKind::kPosix:
      return "posix";
  }
  return "unknown";
}

absl::StatusOr<EngineKind> ParseEngineKind(absl::string_view name) {
  for (EngineKind kind : {EngineKind::kIoUring, EngineKind::kLibAio, EngineKind::kPosix}) {
    if (name == EngineKindName(kind)) return kind;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("aio engine \"", name, "\" is unknown; accepted: io_uring, libaio, posix"));
}

absl::Status Validate(const AioConfig& c) {
  if (c.block_size < kMinBlockSize || c.block_size > kMaxBlockSize ||
      (c.block_size & (c.block_size - 1)) != 0) {
    return Invalid("block_size", absl::StrCat("must be a power of two in [", kMinBlockSize, ", ",
                                              kMaxBlockSize, "] bytes, got ", c.block_size));
  }
  if (c.queue_depth < 1 || c.queue_depth > 1024) {
    return Invalid("queue_depth", absl::StrCat("must be in [1, 1024], got ", c.queue_depth));
  }
  if (c.intra_op_parallelism < 1 || c.intra_op_parallelism > 256) {
    return Invalid("intra_op_parallelism",
                   absl::StrCat("must be in [1, 256] threads, got ", c.intra_op_parallelism));
  }
  if (c.sqpoll_idle_ms < 1 || c.sqpoll_idle_ms > 60000) {
    return Invalid("strata.aio.sqpoll_idle_ms",
                   absl::StrCat("must be in [1, 60000], got ", c.sqpoll_idle_ms));
  }
  if (c.engine != EngineKind::kIoUring) {
    if (c.registered_buffers) {
      return Invalid("strata.aio.registered_buffers", "only the io_uring engine has them");
    }
    if (c.registered_files) {
      return Invalid("strata.aio.registered_files", "only the io_uring engine has them");
    }
    if (c.sqpoll) return Invalid("strata.aio.sqpoll", "only the io_uring engine has it");
  }
  return absl::OkStatus();
}

absl::StatusOr<AioConfig> AioConfigFromJson(const nlohmann::json& root,
                                            std::vector<std::string>* warnings) {
  AioConfig c;
  if (!root.is_object()) {
    return absl::InvalidArgumentError(
        absl::StrCat("config: the config must be a JSON object, got ", root.dump()));
  }
  if (auto it = root.find("aio"); it != root.end()) {
    const nlohmann::json& aio = *it;
    STRATA_RETURN_IF_ERROR(
        config::CheckKeys(aio, "aio",
                          {"block_size", "queue_depth", "intra_op_parallelism", "thread_count",
                           "single_submit", "overlap_events", "use_gds"}));
    const std::string p = "aio.";
    STRATA_RETURN_IF_ERROR(
        config::ReadInt(aio, p, "block_size", kMinBlockSize, kMaxBlockSize, &c.block_size));
    STRATA_RETURN_IF_ERROR(config::ReadInt(aio, p, "queue_depth", 1, 1024, &c.queue_depth));
    if (aio.contains("thread_count")) {
      if (aio.contains("intra_op_parallelism")) {
        return Invalid("aio.thread_count",
                       "give either intra_op_parallelism or its old name thread_count, not both");
      }
      STRATA_RETURN_IF_ERROR(
          config::ReadInt(aio, p, "thread_count", 1, 256, &c.intra_op_parallelism));
      if (warnings) {
        warnings->push_back(
            "aio.thread_count is DeepSpeed's old name; read as aio.intra_op_parallelism (write "
            "that key: DeepSpeed's runtime ignores thread_count)");
      }
    }
    STRATA_RETURN_IF_ERROR(
        config::ReadInt(aio, p, "intra_op_parallelism", 1, 256, &c.intra_op_parallelism));
    STRATA_RETURN_IF_ERROR(config::ReadBool(aio, p, "single_submit", &c.single_submit));
    STRATA_RETURN_IF_ERROR(config::ReadBool(aio, p, "overlap_events", &c.overlap_events));
    bool use_gds = false;
    STRATA_RETURN_IF_ERROR(config::ReadBool(aio, p, "use_gds", &use_gds));
    if (use_gds) {
      return Invalid("aio.use_gds", "GPUDirect Storage is not supported; accepted: false");
    }
  }
  if (auto s = root.find("strata"); s != root.end() && s->is_object()) {
    if (auto it = s->find("aio"); it != s->end()) {
      const nlohmann::json& block = *it;
      STRATA_RETURN_IF_ERROR(config::CheckKeys(block, "strata.aio",
                                               {"engine", "registered_buffers", "registered_files",
                                                "sqpoll", "sqpoll_idle_ms", "direct"}));
      const std::string p = "strata.aio.";
      if (auto e = block.find("engine"); e != block.end()) {
        if (!e->is_string()) {
          return Invalid("strata.aio.engine", "must be one of \"io_uring\", \"libaio\", \"posix\"");
        }
        auto kind = ParseEngineKind(e->get<std::string>());
        if (!kind.ok()) return Annotate(kind.status(), "config: strata.aio.engine");
        c.engine = *kind;
      }
      STRATA_RETURN_IF_ERROR(
          config::ReadBool(block, p, "registered_buffers", &c.registered_buffers));
      STRATA_RETURN_IF_ERROR(config::ReadBool(block, p, "registered_files", &c.registered_files));
      STRATA_RETURN_IF_ERROR(config::ReadBool(block, p, "sqpoll", &c.sqpoll));
      STRATA_RETURN_IF_ERROR(
          config::ReadInt(block, p, "sqpoll_idle_ms", 1, 60000, &c.sqpoll_idle_ms));
      STRATA_RETURN_IF_ERROR(config::ReadBool(block, p, "direct", &c.direct));
    }
  } else if (s != root.end()) {
    return Invalid("strata", absl::StrCat("must be a JSON object, got ", s->dump()));
  }
  STRATA_RETURN_IF_ERROR(Validate(c));
  return c;
}

absl::StatusOr<AioConfig> AioConfigFromJsonText(absl::string_view text,
                                                std::vector<std::string>* warnings) {
  STRATA_ASSIGN_OR_RETURN(const nlohmann::json root, config::Parse(text));
  return AioConfigFromJson(root, warnings);
}

nlohmann::json AioConfigToJson(const AioConfig& c) {
  nlohmann::json out;
  out["aio"] = {{"block_size", c.block_size},
                {"queue_depth", c.queue_depth},
                {"intra_op_parallelism", c.intra_op_parallelism},
                {"single_submit", c.single_submit},
                {"overlap_events", c.overlap_events}};
  out["strata"]["aio"] = {{"engine", std::string(EngineKindName(c.engine))},
                          {"registered_buffers", c.registered_buffers},
                          {"registered_files", c.registered_files},
                          {"sqpoll", c.sqpoll},
                          {"direct", c.direct}};
  return out;
}

}  // namespace strata::aio
