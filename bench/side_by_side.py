#!/usr/bin/env python3
"""Our CPU backend next to PyTorch CPU eager (and, with --peers, ONNX Runtime and OpenVINO),
interleaved in one run, medians and ratios.

    cargo build --release
    pip install torch torchvision            # outside the project's dependencies (or bench/vs-pytorch.sh)
    python3 bench/side_by_side.py --network resnet50 --batch-sizes 8 32 --precisions fp32 bf16 --rounds 3
    pip install onnx onnxscript onnxruntime openvino
    python3 bench/side_by_side.py --network efficientnet_b0 --batch-sizes 1 8 --precisions fp32 bf16 \
        --peers onnxruntime openvino --compile

PyTorch and the peers run on `WORKSHOP_PYTHON` where it is set (the venv that has them, as
for `workshop bench --framework pytorch`), else on the interpreter running this script.
The peers run the torchvision model exported to ONNX (bench/onnx_peers.py): ONNX Runtime's CPU
provider in FP32 only (its BF16 cells stay empty), OpenVINO with its precision hint set to the
precision asked. `--compile` adds our `--compile default` run as a fourth implementation
(`--compile max-autotune` that mode: its first run times the kernel variants and batch
schedules and keeps the choices for the later rounds); the ratio column takes our faster run
against the best of everyone else.

Each round runs every configuration once, alternating implementations, so a slow patch of a
noisy machine hits both sides alike. The report gives each side's median images/s over the
rounds, the ratio ours / the best other of those medians, the same ratio round by round
(median, range, and in how many rounds ours led: the medians of two columns can come from
different phases of a host whose speed swings, the rounds' ratios compare runs seconds
apart) with a verdict on `--target` (1.2× unless told: met, not met, or inconclusive, by a sign
test of the rounds at or above it against those below, as bench/ab.py judges two builds), the
same round by round from each run's fastest iteration (its least disturbed one: a shared host's
noise only adds time, and on a 2-vCPU VM one engine's median moved 1.5× between rounds a minute
apart while its fastest iteration held), each side's effective GFLOP/s (the
network's conv and linear MACs × 2 per second, whatever algorithm ran: Winograd's layers count
their direct convolution's FLOPs) as a share of the machine's measured GEMM peak in that
precision (`workshop peak --precision P`, measured once per precision at the start) and of
the ceiling it measures on registers (FP32: FMA chains; BF16: the dot-product instruction's,
`vdpbf16ps` or AMX's), which no kernel's real FLOPs pass — for ours, for the best other, and
what ours would need for 1.2× the best other: where that passes ~90% of the ceiling, only
less work (fewer FLOPs than the direct convolutions') gets there, not faster kernels; and each
side's start-up: seconds from the start until the model was ready to run (ours: building,
seeding and calibrating the weights, packing them; PyTorch's: building and initialising the
model in NCHW), medians over the rounds, and each process's peak resident memory (the
kernel's high-water mark of its RSS, from wait4: weights, activations, code, the Python
interpreter and libtorch on PyTorch's side), the largest over the rounds.

`--background-load N` runs N busy loops (one process each, spinning in Python, no memory
traffic) through the whole comparison: a machine shared with another program, as a laptop with
a browser open or a busy CI runner is. Every engine then shares the cores with them alike;
what it shows is how each engine's threads cope when one of them loses its core for a while.
"""
import argparse
import json
import os
import pathlib
import signal
import statistics
import subprocess
import sys
import tempfile

from ab import MAX_P, sign_test

ROOT = pathlib.Path(__file__).resolve().parent.parent
WORKSHOP = ROOT / "target" / "release" / "workshop"
# The peers (and PyTorch) run where the rest of our tools run Python: on WORKSHOP_PYTHON (the
# venv with torch, onnx and openvino), else on the interpreter running this script.
PYTHON = os.environ.get("WORKSHOP_PYTHON") or sys.executable


def run_measured(cmd, must=True):
    """(stdout, peak resident bytes) of a command that must succeed (or None when `must` is
    false and it failed)."""
    with tempfile.TemporaryFile() as out:
        proc = subprocess.Popen(cmd, stdout=out)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        if proc.returncode != 0:
            if not must:
                print(f"{' '.join(cmd)} failed with exit status {proc.returncode}: left out", flush=True)
                return None
            sys.exit(f"{' '.join(cmd)} failed with exit status {proc.returncode}")
        out.seek(0)
        return out.read().decode(), usage.ru_maxrss * 1024  # Linux reports KiB


