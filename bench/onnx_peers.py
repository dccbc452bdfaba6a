#!/usr/bin/env python3
"""ONNX Runtime and OpenVINO on the CPU, the engines a user would pick for fast CPU inference:
the torchvision network exported to ONNX (random weights, exported once into a cache folder),
the same batch, threads and input size as `workshop bench`, median of the timed iterations.
Prints one JSON line per run, like bench/pytorch_resnet.py.

    pip install torch torchvision onnx onnxscript onnxruntime openvino   # outside the project's dependencies
    python3 bench/onnx_peers.py --engine onnxruntime --network resnet50 --batch-size 8 --threads 2
    python3 bench/onnx_peers.py --engine openvino --network vit_b_16 --batch-size 1 --dtype bf16
    python3 bench/onnx_peers.py --engine openvino --dtype bf16 --layers   # + per-layer counters
    python3 bench/onnx_peers.py --engine onnxruntime --layers             # + its profiler's node times

ONNX Runtime's CPU provider runs FP32 only here (`--dtype` other than fp32 is refused);
OpenVINO takes `INFERENCE_PRECISION_HINT` f32 or bf16 (on CPUs without BF16 units it
computes FP32 whatever the hint; the JSON says what it reports it ran).
"""
import argparse
import json
import pathlib
import statistics
import sys
import tempfile
import time
import warnings

import numpy as np

# The TorchScript exporter handles every torchvision classifier; its deprecation notice is noise.
warnings.filterwarnings("ignore", category=DeprecationWarning)

p = argparse.ArgumentParser()
p.add_argument("--engine", required=True, choices=["onnxruntime", "openvino"])
p.add_argument("--network", default="resnet50")
p.add_argument("--batch-size", type=int, default=8)
p.add_argument("--iterations", type=int, default=10)
p.add_argument("--warmup", type=int, default=3)
p.add_argument("--threads", type=int, default=2)
p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
p.add_argument("--input-size", type=int, default=224)
p.add_argument("--layers", action="store_true",
               help="also report the time per node of the engine's graph (the timed iterations' "
                    "mean) under \"layers\": OpenVINO's performance counters (PERF_COUNT on), "
                    "ONNX Runtime's profiler (enable_profiling)")
p.add_argument("--cache", default=str(pathlib.Path(tempfile.gettempdir()) / "workshop-onnx"),
               help="folder for the exported models (reused across runs)")
a = p.parse_args()


def export(net, size):
    """The network's ONNX file with a dynamic batch, exported once (random weights)."""
    path = pathlib.Path(a.cache) / f"{net}-{size}.onnx"
    if path.exists():
        return path
    import torch
    import torchvision

    path.parent.mkdir(parents=True, exist_ok=True)
    model = torchvision.models.get_model(net, weights=None).eval()
    x = torch.randn(1, 3, size, size)
    tmp = path.with_suffix(".part")
    # Traced with gradients on: without them nn.MultiheadAttention takes its fused fast path
    # (`_native_multi_head_attention`), which the exporter cannot write.
    torch.onnx.export(model, (x,), str(tmp), input_names=["input"], output_names=["logits"],
                      dynamic_axes={"input": {0: "batch"}, "logits": {0: "batch"}}, dynamo=False)
    tmp.rename(path)
    return path


# The ops ONNX Runtime's CPU provider fuses into the convolution before them.
FUSED_INTO_CONV = {"Relu", "Add", "Sum", "BatchNormalization", "Clip", "Sigmoid", "HardSigmoid",
                   "HardSwish", "LeakyRelu", "Tanh"}


def fused_origins(onnx_file, profiled):
    """ONNX Runtime's profiled node names ({name: op}) → the ONNX nodes they came from, for the
    nodes its NCHWc pass made: it names them after the output of the last node fused in
    (`/layer1/layer1.0/relu/Relu_output_0_nchwc` is conv1 with its batch norm and ReLU), which
    keeps no module's name. A convolution is walked back from that output through the ops it
    fuses to the Conv; at an Add (a residual), along the input whose chain is not profiled under
    a name of its own (the other is the block's input, or a downsample convolution timed apart).
    Any other op (a pool) is the node that made the output."""
    import onnx

    graph = onnx.load(str(onnx_file)).graph
    producer = {out: node for node in graph.node for out in node.output}
    origins = {}
    for name, op in profiled.items():
        node = producer.get(name.removesuffix("_nchwc"))
        while op == "Conv" and node is not None and node.op_type in FUSED_INTO_CONV:
            inputs = [i for i in node.input if i in producer]
            own = [i for i in inputs if i + "_nchwc" not in profiled and i not in profiled]
            node = producer[(own or inputs)[0]] if inputs else None
        if node is not None and name != node.name:
            origins[name] = node.name
    return origins


