#!/usr/bin/env bash
# The GPU check (issue 33), for a lent GPU machine (no Debian -dev packages, no registry; torch,
# transformers and peft installed). Each part runs whatever the parts before it did: a part that
# fails is recorded (its exit code and log under $OUT) and the rest still run. Results:
#   $OUT/summary.txt        one line a part: name, exit code, seconds
#   $OUT/<part>.log         each part's whole output; JSON reports beside them
#   DEPS_DIR=.device-deps OUT=/tmp/out bash scripts/device-check.sh
# DEPS_DIR holds what the machine lacks, fetched here beforehand into the git-ignored .device-deps:
# Debian's .deb files for the C++ build (`apt-get download` of the -dev packages
# scripts/install-deps.sh lists, and their library packages) and, under wheels/, Python wheels of
# what its python3 lacks (pytest, for one). On a machine without a GPU the CUDA parts fail (and
# say why) and the others run: that is how this script is tried here.
# Budget: it aims at under 10 minutes on an H100 (the build about 3, the suites about 4, the rest
# about 3); DEMO_STEPS and the model flags below shrink it.
set -u
cd "$(dirname "$0")/.."
deps=$(realpath "${DEPS_DIR:-.device-deps}")
out=${OUT:-/tmp/strata-device-check}
mkdir -p "$out"
out=$(realpath "$out")
summary=$out/summary.txt
: >"$summary"
python=${STRATA_PYTHON:-$(command -v python3)}
build=build/device

# part NAME COMMAND...: runs COMMAND, its output in $out/NAME.log, one line in the summary.
part() {
  local name=$1 start rc
  shift
  start=$(date +%s)
  "$@" >"$out/$name.log" 2>&1
  rc=$?
  echo "$name rc=$rc $(($(date +%s) - start))s" | tee -a "$summary"
  return 0
}

environment() {
  date -u
  nvidia-smi || echo "no nvidia-smi: no GPU here"
  "$python" -c "import sys, torch; print(sys.version); print('torch', torch.__version__, \
'cuda', torch.version.cuda, 'device', torch.cuda.is_available() and torch.cuda.get_device_name())"
  "$python" -c "import transformers, peft; print('transformers', transformers.__version__, \
'peft', peft.__version__)"
  nproc
  free -g
  df -h .
}

unpack() {
  local prefix=/tmp/strata-deps
  mkdir -p "$prefix"
  for f in "$deps"/*.deb; do
    [ -e "$f" ] || { echo "no .deb files in $deps"; return 1; }
    dpkg -x "$f" "$prefix" || return 1
  done
  if ! "$python" -c "import pytest" 2>/dev/null; then
    "$python" -m pip install --no-index --find-links "$deps/wheels" --target /tmp/strata-wheels \
      pytest || return 1
  fi
}

configure_and_build() {
  local prefix=/tmp/strata-deps
  cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DSTRATA_BUILD_BENCH=ON \
    -DCMAKE_PREFIX_PATH="$prefix/usr" -DSTRATA_PYTHON="$python" || return 1
  cmake --build "$build" -j"$(nproc)"
}

# The C++ suite (its CUDA tests run instead of skipping) and the Python suite.
suites() {
  (cd "$build" && ctest -j8 -E install --output-on-failure --output-junit "$out/ctest.xml")
  local rc=$?
  grep -E "CUDA|Cuda" "$out/suites.log" | grep -E "Skipped|SKIPPED" && {
    echo "a CUDA test skipped"; rc=1; }
  return $rc
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
  "$python" examples/finetune.py --work "$out/finetune" --device cuda --steps "${DEMO_STEPS:-60}" \
    --layers "$layers" --width "$width" --heads "$heads" --context 512 --batch 8 \
    --device-budget-mb "$budget_mb"
}

# The scheduler's step on the CUDA tier: one copy stream per direction, against its lower bound.
sched_step() {
  "$build"/bench/sched_step --device=cuda --dir "$out" --json "$out/sched_step.json"
}

export LD_LIBRARY_PATH=/tmp/strata-deps/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export PKG_CONFIG_PATH=/tmp/strata-deps/usr/lib/x86_64-linux-gnu/pkgconfig
export PYTHONPATH=$PWD/$build/python:/tmp/strata-wheels${PYTHONPATH:+:$PYTHONPATH}

part environment environment
part unpack unpack
part build configure_and_build
part suites suites
part demo demo
part sched_step sched_step
echo "results under $out"
