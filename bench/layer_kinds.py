#!/usr/bin/env python3
"""Where the time goes, per kind of layer, for our CPU backend and for OpenVINO (or ONNX
Runtime, `--peer onnxruntime`, FP32 only) on the same network, batch, precision and threads:
the table that says which layers to work on where the peer leads.

    cargo build --release
    pip install torch torchvision onnx onnxscript openvino      # outside the project's dependencies
    python3 bench/layer_kinds.py --network resnet50 --batch-size 8 --precision bf16 --compile

Ours: `workshop bench --trace` (every kernel timed, its node named), summed per node over the
timed iterations. OpenVINO: its per-node performance counters (bench/onnx_peers.py --layers)
on the ONNX export of torchvision's model; ONNX Runtime: its profiler's node times, the same way. Both are keyed by torchvision's module names
(ours name nodes after them; the ONNX exporter writes `/layer1/layer1.0/conv1/Conv`), and a
convolution's kind comes from the module: its kernel and stride, the stem (3 input channels)
apart. Whatever each engine fused into a convolution (batch norm, the residual add, ReLU) is
timed with it; what it ran on its own is listed under its own kind ("batch_norm", "add", ...).
Profiling costs both sides a little: compare the rows, not the totals with bench runs.
"""
import argparse
import collections
import json
import pathlib
import re
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
WORKSHOP = ROOT / "target" / "release" / "workshop"


def module_kinds(net):
    """torchvision module name → layer kind, for the convolutions, linear layers and pools."""
    import torch
    import torchvision

    kinds = {}
    for name, m in torchvision.models.get_model(net, weights=None).named_modules():
        if isinstance(m, torch.nn.Conv2d):
            k, s = m.kernel_size, m.stride
            kind = f"conv {k[0]}x{k[1]} s{s[0]}"
            if m.groups > 1:
                kind += " grouped" if m.groups != m.in_channels else " depthwise"
            if m.in_channels == 3:
                kind += " (stem)"
            kinds[name] = kind
        elif isinstance(m, torch.nn.Linear):
            kinds[name] = "linear"
        elif isinstance(m, (torch.nn.MaxPool2d, torch.nn.AdaptiveAvgPool2d, torch.nn.AvgPool2d)):
            kinds[name] = "pool"
    return kinds


def ours(a):
    """({node: (op, seconds per iteration)}, {node: the other nodes its kernel ran}) from one
    traced `workshop bench` run."""
    with tempfile.TemporaryDirectory() as d:
        trace = pathlib.Path(d) / "t.json"
        subprocess.run([str(WORKSHOP), "bench", "--network", a.network, "--batch-size", str(a.batch_size),
                        "--precision", a.precision, "--threads", str(a.threads), "--iterations", str(a.iterations),
                        "--trace", str(trace)] + (["--compile", a.compile] if a.compile else []),
                       check=True, stdout=subprocess.DEVNULL)
        events = json.loads(trace.read_text())["traceEvents"]
    iterations = sum(1 for e in events if e.get("cat") == "host")
    nodes, fused = {}, {}
    for e in events:
        if e.get("ph") == "X" and e.get("pid") == 2:
            node = e["args"]["node"]
            op, s = nodes.get(node, (e["cat"], 0.0))
            nodes[node] = (op, s + e["dur"] / 1e6 / iterations)
            if e["args"].get("fused"):
                fused[node] = e["args"]["fused"]
    return nodes, fused


def short_kind(kind):
    """A layer kind as a fused group's kind names it: `pw` for a 1×1 convolution, `dw 3x3 s1`
    for a depthwise one."""
    if kind.startswith("conv 1x1") and "depthwise" not in kind:
        return "pw"
    body = kind.replace("conv ", "").replace(" depthwise", "")
    return f"dw {body}" if "depthwise" in kind else body


def fused_groups(fused, kinds):
    """{module: (group name, group kind)} for the layers our kernels ran together (the CPU's
    pointwise → depthwise → pointwise), so that both sides' times for them land on one row:
    the group named as our profiles name it (`features.2.block.{0.0, 1.0, 2.0}`), its kind
    after its layers' (`pw + dw 3x3 s2 + pw`)."""
    out = {}
    for node, others in fused.items():
        order = lambda n: [int(p) if p.isdigit() else -1 for p in n.split(".")]
        layers = sorted([node] + others, key=order)
        parts = [layer.split(".") for layer in layers]
        shared = 0
        while shared < min(map(len, parts)) - 1 and len({p[shared] for p in parts}) == 1:
            shared += 1
        rest = ", ".join(".".join(p[shared:]) for p in parts)
        name = ".".join(parts[0][:shared] + [f"{{{rest}}}"])
        kind = " + ".join(short_kind(kinds.get(layer, "?")) for layer in layers)
        for layer in layers:
            out[layer] = (name, kind)
    return out


def peer(a):
    """{node: (type, seconds per iteration)} from OpenVINO's performance counters or ONNX
    Runtime's profiler."""
    cmd = [sys.executable, str(ROOT / "bench" / "onnx_peers.py"), "--engine", a.peer, "--network", a.network,
           "--batch-size", str(a.batch_size), "--threads", str(a.threads), "--iterations", str(a.iterations),
           "--dtype", a.precision, "--layers"]
    record = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.splitlines()[-1])
    return {layer["node"]: (layer["type"], layer["s"]) for layer in record["layers"]}