start = time.perf_counter()
onnx_file = export(a.network, a.input_size)
export_s = time.perf_counter() - start
x = np.random.default_rng(0).standard_normal((a.batch_size, 3, a.input_size, a.input_size), dtype=np.float32)
start = time.perf_counter()
if a.engine == "onnxruntime":
    import onnxruntime as ort

    if a.dtype != "fp32":
        sys.exit("ONNX Runtime's CPU provider runs this model in FP32 only")
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = a.threads
    opts.inter_op_num_threads = 1
    if a.layers:
        opts.enable_profiling = True
        opts.profile_file_prefix = str(pathlib.Path(tempfile.mkdtemp()) / "ort")
    session = ort.InferenceSession(str(onnx_file), opts, providers=["CPUExecutionProvider"])
    run = lambda: session.run(None, {"input": x})  # noqa: E731
    impl, ran = f"onnxruntime {ort.__version__} CPU", "f32"
else:
    import openvino as ov

    core = ov.Core()
    config = {"INFERENCE_NUM_THREADS": a.threads, "INFERENCE_PRECISION_HINT": {"fp32": "f32", "bf16": "bf16"}[a.dtype],
              "PERFORMANCE_HINT": "LATENCY"}
    if a.layers:
        config["PERF_COUNT"] = True
    compiled = core.compile_model(str(onnx_file), "CPU", config)
    request = compiled.create_infer_request()
    run = lambda: request.infer({0: x})  # noqa: E731
    hint = compiled.get_property("INFERENCE_PRECISION_HINT")
    impl, ran = f"openvino {ov.__version__.split('-')[0]} CPU", getattr(hint, "to_string", lambda: str(hint))()
prepare_s = time.perf_counter() - start  # loading and compiling the ONNX file
samples = []
# Per node of OpenVINO's executed graph (its fusions: a convolution with its batch norm, add and
# ReLU is one node, named after the last ONNX node fused in): seconds summed over the timed
# iterations, its type, and the kernel it ran ("brgconv_avx512_core_bf16", ...).
layers = {}
for i in range(a.warmup + a.iterations):
    t = time.perf_counter()
    run()
    if i >= a.warmup:
        samples.append(time.perf_counter() - t)
        for info in request.profiling_info if a.layers and a.engine == "openvino" else []:
            if info.status == info.Status.EXECUTED:
                entry = layers.setdefault(info.node_name, {"type": info.node_type, "exec": info.exec_type, "s": 0.0})
                entry["s"] += info.real_time.total_seconds()
if a.layers and a.engine == "onnxruntime":
    # The profiler's events: one "model_run" per run, one "<node>_kernel_time" per node run
    # (ONNX Runtime's own fusions keep the name of the node they started from); the warm-up
    # runs' nodes are left out by time.
    events = json.loads(pathlib.Path(session.end_profiling()).read_text())
    runs = sorted(e["ts"] for e in events if e.get("name") == "model_run")
    timed_from = runs[a.warmup] if len(runs) > a.warmup else 0
    timed = [e for e in events if e.get("cat") == "Node" and e["name"].endswith("_kernel_time")
             and e["ts"] >= timed_from]
    origin = fused_origins(onnx_file, {e["name"].removesuffix("_kernel_time"): e["args"].get("op_name")
                                       for e in timed})
    for e in timed:
        node = e["name"].removesuffix("_kernel_time")
        entry = layers.setdefault(origin.get(node, node), {"type": e["args"].get("op_name", "?"),
                                                          "exec": e["args"].get("provider", "?"), "s": 0.0})
        entry["s"] += e["dur"] / 1e6
median = statistics.median(samples)
record = {
    "impl": impl, "device": "cpu", "network": a.network, "batch_size": a.batch_size, "dtype": a.dtype,
    "computed_in": ran, "threads": a.threads, "median_s": median, "images_per_s": a.batch_size / median,
    # The least disturbed iteration and the spread, as `workshop bench` reports its own.
    "min_s": min(samples), "cv": statistics.pstdev(samples) / statistics.mean(samples),
    "prepare_s": prepare_s, "export_s": export_s,
}
if a.layers:
    record["layers"] = [{"node": k, "type": v["type"], "exec": v["exec"], "s": v["s"] / a.iterations}
                        for k, v in layers.items()]
print(json.dumps(record))
