#!/usr/bin/env python3
"""Our CPU backend next to PyTorch CPU eager, interleaved in one run, medians and ratios.

    cargo build --release
    pip install torch torchvision            # outside the project's dependencies (or bench/vs-pytorch.sh)
    python3 bench/side_by_side.py --network resnet50 --batch-sizes 8 32 --precisions fp32 bf16 --rounds 3

Each round runs every configuration once, alternating implementations, so a slow patch of a
noisy machine hits both sides alike. The report gives each side's median images/s over the
rounds, the ratio ours / PyTorch's best layout, each side's effective GFLOP/s (the
network's conv and linear MACs × 2 per second, whatever algorithm ran) as a share of the
machine's measured FP32 GEMM peak (`workshop peak`, measured once at the start; ours also
against the cores' FMA ceiling it measures on registers, which no kernel's real FLOPs pass), and each
side's start-up: seconds from the start until the model was ready to run (ours: building,
seeding and calibrating the weights, packing them; PyTorch's: building and initialising the
model in NCHW), medians over the rounds, and each process's peak resident memory (the
kernel's high-water mark of its RSS, from wait4: weights, activations, code, the Python
interpreter and libtorch on PyTorch's side), the largest over the rounds.
"""
import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
WORKSHOP = ROOT / "target" / "release" / "workshop"


def run_measured(cmd):
    """(stdout, peak resident bytes) of a command that must succeed."""
    with tempfile.TemporaryFile() as out:
        proc = subprocess.Popen(cmd, stdout=out)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        if proc.returncode != 0:
            sys.exit(f"{' '.join(cmd)} failed with exit status {proc.returncode}")
        out.seek(0)
        return out.read().decode(), usage.ru_maxrss * 1024  # Linux reports KiB


def input_size(net):
    """The network's own input size (`workshop models`): both sides run at it."""
    out = subprocess.run([str(WORKSHOP), "models", "--json"], check=True, capture_output=True, text=True).stdout
    return next(m["input_size"] for m in json.loads(out) if m["network"] == net)


def ours(net, batch, threads, iters, precision):
    """(images/s, effective GFLOP per image, start-up s, peak RSS bytes) of one `workshop bench` run."""
    with tempfile.TemporaryDirectory() as d:
        out = pathlib.Path(d) / "r.json"
        _, rss = run_measured(
            [str(WORKSHOP), "bench", "--network", net, "--batch-size", str(batch), "--threads", str(threads),
             "--iterations", str(iters), "--warmup", "2", "--precision", precision, "--json", str(out),
             "--input-size", str(input_size(net))])
        r = json.loads(out.read_text())
    return r["stats"]["throughput_median"], 2 * r["model"]["macs_per_image"] / 1e9, r["prepare_s"], rss


def pytorch(net, batch, threads, iters, channels_last, dtype):
    cmd = [sys.executable, str(ROOT / "bench" / "pytorch_resnet.py"), "--network", net, "--batch-size", str(batch),
           "--threads", str(threads), "--iterations", str(iters), "--warmup", "2", "--dtype", dtype,
           "--input-size", str(input_size(net))]
    if channels_last:
        cmd.append("--channels-last")
    stdout, rss = run_measured(cmd)
    r = json.loads(stdout)
    return r["images_per_s"], r["prepare_s"], rss


