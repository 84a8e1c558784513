#!/usr/bin/env bash
# The GPU check (issue 33), for a lent GPU machine (no Debian -dev packages, no registry; torch,
# transformers and peft installed). Each part runs whatever the parts before it did: a part that
# fails or runs out of its time is recorded (its exit code and log) and the rest still run.
#   DEPS_DIR=.device-deps OUT=/tmp/out CHECK_SECONDS=480 bash scripts/device-check.sh [PART...]
# PART names the parts to run (default: all, in the order below). Results, under $OUT (the lent
# machine brings back at most 8 files, so the logs travel packed):
#   $OUT/summary.txt     one line a part: name, exit code (124: out of time), seconds
#   $OUT/logs.tar.gz     each part's whole output (NAME.log) and its JSON reports, packed again
#                        after every part, so whatever ran comes back even if the call is cut
# DEPS_DIR holds what the machine lacks, fetched here beforehand into the git-ignored .device-deps
# by scripts/device-deps.sh: Debian's .deb files for the C++ build (`apt-get download` of the -dev
# packages scripts/install-deps.sh lists, and their library packages) and, under wheels/,
# DeepSpeed's source package and the wheels of its dependencies (cp312, manylinux) for
# bench/vs_deepspeed.
# On a machine without a GPU the CUDA parts fail (and say why) and
# the others run: that is how this script is tried here.
# Time: CHECK_SECONDS (default 480) bounds the whole run; each part gets its own limit, cut to
# what is left, and a part that would start with under 20 s left is recorded as not run.
set -u
cd "$(dirname "$0")/.."
deps=$(realpath "${DEPS_DIR:-.device-deps}")
out=${OUT:-/tmp/strata-device-check}
mkdir -p "$out"
out=$(realpath "$out")
logs=$(mktemp -d /tmp/strata-check-logs.XXXXXX)
summary=$out/summary.txt
: >"$summary"
python=${STRATA_PYTHON:-$(command -v python3)}
build=${BUILD_DIR:-build/device}
scratch=${SCRATCH:-/tmp/strata-check-scratch}
mkdir -p "$scratch"
started=$(date +%s)
deadline=$((started + ${CHECK_SECONDS:-480}))
wanted=" $* "

# part NAME LIMIT COMMAND...: runs COMMAND for at most LIMIT seconds (fewer if the run's deadline
# is nearer), its output in NAME.log; one line in the summary; the logs packed into $OUT.
part() {
  local name=$1 limit=$2 start rc left
  shift 2
  if [[ "$wanted" != "  " && "$wanted" != *" $name "* ]]; then return 0; fi
  start=$(date +%s)
  left=$((deadline - start - 10))
  if ((left < 20)); then
    echo "$name not-run (the run's time is spent)" | tee -a "$summary"
    return 0
  fi
  ((limit > left)) && limit=$left
  timeout -k 10 "$limit" bash -c '"$@"' "$name" "$@" >"$logs/$name.log" 2>&1
  rc=$?
  echo "$name rc=$rc $(($(date +%s) - start))s (limit ${limit}s)" | tee -a "$summary"
  cp "$summary" "$logs/"
  tar -czf "$out/logs.tar.gz.part" -C "$logs" . && mv "$out/logs.tar.gz.part" "$out/logs.tar.gz"
  return 0
}

environment() {
  date -u
  pwd
  nvidia-smi || echo "no nvidia-smi: no GPU here"
  echo "TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST-unset}"
  "$python" -c "import sys, sysconfig, os, torch; print(sys.version, sys.executable); \
inc = sysconfig.get_paths()['include']; print('Python.h', inc, os.path.exists(inc + '/Python.h')); \
print('torch', torch.__version__, 'cuda', torch.version.cuda, 'device', \
torch.cuda.is_available() and torch.cuda.get_device_name())"
  "$python" -c "import transformers, peft, pytest, safetensors; print('transformers', \
transformers.__version__, 'peft', peft.__version__, 'pytest', pytest.__version__)"
  g++ --version | head -1
  cmake --version | head -1
  command -v ninja fio || true
  nproc
  free -g
  df -h . /tmp
}

