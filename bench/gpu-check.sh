#!/usr/bin/env bash
# What a session with a real NVIDIA GPU runs, in one go: the machine and its libraries
# (`doctor`), the measured ceilings (`peak`), the test suite on the real device (no emulator),
# the language models, and ResNet-50 against PyTorch eager on the same GPU, ours and theirs
# alternating. Each part has its own time limit, so a hang costs only its part; every log goes
# to OUT (default ./gpu-check-out), and a short table is printed last.
#
#   bench/gpu-check.sh                               # everything, with the release build here
#   STEPS="peak tests" bench/gpu-check.sh            # some parts: env peak tests llm resnet side
#   WORKSHOP_BIN=dist/workshop TESTS_BIN=dist/tests bench/gpu-check.sh
#
# For a machine without Rust, build here (`cargo build --release && cargo test --release
# --no-run`), copy target/release/workshop and target/release/deps/tests-* (strip them: they
# shrink to about 30 and 17 MB) and point WORKSHOP_BIN and TESTS_BIN at them. The test binary
# runs `workshop` and reads its fixtures at the paths it was built with: MANIFEST_DIR (the
# repository's folder where it was built) is linked to this checkout when it does not exist
# there, and WORKSHOP_BIN is copied to its target/release.
#
# PyTorch comes from WORKSHOP_PYTHON (default python3). Charts need a TrueType font: where the
# system has none, WORKSHOP_FONT may name one (matplotlib ships DejaVuSans.ttf).
set -u
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
out="${OUT:-$root/gpu-check-out}"
mkdir -p "$out"
steps="${STEPS:-env peak tests llm resnet side}"
bin="${WORKSHOP_BIN:-$root/target/release/workshop}"
tests="${TESTS_BIN:-$(ls -t "$root"/target/release/deps/tests-* 2>/dev/null | grep -v '\.d$' | head -1)}"
export XDG_RUNTIME_DIR="${XDG_RUNTIME_DIR:-/tmp}" PYTHONUNBUFFERED=1
export WORKSHOP_PYTHON="${WORKSHOP_PYTHON:-python3}"
unset WORKSHOP_GPU_EMULATOR
start=$(date +%s)
say() { echo "[$(($(date +%s) - start)) s] $*"; }
has() { [[ " $steps " == *" $1 "* ]]; }

if [ -n "${MANIFEST_DIR:-}" ] && [ "$MANIFEST_DIR" != "$root" ]; then
    [ -e "$MANIFEST_DIR" ] || { mkdir -p "$(dirname "$MANIFEST_DIR")" && ln -s "$root" "$MANIFEST_DIR"; }
    mkdir -p "$MANIFEST_DIR/target/release"
    cp "$bin" "$MANIFEST_DIR/target/release/workshop"
fi

if has env; then
    { nvidia-smi; ldconfig -p | grep -E "nvrtc|cublas|cudnn|nvidia-ml"; "$bin" doctor; } > "$out/env.log" 2>&1
    say "env: $(grep -A2 '^  cuda' "$out/env.log" | tr -s ' ' | tr '\n' ' ')"
fi
if has peak; then
    for p in fp32 bf16; do timeout 120 "$bin" peak --backend cuda --precision "$p"; done > "$out/peak.log" 2>&1
    say peak; grep -E "^GEMM|^Median|^Memory" "$out/peak.log"
fi
if has tests && [ -n "$tests" ]; then
    WORKSHOP_REQUIRE_BACKENDS=cuda timeout "${TESTS_S:-600}" "$tests" --test-threads "$(nproc)" \
        ${TESTS_FILTER:-} > "$out/tests.log" 2>&1
    echo "rc=$?" >> "$out/tests.log"
    say "tests: $(grep -E '^test result' "$out/tests.log" | tail -1)"
    grep -E "^test .*FAILED|panicked" "$out/tests.log" | head -20
fi
if has llm; then
    b=("$bin" bench --backend cuda --precision bf16)
    { timeout 120 "${b[@]}" --network qwen2.5-0.5b -b 1,8
      timeout 120 "${b[@]}" --network qwen2.5-0.5b -b 1,8 --compile reduce-overhead
      timeout 120 "${b[@]}" --network qwen2.5-0.5b -b 1 --profile
      timeout 300 "${b[@]}" --network llama-3.1-8b -b 1 --compile reduce-overhead
      timeout 300 "${b[@]}" --network llama-3.1-8b -b 1 -n 16 --profile; } > "$out/llm.log" 2>&1
    say llm; grep -E "Performance summary|^TPOT|^Bandwidth" "$out/llm.log"
fi
if has resnet; then
    run() { timeout 120 "$bin" bench --backend cuda --network resnet50 -b 64 --iterations 30 "$@" 2>&1 |
        grep -E "Performance summary|Throughput|Host enqueue|error"; }
    for round in 1 2; do
        for p in fp32 fp16 bf16; do
            if [ "$round" = 1 ]; then run --precision "$p"; run --precision "$p" --framework pytorch
            else run --precision "$p" --framework pytorch; run --precision "$p"; fi
        done
        run --precision fp16 --kernels vendor
        run --precision fp16 --kernels vendor --compile reduce-overhead
        run --precision fp16 --compile reduce-overhead
    done > "$out/resnet.log"
    say resnet; paste - - < <(grep -E "Performance summary|Throughput" "$out/resnet.log") | cut -c1-160
fi
if has side; then
    timeout "${SIDE_S:-900}" "$WORKSHOP_PYTHON" bench/llm_side_by_side.py --device cuda --model qwen2.5-0.5b \
        --precision bf16 --batch 1,8 --rounds 2 --peers transformers --check --replay \
        --workshop "$bin" > "$out/side.log" 2>&1
    say side; tail -15 "$out/side.log"
fi
