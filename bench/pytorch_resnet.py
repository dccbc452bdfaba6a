#!/usr/bin/env python3
"""PyTorch eager baseline for `workshop bench`: same network, batch, threads and a random
input, inference mode, median of the timed iterations. Prints one JSON line per run.

    python3 bench/pytorch_resnet.py --network resnet50 --batch-size 8 --threads 2 [--channels-last] [--dtype bf16]
    python3 bench/pytorch_resnet.py --device cuda --batch-size 32 --dtype fp16   # against `--backend cuda`

`workshop bench --framework pytorch` runs this same script (embedded in the binary, fed to
WORKSHOP_PYTHON or python3) and records its samples in our record format.

On a GPU each timed iteration ends with a synchronize, as `workshop bench` waits for the device;
`--tf32` lets FP32 convolutions and matrix products use TF32 tensor cores (PyTorch's default for
cuDNN convolutions, off for matmuls), which our FP32 kernels do not.
"""
import argparse
import json
import statistics
import time

import torch
import torchvision

p = argparse.ArgumentParser()
p.add_argument("--network", default="resnet50")
p.add_argument("--batch-size", type=int, default=8)
p.add_argument("--iterations", type=int, default=10)
p.add_argument("--warmup", type=int, default=3)
p.add_argument("--threads", type=int, default=2, help="0: PyTorch's own default")
p.add_argument("--channels-last", action="store_true")
p.add_argument("--dtype", default="fp32", choices=["fp32", "fp16", "bf16"])
p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (ROCm builds name their GPUs cuda too)")
p.add_argument("--tf32", action="store_true", help="allow TF32 in FP32 convolutions and matmuls")
p.add_argument("--input-size", type=int, default=224, help="input height and width (inception_v3: 299, ...)")
a = p.parse_args()

if a.threads > 0:
    torch.set_num_threads(a.threads)
torch.backends.cudnn.allow_tf32 = a.tf32
torch.backends.cuda.matmul.allow_tf32 = a.tf32
gpu = a.device != "cpu"
sync = torch.cuda.synchronize if gpu else (lambda: None)
dtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[a.dtype]
start = time.perf_counter()
model = getattr(torchvision.models, a.network)().eval().to(a.device, dtype)
if a.channels_last:
    model = model.to(memory_format=torch.channels_last)
sync()
prepare_s = time.perf_counter() - start  # building the model and initialising its weights
x = torch.randn(a.batch_size, 3, a.input_size, a.input_size, dtype=dtype, device=a.device)
if a.channels_last:
    x = x.to(memory_format=torch.channels_last)
samples, warmup = [], []
with torch.inference_mode():
    for i in range(a.warmup + a.iterations):
        sync()
        t = time.perf_counter()
        model(x)
        sync()
        (samples if i >= a.warmup else warmup).append(time.perf_counter() - t)
median = statistics.median(samples)
print(json.dumps({
    "impl": f"pytorch {torch.__version__} eager" + (" channels_last" if a.channels_last else "")
    + (" tf32" if a.tf32 else ""),
    "device": torch.cuda.get_device_name(a.device) if gpu else "cpu",
    "network": a.network, "batch_size": a.batch_size, "dtype": a.dtype, "threads": a.threads,
    "median_s": median, "images_per_s": a.batch_size / median, "prepare_s": prepare_s,
    "samples_s": samples, "warmup_s": warmup, "threads_used": torch.get_num_threads(),
    "peak_memory_bytes": torch.cuda.max_memory_allocated(a.device) if gpu else None,
}))
