#!/usr/bin/env python3
"""Two builds of workshop side by side on one network or layer: which is faster, and is the
difference larger than the machine's noise?

    cp target/release/workshop /tmp/workshop-before      # then change, rebuild
    python3 bench/ab.py /tmp/workshop-before target/release/workshop --network efficientnet_b0 \
        --precision bf16 --rounds 8
    python3 bench/ab.py OLD NEW --network "conv2d(24,72,1)+relu" --input-size 56 --kernel
    python3 bench/ab.py OLD NEW --network resnet50 --precision fp32 --batch-size 32 \
        --kernel-total conv2d_pointwise --control conv2d_winograd
    python3 bench/ab.py BIN BIN --old-mode eager --new-mode default --network resnet50 \
        --precision fp32 --batch-size 1 --rounds 10      # two modes of one build

Each round runs both builds once, alternating which goes first, on the same arguments (`workshop
bench ... --compile default` unless --eager; --old-mode and --new-mode give each side its own, eager
or a compile mode, so one build's eager and compiled runs can be compared). A round gives one paired
ratio new / old: of the step time's minimum over the run's iterations (the least disturbed
iteration: a shared machine's noise only ever adds time), or with --kernel of the first convolution
kernel's average time from `--profile` (a single layer's step also converts the input, which for
many channels outweighs the layer), or with --kernel-total of the summed total of the kernels named
so. With --control, that total is divided by the total of other kernels that neither build changed,
timed in the same process: on a 2-vCPU VM whose neighbours come and go, ResNet-50's unchanged
Winograd kernels read 0.91–1.17× from one process to the next, and so did the 1×1 kernels under
test, while the quotient of the two kept within 0.94–1.00 (a prefetch change, 8 rounds). Reported:
each build's median and minimum, every round's ratio, their median, and how many rounds the new
build won. The verdict is "faster" or "slower" only when so many rounds agree that a coin would do
it with a chance of at most 10% (a two-sided sign test: all of 5 to 7 rounds, 7 of 8, 8 of 9, 9 of
10) and the median ratio is off 1 by more than 2%, else "inconclusive" with the reason: on a noisy
host most single rounds say little, and a verdict should not rest on one (two rounds of the same
build, both 1–5% slower, once read "slower" under the former rule of 80% agreeing).
"""
import argparse
import math
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
    totals = {}
    in_kernels = False
    for line in text.splitlines():
        in_kernels = in_kernels or line.startswith("Kernels:")
        cells = [c.strip() for c in line.strip("│ ").split("┆")]
        if len(cells) < 4:
            continue
        if kernel is None and cells[0].startswith("conv2d_"):
            kernel = float(cells[3])
        if in_kernels:
            try:
                totals[cells[0]] = float(cells[2])
            except ValueError:
                pass  # the header row
    return float(step.group(1)), kernel, totals


