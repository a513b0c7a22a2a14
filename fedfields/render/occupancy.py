"""Occupancy grid for empty-space skipping (Instant-NGP Sec. 5.1; nerfacc's OccGridEstimator).

The grid keeps a decaying maximum of the field's density per cell. Marching takes uniform
steps along each ray and keeps only the samples that fall in occupied cells: `march` packs
exactly those (their count, read by a `nonzero`, sets every later shape); `march_fixed` writes
them into a buffer of fixed capacity with a mask, so a step's shapes never depend on the data.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from fedfields.geometry.rays import Rays


@dataclass
class PackedSamples:
    """Samples of many rays flattened together, sorted by ray."""

    ray_index: Tensor  # [S] int64
    t_mid: Tensor  # [S]
    deltas: Tensor  # [S]


@dataclass
class FixedSamples(PackedSamples):
    """`capacity` sample slots: the kept samples first, in ray order, then padding.

    Overflow rule: samples are kept in ray order up to the capacity; a ray whose samples do
    not all fit is not `complete` (the static step leaves it out of the loss). Padding slots
    lie on the last ray at t = 0 with delta 0, so they composite to nothing.
    """

    valid: Tensor  # [C] bool: a kept sample, not padding
    complete: Tensor  # [R] bool: every occupied sample of the ray was kept
    count: Tensor  # [] int64: occupied samples before the cap
    kept: Tensor  # [] int64: min(count, capacity)


class OccupancyGrid:
    """A res^3 grid over the scene box of decayed max densities and an occupied mask."""

    def __init__(
        self,
        aabb: Tensor,
        resolution: int = 64,
        decay: float = 0.95,
        opacity_threshold: float = 0.01,
    ) -> None:
        self.aabb = aabb.float()
        self.resolution = resolution
        self.decay = decay
        self.opacity_threshold = opacity_threshold
        self.density = torch.zeros((resolution,) * 3, device=aabb.device)
        self.occupied = torch.ones((resolution,) * 3, dtype=torch.bool, device=aabb.device)

    def state_dict(self) -> dict[str, Tensor]:
        """Grid tensors on the CPU, for checkpoints."""
        return {
            "density": self.density.cpu(),
            "occupied": self.occupied.cpu(),
            "aabb": self.aabb.cpu(),
        }

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        device = self.aabb.device
        self.density = state["density"].float().to(device)
        self.occupied = state["occupied"].bool().to(device)
        self.aabb = state["aabb"].float().to(device)
        self.resolution = self.density.shape[0]

    def to(self, device: torch.device | str) -> OccupancyGrid:
        """Move the grid to `device` in place; returns self."""
        self.aabb, self.density = self.aabb.to(device), self.density.to(device)
        self.occupied = self.occupied.to(device)
        return self

    @torch.no_grad()
    def update(
        self,
        density_fn: Callable[[Tensor], Tensor],
        step_size: float,
        chunk: int = 1 << 16,
        generator: torch.Generator | None = None,
    ) -> None:
        """Re-evaluate density at one random point per cell and refresh the occupied mask.

        A cell counts as occupied when its opacity over one marching step exceeds the
        threshold, or the grid mean if lower (nerfacc's rule, which keeps early grids dense).
        Points are drawn on the grid's device from `generator` (default: torch's global RNG):
        keep the grid where the field is (`to`).
        """
        res = self.resolution
        axis = torch.arange(res, device=self.density.device)
        cells = torch.stack(torch.meshgrid(axis, axis, axis, indexing="ij"), dim=-1).reshape(-1, 3)
        jitter = torch.rand(cells.shape, device=cells.device, generator=generator)
        unit = (cells + jitter) / res
        points = self.aabb[0] + unit * (self.aabb[1] - self.aabb[0])
        fresh = torch.cat([density_fn(part) for part in points.split(chunk)]).view(res, res, res)
        self.density = torch.maximum(self.density * self.decay, fresh)
        opacity = 1.0 - torch.exp(-self.density * step_size)
        threshold = opacity.mean().clamp(max=self.opacity_threshold)  # on the device: no read
        self.occupied = opacity > threshold

    def cell_index(self, points: Tensor) -> Tensor:
        """Flat cell index of world points (clamped into the box), on the points' device."""
        aabb = self.aabb.to(points.device)
        unit = (points - aabb[0]) / (aabb[1] - aabb[0])
        ijk = (unit * self.resolution).long().clamp(0, self.resolution - 1)
        return (ijk[..., 0] * self.resolution + ijk[..., 1]) * self.resolution + ijk[..., 2]

    @torch.no_grad()
    def march(
        self,
        rays: Rays,
        t_near: Tensor,
        t_far: Tensor,
        step_size: float,
        perturb: bool,
        max_length: float | None = None,
    ) -> PackedSamples:
        """Uniform steps of `step_size` inside [t_near, t_far], kept where the grid is occupied.

        Samples are not pruned by the grid's own transmittance estimate: the grid holds each
        cell's maximum density, so partly filled boundary cells look solid and pruning behind
        them cost accuracy on held-out lego views (docs/BENCHMARKS.md, "Defaults, as measured").
        The grid moves to the rays' device first, so a grid kept elsewhere still marches.
        `max_length`, a host-known bound on t_far - t_near (min(far - near, box diagonal) for
        unit directions), fixes the step count without reading the batch; None reads it.
        """
        self.to(rays.origins.device)
        if len(rays) == 0:
            empty = rays.origins.new_zeros(0)
            return PackedSamples(empty.long(), empty, empty)
        t, occupied = self._occupied_steps(rays, t_near, t_far, step_size, perturb, max_length)
        # The one host sync left per batch: the sample count sets every later shape.
        row, column = torch.nonzero(occupied, as_tuple=True)
        t_mid = t[row, column]
        return PackedSamples(row, t_mid, torch.full_like(t_mid, step_size))

    @torch.no_grad()
    def march_fixed(
        self,
        rays: Rays,
        t_near: Tensor,
        t_far: Tensor,
        step_size: float,
        perturb: bool,
        max_length: float,
        capacity: int,
    ) -> FixedSamples:
        """`march`'s samples in `capacity` fixed slots, found without a host sync.

        The same random draws and samples as `march` (given `max_length`); each occupied
        sample's slot is its rank (a cumulative sum), those past the capacity go to one
        spare slot that is dropped (`FixedSamples` states the overflow rule).
        """
        self.to(rays.origins.device)
        t, occupied = self._occupied_steps(rays, t_near, t_far, step_size, perturb, max_length)
        num_rays, num_steps = occupied.shape
        flat = occupied.reshape(-1)
        rank = torch.cumsum(flat, dim=0) - 1
        slot = torch.where(flat & (rank < capacity), rank, capacity)
        rows = torch.arange(num_rays, device=t.device)[:, None].expand(num_rays, num_steps)
        last_ray = torch.full((capacity + 1,), num_rays - 1, device=t.device)
        ray_index = last_ray.scatter(0, slot, rows.reshape(-1))[:capacity]
        t_mid = t.new_zeros(capacity + 1).scatter(0, slot, t.reshape(-1))[:capacity]
        count = rank[-1] + 1
        kept = count.clamp(max=capacity)
        valid = torch.arange(capacity, device=t.device) < kept
        ray_end = torch.cumsum(occupied.sum(dim=1), dim=0)  # one past each ray's last rank
        return FixedSamples(
            ray_index=ray_index,
            t_mid=t_mid,
            deltas=valid * step_size,
            valid=valid,
            complete=ray_end <= capacity,
            count=count,
            kept=kept,
        )

    @torch.no_grad()
    def samples_per_ray(
        self, rays: Rays, t_near: Tensor, t_far: Tensor, step_size: float, max_length: float
    ) -> Tensor:
        """How many samples `march_fixed` finds on each ray [R] (int64) at the steps' midpoints
        (no jitter, no random draw), counted on the device: what a batch of such rays costs."""
        self.to(rays.origins.device)
        _, occupied = self._occupied_steps(rays, t_near, t_far, step_size, False, max_length)
        return occupied.sum(dim=1)

    def _occupied_steps(
        self,
        rays: Rays,
        t_near: Tensor,
        t_far: Tensor,
        step_size: float,
        perturb: bool,
        max_length: float | None,
    ) -> tuple[Tensor, Tensor]:
        """Every uniform step's depth [R, K] and whether it is inside the ray and occupied."""
        hit = t_far > t_near
        if max_length is None:  # the batch's longest interval: a host read (stalls a GPU)
            longest = torch.where(hit, t_far - t_near, 0.0).max()
            num_steps = int(torch.ceil(longest / step_size).item())
        else:  # +1: float32 intervals may round past the bound; extra steps fall outside
            num_steps = math.ceil(max_length / step_size) + 1
        offset = torch.rand_like(t_near) if perturb else torch.full_like(t_near, 0.5)
        steps = torch.arange(num_steps, device=t_near.device)
        t = t_near[:, None] + (steps + offset[:, None]) * step_size  # [R, K]
        inside = (t < t_far[:, None]) & hit[:, None]
        points = rays.origins[:, None, :] + t[..., None] * rays.directions[:, None, :]
        cell = self.cell_index(points)
        return t, self.occupied.view(-1)[cell] & inside
