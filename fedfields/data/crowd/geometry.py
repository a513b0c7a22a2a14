"""The scene's shape for placing persons: visual hulls, bounding sphere, ground, hull depth."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from fedfields.data.crowd.config import OBJECT_ALPHA, CrowdError
from fedfields.data.scene import Scene
from fedfields.geometry.cameras import Cameras, project
from fedfields.geometry.rays import image_rays, intersect_aabb


@dataclass(frozen=True)
class BoundingSphere:
    """A sphere that contains the scene's content: front-layout persons stay outside it."""

    centre: tuple[float, float, float]
    radius: float


@dataclass(frozen=True)
class Ground:
    """Where novel-blender persons stand: the object's support level and its centre."""

    level: float  # z of every person's feet
    centre: tuple[float, float]  # x, y of the object's centre
    object_height: float  # top of the object above `level`


def bounding_sphere(scene: Scene, resolution: int = 64) -> BoundingSphere:
    """A sphere containing the scene: around its silhouettes' visual hull when images carry alpha.

    Without alpha (all masks one) it is the sphere around the scene's box, which is loose but safe.
    """
    aabb = scene.aabb.double()
    if bool((scene.masks >= 1.0).all()):
        centre = 0.5 * (aabb[0] + aabb[1])
        return BoundingSphere(as_triple(centre), float(0.5 * (aabb[1] - aabb[0]).norm()))
    occupied, voxel_centres, half_diagonal = visual_hull(scene, resolution)
    points = voxel_centres[occupied]
    if points.shape[0] == 0:
        raise CrowdError("the scene's silhouettes carve away every voxel; are its masks empty?")
    centre = 0.5 * (points.amin(0) + points.amax(0))
    radius = float((points - centre).norm(dim=-1).max()) + half_diagonal
    return BoundingSphere(as_triple(centre), radius)


def visual_hull(
    scene: Scene, resolution: int = 64, threshold: float = 0.0, conservative: bool = True
) -> tuple[Tensor, Tensor, float]:
    """(occupied [M] bool, voxel centres [M, 3], voxel half-diagonal) carved from the alpha masks.

    Silhouettes are pixels with alpha > `threshold`. Conservative: a voxel survives when every
    view that sees its centre finds silhouette within the voxel's projected radius there, so the
    hull contains every point of the object. Otherwise only the centre's pixel is tested (a
    tight hull, for depth). Voxels are ordered x-major (reshape to [R, R, R] indexes x, y, z).
    """
    aabb = scene.aabb.double()
    centres = voxel_centres(scene.aabb, resolution)
    centres = centres.double() if conservative else centres  # float32 keeps 128^3 affordable
    half_diagonal = float(0.5 * ((aabb[1] - aabb[0]) / resolution).norm())
    occupied = torch.ones(centres.shape[0], dtype=torch.bool)
    cameras = scene.cameras
    for view in range(len(scene)):
        # The conservative radius depends on every voxel's depth; the tight hull projects only
        # the voxels still alive, which is what makes 128^3 affordable.
        alive = torch.arange(occupied.shape[0]) if conservative else occupied.nonzero()[:, 0]
        pixels, depth = project(cameras, view, centres[alive])
        silhouette = scene.masks[view].double() > threshold
        if conservative:
            radius = math.ceil(
                half_diagonal * float(cameras.fx[view]) / max(float(depth.min()), 1e-6)
            )
            silhouette = torch.nn.functional.max_pool2d(
                silhouette[None, None].float(), 2 * radius + 1, stride=1, padding=radius
            )[0, 0].bool()
        column, row = pixels[:, 0].floor().long(), pixels[:, 1].floor().long()
        inside = (
            (depth > 0)
            & (column >= 0)
            & (column < cameras.width)
            & (row >= 0)
            & (row < cameras.height)
        )
        keep = torch.ones(alive.shape[0], dtype=torch.bool)
        keep[inside] = silhouette[row[inside], column[inside]]
        occupied[alive[~keep]] = False
    return occupied, centres.float(), half_diagonal


def silhouette_hull(scene: Scene, resolution: int) -> Tensor:
    """[R, R, R] bool (x, y, z) tight visual hull of the object silhouettes (alpha > 0.5)."""
    occupied, _, _ = visual_hull(scene, resolution, OBJECT_ALPHA, conservative=False)
    return occupied.reshape(resolution, resolution, resolution)


