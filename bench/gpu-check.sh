#!/usr/bin/env bash
# What a session with a real NVIDIA GPU runs, in one go: the machine and its libraries
# (`doctor`), the measured ceilings (`peak`), the language models, the test suite on the real
# device (no emulator), ResNet-50 against PyTorch eager on the same GPU, ours and theirs
# alternating, and the course. Each part has its own time limit, so a hang costs only its part;
# every log goes to OUT (default ./gpu-check-out), and a short table is printed last.
#
#   bench/gpu-check.sh                               # everything, with the release build here
#   STEPS="peak tests" bench/gpu-check.sh            # some parts: env peak llm tests resnet
#                                                    # course side
#   WORKSHOP_BIN=dist/workshop TESTS_BIN=dist/tests bench/gpu-check.sh
#   KERNELS_B=dist/kvar STEPS=llm bench/gpu-check.sh # also this build's kernels against a folder's
#                                                    # (dist/kvar/gpu/llm.cuh ...), A B B A
#
# For a machine without Rust, build here (`cargo build --release && cargo test --release
# --no-run`), copy target/release/workshop and target/release/deps/tests-* (strip them: they
# shrink to about 30 and 17 MB) and point WORKSHOP_BIN and TESTS_BIN at them. The test binary
# runs `workshop` and reads its fixtures at the paths it was built with: MANIFEST_DIR (the
# repository's folder where it was built) is linked to this checkout when it does not exist
# there, and WORKSHOP_BIN is copied to its target/release. On the device tool's machines (about
# 15 minutes a session): env, llm, tests and course with TESTS_S=150 COURSE_S=150 took 530 s,
# the course reaching exercise 08.
#
# PyTorch comes from WORKSHOP_PYTHON (default python3). Charts need a TrueType font: where the
# system has none, WORKSHOP_FONT may name one (default: matplotlib's DejaVuSans.ttf, where that
# Python has matplotlib). The course step walks the embedded course on the cuda backend as a
# student would (`next --yes`, the first choice for each question, a kernel step skipped), for at
# most COURSE_S seconds.
set -u
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
out="${OUT:-$root/gpu-check-out}"
mkdir -p "$out"
steps="${STEPS:-env peak tests llm resnet course side}"
bin="${WORKSHOP_BIN:-$root/target/release/workshop}"
tests="${TESTS_BIN:-$(ls -t "$root"/target/release/deps/tests-* 2>/dev/null | grep -v '\.d$' | head -1)}"
export XDG_RUNTIME_DIR="${XDG_RUNTIME_DIR:-/tmp}" PYTHONUNBUFFERED=1
export WORKSHOP_PYTHON="${WORKSHOP_PYTHON:-python3}"
unset WORKSHOP_GPU_EMULATOR
if [ -z "${WORKSHOP_FONT:-}" ]; then
    font=$("$WORKSHOP_PYTHON" -c 'import matplotlib, os
print(os.path.join(os.path.dirname(matplotlib.__file__), "mpl-data/fonts/ttf/DejaVuSans.ttf"))' \
        2>/dev/null)
    [ -f "$font" ] && export WORKSHOP_FONT="$font"
fi
start=$(date +%s)
say() { echo "[$(($(date +%s) - start)) s] $*"; }
has() { [[ " $steps " == *" $1 "* ]]; }

# The test binary starts MANIFEST_DIR/target/release/workshop: put WORKSHOP_BIN there, also
# where this checkout is MANIFEST_DIR itself (a copied tree has no target/).
if [ -n "${MANIFEST_DIR:-}" ]; then
    [ -e "$MANIFEST_DIR" ] || { mkdir -p "$(dirname "$MANIFEST_DIR")" && ln -s "$root" "$MANIFEST_DIR"; }
    mkdir -p "$MANIFEST_DIR/target/release"
    [ "$bin" -ef "$MANIFEST_DIR/target/release/workshop" ] || cp "$bin" "$MANIFEST_DIR/target/release/workshop"
fi

if has env; then
    { nvidia-smi; ldconfig -p | grep -E "nvrtc|cublas|cudnn|nvidia-ml"; "$bin" doctor; } > "$out/env.log" 2>&1
    say "env: $(grep -A2 '^  cuda' "$out/env.log" | tr -s ' ' | tr '\n' ' ')"
fi
if has peak; then
    for p in fp32 bf16; do timeout 120 "$bin" peak --backend cuda --precision "$p"; done > "$out/peak.log" 2>&1
    say peak; grep -E "^GEMM|^Median|^Memory" "$out/peak.log"
fi
if has llm; then
    b=("$bin" bench --backend cuda --precision bf16)
    { timeout 120 "${b[@]}" --network qwen2.5-0.5b -b 1,8
      timeout 120 "${b[@]}" --network qwen2.5-0.5b -b 1,8 --compile reduce-overhead
      timeout 120 "${b[@]}" --network qwen2.5-0.5b -b 1 --profile
      timeout 300 "${b[@]}" --network llama-3.1-8b -b 1 --compile reduce-overhead
      timeout 300 "${b[@]}" --network llama-3.1-8b -b 1 -n 16 --profile; } > "$out/llm.log" 2>&1
    say llm; grep -E "Performance summary|^TPOT|^Bandwidth|^Decode time" "$out/llm.log"
    # KERNELS_B=DIR: this build's kernels against DIR's (`--kernels-dir`), alternating A B B A.
    if [ -n "${KERNELS_B:-}" ]; then
        for k in "" "$KERNELS_B" "$KERNELS_B" ""; do
            echo "kernels: ${k:-built in}"
            timeout 120 "${b[@]}" --network qwen2.5-1.5b -b 1 --compile reduce-overhead ${k:+--kernels-dir "$k"} |
                grep -E "^TPOT|^Bandwidth"
        done > "$out/ab.log" 2>&1
        say "kernels A/B"; cat "$out/ab.log"
    fi
fi
if has tests && [ -n "$tests" ]; then
    WORKSHOP_REQUIRE_BACKENDS=cuda timeout "${TESTS_S:-600}" "$tests" --test-threads "$(nproc)" \
        ${TESTS_FILTER:-} > "$out/tests.log" 2>&1
    echo "rc=$?" >> "$out/tests.log"
    say "tests: $(grep -E '^test result' "$out/tests.log" | tail -1)"
    grep -E "^test .*FAILED|panicked" "$out/tests.log" | head -20
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
if has course; then
    ws=$(mktemp -d); end=$((SECONDS + ${COURSE_S:-600}))
    { "$bin" init --dir "$ws" --name "GPU check" --backend cuda
      while [ $SECONDS -lt $end ]; do
          o=$(timeout $((end - SECONDS)) "$bin" next --dir "$ws" --yes 2>&1); rc=$?
          echo "$o"
          case "$o" in *"every exercise is done or skipped"*) echo "COURSE FINISHED"; break;; esac
          choice=$(sed -n 's/.*(choices: \([^,)]*\).*/\1/p' <<<"$o" | tail -1)
          if [ $rc -ne 0 ] && [ -n "$choice" ]; then "$bin" next --dir "$ws" --answer "$choice"
          elif [ $rc -ne 0 ] || [[ "$o" == *"stays current until your kernel passes"* ]]; then
              echo "SKIPPED after rc=$rc"; "$bin" skip --dir "$ws" || break
          fi
      done
      "$bin" status --dir "$ws"; } > "$out/course.log" 2>&1
    cp "$ws/results.md" "$out/course-results.md" 2>/dev/null
    say "course: $(grep -c '^SKIPPED' "$out/course.log") skipped, $(grep -c 'COURSE FINISHED' "$out/course.log") finished"
fi
if has side; then
    timeout "${SIDE_S:-900}" "$WORKSHOP_PYTHON" bench/llm_side_by_side.py --device cuda --model qwen2.5-0.5b \
        --precision bf16 --batch 1,8 --rounds 2 --peers transformers --check --replay \
        --workshop "$bin" > "$out/side.log" 2>&1
    say side; tail -15 "$out/side.log"
fi
