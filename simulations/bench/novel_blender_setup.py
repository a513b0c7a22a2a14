"""The Novel Blender bench's common ground: each method's settings, the crowd's render settings
and personal fields, the scores of a server field and of personal content, and the centralised
NeRF-W run; what the CLI (`simulations.bench.novel_blender`), the in-process federation
(`simulations.bench.novel_blender_federation`) and the GPU bench share. No Flower here."""

from __future__ import annotations

import json
import time
import tomllib
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch
from torch import Tensor
from tqdm.auto import tqdm

from fedfields.config import FederatedConfig
from fedfields.config.schema import SceneSection
from fedfields.data import Scene
from fedfields.data.crowd import CrowdData, CrowdUser
from fedfields.fields import Field
from fedfields.fields.encodings import HashGridConfig
from fedfields.fields.personal import PersonalField, PersonalFieldConfig
from fedfields.metrics import psnr, ssim
from fedfields.render import OccupancyGrid, RenderConfig, render_image
from fedfields.train.builders import client_seed, global_field
from fedfields.train.builders import render_config as default_render_config
from fedfields.train.federated import (
    LocalTrainConfig,
    federated_state,
    local_train,
)
from fedfields.train.static_step import StepMode

METHODS = ("centralised", "fednerf", "decentnerf-l", "decentnerf")
LABELS = {
    "centralised": "Centralised NeRF-W (all photos)",
    "fednerf": "FedNeRF (FedAvg, global field only)",
    "decentnerf-l": "DecentNeRF(-L) (FedAvg weights)",
    "decentnerf": "DecentNeRF (learned alpha)",
}
OCCUPANCY_PASSES = 2
STEP_SCALE = {"value": 1.0}
"""Marching step relative to the App's default, set once from --step-scale for every method."""


def personal_field(num_images: int, aabb: Tensor, log2_hashmap_size: int = 13) -> PersonalField:
    """A user's personal field, lighter than the App's (6 levels up to 128, 2^13 entries per
    level by default): persons span 10-20 pixels of the 50x50 views this benchmark affords."""
    encoding = HashGridConfig(num_levels=6, log2_hashmap_size=log2_hashmap_size,
                              max_resolution=128)  # fmt: skip
    config = PersonalFieldConfig(num_images=num_images, encoding=encoding,
                                 aabb=tuple(aabb.flatten().tolist()))  # fmt: skip
    return PersonalField(config)


def render_config(config: FederatedConfig, scene: Scene | None) -> RenderConfig:
    """The App's render settings with the benchmark's marching step."""
    settings = default_render_config(config, scene)
    return replace(settings, step_size=settings.step_size * STEP_SCALE["value"])


@dataclass(frozen=True)
class Settings:
    """The budget and losses shared by every method of one benchmark run."""

    rounds: int = 30
    epochs: float = 1.0  # local passes over a user's pixels per round
    max_steps: int = 400  # cap on local steps per round
    learning_rate: float = 1e-2
    personal_learning_rate: float = SceneSection.personal_learning_rate  # the App's default
    target_samples: int = 1 << 14
    beta_min: float = SceneSection.beta_min  # the App's default (NeRF-W's is 0.03)
    transient_density_weight: float = 0.01
    alpha_lr: float = 1.0
    gradient_rays: int = 4096
    central_transient_log2_hashmap: int = 13  # 17: the hash entries of sixteen users' fields
    fixed_alphas: tuple[float, ...] | None = None  # DecentNeRF(-L)'s weights; None: all 1
    seed: int = 0
    run_config: dict[str, Any] = field(default_factory=dict)
    device: str = "auto"  # every user's local training and every render (the field's device)
    step_mode: StepMode = "dynamic"  # local steps (run-config cuda-graph: "cuda-graph")

    def local(self, round_: int, user: int, personal: bool) -> LocalTrainConfig:
        """One user's round: about `epochs` passes, NeRF-W loss when it has a personal field."""
        return LocalTrainConfig(
            steps=self.max_steps,
            epochs=self.epochs,
            learning_rate=self.learning_rate,
            personal_learning_rate=self.personal_learning_rate,
            target_samples=self.target_samples,
            personal_density_weight=self.transient_density_weight if personal else 0.0,
            beta_min=self.beta_min,
            seed=client_seed(self.seed, user, round_),
            device=self.device,
            step_mode=self.step_mode,
        )


def eval_views(data: CrowdData) -> list[tuple[int, int]]:
    """(user, view) pairs scored every round: each user's view with the most personal pixels."""
    return [
        (index, int(user.personal_masks.flatten(1).sum(1).argmax()))
        for index, user in enumerate(data.users)
    ]


