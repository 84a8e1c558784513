// A program outside the strata tree: parses an aio config block and creates an engine.
#include <cstdio>

#include "aio/config.h"
#include "aio/engine.h"

int main() {
  auto config = strata::aio::AioConfigFromJsonText(R"({"aio": {"queue_depth": 4}})");
  if (!config.ok()) return 1;
  config->engine = strata::aio::EngineKind::kPosix;
  auto engine = strata::aio::Engine::Create(*config);
  if (!engine.ok()) return 2;
  std::printf("strata engine %s, queue_depth %d\n", std::string((*engine)->backend_name()).c_str(),
              (*engine)->config().queue_depth);
  return 0;
}
