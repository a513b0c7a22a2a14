"""Benchmark: vanilla NeRF, hash-grid field and splats on lego at 100x100 for the same wall time.

Prints held-out PSNR/SSIM, training rays per second, and the MLP's achieved FLOP/s as a
fraction of a torch.matmul peak measured in the same run; for splats (issue 59's target:
at least the hash grid's PSNR in the same time) the Gaussian count and bytes instead. Not a
test: it takes minutes.

    .venv/bin/python -m simulations.bench.lego_fields --minutes 10
    .venv/bin/python -m simulations.bench.lego_fields --minutes 10 --models hashgrid splats
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from fedfields.data import holdout_indices, load_scene
from fedfields.devices import resolve_device
from fedfields.metrics import linear_flops_per_sample, matmul_peak_flops
from fedfields.train import default_setup, evaluate, train
from fedfields.train.splats import SplatTrainConfig, splat_render_config, train_splats
from simulations import APP_DIR
from simulations.bench.devices import add_device_argument


def run_model(
    model: str, minutes: float, train_scene, test_scene, peak: float, device: str
) -> dict:
    """Train one model for `minutes` on `device`, evaluate on the held-out views (on the
    field's device), return its figures."""
    if model == "splats":
        return run_splats(minutes, train_scene, test_scene, device)
    torch.manual_seed(0)
    setup = default_setup(model, train_scene)
    config = setup.train_config(minutes=minutes, progress=False, device=device)
    result = train(setup.field, train_scene, config, setup.render_config, setup.occupancy)
    evaluation = evaluate(
        setup.field, test_scene, setup.render_config, setup.occupancy, progress=False
    )
    # Forward + backward of a dense layer costs about 3x its forward multiply-adds.
    mlp_flops = 3 * linear_flops_per_sample(setup.field) * result.samples
    achieved = mlp_flops / result.seconds
    return {
        "model": model,
        "steps": result.steps,
        "psnr": round(evaluation.psnr, 2),
        "ssim": round(evaluation.ssim, 4),
        "lpips": evaluation.lpips,
        "rays_per_second": round(result.rays_per_second),
        "samples_per_ray": round(result.samples / max(result.rays, 1), 1),
        "mlp_gflops": round(achieved / 1e9, 2),
        "mlp_fraction_of_matmul_peak": round(achieved / peak, 4),
    }


def run_splats(minutes: float, train_scene, test_scene, device: str) -> dict:
    """Splats (`fedfields.train.splats`: the torch rasteriser on CPU, gsplat's on CUDA) for
    `minutes` on `device`, scored like the others; the count and bytes of their Gaussians."""
    config = SplatTrainConfig(steps=30_000, seconds=60.0 * minutes)
    steps: list[int] = []
    field = train_splats(
        train_scene, config, on_step=lambda step, *_: steps.append(step),
        device=resolve_device(device),
    )  # fmt: skip
    render_config = splat_render_config(train_scene)
    evaluation = evaluate(field, test_scene, render_config, None, progress=False)
    return {
        "model": "splats",
        "steps": len(steps),
        "psnr": round(evaluation.psnr, 2),
        "ssim": round(evaluation.ssim, 4),
        "lpips": evaluation.lpips,
        "gaussians": field.config.count,
        "megabytes": round(sum(p.numel() * p.element_size() for p in field.parameters()) / 1e6, 2),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scene", type=Path, default=APP_DIR / "data" / "lego")
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--downscale", type=float, default=2.0)
    parser.add_argument("--holdout", type=int, default=8)
    parser.add_argument(
        "--models", nargs="+", choices=["nerf", "hashgrid", "splats"], default=["nerf", "hashgrid"]
    )
    add_device_argument(parser, "training and evaluation")
    args = parser.parse_args(argv)
    scene = load_scene(args.scene, downscale=args.downscale)
    train_ids, test_ids = holdout_indices(len(scene), args.holdout)
    train_scene, test_scene = scene.subset(train_ids), scene.subset(test_ids)
    peak = matmul_peak_flops()
    print(f"torch.matmul peak: {peak / 1e9:.1f} GFLOP/s, threads: {torch.get_num_threads()}")
    print(
        f"{len(train_ids)} training / {len(test_ids)} held-out views at "
        f"{scene.cameras.width}x{scene.cameras.height}, {args.minutes} min per model"
    )
    rows = []
    for model in args.models:
        rows.append(run_model(model, args.minutes, train_scene, test_scene, peak, args.device))
        print(json.dumps(rows[-1]), flush=True)
    if len(rows) == 2 and "splats" in args.models:
        gap = rows[-1]["psnr"] - rows[0]["psnr"]
        print(f"{rows[-1]['model']} - {rows[0]['model']} held-out PSNR: {gap:+.2f} dB")
    elif len(rows) == 2:
        ratio = rows[1]["rays_per_second"] / max(rows[0]["rays_per_second"], 1)
        print(f"{rows[1]['model']} / {rows[0]['model']} rays per second: {ratio:.1f}x")


if __name__ == "__main__":
    main()
