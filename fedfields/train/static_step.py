"""A training step of fixed shapes and no host sync, optionally captured once as a CUDA graph.

The dynamic step (`centralised.train`, `federated.local_train`) lets marching's sample count
set every later shape: one `nonzero` per step, so the host waits for the GPU. Here the ray
batch is fixed per shape and marching fills `capacity` sample slots with a mask
(`OccupancyGrid.march_fixed`); rays whose samples overflow the slots are left out of the loss
and counted (`StepOutputs.dropped_rays`). Every constant sits on the field's device, Adam is
fused (capturable on CUDA, with tensor learning rates) and nothing is read back inside the
step. Given the same random draws, its loss and gradients are the dynamic step's
(tests/test_host_syncs.py): a global field's MSE, DecentNeRF's global+personal composite
under NeRF-W's loss (`PersonalLoss`: over the complete rays and the filled slots), and
a method's corrected gradients (`StaticStep.after_backward`).

`cuda_graph`: the first `WARMUP_STEPS` steps of a shape run eagerly on a side stream (Triton
compiles, Adam makes its state), the next one captures the step (torch.cuda.graphs, one
private memory pool per shape) and every later one replays it; the random draws advance at
each replay. The batch is sized at each refresh of the occupancy grid from fixed probe rays
marched through it (`StaticBatch`), on a short ladder (`static_batch_rays`), so few shapes
are ever captured. `fedfields.train.federated.StepGraphs` keeps a node's steps and their
graphs across users and rounds, refilling the tensors they read in place, so each shape is
captured once per node process rather than once per user and round.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from fedfields.data.pixels import PixelSampler
from fedfields.fields import Field
from fedfields.geometry.rays import intersect_aabb
from fedfields.methods.base import ClientHook
from fedfields.optim import adam_groups
from fedfields.render import OccupancyGrid, RenderConfig, render_rays
from fedfields.render.renderer import render_rays_fixed
from fedfields.train.nerfw import PersonalLoss, local_loss

StepMode = Literal["dynamic", "static", "cuda-graph"]
STEP_MODES: tuple[StepMode, ...] = ("dynamic", "static", "cuda-graph")
WARMUP_STEPS = 2
OVERFLOW_SIGMAS = 3.0
"""A batch's expected samples plus this many standard deviations fit the capacity."""
CAPACITY_HEADROOM = 4 / 3
"""Sample slots per `target_samples`: the sigma margin and the ladder fill about 3/4 of them,
so a step holds about `target_samples` samples, as the dynamic step does (its padding slots
are computed too)."""
PROBE_RAYS = 2048
"""Rays of the `SampleProbe` that sizes the batch at each grid refresh."""
LADDER_STEPS_PER_OCTAVE = 4
MIN_BATCH_RAYS = 64
"""The ladder's lowest rung; the capacity always holds its worst case (`static_capacity`)."""


@dataclass
class StepOutputs:
    """What one step leaves on the device; read back only at the caller's checks."""

    loss: Tensor  # [] the optimised loss (photometric, plus the client hooks' terms)
    photometric: Tensor  # [] mean squared colour error over the complete rays
    samples: Tensor | int  # [] int64 occupied samples marching found (before the cap); the
    # dynamic step's is the host int its marching read back anyway
    dropped_rays: Tensor | int  # [] int64 rays left out of the loss: their samples overflowed


class CheckWindow:
    """Steps' sample and dropped-ray counts since the last check: a static step's kept on the
    device and read together in one host sync (`read`), a dynamic step's host ints summed as
    they come; with the rays the steps drew (host ints)."""

    def __init__(self) -> None:
        self.samples: list[Tensor] = []
        self.dropped: list[Tensor] = []
        self.host_samples = self.host_dropped = self.rays = 0

    def add(self, outputs: StepOutputs, rays: int) -> None:
        for value, device, host in (
            (outputs.samples, self.samples, "host_samples"),
            (outputs.dropped_rays, self.dropped, "host_dropped"),
        ):
            if isinstance(value, int):
                setattr(self, host, getattr(self, host) + value)
            else:
                device.append(value)
        self.rays += rays

    def read(self) -> tuple[int, int, int]:
        """(samples, dropped rays, rays drawn) of the window's steps, then an empty window."""
        samples, dropped = self.host_samples, self.host_dropped
        if self.samples:
            counts = torch.stack([torch.stack(self.samples), torch.stack(self.dropped)])
            device_samples, device_dropped = (int(total) for total in counts.sum(dim=1).tolist())
            samples, dropped = samples + device_samples, dropped + device_dropped
        rays, self.rays = self.rays, 0
        self.host_samples = self.host_dropped = 0
        self.samples.clear()
        self.dropped.clear()
        return samples, dropped, rays