unpack() {
  local prefix=/tmp/strata-deps
  mkdir -p "$prefix"
  for f in "$deps"/*.deb; do
    [ -e "$f" ] || { echo "no .deb files in $deps"; return 1; }
    dpkg -x "$f" "$prefix" || return 1
  done
  # Debian's Gloo and hiredis CMake files name their libraries and headers by absolute /usr
  # paths: point them into the prefix.
  sed -i "s#\"/usr/#\"$prefix/usr/#g" "$prefix"/usr/share/cmake/Gloo/*.cmake \
    "$prefix"/usr/lib/x86_64-linux-gnu/cmake/Hiredis/*.cmake || return 1
  grep -h "IMPORTED_LOCATION" "$prefix"/usr/share/cmake/Gloo/*.cmake
}

# DeepSpeed for bench/vs_deepspeed (issue 32), installed offline from $deps/wheels (its source
# package and the wheels of what it needs) into a folder of its own: only what the interpreter's
# environment lacks, so that nothing of the environment is shadowed.
# DeepSpeed 0.19.8's JIT builder reads each TORCH_CUDA_ARCH_LIST entry as numbers and fails on an
# arch-specific one ("9.0a": ValueError: invalid literal for int() with base 10: '0a'; the lent
# machine's list had one on 2026-11-27, so its async I/O op, a CUDA op there, was never built):
# its builds get the list without those suffixes.
ds_env() {
  if [ -n "${TORCH_CUDA_ARCH_LIST:-}" ]; then
    TORCH_CUDA_ARCH_LIST=$(sed -E 's/([0-9]+\.[0-9]+)[a-z]/\1/g' <<<"$TORCH_CUDA_ARCH_LIST")
    export TORCH_CUDA_ARCH_LIST
  fi
  export PYTHONPATH=/tmp/strata-ds${PYTHONPATH:+:$PYTHONPATH}
  export PATH=/tmp/strata-ds/bin:$(dirname "$("$python" -c 'import sys; print(sys.executable)')"):$PATH
  export TORCH_EXTENSIONS_DIR=/tmp/strata-ds/torch_extensions
}

deepspeed_install() {
  local ds=/tmp/strata-ds wheels=$deps/wheels
  ds_env
  mkdir -p "$ds"
  "$python" -c "import setuptools" 2>/dev/null ||
    "$python" -m pip install -q --no-index --no-deps --target "$ds" "$wheels"/setuptools-*.whl
  DS_BUILD_OPS=0 "$python" -m pip install -q --dry-run --no-index --find-links "$wheels" \
    --no-build-isolation --report "$ds/plan.json" "deepspeed==${DS_VERSION:-0.19.8}" || return 1
  "$python" -c 'import json, sys
for i in json.load(open(sys.argv[1]))["install"]:
    print(i["metadata"]["name"] + "==" + i["metadata"]["version"])' "$ds/plan.json" >"$ds/plan.txt"
  echo "installing into $ds:" $(cat "$ds/plan.txt")
  DS_BUILD_OPS=0 "$python" -m pip install -q --no-index --find-links "$wheels" \
    --no-build-isolation --no-deps --target "$ds" -r "$ds/plan.txt" || return 1
  "$python" -c "import deepspeed; print('deepspeed', deepspeed.__version__, deepspeed.__file__)" ||
    return 1
  # Its CPU Adam, built now rather than inside the first measured child.
  "$python" -c "from deepspeed.ops.op_builder import CPUAdamBuilder; CPUAdamBuilder().load()"
}

# bench/vs_deepspeed on the GPU: the ZeRO-2 and ZeRO-3 cpu-offload rows, each system's step
# split into its phases and one step profiled (the GPU's kernels, and how long it was busy).
# VS_ROWS, VS_ROUNDS; VS_STRATA: a JSON object of strata block keys for strata's copy alone (an
# A/B, e.g. '{"optimizer_threads": 14}'); VS_ARGS: more of the bench's arguments (default
# "--phases 3 --profile"; empty: the timed steps alone, each child shorter). DeepSpeed's async
# I/O op (the zero3_nvme row) is built there with libaio's header (alone in a folder: CPATH comes
# before the -isystem folders, and the prefix's other headers, pybind11's among them, must not
# shadow torch's) and library from the prefix.
# Each row's bound is printed beside both systems where the floor runs (not with --no-floor);
# the NVMe row's disk rates come from fio, else strata's aio_bench (built here). vs_deepspeed
# [NAME ROWS ARGS...]: the report as vs_deepspeed_NAME.json, those rows, those arguments in place
# of VS_ARGS (the parts below: vs_noclip, vs_nvme).
vs_deepspeed() {
  local name=${1:-cuda} rows=${2:-${VS_ROWS:-zero2_cpu,zero3_cpu}}
  local args=(${VS_ARGS---phases 3 --profile})
  (($# > 2)) && args=("${@:3}")
  ds_env
  mkdir -p /tmp/strata-aio-include
  cp /tmp/strata-deps/usr/include/libaio.h /tmp/strata-aio-include/ ||
    echo "device-check: no libaio.h in the prefix: DeepSpeed's async I/O op will not build"
  export CPATH=/tmp/strata-aio-include LIBRARY_PATH=/tmp/strata-deps/usr/lib/x86_64-linux-gnu
  "$python" bench/vs_deepspeed.py --device cuda --dir "$scratch/vsds" \
    --rows "$rows" --bf16 --layers 8 --width 2048 --heads 16 \
    --context 1024 --batch 4 --rounds "${VS_ROUNDS:-1}" --steps 4 "${args[@]}" \
    ${VS_STRATA:+--strata "$VS_STRATA"} --aio-bench "$build/tools/aio_bench/aio_bench" \
    --child-timeout 150 \
    --json "$logs/vs_deepspeed_$name.json" --png "$logs/vs_deepspeed_$name.png"
}

configure_and_build() {
  local prefix=/tmp/strata-deps pybind11_dir
  # The interpreter's own pybind11 where it has one (Debian 12's 2.10 predates Python 3.12).
  pybind11_dir=$("$python" -m pybind11 --cmakedir 2>/dev/null)
  cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DSTRATA_BUILD_BENCH=ON \
    -DCMAKE_PREFIX_PATH="$prefix/usr" -DSTRATA_PYTHON="$python" \
    ${pybind11_dir:+-Dpybind11_DIR="$pybind11_dir"} || return 1
  cmake --build "$build" -j"$(nproc)"
}

# The C++ suite; its CUDA tests must run, not skip. (The install test reads Debian's .pc files,
# whose prefix is /usr: not here. The Python files run as parts of their own.)
cpp_suite() {
  (cd "$build" && ctest -j"$(nproc)" -E "^install|^python\." --timeout 120 --no-tests=error \
    --output-on-failure --output-junit "$logs/ctest.xml")
  local rc=$?
  if grep -E "Cuda|CUDA" "$logs/cpp_suite.log" | grep -qiE "skipped|not run"; then
    echo "device-check: a CUDA test skipped"
    rc=1
  fi
  return $rc
}

# The Python cases on the CUDA tier (tests/python/test_cuda.py); a skip counts as a failure.
# CUDA_K: pytest's -k expression to run some cases alone (default: all but the ranks' cases,
# which are the part cuda_ranks). NAME (default cuda_pytest): the part's name, whose log is read
# for skips.
cuda_pytest() {
  local name=${1:-cuda_pytest}
  (cd tests/python && "$python" -m pytest -q -rs -p no:cacheprovider test_cuda.py \
    -k "${CUDA_K:-not ranks_on_gpus and not nccl_collectives}" --junitxml "$logs/$name.xml")
  local rc=$?
  if grep -qE "[0-9]+ skipped" "$logs/$name.log"; then
    echo "device-check: a CUDA case skipped"
    rc=1
  fi
  return $rc
}

# Across ranks on the GPUs (issue 48): 2 ranks train to one process's weights at stages 1-3, the
# optimizer on cpu and on NVMe, fp32 and bf16 (on one GPU the ranks share it, through strata's
# Gloo and pinned memory; on two or more, NCCL's group); strata's collectives on NCCL, one rank.
# RANKS_K: pytest's -k expression to run some of these alone (e.g. "ranks_on_gpus and 3-").
cuda_ranks() {
  CUDA_K="${RANKS_K:-ranks_on_gpus or nccl_collectives}" cuda_pytest cuda_ranks
}

# make demo's fine-tuning on the GPU in bf16, the device budget a quarter of the model's bf16
# parameters; the loss curves beside plain PyTorch on the same GPU, bytes moved, waits by cause.
demo() {
  local layers=${DEMO_LAYERS:-8} width=${DEMO_WIDTH:-1024} heads=${DEMO_HEADS:-16}
  local budget_mb
  budget_mb=$("$python" - "$layers" "$width" "$heads" <<'EOF'
import sys
sys.path.insert(0, "examples")
from llama import llama
layers, width, heads = map(int, sys.argv[1:])
params = sum(p.numel() for p in llama(layers, width, heads, 512).parameters())
print(f"{params * 2 / 4 / 2**20:.1f}")
EOF
) || return 1
  echo "device budget: ${budget_mb} MiB, a quarter of the bf16 parameters"
  "$python" examples/finetune.py --work "$scratch/finetune" --device cuda \
    --steps "${DEMO_STEPS:-60}" --layers "$layers" --width "$width" --heads "$heads" \
    --context 512 --batch 8 --device-budget-mb "$budget_mb"
  local rc=$?
  cp "$scratch"/finetune/summary.json "$logs/demo_summary.json" 2>/dev/null
  cp "$scratch"/finetune/loss_curves.png "$logs/demo_loss_curves.png" 2>/dev/null
  return $rc
}

# bench/train_step on the GPU: a Llama of about 310M parameters, the device budget a tenth of its
# training state, the optimizer on the host (or on NVMe: OPTIMIZER=nvme); the planner's prediction
# of the same run beside it.
# Beside the default (on a GPU the optimizer steps during backward on all but two cores, one copy
# stream), the same step with the optimizer after backward on every core (the default before
# 2026-11-26), during backward on every core and on half, and with one copy stream per direction
# (strata.optimizer_during_backward, strata.optimizer_threads, strata.copy_streams). TS_EXTRA:
# more train_step arguments (the profiled configuration's, such as --during-backward false).
train_step() {
  local n
  n=$(nproc)
  "$python" bench/train_step.py --device cuda --optimizer "${1:-cpu}" --budget-of-state 0.1 \
    --layers "${TS_LAYERS:-12}" --width "${TS_WIDTH:-1536}" --heads 12 --context 1024 \
    --batch 8 --rounds "${TS_ROUNDS:-2}" --steps 3 --dir "$scratch/train_step" \
    --variants "${TS_VARIANTS:-0/1/0,$n/1/1,$((n / 2))/1/1,0/2/1}" \
    --plan "$build/tools/strata_plan/strata_plan" --json "$logs/train_step_${1:-cpu}.json" \
    --aio-bench "$build/tools/aio_bench/aio_bench" \
    --profile "$logs/train_step_${1:-cpu}_profile.txt" ${TS_EXTRA:-}
}

# The scheduler's step on the CUDA tier against its lower bound: strata with one copy stream and
# with one per direction (the copy engine's open question), LRU and the DeepSpeed-like policy.
sched_step() {
  "$build"/bench/sched_step --device=cuda --dir "$scratch" --json "$logs/sched_step.json" \
    --policies=strata,strata@2,lru,deepspeed_like --rounds "${SS_ROUNDS:-2}" --steps 4
}

# The C++ tests with a CUDA case (the whole suite is cpp_suite).
cpp_cuda() {
  (cd "$build" && ctest -j4 -R "Cuda|CUDA" --timeout 120 --no-tests=error --output-on-failure)
  local rc=$?
  if grep -qiE "skipped|not run" "$logs/cpp_cuda.log"; then
    echo "device-check: a CUDA test skipped"
    rc=1
  fi
  return $rc
}

# The largest model this machine trains (issue 49): strata_plan --largest with this machine's
# description (--calibrate here, the disk from fio, or strata's aio_bench where fio is missing,
# the host memory the run's host budget, the disk the optimizer state's share beside the
# checkpoint) picks the largest member of
# examples/llama.py's family; bench/bigger_than_ram.py builds it under strata.init on GPU 0, bf16,
# the weights in host memory and the optimizer on the disk, trains 3 steps (a checkpoint after the
# second, the third resumed from it), beside the planner's prediction and the disk's floor; peak
# GPU and host memory; the training state beside the GPU's memory.
largest() {
  local ram_gib
  ram_gib=$(awk '/MemTotal/ {print int($2 / 1048576)}' /proc/meminfo)
  "$python" bench/bigger_than_ram.py --dir "$scratch/largest" --device cuda --largest \
    --plan "$build/tools/strata_plan/strata_plan" --aio-bench "$build/tools/aio_bench/aio_bench" \
    --param-device cpu --vocab 32000 \
    --context 512 --host-budget-gib "${LARGEST_HOST_GIB:-$((ram_gib * 3 / 4))}" \
    --device-budget-gib "${LARGEST_DEVICE_GIB:-64}" --steps 3 --save-after 2 \
    --json "$logs/largest.json"
}

# Stage 3's host-side cost with the model held in the device budget (issue 49: forward and
# backward within 1.2x of plain PyTorch's there): bench/host_cost.py on the GPU, bf16, plain
# PyTorch beside it in the same run; first the trainer's shape (bench/vs_deepspeed's model: 8
# layers 2048 wide), then the narrow, deep default (the host's work per module, nothing else).
host_cost() {
  "$python" bench/host_cost.py --device cuda --layers 8 --width 2048 --heads 16 --context 1024 \
    --batch 4 --rounds 5 --steps 4 --json "$logs/host_cost_wide.json" &&
    "$python" bench/host_cost.py --device cuda --json "$logs/host_cost_narrow.json"
}

# The rest of the Python suite (the emulated tier, with this machine's Python and torch).
python_suite() {
  (cd "$build" && ctest -j4 -R "^python\." -E "test_cuda" --timeout 300 --no-tests=error \
    --output-on-failure)
}

export LD_LIBRARY_PATH=/tmp/strata-deps/usr/lib/x86_64-linux-gnu:/tmp/strata-deps/usr/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export PKG_CONFIG_PATH=/tmp/strata-deps/usr/lib/x86_64-linux-gnu/pkgconfig
export PYTHONPATH=$PWD/$build/python${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
export deps logs python build scratch
export -f environment unpack ds_env deepspeed_install vs_deepspeed configure_and_build cpp_suite cpp_cuda cuda_pytest cuda_ranks demo train_step \
  sched_step largest host_cost python_suite

part environment 60 environment
part unpack 60 unpack
part build 300 configure_and_build
part cuda_pytest 120 cuda_pytest
part cuda_ranks 300 cuda_ranks
part largest 420 largest
part host_cost 150 host_cost
part train_step 200 train_step cpu
part sched_step 90 sched_step
part cpp_cuda 60 cpp_cuda
part deepspeed_install 120 deepspeed_install
part vs_deepspeed 300 vs_deepspeed
# The ZeRO-2 row without gradient clipping (the optimizer steps during backward there, exactly).
part vs_noclip 150 vs_deepspeed noclip zero2_cpu --clipping 0 --no-floor
# ZeRO-Infinity and ZenFlow beside DeepSpeed, the NVMe row's bound with the disk's rates.
part vs_nvme 240 vs_deepspeed nvme zero3_nvme,zenflow --steps 2
# ZeRO-Infinity with strata's host budget a half and a quarter of the optimizer state (issue 50):
# where the compute is a GPU's, the step is the disk's, and the bytes read a step decide it.
part vs_nvme_beyond_host 240 vs_deepspeed nvme_beyond_host zero3_nvme_half,zero3_nvme_quarter \
  --steps 2 --no-floor
# transformers' Trainer: deepspeed= beside strata.hf.Trainer, the same TrainingArguments.
part vs_trainer 150 vs_deepspeed trainer trainer --no-floor
part demo 100 demo
part cpp_suite 150 cpp_suite
part train_step_nvme 120 train_step nvme
part python_suite 600 python_suite
echo "results under $out (logs.tar.gz: each part's log)"
