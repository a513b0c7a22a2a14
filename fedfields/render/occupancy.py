"""Occupancy grid for empty-space skipping (Instant-NGP Sec. 5.1; nerfacc's OccGridEstimator).

The grid keeps a decaying maximum of the field's density per cell. Marching takes uniform
steps along each ray and keeps only samples in occupied cells that the grid's own density
estimate has not already hidden behind an opaque surface (transmittance pruning).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from fedfields.render.rays import Rays


@dataclass
class PackedSamples:
    """Samples of many rays flattened together, sorted by ray."""

    ray_index: Tensor  # [S] int64
    t_mid: Tensor  # [S]
    deltas: Tensor  # [S]


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
        self.density = torch.zeros((resolution,) * 3)
        self.occupied = torch.ones((resolution,) * 3, dtype=torch.bool)

    def state_dict(self) -> dict[str, Tensor | int | float]:
        return {"density": self.density, "occupied": self.occupied, "aabb": self.aabb}

    def load_state_dict(self, state: dict) -> None:
        self.density = state["density"].float()
        self.occupied = state["occupied"].bool()
        self.aabb = state["aabb"].float()
        self.resolution = self.density.shape[0]

    @torch.no_grad()
    def update(
        self, density_fn: Callable[[Tensor], Tensor], step_size: float, chunk: int = 1 << 16
    ) -> None:
        """Re-evaluate density at one random point per cell and refresh the occupied mask.

        A cell counts as occupied when its opacity over one marching step exceeds the
        threshold, or the grid mean if lower (nerfacc's rule, which keeps early grids dense).
        """
        res = self.resolution
        cells = torch.stack(
            torch.meshgrid(*(torch.arange(res),) * 3, indexing="ij"), dim=-1
        ).reshape(-1, 3)
        unit = (cells + torch.rand(cells.shape)) / res
        points = self.aabb[0] + unit * (self.aabb[1] - self.aabb[0])
        fresh = torch.cat([density_fn(part) for part in points.split(chunk)]).view(res, res, res)
        self.density = torch.maximum(self.density * self.decay, fresh)
        opacity = 1.0 - torch.exp(-self.density * step_size)
        threshold = min(self.opacity_threshold, opacity.mean().item())
        self.occupied = opacity > threshold

    def _hidden(
        self, cell: Tensor, occupied: Tensor, step_size: float, transmittance_threshold: float
    ) -> Tensor:
        """Samples [R, K] that lie more than two cells behind the point where the grid's
        densities bring transmittance below the threshold.

        The grid holds each cell's maximum density, so a partly filled boundary cell looks
        solid; the two-cell margin keeps the true surface inside such cells.
        """
        optical_depth = torch.where(occupied, self.density.view(-1)[cell] * step_size, 0.0)
        opaque = torch.cumsum(optical_depth, dim=-1) > -math.log(transmittance_threshold)
        cell_size = ((self.aabb[1] - self.aabb[0]) / self.resolution).max().item()
        margin = math.ceil(2.0 * cell_size / step_size)
        hidden = torch.zeros_like(opaque)
        hidden[:, margin:] = opaque[:, :-margin] if margin < opaque.shape[1] else hidden[:, margin:]
        return hidden

    def cell_index(self, points: Tensor) -> Tensor:
        """Flat cell index of world points (clamped into the box)."""
        unit = (points - self.aabb[0]) / (self.aabb[1] - self.aabb[0])
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
        transmittance_threshold: float = 1e-4,
    ) -> PackedSamples:
        """Uniform steps of `step_size` inside [t_near, t_far], kept where occupied and visible."""
        hit = t_far > t_near
        ray_ids = torch.nonzero(hit).squeeze(-1)
        if ray_ids.numel() == 0:
            empty = torch.zeros(0)
            return PackedSamples(torch.zeros(0, dtype=torch.int64), empty, empty)
        near, far = t_near[ray_ids], t_far[ray_ids]
        num_steps = int(torch.ceil((far - near).max() / step_size).item())
        offset = torch.rand(len(ray_ids), 1) if perturb else torch.full((len(ray_ids), 1), 0.5)
        t = near[:, None] + (torch.arange(num_steps) + offset) * step_size  # [R, K]
        inside = t < far[:, None]
        points = rays.origins[ray_ids, None, :] + t[..., None] * rays.directions[ray_ids, None, :]
        cell = self.cell_index(points)
        occupied = self.occupied.view(-1)[cell] & inside
        if transmittance_threshold > 0:
            occupied &= ~self._hidden(cell, occupied, step_size, transmittance_threshold)
        row, column = torch.nonzero(occupied, as_tuple=True)
        t_mid = t[row, column]
        return PackedSamples(ray_ids[row], t_mid, torch.full_like(t_mid, step_size))
