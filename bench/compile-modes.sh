#!/usr/bin/env bash
# Throughput, memory and compile time per `--compile` mode, as ratios to eager, from one run.
#   bench/compile-modes.sh [BACKEND] [NETWORK] [BATCH] [INPUT_SIZE]   (default: cpu resnet50 4 224)
# ROUNDS (default 2) repeats the modes in turn, so drift on a noisy machine hits every mode
# alike; ITERATIONS (default 6) timed iterations per run. max-autotune runs twice in the first
# round: the second run shows the on-disk cache hit. Run it on a quiet machine.
set -euo pipefail
backend=${1:-cpu}
network=${2:-resnet50}
batch=${3:-4}
size=${4:-224}
rounds=${ROUNDS:-2}
iterations=${ITERATIONS:-6}
cd "$(dirname "$0")/.."
cargo build --release --quiet
bin=target/release/workshop
out=$(mktemp -d)
# A fresh autotune cache, so the first max-autotune run tunes and the second hits the cache.
export WORKSHOP_CACHE_DIR="$out/cache"
records=()
for round in $(seq 1 "$rounds"); do
    for mode in eager default reduce-overhead max-autotune; do
        args=(bench --backend "$backend" --network "$network" --batch-size "$batch"
            --input-size "$size" --iterations "$iterations" --warmup 1)
        [ "$mode" = eager ] || args+=(--compile "$mode")
        json="$out/$mode.$round.json"
        echo "== round $round: $mode"
        "$bin" "${args[@]}" --json "$json" |
            grep -E "^(Throughput|Memory |Compile |Check |Replay |Autotune |Host enqueue)" || true
        records+=("$json")
    done
done
"$bin" compare "${records[@]}"
echo "records in $out"
