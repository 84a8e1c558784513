#!/usr/bin/env bash
# Installs every Debian package that strata's build, tests and benchmarks need.
# Idempotent: when everything is present it only checks (dpkg-query) and exits in well under a second.
# Uses sudo when not root. CUDA is not installed here: when the toolkit is present (its standard
# location, /usr/local/cuda) the build uses it; when absent, the configure step says what is left out.
# The Python packages (torch, transformers, pytest, ...) are not Debian's: scripts/python-env.sh
# installs them, pinned, from PyPI into the project's own virtual environment over python3-venv.
set -euo pipefail

packages=(
  build-essential cmake ninja-build pkg-config git
  liburing-dev libaio-dev libhwloc-dev libabsl-dev libboost-dev nlohmann-json3-dev libxxhash-dev
  libgtest-dev libgmock-dev libbenchmark-dev libgloo-dev
  fio clang-format
  python3-dev python3-venv pybind11-dev libdlpack-dev
)

missing=()
for p in "${packages[@]}"; do
  status=$(dpkg-query -W -f='${Status}' "$p" 2>/dev/null || true)
  [[ "$status" == "install ok installed" ]] || missing+=("$p")
done

if ((${#missing[@]} == 0)); then
  exit 0
fi

echo "install-deps: installing ${missing[*]}"
sudo=""
if [[ $(id -u) -ne 0 ]]; then
  command -v sudo >/dev/null || { echo "install-deps: not root and no sudo; install: ${missing[*]}" >&2; exit 1; }
  sudo="sudo"
fi
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -qq
$sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
