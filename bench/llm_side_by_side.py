"""Language-model inference, ours against Hugging Face transformers on PyTorch, side by side
on the same weights and the same work: the same seeded random weights (written once by
`workshop weights` as a Hugging Face folder), seeded random prompts, greedy decoding of a fixed
number of tokens, the same thread count. Rounds rotate the order; medians are reported with
the ratio per row, then each row's ratios round by round with how many rounds ours led and a
sign test of them (bench/ab.py's), since a host whose speed swings can put two medians in
different phases.

    python bench/llm_side_by_side.py --model qwen2.5-0.5b --precision fp32,bf16 --batch 1,8
    python bench/llm_side_by_side.py --model llama-3.1-8b --device cuda --precision bf16 --replay

transformers' TTFT is a `generate` of one token; its TPOT is (a generate of N tokens − TTFT)
/ (N − 1), as vLLM's latency benchmark derives it. `--peers torch.compile` times transformers
the same way with its forward compiled over a static cache (compilation left out). `--check`
first compares the greedy continuation of a prompt between the two at FP32 (a parity check at
full size).

llama.cpp (llama-cpp-python from PyPI; it compiles llama.cpp on install) runs a GGUF of the
same weights that bench/llm_gguf.py writes, unquantised, one sequence at a time.

Needs torch, transformers, llama-cpp-python and gguf (a throwaway venv; not the project's
dependencies) and a release build of workshop (`cargo build --release`).
"""

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

from ab import MAX_P, sign_test

ROOT = pathlib.Path(__file__).resolve().parent.parent


def workshop(args, binary):
    out = subprocess.run([binary, *args], capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"workshop {' '.join(args)} failed:\n{out.stderr}")
    return out


def ours(binary, folder, precision, batch, prompt, gen, threads, iterations, extra):
    with tempfile.TemporaryDirectory() as tmp:
        record = pathlib.Path(tmp) / "run.json"
        workshop(["bench", "--model-dir", str(folder), "--precision", precision, "-b", str(batch),
                  "-p", str(prompt), "-n", str(gen), "--threads", str(threads),
                  "--iterations", str(iterations), "--warmup", "1", "--json", str(record), *extra],
                 binary)
        run = json.loads(record.read_text())["llm"]
    return run["ttft"]["median_ms"], run["tpot"]["median_ms"]


class Hf:
    """transformers on PyTorch, eager; or with `compiled`, its forward through torch.compile
    over a static KV cache (transformers' recipe: fixed shapes, so a prefill and a decode step
    each compile once for a batch and a length), the compilations paid in the warm-up."""

    def __init__(self, folder, precision, threads, device="cpu", compiled=False):
        import torch
        import transformers
        torch.set_num_threads(threads)
        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]
        self.torch, self.device, self.compiled = torch, device, compiled
        self.model = transformers.AutoModelForCausalLM.from_pretrained(
            folder, dtype=dtype).eval().to(device)
        self.vocab = self.model.config.vocab_size
        if compiled:
            # Dynamo's compilations are kept per code object, shared by every model of the
            # run: start afresh, and leave room for each batch's and length's shapes (past the
            # default limit of 8 it falls back to eager without a word in the results).
            torch._dynamo.reset()
            torch._dynamo.config.recompile_limit = 64
            self.model.generation_config.cache_implementation = "static"
            self.model.forward = torch.compile(self.model.forward, dynamic=False)

    def generate(self, ids, n):
        torch = self.torch
        ids = ids.to(self.device)  # the mask too: transformers takes the positions from it
        with torch.inference_mode():
            out = self.model.generate(ids, max_new_tokens=n, min_new_tokens=n,
                                      do_sample=False, attention_mask=torch.ones_like(ids),
                                      pad_token_id=0)
        if self.device != "cpu":
            torch.cuda.synchronize()
        return out.cpu()

    def measure(self, batch, prompt, gen, iterations):
        torch = self.torch
        g = torch.Generator().manual_seed(1)
        ids = torch.randint(0, self.vocab, (batch, prompt), generator=g)
        # Warm-up: a prefill and a decode step; compiled, the two lengths timed below (each
        # length of the static cache compiles anew).
        for n in (1, gen) if self.compiled else (2,):
            self.generate(ids, n)
        ttft, e2e = [], []
        for _ in range(iterations):
            t = time.perf_counter()
            self.generate(ids, 1)
            ttft.append(time.perf_counter() - t)
            t = time.perf_counter()
            self.generate(ids, gen)
            e2e.append(time.perf_counter() - t)
        ttft_ms = statistics.median(ttft) * 1e3
        return ttft_ms, (statistics.median(e2e) * 1e3 - ttft_ms) / (gen - 1)


