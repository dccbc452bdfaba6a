#!/usr/bin/env bash
# Our CPU backend against PyTorch CPU eager on this machine, side by side, and against the
# engines a user would pick for fast CPU inference, ONNX Runtime and OpenVINO: builds the
# release binary, finds a Python with what the run needs (torch and torchvision; with
# `--peers`, onnx, onnxscript and the engines) or installs it in a throwaway venv outside the
# repository, then runs bench/side_by_side.py interleaved over FP32 and BF16, PyTorch in NCHW
# and channels_last, ours eager and compiled, and prints the table (ratios against the best
# other engine, % of the measured GEMM peak and ceiling).
#
#   bench/vs-pytorch.sh                                  # ResNet-50, batches 1 8 32, 2 threads, with the peers
#   bench/vs-pytorch.sh --batch-sizes 8 --rounds 5       # any side_by_side.py option
#   bench/vs-pytorch.sh --network resnet50 --batch-sizes 8   # PyTorch only: no --peers
#
# VENV (default ~/.cache/workshop/bench-venv) is where the venv goes when needed; PYTHON picks
# the interpreter to try first.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
venv="${VENV:-$HOME/.cache/workshop/bench-venv}"
python="${PYTHON:-python3}"

if [ $# -eq 0 ]; then
    set -- --network resnet50 --batch-sizes 1 8 32 --precisions fp32 bf16 --rounds 3 --iterations 4 \
        --peers onnxruntime openvino --compile
fi
# The modules this run imports, and the PyPI packages that bring them.
modules="torch, torchvision"
packages="torch torchvision"
for arg in "$@"; do
    if [ "$arg" = "--peers" ]; then
        modules="$modules, onnx, onnxscript, onnxruntime, openvino"
        packages="$packages onnx onnxscript onnxruntime openvino"
    fi
done

if ! "$python" -c "import $modules" 2>/dev/null; then
    if [ ! -x "$venv/bin/python" ]; then
        echo "making a venv in $venv for $packages (about 1.5 GB with PyPI's wheels)" >&2
        python3 -m venv "$venv"
    fi
    if ! "$venv/bin/python" -c "import $modules" 2>/dev/null; then
        echo "installing $packages in $venv" >&2
        "$venv/bin/pip" install --quiet $packages
    fi
    python="$venv/bin/python"
fi

(cd "$root" && cargo build --release --quiet)
export XDG_RUNTIME_DIR="${XDG_RUNTIME_DIR:-/tmp}"
# side_by_side.py runs PyTorch and the peers on WORKSHOP_PYTHON: the interpreter found here.
export WORKSHOP_PYTHON="$python"
exec "$python" "$root/bench/side_by_side.py" "$@"
