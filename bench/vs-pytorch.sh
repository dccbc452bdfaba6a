#!/usr/bin/env bash
# Our CPU backend against PyTorch CPU eager on this machine, side by side: builds the release
# binary, finds a Python with torch and torchvision (or makes a throwaway venv for them outside
# the repository), then runs bench/side_by_side.py interleaved over FP32 and BF16, PyTorch in
# NCHW and channels_last, and prints the table (ratios, % of the measured GEMM peak).
#
#   bench/vs-pytorch.sh                                  # ResNet-50, batches 1 8 32, 2 threads
#   bench/vs-pytorch.sh --batch-sizes 8 --rounds 5       # any side_by_side.py option
#
# VENV (default ~/.cache/workshop/bench-venv) is where the venv goes when needed; PYTHON picks
# the interpreter to try first.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
venv="${VENV:-$HOME/.cache/workshop/bench-venv}"
python="${PYTHON:-python3}"

if ! "$python" -c 'import torch, torchvision' 2>/dev/null; then
    if [ ! -x "$venv/bin/python" ]; then
        echo "torch not found for $python: making a venv in $venv (about 1 GB with PyPI's wheels)" >&2
        python3 -m venv "$venv"
        "$venv/bin/pip" install --quiet torch torchvision
    fi
    python="$venv/bin/python"
fi

(cd "$root" && cargo build --release --quiet)
export XDG_RUNTIME_DIR="${XDG_RUNTIME_DIR:-/tmp}"
if [ $# -eq 0 ]; then
    set -- --network resnet50 --batch-sizes 1 8 32 --precisions fp32 bf16 --rounds 3 --iterations 4
fi
exec "$python" "$root/bench/side_by_side.py" "$@"
