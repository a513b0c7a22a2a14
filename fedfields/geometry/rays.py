"""Rays of pinhole cameras in the Blender/OpenGL convention, through pixel centres."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from fedfields.geometry.cameras import Cameras


@dataclass
class Rays:
    """A batch of rays: origins [R, 3] and unit directions [R, 3]."""

    origins: Tensor
    directions: Tensor

    def __len__(self) -> int:
        return self.origins.shape[0]

    def __getitem__(self, index: slice | Tensor) -> Rays:
        return Rays(self.origins[index], self.directions[index])


def pixel_rays(cameras: Cameras, view: Tensor, row: Tensor, column: Tensor) -> Rays:
    """Rays of pixels (view, row, column), all [R] integer tensors, through pixel centres.

    OpenGL camera frame: x right, y up, the camera looks down -z; image rows grow downwards.
    """
    x = (column.to(torch.float32) + 0.5 - cameras.cx[view]) / cameras.fx[view]
    y = -(row.to(torch.float32) + 0.5 - cameras.cy[view]) / cameras.fy[view]
    camera_dirs = torch.stack([x, y, -torch.ones_like(x)], dim=-1)
    camera_to_world = cameras.camera_to_world[view]
    directions = torch.einsum("rij,rj->ri", camera_to_world[:, :3, :3], camera_dirs)
    directions = torch.nn.functional.normalize(directions, dim=-1)
    return Rays(camera_to_world[:, :3, 3].clone(), directions)


def image_rays(cameras: Cameras, view: int) -> Rays:
    """All H*W rays of one view in row-major pixel order."""
    device = cameras.camera_to_world.device
    rows, columns = torch.meshgrid(
        torch.arange(cameras.height, device=device),
        torch.arange(cameras.width, device=device),
        indexing="ij",
    )
    views = torch.full((rows.numel(),), view, dtype=torch.int64, device=device)
    return pixel_rays(cameras, views, rows.reshape(-1), columns.reshape(-1))


def intersect_aabb(rays: Rays, aabb: Tensor, near: float, far: float) -> tuple[Tensor, Tensor]:
    """Entry and exit distances of each ray in the box [2, 3], clipped to [near, far].

    Rays that miss the box get t_near >= t_far.
    """
    inverse = 1.0 / torch.where(rays.directions.abs() < 1e-9, 1e-9, rays.directions)
    t0 = (aabb[0] - rays.origins) * inverse
    t1 = (aabb[1] - rays.origins) * inverse
    t_near = torch.minimum(t0, t1).amax(-1).clamp(min=near)
    t_far = torch.maximum(t0, t1).amin(-1).clamp(max=far)
    return t_near, t_far
