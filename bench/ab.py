#!/usr/bin/env python3
"""Two builds of workshop side by side on one network or layer: which is faster, and is the
difference larger than the machine's noise?

    cp target/release/workshop /tmp/workshop-before      # then change, rebuild
    python3 bench/ab.py /tmp/workshop-before target/release/workshop --network efficientnet_b0 \
        --precision bf16 --rounds 8
    python3 bench/ab.py OLD NEW --network "conv2d(24,72,1)+relu" --input-size 56 --kernel

Each round runs both builds once, alternating which goes first, on the same arguments
(`workshop bench ... --compile default` unless --eager). A round gives one paired ratio
new / old: of the step time's minimum over the run's iterations (the least disturbed
iteration: a shared machine's noise only ever adds time), or with --kernel of the first
convolution kernel's average time from `--profile` (a single layer's step also converts the
input, which for many channels outweighs the layer). Reported: each build's median and minimum,
every round's ratio, their median, and how many rounds the new build won. The verdict is
"faster" or "slower" only when at least 80% of the rounds agree and the median ratio is off 1
by more than 2%, else "inconclusive" with the reason: on a noisy host most single rounds
say little, and a verdict should not rest on one.
"""
import argparse
import re
import statistics
import subprocess
import sys


def run(binary, args):
    """One `workshop bench` run: (step minimum ms, first conv kernel's average µs or None)."""
    try:
        out = subprocess.run([binary, "bench"] + args, capture_output=True, text=True)
    except OSError as e:
        sys.exit(f"{binary}: cannot run it ({e.strerror})")
    if out.returncode != 0:
        sys.exit(f"{binary} bench {' '.join(args)} failed:\n{out.stderr.strip() or out.stdout.strip()}")
    text = out.stdout + out.stderr
    step = re.search(r"^Range\s+min ([0-9.]+) ms", text, re.M)
    if step is None:
        sys.exit(f"{binary}: no 'Range min' line in its output")
    kernel = None
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip("│ ").split("┆")]
        if len(cells) >= 4 and cells[0].startswith("conv2d_"):
            kernel = float(cells[3])
            break
    return float(step.group(1)), kernel


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("old", help="the build to compare against")
    p.add_argument("new", help="the build under test")
    p.add_argument("--network", default="resnet50", help="a zoo network or a layer spec")
    p.add_argument("--input-size", type=int, help="image side (for layer specs)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--precision", default="bf16", choices=["fp32", "fp16", "bf16"])
    p.add_argument("--threads", type=int, help="CPU threads (default: every core)")
    p.add_argument("--iterations", type=int, default=20)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--eager", action="store_true", help="without --compile default")
    p.add_argument("--kernel", action="store_true",
                   help="compare the first convolution kernel's average time (--profile) instead of the step")
    a = p.parse_args()
    if a.rounds < 2:
        sys.exit("--rounds must be at least 2: one round cannot tell noise from a difference")
    args = ["--network", a.network, "--batch-size", str(a.batch_size), "--precision", a.precision,
            "--iterations", str(a.iterations), "--warmup", "3"]
    if a.input_size:
        args += ["--input-size", str(a.input_size)]
    if a.threads:
        args += ["--threads", str(a.threads)]
    if not a.eager:
        args += ["--compile", "default"]
    if a.kernel:
        args += ["--profile"]
    unit = "µs (kernel average)" if a.kernel else "ms (step minimum)"
    times = {"old": [], "new": []}
    ratios = []
    for r in range(a.rounds):
        order = ["old", "new"] if r % 2 == 0 else ["new", "old"]
        got = {}
        for side in order:
            step, kernel = run(getattr(a, side), args)
            if a.kernel and kernel is None:
                sys.exit(f"{getattr(a, side)}: no conv2d kernel in the profile (--kernel needs a convolution)")
            got[side] = kernel if a.kernel else step
            times[side].append(got[side])
        ratios.append(got["new"] / got["old"])
        print(f"round {r + 1}: old {got['old']:.2f}  new {got['new']:.2f}  new/old {ratios[-1]:.3f}",
              flush=True)
    print(f"\n{a.network} {a.precision} batch {a.batch_size}, {a.rounds} rounds, {unit}")
    for side in ("old", "new"):
        print(f"  {side}: median {statistics.median(times[side]):.2f}  min {min(times[side]):.2f}"
              f"  ({getattr(a, side)})")
    median = statistics.median(ratios)
    wins = sum(r < 1 for r in ratios)
    print(f"  new/old per round: {' '.join(f'{r:.3f}' for r in ratios)}")
    print(f"  median new/old {median:.3f}; the new build faster in {wins} of {a.rounds} rounds")
    agree = max(wins, a.rounds - wins) / a.rounds
    if agree >= 0.8 and abs(median - 1) > 0.02:
        print(f"verdict: {'faster' if median < 1 else 'slower'} ({(1 / median - 1) * 100:+.1f}% throughput)")
    else:
        why = (f"only {max(wins, a.rounds - wins)} of {a.rounds} rounds agree" if agree < 0.8
               else f"the median ratio is within 2% of 1")
        print(f"verdict: inconclusive ({why}; more rounds, or a quieter machine)")


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        sys.exit("interrupted: no verdict (the rounds so far are printed above)")
