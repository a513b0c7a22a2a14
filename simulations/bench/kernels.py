"""Benchmark: the triton kernels against the torch backend on one device (issue 34).

Times one forward + backward of the hash grid (Instant-NGP's sizes by default: 16 levels,
2^19 rows a level, finest resolution 2048) and of the compositing of packed samples, each on
both backends with the same weights and inputs, and prints one table: median milliseconds
per backend, the speed-up and the largest difference of the outputs and gradients. Triton
runs on CUDA tensors, or on CPU ones when TRITON_INTERPRET=1 is set (slowly: shrink the sizes).

    python -m simulations.bench.kernels [--device cuda] [--points 262144] [--rays 16384]
        [--samples-per-ray 16] [--repeats 20]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from functools import partial

import torch
from torch import Tensor

from fedfields.fields import HashGridConfig, HashGridEncoding
from fedfields.fields.encodings import triton_runs_on
from fedfields.render.volume import render_packed

Step = Callable[[], list[Tensor]]


def median_ms(step: Step, device: torch.device, repeats: int) -> float:
    """Median wall time of `step` after two warm-up calls (Triton compiles on the first)."""
    for _ in range(2):
        step()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def hash_grid_step(points: int, device: torch.device, backend: str) -> Step:
    """Features of random points and the table gradient of a fixed cotangent (same weights on
    every backend)."""
    generator = torch.Generator().manual_seed(0)
    coordinates = torch.rand(points, 3, generator=generator).to(device)
    encoding = HashGridEncoding(HashGridConfig(implementation=backend))  # type: ignore[arg-type]
    with torch.no_grad():
        encoding.table.uniform_(-1.0, 1.0, generator=generator)
    encoding.to(device)
    cotangent = torch.randn(points, encoding.out_dim, generator=generator).to(device)

    def step() -> list[Tensor]:
        features = encoding(coordinates)
        (grad,) = torch.autograd.grad((features * cotangent).sum(), encoding.table)
        return [features, grad]

    return step


def compositing_step(rays: int, per_ray: int, device: torch.device, backend: str) -> Step:
    """Rendered colour, depth, opacity and the density and colour gradients of a loss."""
    generator = torch.Generator().manual_seed(1)
    counts = torch.randint(0, 2 * per_ray + 1, (rays,), generator=generator)
    samples = int(counts.sum())
    ray_index = torch.repeat_interleave(torch.arange(rays), counts).to(device)
    densities = (torch.rand(samples, generator=generator) * 5).to(device).requires_grad_()
    rgb = torch.rand(samples, 3, generator=generator).to(device).requires_grad_()
    deltas = torch.full((samples,), 0.02, device=device)
    t_mid = torch.rand(samples, generator=generator).to(device) + 2.0
    target = torch.rand(rays, 3, generator=generator).to(device)
    background = torch.ones(3, device=device)

    def step() -> list[Tensor]:
        rendered, _ = render_packed(
            densities,
            deltas,
            rgb,
            t_mid,
            ray_index,
            rays,
            background,
            backend,  # type: ignore[arg-type]
        )
        loss = ((rendered.rgb - target) ** 2).sum() + rendered.depth.sum()
        grads = torch.autograd.grad(loss, [densities, rgb])
        return [rendered.rgb, rendered.depth, rendered.opacity, *grads]

    return step


def compare(name: str, make_step: Callable[[str], Step], device: torch.device, repeats: int) -> str:
    """One table row: each backend's median time, the speed-up and the largest difference."""
    reference = make_step("torch")
    torch_ms = median_ms(reference, device, repeats)
    if not triton_runs_on(device):
        return f"| {name} | {torch_ms:.2f} | n/a (needs CUDA or TRITON_INTERPRET=1) | | |"
    kernels = make_step("triton")
    triton_ms = median_ms(kernels, device, repeats)
    difference = max(
        float((a - b).detach().abs().max()) if a.numel() else 0.0
        for a, b in zip(reference(), kernels(), strict=True)
    )
    return (
        f"| {name} | {torch_ms:.2f} | {triton_ms:.2f} | {torch_ms / triton_ms:.1f}x "
        f"| {difference:.1e} |"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m simulations.bench.kernels")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--points", type=int, default=1 << 18, help="hash-grid points")
    parser.add_argument("--rays", type=int, default=1 << 14, help="rays to composite")
    parser.add_argument("--samples-per-ray", type=int, default=16, help="mean samples per ray")
    parser.add_argument("--repeats", type=int, default=20, help="timed calls per backend")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"device: {name}; forward + backward, median of {args.repeats}")
    print("| kernel | torch ms | triton ms | speed-up | max abs difference |")
    print("|---|---|---|---|---|")
    hash_name = f"hash grid, {args.points} points x 16 levels"
    hash_grid = partial(hash_grid_step, args.points, device)
    print(compare(hash_name, hash_grid, device, args.repeats))
    composite_name = f"packed compositing, {args.rays} rays x ~{args.samples_per_ray} samples"
    composite = partial(compositing_step, args.rays, args.samples_per_ray, device)
    print(compare(composite_name, composite, device, args.repeats))


if __name__ == "__main__":
    main()
