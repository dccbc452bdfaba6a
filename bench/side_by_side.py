#!/usr/bin/env python3
"""Our CPU backend next to PyTorch CPU eager, interleaved in one run, medians and ratios.

    cargo build --release
    pip install torch torchvision            # outside the project's dependencies
    python3 bench/side_by_side.py --network resnet50 --batch-sizes 8 32 --threads 2 --rounds 3

Each round runs every configuration once, alternating implementations, so a slow patch of a
noisy machine hits both sides alike. The report gives each side's median images/s over the
rounds and the ratio ours / PyTorch's best layout.
"""
import argparse
import json
import pathlib
import statistics
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
WORKSHOP = ROOT / "target" / "release" / "workshop"


def ours(net, batch, threads, iters, precision):
    with tempfile.TemporaryDirectory() as d:
        out = pathlib.Path(d) / "r.json"
        subprocess.run(
            [str(WORKSHOP), "bench", "--network", net, "--batch-size", str(batch), "--threads", str(threads),
             "--iterations", str(iters), "--warmup", "2", "--precision", precision, "--json", str(out)],
            check=True, stdout=subprocess.DEVNULL)
        r = json.loads(out.read_text())
    return r["stats"]["throughput_median"], r["loss"]


def pytorch(net, batch, threads, iters, channels_last, dtype):
    cmd = [sys.executable, str(ROOT / "bench" / "pytorch_resnet.py"), "--network", net, "--batch-size", str(batch),
           "--threads", str(threads), "--iterations", str(iters), "--warmup", "2", "--dtype", dtype]
    if channels_last:
        cmd.append("--channels-last")
    r = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
    return r["images_per_s"]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--network", default="resnet50")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[8, 32])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--iterations", type=int, default=5)
    p.add_argument("--precision", default="fp32", choices=["fp32", "fp16", "bf16"])
    a = p.parse_args()
    if not WORKSHOP.exists():
        sys.exit(f"{WORKSHOP} not found: run `cargo build --release` first")
    results = {}
    for rnd in range(a.rounds):
        for b in a.batch_sizes:
            for name, fn in [
                ("workshop", lambda: ours(a.network, b, a.threads, a.iterations, a.precision)[0]),
                ("pytorch NCHW", lambda: pytorch(a.network, b, a.threads, a.iterations, False, a.precision)),
                ("pytorch channels_last", lambda: pytorch(a.network, b, a.threads, a.iterations, True, a.precision)),
            ]:
                v = fn()
                results.setdefault((b, name), []).append(v)
                print(f"round {rnd} batch {b:>3} {name:<22} {v:7.2f} images/s", flush=True)
    print(f"\n{a.network} {a.precision}, {a.threads} threads, median of {a.rounds} interleaved rounds")
    print(f"{'batch':>5}  {'workshop':>9}  {'torch NCHW':>10}  {'torch CL':>9}  {'ours / best torch':>17}")
    for b in a.batch_sizes:
        m = {n: statistics.median(results[(b, n)]) for n in ["workshop", "pytorch NCHW", "pytorch channels_last"]}
        best = max(m["pytorch NCHW"], m["pytorch channels_last"])
        print(f"{b:>5}  {m['workshop']:>9.2f}  {m['pytorch NCHW']:>10.2f}  {m['pytorch channels_last']:>9.2f}  {m['workshop'] / best:>16.2f}×")


if __name__ == "__main__":
    main()