def render(field: Field, scene: Scene, view: int, config: FederatedConfig, grid: OccupancyGrid):
    """[H, W, 3] render of a scene's view on the field's device, clamped, on the CPU."""
    settings = render_config(config, scene)
    return render_image(field, scene.cameras, view, settings, grid).rgb.clamp(0.0, 1.0).cpu()


def fresh_grid(field: Field, config: FederatedConfig) -> OccupancyGrid:
    """An occupancy grid built from a field's density alone (what any holder of it can do)."""
    grid = OccupancyGrid(field.aabb)
    step = render_config(config, None).step_size
    for _ in range(OCCUPANCY_PASSES):
        grid.update(field.density, step)
    return grid


def personal_psnr(image: Tensor, user: CrowdUser, view: int) -> float:
    """PSNR inside the user's personal-content mask against the photo (higher: more leaked)."""
    return psnr(image, user.scene.images[view], user.personal_masks[view])


def floor_psnr(user: CrowdUser, view: int) -> float:
    """The same for the clean view: what a field that renders no person scores."""
    return psnr(user.clean_images[view], user.scene.images[view], user.personal_masks[view])


def score_server_field(
    field: Field, data: CrowdData, config: FederatedConfig, views: list[tuple[int, int]] | None
) -> dict[str, float]:
    """Clean-view PSNR/SSIM and personal-content PSNR with its floor over `views` (None: all)."""
    grid = fresh_grid(field, config)
    pairs = views or [(u, v) for u, user in enumerate(data.users) for v in range(len(user.scene))]
    renders, cleans, personal, floors = [], [], [], []
    for u, v in pairs:
        user = data.users[u]
        image = render(field, user.scene, v, config, grid)
        renders.append(image)
        cleans.append(user.clean_images[v])
        personal.append(personal_psnr(image, user, v))
        floors.append(floor_psnr(user, v))
    return {
        "clean-psnr": float(np.mean([psnr(r, c) for r, c in zip(renders, cleans, strict=True)])),
        "clean-ssim": ssim(torch.stack(renders), torch.stack(cleans)),
        "personal-psnr": float(np.mean(personal)),
        "personal-floor": float(np.mean(floors)),
    }


def run_centralised(data: CrowdData, config: FederatedConfig, settings: Settings) -> dict[str, Any]:
    """NeRF-W on all photos: one global + personal (transient) field, `rounds` epochs, each
    one `local_train` call (Adam restarts per epoch, as a user's does per round)."""
    # Imported here: federated_lego imports Flower, which this module's federated path (and
    # simulations.bench.gpu, run where Flower is absent) does without.
    from simulations.bench.federated_lego import all_photos

    torch.manual_seed(settings.seed)
    photos = all_photos(data)
    model = global_field(config)
    personal = personal_field(len(photos), model.aabb, settings.central_transient_log2_hashmap)
    grid = OccupancyGrid(model.aabb)
    per_round_views = eval_views(data)
    history: list[dict[str, Any]] = []
    started = time.perf_counter()
    train_seconds, rays = 0.0, 0
    for epoch in tqdm(range(1, settings.rounds + 1), desc="centralised"):
        local = replace(settings.local(epoch, 0, True), steps=settings.max_steps * len(data.users))
        tick = time.perf_counter()
        result = local_train(model, photos, local, render_config(config, photos), grid,
                             personal_field=personal)  # fmt: skip
        train_seconds += time.perf_counter() - tick
        rays += result.rays
        model.eval()
        record = {"round": epoch, **score_server_field(model, data, config, per_round_views)}
        model.train()
        record["seconds"] = time.perf_counter() - started
        history.append(record)
        tqdm.write(json.dumps(record))
    wall = time.perf_counter() - started
    model.eval()
    final = score_server_field(model, data, config, None)
    return {
        "method": "centralised",
        "history": history,
        "final": final,
        "wall-seconds": wall,
        "train-seconds": train_seconds,
        "rays-per-second": rays / max(train_seconds, 1e-9),
        "server-flops-per-round": 0,
        "bytes-per-round": 0,
        "alphas": [],
        "transient-parameters": sum(p.numel() for p in personal.parameters()),
        "state": federated_state(model),
    }


def parse_run_config(text: str) -> dict[str, Any]:
    """'key=value key=value' (values as TOML scalars) into a dict."""
    return tomllib.loads("\n".join(text.split())) if text.strip() else {}
