#!/usr/bin/env bash
# Fetches, on this machine, what a lent GPU machine lacks for scripts/device-check.sh and
# scripts/device-test.sh, into DEPS_DIR (default .device-deps, git-ignored), which the device
# call then carries (`carry: [".device-deps"]`, about 40 MB of its 64 MiB):
#   *.deb     Debian 12's packages for the C++ build (`apt-get download`: that machine has no
#             registry and no -dev packages): the -dev packages scripts/install-deps.sh installs
#             here and the library packages they need that the lent machine's Ubuntu lacks
#   wheels/   DeepSpeed's source package (bench/requirements-deepspeed.txt's pin) and the wheels of
#             what it needs but torch, for that machine's Python (CPython 3.12, manylinux x86_64),
#             at python/requirements.txt's pins where it has them; setuptools and wheel to build it
# Needs apt-get (run `apt-get update` once) and the project's environment (.venv: its pip). What
# is already in DEPS_DIR is kept (apt-get and pip skip files that are there).
#   DEPS_DIR=.device-deps bash scripts/device-deps.sh
set -euo pipefail
cd "$(dirname "$0")/.."
deps=${DEPS_DIR:-.device-deps}
pip=${STRATA_VENV:-.venv}/bin/pip
mkdir -p "$deps/wheels"
deps=$(realpath "$deps")

debs=(
  liburing-dev liburing2 libaio-dev libaio1 libhwloc-dev libhwloc15 libnuma-dev libnuma1
  libltdl-dev libltdl7 libudev-dev libudev1 libabsl-dev libabsl20220623 libboost1.74-dev
  libboost-dev nlohmann-json3-dev libxxhash-dev libxxhash0 libgtest-dev libgmock-dev googletest
  libbenchmark-dev libbenchmark1debian libgloo-dev libgloo0 libhiredis-dev libhiredis0.14
  libibverbs-dev libibverbs1 libnl-3-dev libnl-3-200 libnl-route-3-dev libnl-route-3-200
  pybind11-dev libdlpack-dev
)
(cd "$deps" && apt-get download -q "${debs[@]}")

# DeepSpeed's own requirements (its requirements/requirements.txt) but torch, which the lent
# machine has.
ds_needs=(einops hjson msgpack ninja numpy packaging psutil py-cpuinfo pydantic tqdm)
constraints=$(mktemp)
trap 'rm -f "$constraints"' EXIT
grep -E '^[A-Za-z0-9_.-]+==' python/requirements.txt bench/requirements-deepspeed.txt |
  cut -d: -f2 | grep -v '^deepspeed==' >"$constraints"
"$pip" download -q --disable-pip-version-check --no-deps --no-binary :all: -d "$deps/wheels" \
  "$(grep '^deepspeed==' bench/requirements-deepspeed.txt)"
"$pip" download -q --disable-pip-version-check --only-binary :all: --python-version 3.12 \
  --implementation cp --abi cp312 --platform manylinux2014_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 -c "$constraints" \
  -d "$deps/wheels" "${ds_needs[@]}" setuptools==84.2.1 wheel==0.48.0
echo "device-deps: $(ls "$deps"/*.deb | wc -l) .deb files, $(ls "$deps"/wheels | wc -l) wheels" \
  "and source packages, $(du -sh "$deps" | cut -f1) in $deps"
