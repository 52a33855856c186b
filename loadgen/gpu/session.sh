#!/usr/bin/env bash
# One command for a session with a GPU: what the machine is, then `gpu_bench` (which runs
# `gpu_check` first, then the throughput, roof and latency figures), everything printed and the
# JSON files left in OUT. Run from the repository root:
#
#   loadgen/gpu/session.sh [OUT]        (default OUT: gpu-session-out)
#
# Settings (environment):
#   BUDGET_S=360       gpu_bench's time budget, gpu_check and writing the checkpoints included;
#                      the process is interrupted (SIGINT: it prints and saves what it has) at
#                      BUDGET_S + 60 and killed 30 s later, so the whole script ends by
#                      BUDGET_S + 100 s (under 8 minutes by default: room to run it twice in a
#                      15-minute device allowance)
#   GPU_CHECK_S=150    the most gpu_check may take of the budget
#   MODELS=0.5b,1.5b   gpu_bench --models
#   EXTRA=             more gpu_bench flags, e.g. "--num-requests 128"
#   DEVICE=cuda        cpu runs the same script without a GPU (with MODELS=tiny and small
#                      EXTRA settings: how the tests check it)
#   PYTHON=python3     a python with torch (CUDA build), triton, transformers and mqinfer's
#                      dependencies; where `import mqinfer` fails it is run from this tree
#                      (the package laid out under a temporary folder on PYTHONPATH)
#
# Nothing is downloaded: the checkpoints are random weights written locally
# (loadgen/checkpoint.py), into OUT/checkpoints.
set -uo pipefail

OUT=${1:-gpu-session-out}
BUDGET_S=${BUDGET_S:-360}
GPU_CHECK_S=${GPU_CHECK_S:-150}
MODELS=${MODELS:-0.5b,1.5b}
EXTRA=${EXTRA:-}
PYTHON=${PYTHON:-python3}
DEVICE=${DEVICE:-cuda}
cd "$(dirname "$0")/../.."
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)

echo "== machine ($(date -u '+%Y-%m-%d %H:%M:%S') UTC, commit $(git rev-parse --short HEAD 2>/dev/null || echo '?'))"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.memory --format=csv 2>&1 || echo "no nvidia-smi"
"$PYTHON" - <<'EOF'
# Versions from the installed packages' metadata (importing transformers alone takes seconds of
# the session's device time; gpu_bench imports what it uses and says what fails); torch is
# imported for the devices it sees.
import platform
from importlib import metadata
print("python", platform.python_version())
for name in ("torch", "triton", "transformers", "pyarrow", "redis", "numpy", "safetensors"):
    try:
        print(f"{name} {metadata.version(name)}")
    except metadata.PackageNotFoundError:  # report every missing piece, not just the first
        print(f"{name} MISSING (not installed)")
try:
    import torch
    print("cuda available:", torch.cuda.is_available(), "| devices:",
          [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())])
except Exception as exc:
    print(f"torch does not import ({type(exc).__name__}: {exc})")
EOF

# Run from the repository's root, `python -m mqinfer...` is this tree's code, installed or not
# (README.md, "Where the code lives").

echo
echo "== gpu_bench (budget ${BUDGET_S}s; gpu_check first, at most ${GPU_CHECK_S}s)"
# shellcheck disable=SC2086  # EXTRA is a list of flags
timeout -s INT -k 30 $((BUDGET_S + 60)) "$PYTHON" -m mqinfer.loadgen.gpu.bench --device "$DEVICE" --models "$MODELS" \
    --budget-s "$BUDGET_S" --gpu-check-timeout-s "$GPU_CHECK_S" --workdir "$OUT/checkpoints" \
    --json "$OUT/gpu_bench.json" $EXTRA
code=$?
echo
echo "== gpu_bench exit status $code (0: every phase that ran succeeded; 1: gpu_check or a phase failed;"
echo "   124/130: stopped by the timeout or an interrupt); figures in $OUT/gpu_bench.json"
if [ -f "$OUT/gpu_bench.json" ]; then
    "$PYTHON" -c 'import json, sys; b = json.load(open(sys.argv[1])); print(json.dumps({"gpu_check": b.get("gpu_check"), "summary": b.get("summary")}, indent=1, default=str))' "$OUT/gpu_bench.json"
fi
exit "$code"
