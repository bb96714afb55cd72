#!/usr/bin/env bash
# The GPU tier on a CUDA machine that reaches no package registry but has torch, transformers, peft, pyarrow and
# pytest (docs/testing.md, "The GPU tier"). Two steps:
#
#     bash benchmarks/gpu_tier.sh wheels            here, with a registry: pydantic's wheels into .whl/
#     bash benchmarks/gpu_tier.sh run [--out DIR]   there, in a copy of this tree with .whl/ beside it
#
# `wheels` downloads the versions constraints.txt pins of pydantic, pydantic-core, pydantic-settings and their
# small dependencies, built for --python VERSION (default 3.12) on manylinux x86-64, into .whl/ (ignored by git).
# `run` installs them into a private directory on PYTHONPATH (nothing else on that machine changes), runs
# `pytest -m gpu tests/test_gpu.py` (the vLLM and Ray tests skip, saying why), then benchmarks/gpu_tier.py at
# Qwen2.5-0.5B's shape, and writes the logs and the figures' JSON into --out (default ./gpu-tier). It stops at
# once on a machine where torch sees no CUDA device. Sized to end well inside 8 minutes on one GPU: the gpu tests
# use tiny policies, and the benchmark one 0.5B policy, 64 x 128 sampled tokens and four train steps.
set -euo pipefail
cd "$(dirname "$0")/.."

WHEELS=.whl
PACKAGES=(pydantic pydantic_core pydantic-settings annotated-types typing-inspection typing_extensions python-dotenv)

pinned() {  # NAME==VERSION as constraints.txt pins it
  local line
  line=$(grep -i -E "^$1==" constraints.txt) || { echo "gpu_tier: constraints.txt pins no $1" >&2; exit 1; }
  echo "$line"
}

wheels() {
  local python=3.12
  while [[ $# -gt 0 ]]; do
    case "$1" in
      --python) python="$2"; shift 2 ;;
      *) echo "gpu_tier wheels: unknown option $1" >&2; exit 2 ;;
    esac
  done
  mkdir -p "$WHEELS"
  grep -qxF "/$WHEELS/" .git/info/exclude 2>/dev/null || echo "/$WHEELS/" >>.git/info/exclude
  for name in "${PACKAGES[@]}"; do
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$python" --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
      -d "$WHEELS" "$(pinned "$name")"
  done
  ls -1 "$WHEELS"
  echo "gpu_tier: carry $WHEELS/ with the tree, then run: bash benchmarks/gpu_tier.sh run"
}

run() {
  local out=./gpu-tier
  while [[ $# -gt 0 ]]; do
    case "$1" in
      --out) out="$2"; shift 2 ;;
      *) echo "gpu_tier run: unknown option $1" >&2; exit 2 ;;
    esac
  done
  mkdir -p "$out"
  if compgen -G "$WHEELS/*.whl" >/dev/null; then
    local site=/tmp/rlrounds-gpu-site
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" "$WHEELS"/*.whl || {
      echo "gpu_tier: the wheels in $WHEELS/ do not install on this $(python3 -V); fetch them for it:" \
        "rm -r $WHEELS && bash benchmarks/gpu_tier.sh wheels --python X.Y" >&2
      exit 1
    }
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
  fi
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
  python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" || {
    echo "gpu_tier: torch $(python3 -c 'import torch; print(torch.__version__)') sees no CUDA device here" >&2
    exit 1
  }
  python3 -c "import pydantic, pydantic_settings, transformers, peft" || {
    echo "gpu_tier: a package the tier needs is missing (above); carry pydantic's wheels: bash benchmarks/gpu_tier.sh wheels" >&2
    exit 1
  }
  nvidia-smi -L | tee "$out/device.txt" || true
  local code=0
  python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu.py 2>&1 | tee "$out/tests.log" || code=$?
  python3 benchmarks/gpu_tier.py --json "$out/gpu_tier.json" 2>&1 | tee "$out/benchmark.log" || code=$?
  return "$code"
}

case "${1:-}" in
  wheels) shift; wheels "$@" ;;
  run) shift; run "$@" ;;
  *) sed -n '2,14p' "$0"; exit 2 ;;
esac
