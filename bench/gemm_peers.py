#!/usr/bin/env python3
"""Our CPU GEMM (`workshop peak`) next to the vendor library behind PyTorch's CPU matmul (MKL
for FP32, oneDNN for BF16, AMX where the CPU has it), same size, precision and threads,
interleaved in one run: where the issue asks for a share of the measured ceiling, this says
what share the library a user would otherwise call reaches on the same machine.

    cargo build --release
    pip install torch                    # outside the project's dependencies
    python3 bench/gemm_peers.py --precisions fp32 bf16 --sizes 1024 2048 --rounds 5

PyTorch runs on `WORKSHOP_PYTHON` where it is set (the venv that has it), else on the
interpreter running this script. Each round runs every configuration once, ours and the peer
in turn (the order rotating between rounds), each in its own process: ours `workshop peak
--json` (its GEMM validated, median of `--iterations`), the peer `torch.matmul` on random
square matrices of the same dtype (after three warm-up calls, the median of `--iterations`).
The report gives each side's median GFLOP/s over the rounds, the rounds' own ratios (median,
range, rounds ours led: a host whose speed swings between phases can give the two columns'
medians from different phases), and both as a share of the ceiling `workshop peak` measures
(the FMA chains, or the bf16 ones where its BF16 GEMM multiplies pairs): of its best, and of
the same chains timed just before each of our GEMMs in that round (the peer's share against
those is against chains timed a few seconds before it, not beside it).
"""
import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
WORKSHOP = ROOT / "target" / "release" / "workshop"
PYTHON = os.environ.get("WORKSHOP_PYTHON") or sys.executable


def ours(precision, size, threads, iterations):
    """`workshop peak`'s GEMM: (median GFLOP/s, its ceiling's best, the chains beside it or
    None, the kernel it names)."""
    out = subprocess.run(
        [str(WORKSHOP), "peak", "--precision", precision, "--size", str(size),
         "--threads", str(threads), "--iterations", str(iterations),
         "--array-mib", "16", "--json"],
        check=True, capture_output=True, text=True).stdout
    peak = json.loads(out)
    gemm = peak["gemm"]
    if gemm["validated"] != gemm["iterations"]:
        sys.exit(f"workshop peak: {gemm['validated']} of {gemm['iterations']} GEMMs validated")
    beside = (gemm.get("beside") or {}).get("chains_gflops")
    return gemm["gflops"], peak["theoretical"]["gflops"], beside, peak["theoretical"]["name"]


def peer(precision, size, threads, iterations):
    """PyTorch's matmul in a process of its own: (median GFLOP/s, what it says it ran on)."""
    proc = subprocess.run(
        [PYTHON, __file__, "--peer-run", precision, str(size), str(threads), str(iterations)],
        capture_output=True, text=True)
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["no message"])[-1]
        sys.exit(f"the PyTorch peer failed on {PYTHON} ({last}): set WORKSHOP_PYTHON to a "
                 "Python that has torch")
    r = json.loads(proc.stdout)
    return r["gflops"], r["impl"]


def peer_run(precision, size, threads, iterations):
    import torch

    torch.set_num_threads(threads)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[precision]
    a = torch.randn(size, size).to(dtype)
    b = torch.randn(size, size).to(dtype)
    for _ in range(3):
        torch.matmul(a, b)
    times = []
    for _ in range(iterations):
        t = time.perf_counter()
        torch.matmul(a, b)
        times.append(time.perf_counter() - t)
    lib = "MKL" if precision == "fp32" and torch.backends.mkl.is_available() else "oneDNN"
    print(json.dumps({
        "gflops": 2 * size**3 / statistics.median(times) / 1e9,
        "impl": f"PyTorch {torch.__version__} matmul ({lib})",
    }))


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--peer-run":
        precision, size, threads, iterations = sys.argv[2], *map(int, sys.argv[3:6])
        return peer_run(precision, size, threads, iterations)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--precisions", nargs="+", default=["fp32"], choices=["fp32", "bf16"])
    p.add_argument("--sizes", nargs="+", type=int, default=[1024])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--iterations", type=int, default=20)
    a = p.parse_args()
    if not WORKSHOP.exists():
        sys.exit(f"{WORKSHOP} not found: run `cargo build --release` first")
    if any(s < 1 for s in a.sizes) or a.rounds < 1 or a.iterations < 1 or a.threads < 1:
        sys.exit("--sizes, --rounds, --iterations and --threads must be positive")
    rows = {}  # (precision, size) → list of per-round dicts
    impl = {}
    for rnd in range(a.rounds):
        for precision in a.precisions:
            for size in a.sizes:
                r = {}
                # Rotate the order each round, so neither side always runs first.
                for side in (["ours", "peer"] if rnd % 2 == 0 else ["peer", "ours"]):
                    if side == "ours":
                        r["ours"], r["ceiling"], r["beside"], impl["ceiling", precision] = ours(
                            precision, size, a.threads, a.iterations)
                    else:
                        r["peer"], impl[precision] = peer(precision, size, a.threads, a.iterations)
                rows.setdefault((precision, size), []).append(r)
                print(f"round {rnd} {precision} {size}: ours {r['ours']:.1f} GFLOP/s, "
                      f"peer {r['peer']:.1f}, ceiling {r['ceiling']:.1f}"
                      + (f", chains beside ours {r['beside']:.1f}" if r["beside"] else ""),
                      flush=True)
    print(f"\nGEMM M = N = K, {a.threads} threads, GFLOP/s, median of {a.rounds} interleaved "
          "rounds; peer: " + "; ".join(f"{p} {impl[p]}" for p in a.precisions))
    print(f"{'precision':>9} {'size':>5} {'workshop':>9} {'peer':>8} {'ours/peer':>9} "
          f"{'per round [range], led':>28} {'ceiling':>8} {'ours':>5} {'peer':>5} "
          f"{'ours beside':>11} {'peer beside':>11}")
    for (precision, size), rs in rows.items():
        med = lambda key: statistics.median(r[key] for r in rs)
        ratios = sorted(r["ours"] / r["peer"] for r in rs)
        led = sum(x > 1 for x in ratios)
        per_round = (f"{statistics.median(ratios):.2f}× [{ratios[0]:.2f}–{ratios[-1]:.2f}], "
                     f"{led} of {len(rs)}")
        besides = [r for r in rs if r["beside"]]
        share = lambda key: (f"{statistics.median(r[key] / r['beside'] for r in besides):>10.0%}"
                             if besides else f"{'—':>10}")
        print(f"{precision:>9} {size:>5} {med('ours'):>9.1f} {med('peer'):>8.1f} "
              f"{med('ours') / med('peer'):>8.2f}× {per_round:>28} {med('ceiling'):>8.1f} "
              f"{med('ours') / med('ceiling'):>5.0%} {med('peer') / med('ceiling'):>5.0%} "
              f"{share('ours')} {share('peer')}")
    ceilings = "; ".join(f"{p} {impl['ceiling', p]}" for p in a.precisions)
    print(f"\nceiling: {ceilings} (`workshop peak`, the best of its runs); 'beside': each "
          "side's GFLOP/s over the median of the chains timed just before each of our GEMMs, "
          "round by round, the median of the rounds")


if __name__ == "__main__":
    main()
