#!/usr/bin/env python3
"""PyTorch CPU eager baseline for `workshop bench`: same network, batch, threads and a random
input, inference mode, median of the timed iterations. Prints one JSON line per run.

    python3 bench/pytorch_resnet.py --network resnet50 --batch-size 8 --threads 2 [--channels-last] [--dtype bf16]
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
p.add_argument("--threads", type=int, default=2)
p.add_argument("--channels-last", action="store_true")
p.add_argument("--dtype", default="fp32", choices=["fp32", "fp16", "bf16"])
a = p.parse_args()

torch.set_num_threads(a.threads)
dtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[a.dtype]
model = getattr(torchvision.models, a.network)().eval().to(dtype)
x = torch.randn(a.batch_size, 3, 224, 224, dtype=dtype)
if a.channels_last:
    model = model.to(memory_format=torch.channels_last)
    x = x.to(memory_format=torch.channels_last)
samples = []
with torch.inference_mode():
    for i in range(a.warmup + a.iterations):
        t = time.perf_counter()
        model(x)
        if i >= a.warmup:
            samples.append(time.perf_counter() - t)
median = statistics.median(samples)
print(json.dumps({
    "impl": f"pytorch {torch.__version__} eager" + (" channels_last" if a.channels_last else ""),
    "network": a.network, "batch_size": a.batch_size, "dtype": a.dtype, "threads": a.threads,
    "median_s": median, "images_per_s": a.batch_size / median,
}))
