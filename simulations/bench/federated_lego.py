"""Benchmark: DecentNeRF vs its FedAvg-weights ablation vs FedNeRF vs centralised, one run each.

All on crowdsourced lego (16 users x 5 views, 100x100) with equal total client steps: each
federated run does rounds x sampled users x local steps optimiser steps, the centralised
trainer does as many steps with the same samples per step on all users' photos (persons
included, as a central server that collected the photos would). Federated runs go through
Flower's simulation engine (Ray). Prints a markdown table; writes runs/bench_federated/*.

    python -m simulations.bench.federated_lego [--rounds 8] [--local-steps 32]
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path

import torch

from fedfields.config import FederatedConfig
from fedfields.data import Scene
from fedfields.data.crowd import CrowdData
from fedfields.geometry import Cameras
from fedfields.privacy.leakage import score_crowd
from fedfields.render import OccupancyGrid, render_image
from fedfields.train import TrainConfig, train
from fedfields.train.builders import global_field, render_config
from simulations import APP_DIR
from simulations.bench.devices import add_device_argument
from simulations.run import run_with_ray
from strategies import parse_app_config, strategy_class

VARIANTS = {
    "DecentNeRF": {"strategy": "decentnerf"},
    "DecentNeRF, FedAvg weights": {"strategy": "decentnerf", "alpha-lr": 0.0},
    "FedNeRF (FedAvg)": {"strategy": "fedavg"},
}


def centralised(data: CrowdData, config: FederatedConfig, steps: int) -> dict[str, float]:
    """The same global field trained on every user's photos in one place, equal steps, on
    run-config server-device (the bench's `--device`)."""
    photos = all_photos(data)
    field = global_field(config)
    settings = render_config(config, photos)
    occupancy = OccupancyGrid(field.aabb)
    train_config = TrainConfig(
        steps=steps,
        learning_rate=config.scene.learning_rate,
        target_samples=config.scene.target_samples,
        batch_rays=512,
        progress=False,
        device=config.common.server_device,
    )
    started = time.perf_counter()
    train(field, photos, train_config, settings, occupancy)
    seconds = time.perf_counter() - started
    field.eval()

    def render(scene: Scene, view: int) -> torch.Tensor:
        return render_image(field, scene.cameras, view, settings, occupancy).rgb.clamp(0, 1).cpu()

    return {**score_crowd(render, data.users), "seconds": seconds}


def all_photos(data: CrowdData) -> Scene:
    """Every user's photos as one scene (what a central server that collected them holds)."""
    first = data.users[0].scene
    return Scene(
        images=torch.cat([u.scene.images for u in data.users]),
        masks=torch.cat([u.scene.masks for u in data.users]),
        cameras=_cat_cameras([u.scene for u in data.users]),
        image_paths=tuple(p for u in data.users for p in u.scene.image_paths),
        background=first.background,
        aabb=first.aabb,
        near=first.near,
        far=first.far,
    )


def _cat_cameras(scenes: list[Scene]) -> Cameras:
    """All scenes' cameras as one set (they share one image size)."""
    first = scenes[0].cameras
    return replace(
        first,
        camera_to_world=torch.cat([s.cameras.camera_to_world for s in scenes]),
        fx=torch.cat([s.cameras.fx for s in scenes]),
        fy=torch.cat([s.cameras.fy for s in scenes]),
        cx=torch.cat([s.cameras.cx for s in scenes]),
        cy=torch.cat([s.cameras.cy for s in scenes]),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--crowd", type=Path, default=APP_DIR / "runs" / "crowd_lego_16x5_ds2")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--local-steps", type=int, default=32)
    parser.add_argument("--out", type=Path, default=APP_DIR / "runs" / "bench_federated")
    add_device_argument(parser, "the server, the Ray clients and the centralised run")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    data = CrowdData.load(str(args.crowd), 1.0)
    base = parse_app_config(
        {
            "data-dir": str(args.crowd.resolve()),
            "simulation-audit": True,
            "num-server-rounds": args.rounds,
            "local-steps": args.local_steps,
            "server-device": args.device,
        }
    )
    sampled = max(int(len(data.users) * base.scene.fraction_train), base.deployment.min_train_nodes)
    total_steps = args.rounds * sampled * args.local_steps
    parameters = sum(p.numel() for p in global_field(base).parameters())
    rows = {}
    for name, overrides in VARIANTS.items():
        stamp = time.strftime("%H%M%S")
        run_dir = args.out / f"{stamp}-{overrides['strategy']}-{overrides.get('alpha-lr', 'a')}"
        state = {"state-dir": str(run_dir.with_name(run_dir.name + ".nodes"))}
        config = {**base.to_run_config(), **overrides, "run-dir": str(run_dir), **state}
        started = time.perf_counter()
        run_with_ray(config, num_supernodes=len(data.users), client_device=args.device)
        summary = json.loads((run_dir / "summary.json").read_text())
        cost = strategy_class(overrides["strategy"]).cost_model.round_cost(parameters, sampled)
        rows[name] = {
            **summary["final"],
            "seconds": time.perf_counter() - started,
            "server-flops": cost.server_flops,
            "bytes": cost.uplink_bytes + cost.downlink_bytes,
        }
        print(name, json.dumps(rows[name]), flush=True)
    rows["Centralised (same steps)"] = {
        **centralised(data, base, total_steps),
        "server-flops": 0,
        "bytes": 0,
    }
    (args.out / "results.json").write_text(json.dumps(rows, indent=2))
    print(f"\n{total_steps} client steps in total, {parameters} federated parameters\n")
    print(
        "| run | clean PSNR | clean SSIM | personal-mask PSNR | server FLOPs/round | "
        "bytes/round | wall s |"
    )
    print("|---|---|---|---|---|---|---|")
    for name, row in rows.items():
        print(
            f"| {name} | {row['clean-psnr']:.2f} | {row['clean-ssim']:.3f} | "
            f"{row['personal-psnr']:.2f} | {row['server-flops']:.3g} | {row['bytes']:.3g} | "
            f"{row['seconds']:.0f} |"
        )


if __name__ == "__main__":
    main()
