"""Centralised training of any field on a scene: the reference for every federated run."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace
from typing import Literal

import torch
from torch import Tensor
from tqdm import tqdm

from fedfields.data.pixels import PixelSampler
from fedfields.data.scene import Scene
from fedfields.devices import resolve_device
from fedfields.fields import (
    Field,
    HashGridConfig,
    HashGridField,
    HashGridFieldConfig,
    NeRFField,
    NeRFFieldConfig,
)
from fedfields.optim import make_optimizer
from fedfields.render import OccupancyGrid, RenderConfig, render_rays
from fedfields.train.static_step import (
    STEP_MODES,
    CheckWindow,
    StaticBatch,
    StaticStep,
    StepMode,
    set_learning_rate,
    static_capacity,
    static_loss,
    static_optimizer,
)

ModelName = Literal["hashgrid", "nerf"]
HashImplementation = Literal["auto", "torch", "triton", "tcnn"]


@dataclass
class TrainConfig:
    """Budget (steps or minutes), batch, optimiser and occupancy-grid settings."""

    steps: int | None = None
    minutes: float | None = None
    batch_rays: int = 4096  # rays per step; the starting value when target_samples is set
    target_samples: int | None = None  # adapt batch_rays to ~this many field samples per step
    max_batch_rays: int = 16384
    learning_rate: float = 1e-2
    weight_decay: float = 1e-6  # on MLP weights only, as Instant-NGP
    occupancy_update_every: int = 16
    random_background: bool = True  # composite targets on random colours where alpha < 1
    device: str = "auto"  # "auto": CUDA when available (and tinycudann then serves hash grids)
    seed: int = 0
    log_every: int = 25
    progress: bool = True
    step_mode: StepMode = "dynamic"  # "static": fixed shapes, no host sync; "cuda-graph": captured

    def __post_init__(self) -> None:
        if self.step_mode not in STEP_MODES:
            raise ValueError(f"step_mode must be one of {STEP_MODES}, got {self.step_mode!r}")
        if (self.steps is None) == (self.minutes is None):
            raise ValueError("give exactly one training budget: steps or minutes")
        if self.steps is not None and self.steps <= 0:
            raise ValueError(f"steps must be positive, got {self.steps}")
        if self.minutes is not None and self.minutes <= 0:
            raise ValueError(f"minutes must be positive, got {self.minutes}")


@dataclass
class TrainResult:
    """What a run did: steps, rays and field samples processed, seconds, training curve."""

    steps: int
    rays: int
    samples: int
    seconds: float
    history: list[dict[str, float]] = field(default_factory=list)
    dropped_rays: int = 0  # static steps: rays left out of the loss (their samples overflowed)

    @property
    def rays_per_second(self) -> float:
        return self.rays / max(self.seconds, 1e-9)


@dataclass
class Setup:
    """A field with the render settings, occupancy grid and optimiser defaults that suit it."""

    field: Field
    render_config: RenderConfig
    occupancy: OccupancyGrid | None
    learning_rate: float
    batch_rays: int
    target_samples: int | None

    def train_config(self, **overrides: object) -> TrainConfig:
        """A TrainConfig with this setup's optimiser and batch defaults, then `overrides`."""
        defaults = {
            "learning_rate": self.learning_rate,
            "batch_rays": self.batch_rays,
            "target_samples": self.target_samples,
        }
        return TrainConfig(**{**defaults, **overrides})


def default_setup(
    model: ModelName, scene: Scene, implementation: HashImplementation = "auto", seed: int = 0
) -> Setup:
    """The field, renderer and optimiser defaults of `model` for `scene`'s bounds and size,
    the field's initial weights drawn from `seed` (without touching the global generator).

    hashgrid: Instant-NGP field with occupancy-grid marching and a dynamic ray batch of about
    2^16 samples, its hash grid run by `implementation`; nerf: the original 8x256 MLP with
    64 stratified + 64 hierarchical samples.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return _setup(model, scene, implementation)


def _setup(model: ModelName, scene: Scene, implementation: HashImplementation) -> Setup:
    """`default_setup`'s field and settings, drawn from the global generator."""
    aabb = tuple(scene.aabb.reshape(-1).tolist())
    base = RenderConfig(near=scene.near, far=scene.far, aabb=aabb, background=scene.background)
    if model == "hashgrid":
        extent = max(scene.aabb[1] - scene.aabb[0]).item()
        resolution = max(scene.cameras.width, scene.cameras.height)
        encoding = HashGridConfig(
            max_resolution=max(64, 4 * resolution),
            log2_hashmap_size=17,
            implementation=implementation,
        )
        return Setup(
            field=HashGridField(HashGridFieldConfig(encoding=encoding, aabb=aabb)),
            render_config=replace(base, step_size=extent * math.sqrt(3) / 256),
            occupancy=OccupancyGrid(scene.aabb),
            learning_rate=1e-2,
            batch_rays=1024,
            target_samples=1 << 16,
        )
    if model == "nerf":
        return Setup(
            field=NeRFField(NeRFFieldConfig()),
            render_config=replace(base, num_samples=64, num_importance=64),
            occupancy=None,
            learning_rate=5e-4,
            batch_rays=1024,
            target_samples=None,
        )
    raise ValueError(f"unknown model {model!r}; expected 'hashgrid' or 'nerf'")


def learning_rate_factor(progress: float) -> float:
    """Short linear warm-up, then x0.33 at 50%, 75% and 90% of the budget (nerfacc's recipe)."""
    warmup = min(1.0, 0.01 + progress / 0.02)
    return warmup * 0.33 ** sum(progress >= mark for mark in (0.5, 0.75, 0.9))


