"""MiniMax-M3's vision side at the published width: a step's images encoded together, against one
at a time (what the engine's ``MultimodalEncoder`` saves by batching them), on CUDA.

The tower: hidden 1280, 32 layers of 16 heads, MLP 5120, patches of 14 pixels merged 2 x 2, the
projector and patch merge to the text width 6144; bf16, random weights built on the device. The
images are ``--size`` pixels square (448: 32 x 32 patches, 256 image tokens each). For each count
of images the table gives milliseconds per image encoded together (one ``encode_images`` call for
all) and one by one, their ratio, and image tokens per second encoded together.

    python benchmarks/bench_vision.py [--images 1,4,16] [--size 448] [--iters 5]
    python benchmarks/bench_vision.py --device cpu --tiny   # the code path, not a measurement
"""

from __future__ import annotations

import argparse
import time

import torch
from bench_common import machine_name, sync_device

from tensorrt_llm._torch.models.modeling_minimaxm3_vision import (
    MiniMaxM3MultiModalProjector,
    MiniMaxM3VisionConfig,
    MiniMaxM3VisionModel,
)

TINY = dict(
    hidden_size=24,
    intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=2,
    projector_hidden_size=32,
    text_hidden_size=32,
)


class Encoder(torch.nn.Module):
    def __init__(self, cfg: MiniMaxM3VisionConfig) -> None:
        super().__init__()
        self.tower = MiniMaxM3VisionModel(cfg)
        self.projector = MiniMaxM3MultiModalProjector(cfg)

    @torch.inference_mode()
    def forward(self, patches: torch.Tensor, grids: list) -> torch.Tensor:
        return self.projector(self.tower(patches, grids))


def seconds(fn, device: str, iters: int) -> float:
    """Median wall time of ``fn()`` (synchronized) over ``iters`` runs, after one warm-up."""
    fn()
    samples = []
    for _ in range(iters):
        sync_device(device)
        start = time.perf_counter()
        fn()
        sync_device(device)
        samples.append(time.perf_counter() - start)
    return sorted(samples)[len(samples) // 2]


def measure(encoder: Encoder, patches: torch.Tensor, grid: tuple, count: int, args) -> dict:
    """Milliseconds per image: all ``count`` images in one call, then one call each."""
    singles = patches.split(patches.shape[0] // count)
    together = seconds(lambda: encoder(patches, [grid] * count), args.device, args.iters)
    apart = seconds(lambda: [encoder(p, [grid]) for p in singles], args.device, args.iters)
    return {
        "images": count,
        "together_ms": 1e3 * together / count,
        "apart_ms": 1e3 * apart / count,
        "ratio": apart / together,
    }


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", default="1,4,16")
    parser.add_argument("--size", type=int, default=448)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--tiny", action="store_true", help="a tiny tower (a test of the code)")
    args = parser.parse_args(argv)
    cfg = MiniMaxM3VisionConfig(**TINY) if args.tiny else MiniMaxM3VisionConfig()
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    encoder = Encoder(cfg).to(args.device, dtype).eval()
    side = args.size // cfg.patch_size
    grid = (1, side, side)
    patch_dim = cfg.num_channels * cfg.temporal_patch_size * cfg.patch_size**2
    tokens_per_image = side * side // cfg.merge_area
    print(
        f"# {machine_name(args.device)}; vision tower {cfg.hidden_size} x {cfg.num_hidden_layers}"
    )
    print(f"# images of {args.size} px: {side} x {side} patches, {tokens_per_image} tokens each")
    print("| images | together ms/image | one by one ms/image | one by one / together | tokens/s |")
    print("| --- | --- | --- | --- | --- |")
    rows = []
    for count in (int(n) for n in args.images.split(",")):
        patches = torch.randn(count * side * side, patch_dim, device=args.device, dtype=dtype)
        row = measure(encoder, patches, grid, count, args)
        row["tokens_per_s"] = count * tokens_per_image * 1e3 / (row["together_ms"] * count)
        rows.append(row)
        print(
            f"| {count} | {row['together_ms']:.2f} | {row['apart_ms']:.2f} | {row['ratio']:.2f} "
            f"| {row['tokens_per_s']:.0f} |"
        )
    return rows


if __name__ == "__main__":
    main()
