#!/usr/bin/env bash
# On a lent GPU machine (no Debian -dev packages, no registry): unpacks the Debian packages the
# build needs from DEPS_DIR (fetched beforehand by scripts/device-deps.sh into a git-ignored folder
# and carried over) into a prefix of their own, builds strata with CUDA, and runs the test suite
# there (the CUDA tests run instead of skipping). Output and a JUnit report go to $OUT when set.
#   DEPS_DIR=.device-deps bash scripts/device-test.sh [ctest -R regex]
# STRATA_BUILD_BENCH=ON also builds the benchmarks (then run build/device/bench/sched_step
# --device=cuda, for one). The Python package is built for STRATA_PYTHON (default: the python3 on
# PATH, the one with the machine's CUDA PyTorch); DEPS_DIR should then hold pybind11-dev and
# libdlpack-dev too (python/CMakeLists.txt says what is missing), and its tests run with the rest.
set -euo pipefail
cd "$(dirname "$0")/.."
deps=${DEPS_DIR:-.device-deps}
prefix=${DEPS_PREFIX:-/tmp/strata-deps}
mkdir -p "$prefix"
for f in "$deps"/*.deb; do dpkg -x "$f" "$prefix"; done
lib=$prefix/usr/lib/x86_64-linux-gnu
export LD_LIBRARY_PATH=$lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export PKG_CONFIG_PATH=$lib/pkgconfig:$prefix/usr/share/pkgconfig
build=build/device
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DSTRATA_BUILD_BENCH="${STRATA_BUILD_BENCH:-OFF}" \
  -DCMAKE_PREFIX_PATH="$prefix/usr" -DSTRATA_PYTHON="${STRATA_PYTHON:-$(command -v python3)}" \
  >"${OUT:-/tmp}/configure.log" 2>&1 || {
  tail -40 "${OUT:-/tmp}/configure.log"; exit 1; }
grep -E "strata:|CUDA" "${OUT:-/tmp}/configure.log" || true
cmake --build "$build" -j"$(nproc)" >"${OUT:-/tmp}/build.log" 2>&1 || {
  grep -E "error|Error" "${OUT:-/tmp}/build.log" | head -40; exit 1; }
nvidia-smi -L || true
# The install test runs pkg-config on Debian's .pc files, whose prefix is /usr: not here.
cd "$build"
ctest -j8 -E install ${1:+-R "$1"} --output-on-failure --output-junit "${OUT:-/tmp}/ctest.xml" \
  >"${OUT:-/tmp}/ctest.log" 2>&1 || true
grep -E "tests passed|tests failed|\(Failed\)|\(Timeout\)|Skipped|Not Run" "${OUT:-/tmp}/ctest.log" | head -40