def checked_losses(losses: list[Tensor], first_step: int, what: str) -> list[float]:
    """The scalar losses of steps `first_step`, `first_step` + 1, ... read in one host sync;
    raises naming the first non-finite one (checking each step would stall a GPU each step)."""
    values = torch.stack(losses).tolist() if losses else []
    for offset, value in enumerate(values):
        if not math.isfinite(value):
            raise FloatingPointError(
                f"{what} diverged at step {first_step + offset}: loss is {value}; "
                "try a lower learning rate"
            )
    return values


def adapt_batch_rays(batch_rays: int, num_samples: int, target: int, maximum: int) -> int:
    """Next batch size so a step holds about `target` field samples (nerfacc's dynamic batch)."""
    proposed = batch_rays * target / max(num_samples, 1)
    smoothed = 0.5 * batch_rays + 0.5 * proposed
    return int(min(max(smoothed, 64), maximum))


def train(
    field: Field,
    scene: Scene,
    config: TrainConfig,
    render_config: RenderConfig,
    occupancy: OccupancyGrid | None = None,
) -> TrainResult:
    """Fit `field` to the views of `scene` with Adam on the photometric MSE.

    A dynamic step's one host sync is marching's sample count; a static step has none
    (`fedfields.train.static_step`; its batch follows `target_samples` at grid refreshes).
    Losses are checked for finiteness at log steps and at the end, naming the first bad step.
    """
    torch.manual_seed(config.seed)
    device = resolve_device(config.device)
    if config.step_mode == "cuda-graph" and device.type != "cuda":
        raise ValueError(
            f"step mode 'cuda-graph' (--cuda-graph) needs a CUDA device; this run trains on "
            f"{device}: use the static or the dynamic step"
        )
    field.to(device).train()
    scene = scene.to(device)
    if occupancy is not None:
        occupancy.to(device)
    sampler = PixelSampler(scene, config.random_background)
    static = None
    if config.step_mode == "dynamic":
        optimizer = make_optimizer(field, config.learning_rate, config.weight_decay)
    else:
        optimizer = static_optimizer(field, config.learning_rate, config.weight_decay, device)
        capacity = static_capacity(config.target_samples, config.batch_rays, render_config)

        def loss_fn(grid: OccupancyGrid | None, rays: int):
            return static_loss(field, sampler, render_config, grid, rays, capacity)

        static = StaticStep(
            loss_fn, optimizer, occupancy, config.step_mode == "cuda-graph", device=device
        )
        static_batch = StaticBatch(
            sampler, render_config, capacity, config.batch_rays, config.max_batch_rays,
            config.target_samples, occupancy,
        )  # fmt: skip
    window = CheckWindow()  # static steps' counts, still on the device
    budget_seconds = config.minutes * 60.0 if config.minutes is not None else None
    result = TrainResult(steps=0, rays=0, samples=0, seconds=0.0)
    # The bar counts steps for a step budget and seconds for a time budget.
    bar = tqdm(
        total=config.steps if budget_seconds is None else round(budget_seconds),
        unit="step" if budget_seconds is None else "s",
        desc="train",
        disable=not config.progress,
        mininterval=1.0,
    )
    batch_rays = config.batch_rays if static is None else static_batch.rays
    unchecked: list[Tensor] = []  # losses since the last finiteness check, still on the device
    start = time.perf_counter()
    while True:
        elapsed = time.perf_counter() - start
        if budget_seconds is not None:
            progress = elapsed / budget_seconds
        else:
            progress = result.steps / config.steps
        if progress >= 1.0:
            break
        set_learning_rate(optimizer, config.learning_rate * learning_rate_factor(progress))
        if occupancy is not None and result.steps % config.occupancy_update_every == 0:
            occupancy.update(field.density, render_config.step_size)
            if static is not None:
                batch_rays = static_batch.refreshed(occupancy)
        if static is None:
            batch = sampler.sample(batch_rays)
            rendered, num_samples = render_rays(
                field, batch.rays, render_config, occupancy, True, batch.background
            )
            loss = torch.nn.functional.mse_loss(rendered.rgb, batch.colors)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            result.samples += num_samples
        else:
            outputs = static(batch_rays)
            loss = outputs.loss
            window.add(outputs, batch_rays)
        unchecked.append(loss.detach())
        result.steps += 1
        result.rays += batch_rays
        ticks = result.steps if budget_seconds is None else int(time.perf_counter() - start)
        bar.update(min(ticks, bar.total) - bar.n)
        if result.steps % config.log_every == 0:
            last = checked_losses(unchecked, result.steps - len(unchecked), "training")[-1]
            unchecked.clear()
            samples_per_ray = num_samples / batch_rays if static is None else 0.0
            dropped: dict[str, int] = {}
            if static is not None:  # the window's counts, read at the loss check
                samples, dropped["dropped_rays"], window_rays = window.read()
                samples_per_ray = samples / window_rays
                result.samples += samples
                result.dropped_rays += dropped["dropped_rays"]
            record = {
                "step": result.steps,
                "seconds": time.perf_counter() - start,
                "loss": last,
                "psnr": -10.0 * math.log10(max(last, 1e-10)),
                "samples_per_ray": samples_per_ray,
                "batch_rays": batch_rays,
                **dropped,
            }
            result.history.append(record)
            bar.set_postfix(
                step=result.steps,
                psnr=f"{record['psnr']:.2f}",
                spr=f"{record['samples_per_ray']:.1f}",
            )
        if config.target_samples is not None and static is None:
            batch_rays = adapt_batch_rays(
                batch_rays, num_samples, config.target_samples, config.max_batch_rays
            )
    checked_losses(unchecked, result.steps - len(unchecked), "training")
    samples, dropped_rays, _ = window.read()
    result.samples += samples
    result.dropped_rays += dropped_rays
    result.seconds = time.perf_counter() - start
    bar.close()
    return result
