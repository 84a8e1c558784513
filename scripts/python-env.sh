#!/usr/bin/env bash
# Makes strata's Python environment: a virtual environment of the project's own (.venv at the
# repository root, git-ignored; STRATA_VENV=DIR puts it elsewhere) over Debian's python3, with
# every package of python/requirements.txt at its pinned version, from PyPI.
# Idempotent: when the environment holds exactly those requirements (a copy of the file is kept
# beside it once the install has succeeded) it exits at once. The first run downloads about
# 3 GB and takes about 5.3 GB of disk: PyPI's torch for Linux is a CUDA build and brings CUDA's
# libraries (about 2.5 minutes on this project's machine). An interrupted install is redone
# whole on the next run.
#   --deepspeed: also DeepSpeed (bench/requirements-deepspeed.txt, for bench/vs_deepspeed.py only),
#   a source package installed against the environment's torch with no op built ahead (DS_BUILD_OPS=0:
#   DeepSpeed builds the ops it uses on first use, with ninja); a second stamp beside the first.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${STRATA_VENV:-.venv}
base=${STRATA_BASE_PYTHON:-/usr/bin/python3}
requirements=python/requirements.txt
stamp=$venv/strata-requirements.txt
deepspeed=0
case "${1:-}" in
  "") ;;
  --deepspeed) deepspeed=1 ;;
  *) echo "python-env: unknown argument $1; accepted: --deepspeed, or none" >&2; exit 2 ;;
esac

install_deepspeed() {
  local ds_requirements=bench/requirements-deepspeed.txt ds_stamp=$venv/strata-deepspeed.txt
  ((deepspeed)) || return 0
  cmp -s "$ds_requirements" "$ds_stamp" && return 0
  echo "python-env: installing $ds_requirements into $venv" >&2
  DS_BUILD_OPS=0 "$venv/bin/python" -m pip install --quiet --disable-pip-version-check \
    --no-build-isolation -r "$ds_requirements"
  cp "$ds_requirements" "$ds_stamp"
}

if [[ -x $venv/bin/python ]] && cmp -s "$requirements" "$stamp"; then
  install_deepspeed
  exit 0
fi
if [[ ! -x $base ]]; then
  echo "python-env: $base not found; accepted: Debian's python3 (scripts/install-deps.sh " \
       "installs it) or STRATA_BASE_PYTHON=/path/to/python3.10+" >&2
  exit 1
fi
echo "python-env: installing $requirements into $venv (the first time: about 3 GB from PyPI," \
     "5.3 GB on disk)" >&2
rm -f "$stamp"
if [[ ! -x $venv/bin/python ]]; then
  "$base" -m venv "$venv"
fi
start=$(date +%s)
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check -r "$requirements"
cp "$requirements" "$stamp"
echo "python-env: done in $(( $(date +%s) - start )) s" >&2
install_deepspeed