def measured_peak(threads):
    """The FP32 GEMM peak `workshop peak` measures on `threads` cores, and the cores' FMA
    ceiling it measures (registers only; None where it has none), GFLOP/s."""
    out = subprocess.run([str(WORKSHOP), "peak", "--threads", str(threads), "--json"],
                         check=True, capture_output=True, text=True).stdout
    r = json.loads(out)
    ceiling = r.get("theoretical") or {}
    return r["gemm"]["gflops"], ceiling.get("gflops") if ceiling.get("measured") else None


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--network", default="resnet50")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[8, 32])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--iterations", type=int, default=5)
    p.add_argument("--precisions", nargs="+", default=["fp32"], choices=["fp32", "fp16", "bf16"])
    p.add_argument("--no-peak", action="store_true", help="skip measuring the GEMM peak")
    a = p.parse_args()
    if not WORKSHOP.exists():
        sys.exit(f"{WORKSHOP} not found: run `cargo build --release` first")
    peak, ceiling = (None, None) if a.no_peak else measured_peak(a.threads)
    if peak:
        print(f"measured FP32 GEMM peak: {peak:.1f} GFLOP/s on {a.threads} threads", flush=True)
    if ceiling:
        print(f"measured FP32 FMA ceiling (registers only): {ceiling:.1f} GFLOP/s", flush=True)
    results = {}
    startup = {}
    peak_rss = {}
    gflop_per_image = {}
    for rnd in range(a.rounds):
        for prec in a.precisions:
            for b in a.batch_sizes:
                def run_ours():
                    ips, per_image, prepare_s, rss = ours(a.network, b, a.threads, a.iterations, prec)
                    gflop_per_image[a.network] = per_image
                    return ips, prepare_s, rss
                for name, fn in [
                    ("workshop", run_ours),
                    ("pytorch NCHW", lambda: pytorch(a.network, b, a.threads, a.iterations, False, prec)),
                    ("pytorch channels_last", lambda: pytorch(a.network, b, a.threads, a.iterations, True, prec)),
                ]:
                    v, prepare_s, rss = fn()
                    results.setdefault((prec, b, name), []).append(v)
                    startup.setdefault((prec, b, name), []).append(prepare_s)
                    peak_rss[(prec, b, name)] = max(peak_rss.get((prec, b, name), 0), rss)
                    print(f"round {rnd} {prec} batch {b:>3} {name:<22} {v:7.2f} images/s  "
                          f"peak RSS {rss / 2**30:.2f} GiB", flush=True)
    per_image = gflop_per_image[a.network]
    print(f"\n{a.network}, {a.threads} threads, median of {a.rounds} interleaved rounds "
          f"({per_image:.2f} GFLOP per image)")
    head = f"{'precision':>9}  {'batch':>5}  {'workshop':>9}  {'torch NCHW':>10}  {'torch CL':>9}  {'ours / best torch':>17}"
    if peak:
        head += f"  {'ours % peak':>11}  {'torch % peak':>12}"
    if ceiling:
        head += f"  {'ours % FMA':>10}"
    head += f"  {'start-up ours':>13}  {'torch NCHW':>10}"
    head += f"  {'peak RSS ours':>13}  {'torch NCHW':>10}  {'torch CL':>9}"
    print(head)
    for prec in a.precisions:
        for b in a.batch_sizes:
            m = {n: statistics.median(results[(prec, b, n)])
                 for n in ["workshop", "pytorch NCHW", "pytorch channels_last"]}
            best = max(m["pytorch NCHW"], m["pytorch channels_last"])
            line = (f"{prec:>9}  {b:>5}  {m['workshop']:>9.2f}  {m['pytorch NCHW']:>10.2f}  "
                    f"{m['pytorch channels_last']:>9.2f}  {m['workshop'] / best:>16.2f}×")
            if peak:
                line += (f"  {100 * m['workshop'] * per_image / peak:>10.0f}%"
                         f"  {100 * best * per_image / peak:>11.0f}%")
            if ceiling:
                line += f"  {100 * m['workshop'] * per_image / ceiling:>9.0f}%"
            up = {n: statistics.median(startup[(prec, b, n)]) for n in ["workshop", "pytorch NCHW"]}
            line += f"  {up['workshop']:>12.2f}s  {up['pytorch NCHW']:>9.2f}s"
            rss = {n: peak_rss[(prec, b, n)] / 2**30 for n in ["workshop", "pytorch NCHW", "pytorch channels_last"]}
            line += (f"  {rss['workshop']:>9.2f} GiB  {rss['pytorch NCHW']:>6.2f} GiB"
                     f"  {rss['pytorch channels_last']:>5.2f} GiB")
            print(line)


if __name__ == "__main__":
    main()
