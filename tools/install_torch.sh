#!/usr/bin/env bash
# Install the pinned torch into a venv before the rest of the project's packages.
#   tools/install_torch.sh VENV_PYTHON [--dry-run]
# With a GPU (nvidia-smi on PATH): the default index's build of the pin, which is the CUDA
# build. Without one: the CPU build from the PyTorch project's CPU wheel index; where that
# index does not answer within TORCH_INDEX_TIMEOUT seconds, the default index (which gives
# the CUDA build unless pip finds a CPU wheel locally). --dry-run prints the pip command
# and the reason instead of running it.
# Environment: TORCH_VERSION (2.13.0), TORCH_CPU_INDEX (the CPU wheel index's URL),
# TORCH_INDEX_TIMEOUT (5, seconds for the probe and for each of pip's requests there).
set -euo pipefail

python=${1:?usage: tools/install_torch.sh VENV_PYTHON [--dry-run]}
dry_run=0
[ "${2:-}" = --dry-run ] && dry_run=1
version=${TORCH_VERSION:-2.13.0}
cpu_index=${TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}
timeout_s=${TORCH_INDEX_TIMEOUT:-5}

run_pip() {  # the reason, then pip's arguments
  echo "install_torch: $1"
  shift
  if [ "$dry_run" = 1 ]; then
    echo "install_torch: would run: $python -m pip install $*"
  else
    "$python" -m pip install --quiet "$@"
  fi
}

index_answers() {  # one request with a bounded wait: refused, unresolved or silent is "no"
  "$python" - "$cpu_index/torch/" "$timeout_s" <<'PY' >/dev/null 2>&1
import sys, urllib.request
urllib.request.urlopen(sys.argv[1], timeout=float(sys.argv[2])).close()
PY
}

if command -v nvidia-smi >/dev/null 2>&1; then
  run_pip "nvidia-smi found: torch==$version from the default index (the CUDA build)" "torch==$version"
elif index_answers; then
  run_pip "no GPU: torch==$version, the CPU build from $cpu_index" \
      --index-url "$cpu_index" --timeout "$timeout_s" --retries 1 "torch==$version" \
    || run_pip "the CPU index failed mid-install: torch==$version from the default index" "torch==$version"
else
  run_pip "no GPU and $cpu_index did not answer within ${timeout_s}s: torch==$version from the default index" "torch==$version"
fi