def total(totals, prefix, binary):
    """The summed total (ms) of the profiled kernels whose names start with `prefix` (or with
    any of its comma-separated prefixes: `linear,add`)."""
    prefixes = tuple(prefix.split(","))
    picked = [ms for name, ms in totals.items() if name.startswith(prefixes)]
    if not picked:
        sys.exit(f"{binary}: no kernel named {prefix}… in the profile (it has: {', '.join(sorted(totals))})")
    return sum(picked)


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
    modes = ["eager", "default", "reduce-overhead", "max-autotune"]
    p.add_argument("--old-mode", choices=modes, help="the old side's mode (default: --compile default, or eager with --eager)")
    p.add_argument("--new-mode", choices=modes, help="the new side's mode (as --old-mode)")
    p.add_argument("--kernel", action="store_true",
                   help="compare the first convolution kernel's average time (--profile) instead of the step")
    p.add_argument("--kernel-total", metavar="PREFIX",
                   help="compare the total time (--profile) of the kernels whose names start with PREFIX "
                        "(or with any of several, comma-separated: linear,add)")
    p.add_argument("--control", metavar="PREFIX",
                   help="with --kernel-total: divide it by the total of these kernels, which the change "
                        "leaves alone, in the same process (the machine's drift cancels)")
    a = p.parse_args()
    if a.rounds < 2:
        sys.exit("--rounds must be at least 2: one round cannot tell noise from a difference")
    if a.rounds < 5:
        print(f"note: {a.rounds} rounds can only say inconclusive (a verdict takes 5 rounds or more)",
              file=sys.stderr)
    if a.control and not a.kernel_total:
        sys.exit("--control needs --kernel-total: it is what the changed kernels' total is divided by")
    if a.kernel and a.kernel_total:
        sys.exit("--kernel and --kernel-total each choose what to compare: give one")
    args = ["--network", a.network, "--batch-size", str(a.batch_size), "--precision", a.precision,
            "--iterations", str(a.iterations), "--warmup", "3"]
    if a.input_size:
        args += ["--input-size", str(a.input_size)]
    if a.threads:
        args += ["--threads", str(a.threads)]
    mode = {}
    for side in ("old", "new"):
        mode[side] = getattr(a, f"{side}_mode") or ("eager" if a.eager else "default")
    if a.kernel or a.kernel_total:
        args += ["--profile"]
    if a.control:
        unit = f"{a.kernel_total}… total over {a.control}… total"
    elif a.kernel_total:
        unit = f"ms ({a.kernel_total}… total)"
    else:
        unit = "µs (kernel average)" if a.kernel else "ms (step minimum)"
    times = {"old": [], "new": []}
    ratios = []
    for r in range(a.rounds):
        order = ["old", "new"] if r % 2 == 0 else ["new", "old"]
        got = {}
        for side in order:
            binary = getattr(a, side)
            extra = [] if mode[side] == "eager" else ["--compile", mode[side]]
            step, kernel, totals = run(binary, args + extra)
            if a.kernel and kernel is None:
                sys.exit(f"{binary}: no conv2d kernel in the profile (--kernel needs a convolution)")
            if a.kernel_total:
                got[side] = total(totals, a.kernel_total, binary)
                if a.control:
                    got[side] /= total(totals, a.control, binary)
            else:
                got[side] = kernel if a.kernel else step
            times[side].append(got[side])
        ratios.append(got["new"] / got["old"])
        print(f"round {r + 1}: old {got['old']:.2f}  new {got['new']:.2f}  new/old {ratios[-1]:.3f}",
              flush=True)
    print(f"\n{a.network} {a.precision} batch {a.batch_size}, {a.rounds} rounds, {unit}")
    for side in ("old", "new"):
        print(f"  {side}: median {statistics.median(times[side]):.2f}  min {min(times[side]):.2f}"
              f"  ({getattr(a, side)}, {mode[side]})")
    median = statistics.median(ratios)
    wins = sum(r < 1 for r in ratios)
    print(f"  new/old per round: {' '.join(f'{r:.3f}' for r in ratios)}")
    print(f"  median new/old {median:.3f}; the new build faster in {wins} of {a.rounds} rounds")
    agree = max(wins, a.rounds - wins)
    p_value = sign_test(agree, a.rounds)
    if p_value <= MAX_P and abs(median - 1) > 0.02:
        print(f"verdict: {'faster' if median < 1 else 'slower'} ({(1 / median - 1) * 100:+.1f}% throughput;"
              f" {agree} of {a.rounds} rounds agree, sign test p = {p_value:.3f})")
    else:
        why = (f"{agree} of {a.rounds} rounds agree, which a coin does with p = {p_value:.2f}"
               f" (a verdict needs p ≤ {MAX_P})" if p_value > MAX_P
               else "the median ratio is within 2% of 1")
        print(f"verdict: inconclusive ({why}; more rounds, or a quieter machine)")


# The largest chance that noise alone (each round a coin toss) would make as many rounds agree,
# under which a verdict is given: all of 5 to 7 rounds, 7 of 8, 8 of 9, 9 of 10.
MAX_P = 0.1


def sign_test(agree, n):
    """Two-sided sign test: the chance that n fair coin tosses split at least `agree` to one side."""
    tail = sum(math.comb(n, i) for i in range(agree, n + 1)) / 2 ** n
    return min(1.0, 2 * tail)


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        sys.exit("interrupted: no verdict (the rounds so far are printed above)")