def input_size(net):
    """The network's own input size (`workshop models`): both sides run at it."""
    out = subprocess.run([str(WORKSHOP), "models", "--json"], check=True, capture_output=True, text=True).stdout
    return next(m["input_size"] for m in json.loads(out) if m["network"] == net)


def ours(net, batch, threads, iters, precision, compile=None):
    """(images/s, images/s at the fastest iteration, effective GFLOP per image, start-up s, peak
    RSS bytes) of one `workshop bench` run."""
    with tempfile.TemporaryDirectory() as d:
        out = pathlib.Path(d) / "r.json"
        _, rss = run_measured(
            [str(WORKSHOP), "bench", "--network", net, "--batch-size", str(batch), "--threads", str(threads),
             "--iterations", str(iters), "--warmup", "2", "--precision", precision, "--json", str(out),
             "--input-size", str(input_size(net))] + (["--compile", compile] if compile else []))
        r = json.loads(out.read_text())
    best = batch / r["stats"]["min_s"]
    return r["stats"]["throughput_median"], best, 2 * r["model"]["macs_per_image"] / 1e9, r["prepare_s"], rss


def pytorch(net, batch, threads, iters, channels_last, dtype):
    cmd = [PYTHON, str(ROOT / "bench" / "pytorch_resnet.py"), "--network", net, "--batch-size", str(batch),
           "--threads", str(threads), "--iterations", str(iters), "--warmup", "2", "--dtype", dtype,
           "--input-size", str(input_size(net))]
    if channels_last:
        cmd.append("--channels-last")
    stdout, rss = run_measured(cmd)
    r = json.loads(stdout)
    return r["images_per_s"], batch / min(r["samples_s"]), r["prepare_s"], rss


def peer(engine, net, batch, threads, iters, dtype):
    """(images/s, images/s at the fastest iteration, start-up s, peak RSS bytes) of ONNX Runtime
    or OpenVINO; None where the engine does not run that precision."""
    if engine == "onnxruntime" and dtype != "fp32":
        return None
    done = run_measured([PYTHON, str(ROOT / "bench" / "onnx_peers.py"), "--engine", engine,
                         "--network", net, "--batch-size", str(batch), "--threads", str(threads),
                         "--iterations", str(iters), "--warmup", "2", "--dtype", dtype,
                         "--input-size", str(input_size(net))], must=False)
    if done is None:
        return None
    stdout, rss = done
    r = json.loads(stdout)
    return r["images_per_s"], batch / r["min_s"], r["prepare_s"], rss


def measured_peak(threads, precision):
    """The GEMM peak `workshop peak` measures on `threads` cores in `precision`, and the
    ceiling it measures on registers for that precision's instruction (None where it has
    none), GFLOP/s; (None, None) where our CPU backend has no GEMM in that precision."""
    done = subprocess.run([str(WORKSHOP), "peak", "--threads", str(threads), "--precision", precision,
                           "--json"], capture_output=True, text=True)
    if done.returncode != 0:
        print(f"workshop peak --precision {precision}: {done.stderr.strip()} (no peak for its rows)", flush=True)
        return None, None
    r = json.loads(done.stdout)
    ceiling = r.get("theoretical") or {}
    return r["gemm"]["gflops"], ceiling.get("gflops") if ceiling.get("measured") else None