class LlamaCpp:
    """llama.cpp through llama-cpp-python on a GGUF of the same weights (bench/llm_gguf.py),
    unquantised; one sequence (its high-level API decodes one)."""

    def __init__(self, folder, precision, threads, context):
        import llama_cpp
        import numpy as np
        gguf = folder / f"model-{precision}.gguf"
        if not gguf.exists():
            subprocess.run([sys.executable, str(ROOT / "bench/llm_gguf.py"), str(folder), str(gguf),
                            "--type", {"fp32": "f32"}.get(precision, precision)], check=True)
        self.np, self.lib = np, llama_cpp
        self.m = llama_cpp.Llama(str(gguf), n_threads=threads, n_threads_batch=threads,
                                 n_ctx=context, n_batch=context, logits_all=False, verbose=False)
        self.vocab = self.m.n_vocab()

    def next_token(self):
        ptr = self.lib.llama_get_logits_ith(self.m._ctx.ctx, -1)
        return int(self.np.ctypeslib.as_array(ptr, shape=(self.vocab,)).argmax())

    def measure(self, batch, prompt, gen, iterations):
        import random
        rng = random.Random(1)
        ids = [rng.randrange(self.vocab) for _ in range(prompt)]
        ttft, tpot = [], []
        for i in range(iterations + 1):  # the first is the warm-up
            self.m.reset()
            t = time.perf_counter()
            self.m.eval(ids)
            tok = self.next_token()
            first = time.perf_counter() - t
            t = time.perf_counter()
            for _ in range(gen - 1):
                self.m.eval([tok])
                tok = self.next_token()
            if i > 0:
                ttft.append(first)
                tpot.append((time.perf_counter() - t) / (gen - 1))
        return statistics.median(ttft) * 1e3, statistics.median(tpot) * 1e3


