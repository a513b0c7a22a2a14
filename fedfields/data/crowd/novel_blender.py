"""DecentNeRF's Novel Blender layout: each user's static person and passers-by on the ground."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor
from tqdm.auto import tqdm

from fedfields.data.crowd.compositing import composite_persons, straight_rgba, written_change
from fedfields.data.crowd.config import CrowdConfig, CrowdError
from fedfields.data.crowd.geometry import (
    BoundingSphere,
    Ground,
    as_triple,
    ground_of,
    hull_depth,
    silhouette_hull,
    voxel_centres,
)
from fedfields.data.crowd.partition import partition_views
from fedfields.data.crowd.records import Crowd, PersonSpec, UserViews
from fedfields.data.scene import Scene
from fedfields.data.surfaces import SurfaceObject, SurfaceRender, render_surfaces


def build_novel_blender(scene: Scene, config: CrowdConfig, progress: bool) -> Crowd:
    """DecentNeRF's layout: per view one static person of the user and transient passers-by.

    Everyone stands on the object's ground around it; occlusion against the scene uses the
    depth of a tight visual hull, so persons behind the object are hidden by it.
    """
    occupied = silhouette_hull(scene, config.hull_resolution)
    aabb = scene.aabb.float()
    points = voxel_centres(aabb, config.hull_resolution)[occupied.reshape(-1)]
    if points.shape[0] == 0:
        raise CrowdError("the scene's silhouettes (alpha > 0.5) carve away every hull voxel")
    voxel = float((aabb[1, 0] - aabb[0, 0]) / config.hull_resolution)
    ground = ground_of(occupied, aabb)
    centre = 0.5 * (points.amin(0) + points.amax(0))
    radius = float((points - centre).norm(dim=-1).max()) + 0.5 * math.sqrt(3.0) * voxel
    sphere = BoundingSphere(as_triple(centre), radius)
    partition = partition_views(scene, sphere, config)
    rng = np.random.default_rng(config.seed)
    heavy = set(
        rng.choice(config.users, config.users // 2, replace=False).tolist()
        if config.heterogeneous
        else []
    )
    clean = straight_rgba(scene)
    used = sorted({int(v) for group in partition.groups for v in group})
    scene_pixels = [scene.masks[view] > 0 for view in used]
    depths = hull_depth(occupied, aabb, scene.cameras, used, scene_pixels)
    depth = dict(zip(used, depths, strict=True))
    obstacles = _obstacles(occupied, aabb, ground.level + 1.5 * voxel)
    world = _PlacementWorld(scene, ground, obstacles, voxel, clean, depth, config)
    users = []
    for user, views in enumerate(tqdm(partition.groups, desc="persons", disable=not progress)):
        occlusion = "uniform"
        if config.heterogeneous:
            occlusion = "heavy" if user in heavy else "light"
        users.append(_novel_blender_user(world, user, tuple(int(v) for v in views), occlusion, rng))
    return Crowd(users, partition, sphere, scene.cameras, scene, "novel-blender", ground)


@dataclass
class _PlacementWorld:
    """What placing novel-blender persons needs to know about the scene (shared by all users)."""

    scene: Scene
    ground: Ground
    obstacles: Tensor  # [K, 3] hull columns above the ground: x, y, lowest occupied z
    voxel: float  # hull voxel edge
    clean: Tensor  # [N, H, W, 4] straight-alpha source views
    depth: dict[int, Tensor]  # view -> [H, W] hull depth
    config: CrowdConfig

    @property
    def min_pixels(self) -> int:
        """`min_person_pixels` scaled from 100x100 to the image size."""
        cameras = self.scene.cameras
        return max(1, round(self.config.min_person_pixels * cameras.width * cameras.height / 1e4))


# Attempts at placing a view's passers-by that may all run out of room before giving up.
CROWDED_ATTEMPTS = 3


def _novel_blender_user(
    world: _PlacementWorld,
    user: int,
    views: tuple[int, ...],
    occlusion: str,
    rng: np.random.Generator,
) -> UserViews:
    """Place the user's static person (visible in all its views), then each view's passers-by."""
    config = world.config
    height = config.person_scale * world.ground.object_height
    if occlusion == "heavy":
        height *= config.heavy_scale
    transients_per_view = 0 if occlusion == "light" else config.transients_per_view
    clean = world.clean[list(views)]
    static = None
    for _ in range(config.max_tries):
        drawn = _draw_standing(world, height, rng, [])
        if drawn is None:
            continue
        spec = drawn[0]
        rendered = render_surfaces([drawn[1]], world.scene.cameras, views=list(views))
        shown = [
            int(_person_changes(world, view, clean[i], rendered, i)[0].sum())
            for i, view in enumerate(views)
        ]
        if min(shown) >= world.min_pixels:
            static = spec
            break
    if static is None:
        raise CrowdError(
            f"user {user}: no spot on the ground within {config.spot_radius} of the object shows "
            f"its person with >= {world.min_pixels} pixels in all of views {list(views)} after "
            f"{config.max_tries} tries"
        )
    outputs = [
        _compose_view(world, static, view, clean[i], transients_per_view, rng, user)
        for i, view in enumerate(views)
    ]
    rgba, union, personal, transient, passers_by = zip(*outputs, strict=True)
    return UserViews(
        user,
        views,
        static,
        torch.stack(rgba),
        clean,
        torch.stack(union),
        tuple(passers_by),
        torch.stack(personal),
        torch.stack(transient),
        occlusion,
    )


def _compose_view(
    world: _PlacementWorld,
    static: PersonSpec,
    view: int,
    clean: Tensor,
    count: int,
    rng: np.random.Generator,
    user: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor, tuple[PersonSpec, ...]]:
    """(rgba, union, static, transient masks, passers-by) of one view of a user.

    Passers-by are redrawn together while they would hide the static person below
    `min_person_pixels`, so personal content stays visible in every view.
    """
    static_figure = static.build()
    standing = [(static, _footprint(static, static_figure.bounds()))]
    crowded = 0
    for _ in range(max(1, world.config.max_tries // 40)):
        placed: list[tuple[PersonSpec, SurfaceObject]] = []
        for _ in range(count * 200):
            if len(placed) == count:
                break
            others = standing + [(spec, _footprint(spec, f.bounds())) for spec, f in placed]
            drawn = _draw_standing(world, static.height, rng, others)
            if drawn is not None:
                placed.append(drawn)
        if len(placed) < count:
            crowded += 1
            if crowded == CROWDED_ATTEMPTS:
                raise CrowdError(
                    f"user {user}: view {view} has no room for {count} passers-by of height "
                    f"{static.height:.2f} within {world.config.spot_radius} of the object; "
                    "lower person_scale or transients_per_view"
                )
            continue
        passers_by = [spec for spec, _ in placed]
        figures = [static_figure, *(figure for _, figure in placed)]
        rendered = render_surfaces(figures, world.scene.cameras, views=[view])
        changed, rgba = _person_changes(world, view, clean, rendered, 0)
        personal = changed & (rendered.instance[0] == 0)
        if int(personal.sum()) >= world.min_pixels:
            transient = changed & (rendered.instance[0] > 0)
            return rgba, changed, personal, transient, tuple(passers_by)
    raise CrowdError(
        f"user {user}: no {count} passers-by for view {view} leave its person "
        f">= {world.min_pixels} pixels"
    )


def _person_changes(
    world: _PlacementWorld, view: int, clean: Tensor, rendered: SurfaceRender, position: int
) -> tuple[Tensor, Tensor]:
    """(changed [H, W], rgba [H, W, 4]): persons of `rendered[position]` composited into `view`."""
    rgba = composite_persons(
        clean, world.depth[view], rendered.rgba[position], rendered.depth[position]
    )
    changed = written_change(rgba, clean)
    return changed, torch.where(changed[..., None], rgba, clean)


def _draw_standing(
    world: _PlacementWorld,
    height: float,
    rng: np.random.Generator,
    others: list[tuple[PersonSpec, float]],
) -> tuple[PersonSpec, SurfaceObject] | None:
    """A random person (spec, figure) on the ground near the object; None where it won't fit.

    It must stay in the scene's box, keep hull columns that rise above the ground lower than
    its head out of its footprint (so it does not intersect the object), and keep its footprint
    apart from the `others` (spec, footprint radius).
    """
    ground, config = world.ground, world.config
    distance = config.spot_radius * math.sqrt(rng.random())
    angle = rng.uniform(0.0, 2.0 * math.pi)
    feet = (
        ground.centre[0] + distance * math.cos(angle),
        ground.centre[1] + distance * math.sin(angle),
        ground.level,
    )
    obstacles = world.obstacles
    offsets = (obstacles[:, :2] - torch.tensor(feet[:2])).norm(dim=-1)
    if bool((offsets < world.voxel).any()):  # standing right on the object: skip the build
        return None
    spec = PersonSpec(int(rng.integers(2**31)), height, feet, rng.uniform(0.0, 2.0 * math.pi))
    figure = spec.build()
    bounds = figure.bounds()
    aabb = world.scene.aabb.float()
    if bool((bounds[0] < aabb[0]).any() or (bounds[1] > aabb[1]).any()):
        return None
    footprint = _footprint(spec, bounds)
    under_head = obstacles[:, 2] < float(bounds[1, 2])
    if bool((under_head & (offsets < footprint + 0.5 * world.voxel)).any()):
        return None
    for other, other_footprint in others:
        if math.dist(feet[:2], other.feet[:2]) < footprint + other_footprint:
            return None
    return spec, figure


def _obstacles(occupied: Tensor, aabb: Tensor, floor: float) -> Tensor:
    """[K, 3] (x, y, lowest occupied z above `floor`) of every hull column with voxels there."""
    resolution = occupied.shape[2]
    voxel = (aabb[1] - aabb[0]) / resolution
    z = aabb[0, 2] + (torch.arange(resolution) + 0.5) * voxel[2]
    above = occupied & (z > floor)
    columns = above.any(dim=2).nonzero()
    lowest = above[columns[:, 0], columns[:, 1]].int().argmax(dim=1)
    xy = aabb[0, :2] + (columns + 0.5) * voxel[:2]
    return torch.cat([xy, (aabb[0, 2] + lowest * voxel[2])[:, None]], dim=1).float()


def _footprint(spec: PersonSpec, bounds: Tensor) -> float:
    """Radius about the feet of a vertical cylinder containing the person."""
    corners = torch.tensor(
        [[bounds[i, 0], bounds[j, 1]] for i in (0, 1) for j in (0, 1)], dtype=torch.float32
    )
    return float((corners - torch.tensor(spec.feet[:2])).norm(dim=-1).max())
