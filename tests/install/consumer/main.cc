// A program outside the strata tree, built against the installed package: parses an aio config
// block and creates an engine, keeps a partition in an NVMe store and reads it back, and runs one
// pipelined optimizer step over NVMe-resident state (aio/, tiering/, optim_cpu/ and swap/).
#include <stdlib.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "aio/config.h"
#include "aio/engine.h"
#include "optim_cpu/adam.h"
#include "swap/optimizer_swapper.h"
#include "tiering/memory_resource.h"
#include "tiering/nvme_store.h"

int main() {
  auto config = strata::aio::AioConfigFromJsonText(R"({"aio": {"queue_depth": 4}})");
  if (!config.ok()) return 1;
  config->engine = strata::aio::EngineKind::kPosix;
  config->direct = false;  // wherever the temporary folder lies
  auto engine = strata::aio::Engine::Create(*config);
  if (!engine.ok()) return 2;

  std::string dir = (std::filesystem::temp_directory_path() / "strata-consumer-XXXXXX").string();
  if (mkdtemp(dir.data()) == nullptr) return 3;
  int rc = 0;
  {
    strata::tiering::NvmeStoreOptions so;
    so.capacity_bytes = 8 << 20;
    auto store = strata::tiering::NvmeStore::Open(dir + "/store", so, engine->get());
    if (!store.ok()) {
      std::fprintf(stderr, "%s\n", store.status().ToString().c_str());
      rc = 4;
    }
    std::vector<std::byte> bytes(100000, std::byte{7}), back(100000);
    if (rc == 0 && (!(*store)->Put(1, bytes).ok() || !(*store)->Get(1, absl::MakeSpan(back)).ok() ||
                    back != bytes)) {
      rc = 5;
    }
    auto adam = strata::optim_cpu::CpuAdam::Create({.lr = 0.1f});
    strata::tiering::HostMemoryResource host;
    if (rc == 0 && adam.ok()) {
      auto swapper = strata::swap::PipelinedOptimizerSwapper::Create(
          store->get(), adam->get(), &host, {}, {{10, 1000}, {11, 1000}});
      std::vector<float> master(1000, 1.0f), grad(1000, 1.0f), m(1000), v(1000);
      std::vector<strata::swap::StepInput> in = {{.id = 10, .grad = grad.data()},
                                                 {.id = 11, .grad = grad.data()}};
      if (!swapper.ok() || !(*swapper)->Initialize(10, master).ok() ||
          !(*swapper)->Initialize(11, master).ok() || !(*swapper)->Step(1, in).ok() ||
          !(*swapper)
               ->ReadState(11, absl::MakeSpan(master), absl::MakeSpan(m), absl::MakeSpan(v))
               .ok() ||
          !(master[0] < 1.0f)) {
        rc = 6;
      }
    } else if (rc == 0) {
      rc = 7;
    }
  }
  std::filesystem::remove_all(dir);
  if (rc != 0) return rc;
  std::printf("strata engine %s, queue_depth %d; store, CPU Adam and the optimizer swap step ran\n",
              std::string((*engine)->backend_name()).c_str(), (*engine)->config().queue_depth);
  return 0;
}