def module_of(node):
    """torchvision's module name of a node of ours (already one) or of OpenVINO's graph, named
    after the ONNX export's scopes (`/layer1/layer1.0/downsample/downsample.0/Conv/WithoutBiases`
    → `layer1.0.downsample.0`, `/features/features.2/block/block.1/block.1.0/Conv` →
    `features.2.block.1.0`): scopes up to the first operator name (capitalised), each either a
    longer path of the scope before it (which it replaces), a full path below the name so far,
    or a child."""
    if not node.startswith("/"):
        return node
    name, prev = "", ""
    for scope in node.strip("/").split("/"):
        if scope[:1].isupper():
            break
        if prev and scope.startswith(prev + "."):
            name = name[: len(name) - len(prev)] + scope
        elif not name or scope.startswith(name + "."):
            name = scope
        else:
            name = f"{name}.{scope}"
        prev = scope
    return name


# OpenVINO's node types named as our kinds are, where a node keeps no module's name (its
# classifier is named after the graph's output, `logits`).
TYPE_KINDS = {"FullyConnected": "linear", "ReduceMean": "pool", "MaxPool": "pool", "AvgPool": "pool",
              "Gemm": "linear", "GlobalAveragePool": "pool"}


def module_in(node, op, kinds):
    """The module of a node, where a convolution fused with the activation after it is named
    after the activation (ONNX Runtime: `/features/features.1/block/block.0/block.0.2/Relu` for
    the convolution `block.0.0`): the first sibling of that name then."""
    name = module_of(node)
    if name not in kinds and op == "Conv" and "." in name:
        sibling = name.rsplit(".", 1)[0] + ".0"
        if sibling in kinds:
            return sibling
    return name


def by_kind(nodes, kinds):
    """{kind: seconds}: a node's module kind where it has one, else its op or type in lower case."""
    out = collections.Counter()
    for node, (op, s) in nodes.items():
        kind = kinds.get(module_in(node, op, kinds)) or TYPE_KINDS.get(op)
        out[kind or re.sub(r"(?<!^)(?=[A-Z])", "_", op).lower()] += s
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--network", default="resnet50")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--precision", default="bf16", choices=["fp32", "bf16"])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--iterations", type=int, default=5)
    p.add_argument("--compile", nargs="?", const="default", choices=["default", "max-autotune"],
                   help="ours with --compile MODE (default when no mode is given)")
    p.add_argument("--top", type=int, default=8, help="how many modules to list where ours loses the most")
    p.add_argument("--peer", default="openvino", choices=["openvino", "onnxruntime"])
    a = p.parse_args()
    if a.peer == "onnxruntime" and a.precision != "fp32":
        p.error("ONNX Runtime's CPU provider runs these models in FP32 only")
    kinds = module_kinds(a.network)
    ours_nodes, fused = ours(a)
    ov_nodes = peer(a)
    # Layers our kernels ran together count as one kind on both sides, one module in the list.
    groups = fused_groups(fused, kinds)
    module_names = {m: groups[m][0] if m in groups else m for m in kinds}
    kinds = {m: groups[m][1] if m in groups else k for m, k in kinds.items()}
    name, short = {"openvino": ("OpenVINO", "OV"), "onnxruntime": ("ONNX Runtime", "ORT")}[a.peer]
    mine, theirs = by_kind(ours_nodes, kinds), by_kind(ov_nodes, kinds)
    total_m, total_t = sum(mine.values()), sum(theirs.values())
    label = "ours" + ({None: "", "default": " compiled"}.get(a.compile, f" {a.compile}"))
    print(f"{a.network} {a.precision.upper()} batch {a.batch_size}, {a.threads} threads: ms per iteration "
          f"(kernel times, profiling on)")
    print(f"{'layer kind':28} {label:>14} {'share':>6} {name:>12} {'share':>6} {'ours/' + short:>8}")
    for kind in sorted(set(mine) | set(theirs), key=lambda k: -(mine[k] + theirs[k])):
        m, t = mine[kind], theirs[kind]
        ratio = f"{m / t:8.2f}" if t > 0 and m > 0 else f"{'—':>8}"
        print(f"{kind:28} {m * 1e3:14.2f} {100 * m / total_m:5.1f}% {t * 1e3:12.2f} {100 * t / total_t:5.1f}% {ratio}")
    print(f"{'total':28} {total_m * 1e3:14.2f} {'':>6} {total_t * 1e3:12.2f} {'':>6} {total_m / total_t:8.2f}")
    # The layers where ours loses the most time to the peer, module by module.
    per = collections.defaultdict(lambda: [0.0, 0.0])
    kind_of = {}
    for side, nodes in ((0, ours_nodes), (1, ov_nodes)):
        for node, (op, s) in nodes.items():
            module = module_in(node, op, kinds)
            if module in kinds:
                per[module_names[module]][side] += s
                kind_of[module_names[module]] = kinds[module]
    worst = sorted(per.items(), key=lambda kv: -(kv[1][0] - kv[1][1]))[:a.top]
    print(f"\nmodules where ours spends the most over {name} (ms):")
    for module, (m, t) in worst:
        print(f"  {module:28} {kind_of[module]:22} ours {m * 1e3:7.2f}  {name} {t * 1e3:7.2f}")


if __name__ == "__main__":
    main()
