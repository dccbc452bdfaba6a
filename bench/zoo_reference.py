#!/usr/bin/env python3
"""Count torchvision's classifiers the way `workshop models` does, for tests/fixtures/zoo-reference.json.

For each network: learned parameters, floating-point state_dict entries, and the
multiply-accumulates of one 224x224 image (ViT: its own size) in Conv2d and Linear modules
(forward hooks) plus, for each nn.MultiheadAttention, what it computes without calling its
submodules: the input projection (3 x T x D x D), the two attention products (2 x T x T x D)
and the output projection (T x D x D); likewise Swin's shifted window attention, per token of
its padded grid against the w x w keys of its window (Swin V2's position-bias MLP, which
depends on the weights only, is left out: it is not work per image), and MaxViT's partition
attention's two products (2 x P x P x C per partition of P tokens; its projections are Linear
modules). Random weights; nothing is downloaded.

    python3 bench/zoo_reference.py NAME ... > /tmp/new.json   # merge by hand, or
    python3 bench/zoo_reference.py --write NAME ...            # update the committed file

Needs torch and torchvision (any recent version; the file says which one counted).
"""

import json
import pathlib
import sys

import torch
import torchvision

# The input size of torchvision's weights for networks that take any size (their transforms'
# crop); a ViT carries its own (`image_size`).
SIZES = {"efficientnet_b1": 240, "efficientnet_b2": 288, "efficientnet_b3": 300, "efficientnet_b4": 380,
         "efficientnet_b5": 456, "efficientnet_b6": 528, "efficientnet_b7": 600,
         "efficientnet_v2_s": 384, "efficientnet_v2_m": 480, "efficientnet_v2_l": 480,
         "inception_v3": 299, "swin_v2_t": 256, "swin_v2_s": 256, "swin_v2_b": 256}

FIXTURE = pathlib.Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "zoo-reference.json"


def count(name):
    model = torchvision.models.get_model(name, weights=None).eval()
    size = getattr(model, "image_size", SIZES.get(name, 224))
    macs = 0

    def conv(m, _inp, out):
        nonlocal macs
        macs += out.numel() * (m.in_channels // m.groups) * m.kernel_size[0] * m.kernel_size[1]

    def linear(m, _inp, out):
        nonlocal macs
        macs += out.numel() * m.in_features

    def attention(m, inp, _out):
        nonlocal macs
        q = inp[0]  # (N, T, D) with batch_first
        t, d = q.shape[-2], q.shape[-1]
        macs += 3 * t * d * d + 2 * t * t * d + t * d * d

    def windows(m, inp, _out):
        # Swin calls F.linear with its projections' weights (no module hooks fire): per token
        # of the grid padded to whole windows, q/k/v (3·C²) and output (C²) projections, and
        # q·kᵀ and weights·v against its window's keys (2·w²·C).
        nonlocal macs
        b, h, w, c = inp[0].shape
        wh, ww = m.window_size
        tokens = b * (-(-h // wh) * wh) * (-(-w // ww) * ww)
        macs += tokens * 4 * c * c + 2 * tokens * wh * ww * c

    def partitions(m, inp, _out):
        # MaxViT: q·kᵀ and weights·v within each partition (its projections are hooked Linears).
        nonlocal macs
        b, g, p, c = inp[0].shape
        macs += 2 * b * g * p * p * c

    swa = torchvision.models.swin_transformer.ShiftedWindowAttention  # V2 derives from it
    rpa = torchvision.models.maxvit.RelativePositionalMultiHeadAttention
    # Swin V2's position-bias MLP (cpb_mlp) reads only weights: it runs once per forward pass
    # whatever the batch, and the engine folds it when it loads them, so it is not per image.
    folded = {id(l) for m in model.modules() if hasattr(m, "cpb_mlp") for l in m.cpb_mlp.modules()}
    for m in model.modules():
        if id(m) in folded:
            continue
        if isinstance(m, swa):
            m.register_forward_hook(windows)
        if isinstance(m, rpa):
            m.register_forward_hook(partitions)
        if isinstance(m, torch.nn.Conv2d):
            m.register_forward_hook(conv)
        elif isinstance(m, torch.nn.MultiheadAttention):
            m.register_forward_hook(attention)
        elif isinstance(m, torch.nn.Linear) and not isinstance(
            m, torch.nn.modules.linear.NonDynamicallyQuantizableLinear
        ):
            m.register_forward_hook(linear)
    with torch.no_grad():
        model(torch.zeros(1, 3, size, size))
    return {
        "params": sum(p.numel() for p in model.parameters()),
        "state_dict_floats": sum(t.numel() for t in model.state_dict().values() if t.is_floating_point()),
        "macs_per_image": macs,
        "input_size": size,
    }


def main():
    args = sys.argv[1:]
    write = "--write" in args
    names = [a for a in args if a != "--write"]
    data = json.loads(FIXTURE.read_text()) if FIXTURE.exists() else {"models": {}}
    data["source"] = (
        f"torchvision {torchvision.__version__.split('+')[0]} model definitions, counted by bench/zoo_reference.py "
        "(Conv2d + Linear MACs by forward hooks, attention analytically; batch 1 at the model's input size)"
    )
    for name in names:
        data["models"][name] = count(name)
        print(f"{name}: {data['models'][name]}", file=sys.stderr)
    text = json.dumps(data, indent=1) + "\n"
    if write:
        FIXTURE.write_text(text)
    else:
        sys.stdout.write(text)


if __name__ == "__main__":
    main()
