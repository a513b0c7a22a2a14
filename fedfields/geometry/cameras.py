"""Pinhole cameras in the Blender/OpenGL convention: poses, rigs and projection of points."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch
from torch import Tensor

CAMERA_ANGLE_X = 0.6911112070083618  # the NeRF-synthetic field of view


@dataclass(frozen=True)
class Cameras:
    """Pinhole cameras sharing one image size; poses are camera-to-world, OpenGL convention.

    The camera looks down -z with y up; (cx, cy) are in pixel-edge coordinates (centre = W/2).
    """

    camera_to_world: Tensor  # [N, 4, 4] float32
    fx: Tensor  # [N] float32, focal lengths in pixels
    fy: Tensor  # [N]
    cx: Tensor  # [N] principal point in pixels
    cy: Tensor  # [N]
    width: int
    height: int

    def __len__(self) -> int:
        return self.camera_to_world.shape[0]

    def subset(self, indices: Sequence[int] | Tensor) -> Cameras:
        """Cameras at `indices` (ints or a boolean mask), in that order."""
        index = as_index(indices)
        return Cameras(
            camera_to_world=self.camera_to_world[index],
            fx=self.fx[index],
            fy=self.fy[index],
            cx=self.cx[index],
            cy=self.cy[index],
            width=self.width,
            height=self.height,
        )

    def to(self, device: torch.device | str) -> Cameras:
        """The same cameras with their tensors on `device`."""
        return replace(
            self,
            camera_to_world=self.camera_to_world.to(device),
            fx=self.fx.to(device),
            fy=self.fy.to(device),
            cx=self.cx.to(device),
            cy=self.cy.to(device),
        )


def as_index(indices: Sequence[int] | Tensor) -> Tensor:
    """A 1-D long index tensor from ints or a boolean mask, so views subset alike everywhere."""
    index = torch.as_tensor(indices)
    if index.dtype == torch.bool:
        return index.nonzero().flatten()
    return index.to(torch.long).flatten()


def look_at(position: Tensor, target: Tensor, up: Tensor | None = None) -> Tensor:
    """[4, 4] camera-to-world of an OpenGL camera at `position` looking at `target`, z up."""
    up = torch.tensor([0.0, 0.0, 1.0], dtype=position.dtype) if up is None else up
    backward = torch.nn.functional.normalize(position - target, dim=0)
    right = torch.nn.functional.normalize(torch.linalg.cross(up, backward), dim=0)
    true_up = torch.linalg.cross(backward, right)
    matrix = torch.eye(4, dtype=position.dtype)
    matrix[:3, 0], matrix[:3, 1], matrix[:3, 2], matrix[:3, 3] = right, true_up, backward, position
    return matrix


def orbit_cameras(
    rng: np.random.Generator,
    views: int,
    resolution: int,
    distance: float,
    elevation_range: tuple[float, float],
) -> Cameras:
    """`views` cameras at random yaw and elevation on a sphere, all looking at the origin."""
    yaw = rng.uniform(0.0, 2.0 * math.pi, size=views)
    low, high = (math.sin(math.radians(e)) for e in elevation_range)
    elevation = np.arcsin(rng.uniform(low, high, size=views))  # uniform in area on the sphere
    positions = distance * np.stack(
        [np.cos(elevation) * np.cos(yaw), np.cos(elevation) * np.sin(yaw), np.sin(elevation)], -1
    )
    origin = torch.zeros(3)
    poses = torch.stack([look_at(torch.tensor(p, dtype=torch.float32), origin) for p in positions])
    focal = 0.5 * resolution / math.tan(0.5 * CAMERA_ANGLE_X)
    full = torch.full((views,), focal)
    centre = torch.full((views,), resolution / 2)
    return Cameras(poses, full, full.clone(), centre, centre.clone(), resolution, resolution)


def project(cameras: Cameras, view: int, points: Tensor) -> tuple[Tensor, Tensor]:
    """(pixels [P, 2] as (x, y) in pixel-edge coordinates, depth [P] along the view axis).

    Inverse of `fedfields.geometry.rays.pixel_rays`: pixel centres sit at integer + 0.5.
    """
    camera_to_world = cameras.camera_to_world[view].double()
    rotation, origin = camera_to_world[:3, :3], camera_to_world[:3, 3]
    local = (points.double() - origin) @ rotation  # world -> camera: R^T (p - o)
    depth = -local[:, 2]
    safe = torch.where(depth.abs() < 1e-9, torch.full_like(depth, 1e-9), depth)
    x = float(cameras.cx[view]) + float(cameras.fx[view]) * local[:, 0] / safe
    y = float(cameras.cy[view]) - float(cameras.fy[view]) * local[:, 1] / safe
    return torch.stack([x, y], dim=-1), depth