def static_optimizer(
    module: torch.nn.Module, learning_rate: float, weight_decay: float, device: torch.device
) -> torch.optim.Adam:
    """`fedfields.optim.make_optimizer`'s Adam, fused, with one learning-rate tensor per group
    on `device` and capturable state on CUDA: its step reads nothing back."""
    groups = [
        {**group, "lr": torch.tensor(learning_rate, device=device)}
        for group in adam_groups(module, weight_decay)
    ]
    return torch.optim.Adam(
        groups, betas=(0.9, 0.99), eps=1e-15, fused=True, capturable=device.type == "cuda"
    )


def set_learning_rate(optimizer: torch.optim.Optimizer, value: float) -> None:
    """Every group's learning rate: in place where it is a tensor (a captured step reads it)."""
    for group in optimizer.param_groups:
        if isinstance(group["lr"], Tensor):
            group["lr"].fill_(value)
        else:
            group["lr"] = value


def static_batch_rays(mean: float, std: float, capacity: int, maximum: int) -> int:
    """The largest rung of 2^(k/4) in [MIN_BATCH_RAYS, `maximum`] whose B rays, each with
    `mean` ± `std` samples drawn independently, fit the capacity with OVERFLOW_SIGMAS to spare:
    B * mean + OVERFLOW_SIGMAS * sqrt(B) * std <= capacity (few distinct shapes)."""
    if mean <= 0:
        return maximum
    margin = OVERFLOW_SIGMAS * std
    root = (-margin + math.sqrt(margin**2 + 4.0 * mean * capacity)) / (2.0 * mean)  # sqrt(B)
    wanted = max(root**2, MIN_BATCH_RAYS)
    rung = math.floor(LADDER_STEPS_PER_OCTAVE * math.log2(wanted) + 1e-9)
    return max(MIN_BATCH_RAYS, min(int(2 ** (rung / LADDER_STEPS_PER_OCTAVE)), maximum))


def max_samples_per_ray(render_config: RenderConfig) -> int:
    """The most samples marching gives one ray: every step of `march_fixed`'s fixed count
    (the longest interval in the box, +1), reached where the grid is fully occupied."""
    return math.ceil(render_config.max_ray_length / render_config.step_size) + 1


def static_capacity(
    target_samples: int | None, batch_rays: int, render_config: RenderConfig
) -> int:
    """Sample slots of a static step: CAPACITY_HEADROOM x `target_samples`, else every step
    of `batch_rays` rays (a fixed batch then never overflows); at least MIN_BATCH_RAYS rays'
    worst case, so the ladder's lowest rung never overflows."""
    worst = max_samples_per_ray(render_config)
    if target_samples is None:
        return batch_rays * worst
    return max(math.ceil(CAPACITY_HEADROOM * target_samples), MIN_BATCH_RAYS * worst)