def check(binary, folder, threads, device, prompt=16, tokens=24):
    """Greedy continuation of a seeded prompt of `prompt` tokens, ours against transformers, in
    FP32, both on `device` (cpu, or cuda for our CUDA backend and PyTorch's)."""
    import torch
    hf = Hf(folder, "fp32", threads, device)
    ids = torch.randint(0, hf.vocab, (1, prompt), generator=torch.Generator().manual_seed(3))
    want = hf.generate(ids, tokens)[0, prompt:].tolist()
    out = workshop(["generate", "--model-dir", str(folder), "--threads", str(threads),
                    "--backend", device, "--prompt-ids", ",".join(map(str, ids[0].tolist())),
                    "--max-tokens", str(tokens)], binary)
    got = [int(t) for t in out.stdout.strip().split(",")]
    same = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), len(want))
    print(f"parity: {same} of {tokens} greedy tokens after a prompt of {prompt} equal to "
          "transformers' (FP32)")
    if same < tokens:
        print(f"  ours: {got}\n  hf:   {want}")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen2.5-0.5b")
    p.add_argument("--precision", default="fp32,bf16")
    p.add_argument("--batch", default="1,8")
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--gen", type=int, default=64)
    p.add_argument("--threads", type=int, default=os.cpu_count())
    # Two rounds proved too few on a noisy 2-core machine (a 0.78× that 4 rounds showed was 0.98×);
    # five are the fewest whose sign test can give a verdict (all five: p = 0.06).
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--iterations", type=int, default=2)
    p.add_argument("--check", action="store_true")
    p.add_argument("--check-prompt", type=int, default=16,
                   help="the parity check's prompt length (past 512 it crosses our CPU "
                        "attention's key tiles)")
    p.add_argument("--peers", default="transformers,llama.cpp",
                   help="transformers, torch.compile (transformers compiled, static cache), "
                        "llama.cpp (batch 1 only), comma-separated")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                   help="cuda: our CUDA backend against transformers on the GPU (no llama.cpp)")
    p.add_argument("--replay", action="store_true",
                   help="ours with --compile reduce-overhead (a decode step replayed as a graph)")
    p.add_argument("--workshop", default=str(ROOT / "target/release/workshop"))
    p.add_argument("--folder", help="model folder (default: written to a cache folder)")
    a = p.parse_args()
    folder = pathlib.Path(a.folder or pathlib.Path.home() / ".cache/workshop/models" / a.model)
    if not (folder / "config.json").exists():
        workshop(["weights", "--network", a.model, "--output", str(folder)], a.workshop)
    if a.check:
        check(a.workshop, folder, a.threads, a.device, a.check_prompt)
    rows = []
    wanted = a.peers.split(",") if a.peers else []
    extra = ["--backend", a.device] + (["--compile", "reduce-overhead"] if a.replay else [])
    if a.device != "cpu" and "llama.cpp" in wanted:
        print("llama.cpp left out: the PyPI build of llama-cpp-python runs on the CPU")
        wanted.remove("llama.cpp")
    for precision in a.precision.split(","):
        peers = {}
        if "transformers" in wanted:
            peers["transformers"] = Hf(folder, precision, a.threads, a.device)
        if "torch.compile" in wanted:
            peers["torch.compile"] = Hf(folder, precision, a.threads, a.device, compiled=True)
        if "llama.cpp" in wanted and precision in ("fp32", "bf16"):
            peers["llama.cpp"] = LlamaCpp(folder, precision, a.threads, a.prompt + a.gen)
        for batch in map(int, a.batch.split(",")):
            here = [n for n in peers if batch == 1 or n != "llama.cpp"]
            results = {k: [] for k in ["workshop", *here]}
            for r in range(a.rounds):
                # Rotate who goes first, so a drift in the machine's speed favours no one.
                names = list(results)
                order = names[r % len(names):] + names[:r % len(names)]
                for who in order:
                    if who == "workshop":
                        results[who].append(ours(a.workshop, folder, precision, batch, a.prompt,
                                                 a.gen, a.threads, a.iterations, extra))
                    else:
                        results[who].append(peers[who].measure(batch, a.prompt, a.gen,
                                                               a.iterations))
            med = {k: (statistics.median(v[0] for v in runs), statistics.median(v[1] for v in runs))
                   for k, runs in results.items()}
            rows.append((precision, batch, med, results))
            print(precision, batch, med, flush=True)
        del peers
    name = a.folder if a.folder else a.model
    print(f"\n{name} on {a.device}, prompt {a.prompt}, {a.gen} new tokens, {a.threads} "
          f"threads, {a.rounds} interleaved rounds (medians)")
    print("| precision | batch | peer | TTFT ours ms | TTFT peer ms | prefill ours/peer speed "
          "| TPOT ours ms | TPOT peer ms | decode ours/peer speed |")
    print("|---|---|---|---|---|---|---|---|---|")
    for precision, batch, m, _ in rows:
        ot, op = m["workshop"]
        for peer, (pt, pp) in m.items():
            if peer == "workshop":
                continue
            print(f"| {precision} | {batch} | {peer} | {ot:.1f} | {pt:.1f} | {pt / ot:.2f}× | "
                  f"{op:.2f} | {pp:.2f} | {pp / op:.2f}× |")
    print("\nRound by round (peer time / ours: above 1, ours faster), with a sign test of the "
          "rounds: a host whose speed swings between phases can put the two medians above in "
          "different phases")
    for precision, batch, _, results in rows:
        for peer, runs in results.items():
            if peer == "workshop":
                continue
            for phase, i in (("prefill", 0), ("decode", 1)):
                ratios = [p[i] / o[i] for o, p in zip(results["workshop"], runs)]
                print(f"{precision} batch {batch} {peer} {phase}: {rounds_verdict(ratios)}")


def rounds_verdict(ratios):
    """The rounds' ratios (peer time / ours), their median and range, how many ours led, and
    whether that many is more than noise would give (bench/ab.py's sign test)."""
    led, n = sum(x > 1 for x in ratios), len(ratios)
    p_value = sign_test(max(led, n - led), n)
    if p_value > MAX_P:
        verdict = f"inconclusive (a coin does that with p = {p_value:.2f})"
    else:
        verdict = f"{'ours' if led > n - led else 'the peer'} faster (p = {p_value:.3f})"
    return (f"{statistics.median(ratios):.2f}× [{min(ratios):.2f}–{max(ratios):.2f}], ours led "
            f"{led} of {n}: " + " ".join(f"{x:.2f}" for x in ratios) + f"; {verdict}")


if __name__ == "__main__":
    main()