# One busy loop of --background-load: spins until its parent (given as its argument) is gone.
BUSY_LOOP = """
import os, sys
parent = int(sys.argv[1])
while os.getppid() == parent:
    for _ in range(100_000):
        pass
"""


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--network", default="resnet50")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[8, 32])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--iterations", type=int, default=5)
    p.add_argument("--precisions", nargs="+", default=["fp32"], choices=["fp32", "fp16", "bf16"])
    p.add_argument("--no-peak", action="store_true", help="skip measuring the GEMM peak")
    p.add_argument("--target", type=float, default=1.2,
                   help="the ratio ours / best other each row is judged against (issue 32's 1.2×)")
    p.add_argument("--peers", nargs="*", default=[], choices=["onnxruntime", "openvino"],
                   help="also run these engines on the model exported to ONNX")
    p.add_argument("--compile", nargs="?", const="default", choices=["default", "max-autotune"],
                   help="also run ours with --compile MODE (default when no mode is given)")
    p.add_argument("--no-torch", action="store_true",
                   help="leave PyTorch out (on a CPU without bf16 instructions its BF16 ResNet-50 "
                        "takes seconds an image, far behind every other engine)")
    p.add_argument("--background-load", type=int, default=0, metavar="N",
                   help="run N busy loops beside every engine for the whole comparison")
    a = p.parse_args()
    if not WORKSHOP.exists():
        sys.exit(f"{WORKSHOP} not found: run `cargo build --release` first")
    if not 0 <= a.background_load <= 64:
        p.error("--background-load takes 0 to 64 busy loops")
    # Started before anything is measured (the peaks too) and stopped however the run ends: a
    # SIGTERM (`timeout`) exits through the `finally` below, and a loop whose parent is gone
    # (SIGKILL) stops by itself within a few milliseconds.
    if a.background_load:
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    load = [subprocess.Popen([sys.executable, "-c", BUSY_LOOP, str(os.getpid())])
            for _ in range(a.background_load)]
    if load:
        print(f"background load: {len(load)} busy loop(s) running beside every engine", flush=True)
    try:
        compare(a)
    finally:
        for proc in load:
            proc.kill()
            proc.wait()


def compare(a):
    peaks = {}
    for prec in [] if a.no_peak else a.precisions:
        peaks[prec] = measured_peak(a.threads, prec)
        peak, ceiling = peaks[prec]
        if peak:
            print(f"measured {prec.upper()} GEMM peak: {peak:.1f} GFLOP/s on {a.threads} threads", flush=True)
        if ceiling:
            print(f"measured {prec.upper()} ceiling (registers only): {ceiling:.1f} GFLOP/s", flush=True)
    results, fastest, startup, peak_rss, gflop_per_image = {}, {}, {}, {}, {}

    def run_ours(b, prec, compile=None):
        ips, best, per_image, prepare_s, rss = ours(a.network, b, a.threads, a.iterations, prec, compile)
        gflop_per_image[a.network] = per_image
        return ips, best, prepare_s, rss

    impls = [("workshop", lambda b, prec: run_ours(b, prec))]
    if a.compile:
        impls.append(("workshop compiled", lambda b, prec: run_ours(b, prec, a.compile)))
    ours_names = [n for n, _ in impls]
    if not a.no_torch:
        impls += [
            ("torch NCHW", lambda b, prec: pytorch(a.network, b, a.threads, a.iterations, False, prec)),
            ("torch CL", lambda b, prec: pytorch(a.network, b, a.threads, a.iterations, True, prec)),
        ]
    impls += [(e, lambda b, prec, e=e: peer(e, a.network, b, a.threads, a.iterations, prec)) for e in a.peers]
    names = [n for n, _ in impls]
    for rnd in range(a.rounds):
        for prec in a.precisions:
            for b in a.batch_sizes:
                # Rotate the order each round, so no implementation always runs first.
                order = impls[rnd % len(impls):] + impls[:rnd % len(impls)]
                for name, fn in order:
                    r = fn(b, prec)
                    if r is None:
                        continue
                    v, best, prepare_s, rss = r
                    results.setdefault((prec, b, name), []).append(v)
                    fastest.setdefault((prec, b, name), []).append(best)
                    startup.setdefault((prec, b, name), []).append(prepare_s)
                    peak_rss[(prec, b, name)] = max(peak_rss.get((prec, b, name), 0), rss)
                    print(f"round {rnd} {prec} batch {b:>3} {name:<18} {v:7.2f} images/s "
                          f"(fastest iteration {best:7.2f})  peak RSS {rss / 2**30:.2f} GiB", flush=True)
    per_image = gflop_per_image[a.network]
    print(f"\n{a.network}, {a.threads} threads, images/s, median of {a.rounds} interleaved rounds "
          f"({per_image:.2f} GFLOP per image)")
    head = f"{'precision':>9}  {'batch':>5}" + "".join(f"  {n:>17}" for n in names) + f"  {'ours / best other':>17}"
    any_peak = any(p for p, _ in peaks.values())
    any_ceiling = any(c for _, c in peaks.values())
    if any_peak:
        head += f"  {'ours % peak':>11}"
    if any_ceiling:
        head += f"  {'ours % ceil':>11}  {'other % ceil':>12}  {'1.2× needs':>10}"
    print(head)
    median = lambda k: statistics.median(results[k]) if k in results else None  # noqa: E731
    for prec in a.precisions:
        for b in a.batch_sizes:
            m = {n: median((prec, b, n)) for n in names}
            best_ours = max(m[n] for n in ours_names)
            # Every other implementation may have been left out (a peer that failed to run).
            best_other = max((v for n, v in m.items() if n not in ours_names and v is not None), default=None)
            line = f"{prec:>9}  {b:>5}" + "".join(f"  {v:>17.2f}" if v else f"  {'—':>17}" for v in m.values())
            line += f"  {best_ours / best_other:>16.2f}×" if best_other else f"  {'—':>17}"
            peak, ceiling = peaks.get(prec, (None, None))
            share = lambda ips, of: f"{100 * ips * per_image / of:.0f}%" if ips and of else "—"  # noqa: E731
            if any_peak:
                line += f"  {share(best_ours, peak):>11}"
            if any_ceiling:
                needs = 1.2 * best_other if best_other else None
                line += (f"  {share(best_ours, ceiling):>11}  {share(best_other, ceiling):>12}"
                         f"  {share(needs, ceiling):>10}")
            print(line)
    # Paired by round: on a host whose speed swings between phases, the medians of the columns
    # can come from different phases (ours from slow rounds, a peer's from fast ones); a
    # round's ratio compares runs seconds apart.
    print(f"\nours / best other per round (each round's best of ours against its best other), "
          f"median [range], rounds ours led")
    per_round(results, a, names, ours_names)
    # Noise on a shared host only ever adds time, so each run's fastest iteration is its least
    # disturbed one: the same ratios from those, for a host whose speed swings within a run.
    print(f"\nthe same from each run's fastest iteration")
    per_round(fastest, a, names, ours_names)
    print(f"\nstart-up s (median) and peak RSS GiB (largest) per implementation")
    for prec in a.precisions:
        for b in a.batch_sizes:
            cells = [f"{n} {statistics.median(startup[(prec, b, n)]):.2f} s {peak_rss[(prec, b, n)] / 2**30:.2f} GiB"
                     for n in names if (prec, b, n) in startup]
            print(f"{prec:>9}  {b:>5}  " + "; ".join(cells))