class SampleProbe:
    """Fixed rays through evenly spaced pixels of every view, marched without jitter: the
    samples per ray that batches drawn from the same pixels meet in the current grid."""

    def __init__(self, sampler: PixelSampler, render_config: RenderConfig, count: int) -> None:
        num_pixels, device = sampler.num_pixels, sampler.colors.device
        count = min(count, num_pixels)
        self.rays = sampler.rays(torch.arange(count, device=device) * num_pixels // count)
        self.t_near, self.t_far = intersect_aabb(
            self.rays, render_config.aabb_on(device), render_config.near, render_config.far
        )
        self.render_config = render_config

    def moments(self, grid: OccupancyGrid) -> tuple[float, float]:
        """Mean and standard deviation of the probe rays' samples in `grid`: one host read."""
        counts = grid.samples_per_ray(
            self.rays, self.t_near, self.t_far, self.render_config.step_size,
            self.render_config.max_ray_length,
        ).float()  # fmt: skip
        mean, std = torch.stack([counts.mean(), counts.std(correction=0)]).tolist()
        return mean, std


class StaticBatch:
    """The static step's ray batch: re-sized at every refresh of the occupancy grid, the only
    time the samples per ray change, from a probe marched through the refreshed grid (one host
    read per refresh), so that a batch overflows the capacity at about OVERFLOW_SIGMAS sigmas.

    Without `target_samples` the capacity holds `batch_rays` rays' worst case and the batch
    stays; without a grid the stratified sample count and the target set it once.
    """

    def __init__(
        self,
        sampler: PixelSampler,
        render_config: RenderConfig,
        capacity: int,
        batch_rays: int,
        maximum: int,
        target_samples: int | None,
        occupancy: OccupancyGrid | None,
    ) -> None:
        self.capacity, self.maximum, self.rays = capacity, maximum, batch_rays
        self.probe = None
        if target_samples is None:
            return
        if occupancy is None:  # nothing overflows: the dynamic step's batch, on the ladder
            per_ray = render_config.num_samples + render_config.num_importance
            self.rays = static_batch_rays(per_ray, 0.0, target_samples, maximum)
        else:
            self.probe = SampleProbe(sampler, render_config, PROBE_RAYS)

    def stepped(self, outputs: StepOutputs) -> None:
        """Nothing between refreshes: a static batch changes only when the grid does."""

    def refreshed(self, grid: OccupancyGrid) -> int:
        """The batch for the steps until the next refresh of `grid` (just refreshed)."""
        if self.probe is not None:
            mean, std = self.probe.moments(grid)
            self.rays = static_batch_rays(mean, std, self.capacity, self.maximum)
        return self.rays


def static_loss(
    field: Field,
    sampler: PixelSampler,
    render_config: RenderConfig,
    occupancy: OccupancyGrid | None,
    batch_rays: int,
    capacity: int,
    hooks: Sequence[ClientHook] = (),
    personal: PersonalLoss | None = None,
) -> StepOutputs:
    """Draw `batch_rays` pixels and render them in fixed shapes; the MSE over complete rays
    (with `personal`, NeRF-W's loss over them and the filled sample slots).

    The draws are the dynamic step's (pixels, background, marching offsets), so with no
    overflow the loss equals `mse_loss(render_rays(...).rgb, colors)` (or its `nerfw_loss`).
    """
    batch = sampler.sample(batch_rays)
    image_index = None if personal is None else batch.image_index
    rays_kept = samples_kept = None
    if occupancy is None:  # stratified samples: their count is fixed already
        rendered, num_samples = render_rays(
            field, batch.rays, render_config, None, True, batch.background, image_index
        )
        samples = torch.full((), num_samples, device=rendered.rgb.device)
        dropped = torch.zeros((), dtype=torch.int64, device=rendered.rgb.device)
    else:
        rendered, fixed = render_rays_fixed(
            field, batch.rays, render_config, occupancy, capacity, True, batch.background,
            image_index,
        )  # fmt: skip
        rays_kept, samples_kept = fixed.complete, fixed.valid
        samples, dropped = fixed.count, batch_rays - fixed.complete.sum()
    photometric, loss = local_loss(rendered, batch.colors, personal, rays_kept, samples_kept)
    return StepOutputs(with_hook_terms(loss, hooks), photometric, samples, dropped)


def with_hook_terms(loss: Tensor, hooks: Sequence[ClientHook]) -> Tensor:
    """`loss` plus each client hook's term, in the hooks' order."""
    for hook in hooks:
        term = hook.loss()
        if term is not None:
            loss = loss + term
    return loss


def graphs_supported(device: torch.device) -> bool:
    """Whether a static step on `device` can be captured as a CUDA graph."""
    return device.type == "cuda"


class StaticStep:
    """One optimiser step of `loss_fn` per call (`static_loss`; `local_train`'s one loop runs
    its dynamic step, never captured, through it too); with `cuda_graph`, captured per shape.

    `after_backward` runs between the backward pass and the optimiser's step (the client hooks'
    correction of the gradients), inside the graph when captured: in place, on the device.
    Warm-up, capture and replay run with `device` (the field's; None: the current CUDA
    device) made current, on streams of that device. A capture that fails never takes the run
    down: one warning names the cause, the stream torch was on is restored and this step and
    every later one run uncaptured (`capture_error` keeps the cause).
    """

    def __init__(
        self,
        loss_fn: Callable[[OccupancyGrid | None, int], StepOutputs],
        optimizer: torch.optim.Optimizer,
        occupancy: OccupancyGrid | None,
        cuda_graph: bool,
        after_backward: Callable[[], None] | None = None,
        device: torch.device | None = None,
    ) -> None:
        self.loss_fn, self.optimizer, self.occupancy = loss_fn, optimizer, occupancy
        self.cuda_graph, self.after_backward = cuda_graph, after_backward
        self.device = device
        self.graphs: dict[int, _CapturedStep] = {}
        self.eager_steps: dict[int, int] = {}
        self.capture_error: str | None = None
        self.captures = 0

    def bind(self, occupancy: OccupancyGrid | None) -> None:
        """Read `occupancy` from now on (another user's grid of the same resolution): the
        graphs copy its box now and its mask at their next replay."""
        self.occupancy = occupancy
        for captured in self.graphs.values():
            if captured.mirror is not None and occupancy is not None:
                captured.mirror.aabb.copy_(occupancy.aabb)

    def __call__(self, batch_rays: int) -> StepOutputs:
        if not self.cuda_graph:
            return self._eager(self.occupancy, batch_rays)
        with torch.cuda.device(self.device):
            captured = self.graphs.get(batch_rays)
            if captured is not None:
                return captured.replay(self.occupancy)
            if self.eager_steps.get(batch_rays, 0) < WARMUP_STEPS:
                self.eager_steps[batch_rays] = self.eager_steps.get(batch_rays, 0) + 1
                return self._on_side_stream(lambda: self._eager(self.occupancy, batch_rays))
            stream = torch.cuda.current_stream(self.device)
            try:
                captured = _CapturedStep(self, batch_rays)
            except Exception as error:  # any capture failure: go on uncaptured, say why once
                torch.cuda.set_stream(stream)  # a failed capture_end skips the graph's exit
                self._uncaptured_from_now(error)
                return self._eager(self.occupancy, batch_rays)
            self.graphs[batch_rays] = captured
            self.captures += 1
            return captured.replay(self.occupancy)

    def _uncaptured_from_now(self, error: Exception) -> None:
        """Give up capturing after `error`: one warning, no graphs kept, fresh gradients."""
        self.capture_error = f"{type(error).__name__}: {error}"
        warnings.warn(
            f"CUDA graph capture failed ({self.capture_error}); the static steps go on uncaptured",
            RuntimeWarning,
            stacklevel=3,
        )
        self.cuda_graph = False
        self.graphs.clear()
        self.optimizer.zero_grad(set_to_none=True)

    def _eager(self, occupancy: OccupancyGrid | None, batch_rays: int) -> StepOutputs:
        outputs = self.loss_fn(occupancy, batch_rays)
        self.optimizer.zero_grad(set_to_none=True)
        outputs.loss.backward()
        if self.after_backward is not None:
            self.after_backward()
        self.optimizer.step()
        return outputs

    def _on_side_stream(self, work: Callable[[], StepOutputs]) -> StepOutputs:
        """Warm-up before a capture runs on a side stream of the step's device
        (torch.cuda.graphs' recipe)."""
        current = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(device=self.device)
        side.wait_stream(current)
        with torch.cuda.stream(side):
            outputs = work()
        current.wait_stream(side)
        return outputs


class _CapturedStep:
    """One shape's step captured as a CUDA graph, reading its own copy of the grid's mask."""

    def __init__(self, step: StaticStep, batch_rays: int) -> None:
        grid = step.occupancy
        self.mirror = None
        if grid is not None:  # the grid rebinds its mask when updated: the graph reads a copy
            self.mirror = OccupancyGrid(grid.aabb.clone(), grid.resolution)
            self.mirror.occupied.copy_(grid.occupied)
        self.source: Tensor | None = None if grid is None else grid.occupied
        self.graph = torch.cuda.CUDAGraph()
        step.optimizer.zero_grad(set_to_none=True)  # gradients live in the graph's pool
        with torch.cuda.graph(self.graph):
            self.outputs = step.loss_fn(self.mirror, batch_rays)
            self.outputs.loss.backward()
            if step.after_backward is not None:
                step.after_backward()
            step.optimizer.step()

    def replay(self, grid: OccupancyGrid | None) -> StepOutputs:
        if grid is not None and self.mirror is not None and grid.occupied is not self.source:
            self.mirror.occupied.copy_(grid.occupied)
            self.source = grid.occupied
        self.graph.replay()
        return StepOutputs(*(value.clone() for value in vars(self.outputs).values()))