def ground_of(occupied: Tensor, aabb: Tensor) -> Ground:
    """The ground persons stand on: the bottom of the hull's widest horizontal slice.

    The object's support (lego's base plate) is its widest slice; the hull's lowest voxels lie
    under it only because cameras on the upper hemisphere cannot carve below the support.
    """
    resolution = occupied.shape[2]
    voxel = (aabb[1] - aabb[0]) / resolution
    area = occupied.sum(dim=(0, 1))
    widest = int(area.argmax())
    filled = area.nonzero()[:, 0]
    level = float(aabb[0, 2] + widest * voxel[2])
    top = float(aabb[0, 2] + (int(filled.max()) + 1) * voxel[2])
    xy = occupied.any(dim=2).nonzero()
    low = aabb[0, :2] + (xy.amin(0) + 0.5) * voxel[:2]
    high = aabb[0, :2] + (xy.amax(0) + 0.5) * voxel[:2]
    centre = 0.5 * (low + high)
    return Ground(level, (float(centre[0]), float(centre[1])), top - level)


def hull_depth(
    occupied: Tensor,
    aabb: Tensor,
    cameras: Cameras,
    views: Sequence[int],
    pixels: Sequence[Tensor] | None = None,
) -> list[Tensor]:
    """Per view [H, W] distance along each pixel's unit ray to the first occupied voxel (inf: none).

    Only `pixels` ([H, W] bool per view; all when None) are marched, the others stay inf:
    persons show where the scene has no alpha anyway. Marched at half-voxel steps inside the
    hull's box, one view at a time. A visual hull contains the object, so in concavities its
    depth is <= the true depth: a person there is taken as hidden although the real surface
    lies behind it.
    """
    resolution = occupied.shape[0]
    voxel = (aabb[1] - aabb[0]) / resolution
    cells = occupied.nonzero()
    box = torch.stack([aabb[0] + cells.amin(0) * voxel, aabb[0] + (cells.amax(0) + 1) * voxel])
    step = 0.5 * float(voxel.min())
    flat = occupied.reshape(-1)
    depths = []
    for position, view in enumerate(views):
        rays = image_rays(cameras, view)
        chosen = torch.ones(len(rays.origins), dtype=torch.bool)
        if pixels is not None:
            chosen = pixels[position].reshape(-1)
        depth = torch.full((len(chosen),), math.inf)
        rays = rays[chosen]
        t_near, t_far = intersect_aabb(rays, box, 0.0, math.inf)
        samples = max(1, math.ceil(float((t_far - t_near).clamp(min=0).max()) / step))
        t = t_near[:, None] + (torch.arange(samples) + 0.5) * step  # [R, S]
        points = rays.origins[:, None] + t[..., None] * rays.directions[:, None]
        cell = ((points - aabb[0]) / voxel).floor().long().clamp(0, resolution - 1)
        index = (cell[..., 0] * resolution + cell[..., 1]) * resolution + cell[..., 2]
        inside = flat[index] & (t < t_far[:, None])
        first = inside.int().argmax(dim=1)
        entry = t.gather(1, first[:, None])[:, 0] - step  # the voxel began up to a step before
        depth[chosen] = torch.where(inside.any(dim=1), entry, torch.full_like(entry, math.inf))
        depths.append(depth.reshape(cameras.height, cameras.width))
    return depths


def voxel_centres(aabb: Tensor, resolution: int) -> Tensor:
    """[R^3, 3] voxel centres in the x-major order of `visual_hull`."""
    steps = [torch.linspace(0.0, 1.0, 2 * resolution + 1, dtype=torch.float64)[1::2]] * 3
    grid = torch.stack(torch.meshgrid(*steps, indexing="ij"), dim=-1).reshape(-1, 3)
    return (aabb[0].double() + grid * (aabb[1] - aabb[0]).double()).float()


def as_triple(vector: Tensor | Sequence[float]) -> tuple[float, float, float]:
    """A plain (x, y, z) tuple of floats, for JSON and frozen dataclasses."""
    values = [float(v) for v in vector]
    return (values[0], values[1], values[2])