def per_round(results, a, names, ours_names):
    """Prints, per row, the ratio of ours to the best other round by round: median, range, how
    many rounds ours led, and each round's ratio."""
    for prec in a.precisions:
        for b in a.batch_sizes:
            # Those that ran in every round (a peer without this precision ran in none).
            full = [n for n in names if len(results.get((prec, b, n), [])) == a.rounds]
            if not any(n not in ours_names for n in full) or not any(n in ours_names for n in full):
                print(f"{prec:>9}  {b:>5}  — (no other implementation ran in every round)")
                continue
            rounds = [
                max(results[(prec, b, n)][r] for n in full if n in ours_names)
                / max(results[(prec, b, n)][r] for n in full if n not in ours_names)
                for r in range(a.rounds)
            ]
            led = sum(x > 1 for x in rounds)
            print(f"{prec:>9}  {b:>5}  {statistics.median(rounds):.2f}× "
                  f"[{min(rounds):.2f}–{max(rounds):.2f}×], {led} of {len(rounds)}: "
                  + " ".join(f"{x:.2f}" for x in rounds)
                  + f"; {target_verdict(rounds, a.target)}")


def target_verdict(rounds, target):
    """Whether the rounds' ratios say ours is at least `target` × the best other: a sign test of
    the rounds at or above it against those below (bench/ab.py's), so that a median that
    crossed the target in a host's lucky phase is not read as met."""
    above = sum(x >= target for x in rounds)
    n = len(rounds)
    p_value = sign_test(max(above, n - above), n)
    if p_value > MAX_P:
        return (f"{target:g}× inconclusive ({above} of {n} rounds at or above it; a coin does "
                f"that with p = {p_value:.2f})")
    what = "met" if above > n - above else "not met"
    return f"{target:g}× {what} ({above} of {n} rounds at or above it, sign test p = {p_value:.3f})"


if __name__ == "__main__":
    main()
