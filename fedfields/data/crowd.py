"""Crowdsourced scenes: a real scene's views split among users, each photographing their own person.

DecentNeRF's "Novel Blender" benchmark in our words: every user holds a few views from nearby
directions, and a static person (personal content) stands in all of them at one fixed 3D spot
between that user's cameras and the scene, so compositing it over the real image is physically
correct. Persons are ray-cast surfaces (`fedfields.data.surfaces`), never volume renders, and
come with exact per-pixel masks, so leakage of personal content can be measured.
"""

from __future__ import annotations

import json
import math
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image, ImageDraw
from torch import Tensor
from tqdm.auto import tqdm

from fedfields.data.figures import TORSO_SPAN, person, place
from fedfields.data.partition import (
    Partition,
    direction_clusters,
    random_partition,
    viewing_directions,
    yaw_sectors,
)
from fedfields.data.scene import Scene, SceneError, load_scene
from fedfields.data.surfaces import SurfaceObject, SurfaceRender, render_surfaces
from fedfields.geometry.cameras import Cameras, project
from fedfields.geometry.rays import image_rays, intersect_aabb

PARTITIONS = ("directions", "yaw", "random")
LAYOUTS = ("novel-blender", "front")
DEFAULT_PARTITION = {"novel-blender": "yaw", "front": "directions"}
# Fig. 4 of DecentNeRF: 8 users whose views overlap (random split), half heavily occluded.
PRESETS: dict[str, dict[str, Any]] = {
    "novel-blender": {},
    "heterogeneous": {
        "users": 8,
        "views_per_user": 10,
        "partition": "random",
        "heterogeneous": True,
    },
}
CROWD_FORMAT = "fedfields-crowd-1"
ANCHOR_HEIGHT = sum(TORSO_SPAN) / 2  # inside every torso, as a fraction of the height
OBJECT_ALPHA = 0.5  # pixels with more scene alpha are the object (hull silhouettes, coverage)


class CrowdError(ValueError):
    """A crowd cannot be built as asked (too few views, no spot for a user's person)."""


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


@dataclass(frozen=True)
class CrowdConfig:
    """How a crowd is drawn: users, their views, their persons, and transient passers-by.

    layout "novel-blender" (DecentNeRF's benchmark): persons stand on the object's ground
    around it, one static per user plus `transients_per_view` passers-by in every view.
    layout "front": one person per user outside the scene's bounding sphere, toward its cameras.
    """

    users: int = 16
    views_per_user: int = 5
    layout: str = "novel-blender"
    partition: str | None = None  # None: the layout's default (DEFAULT_PARTITION)
    seed: int = 0
    person_height: float = 0.35  # front: as a fraction of the bounding sphere's radius
    # novel-blender: person height as a share of the object height above the ground (0.59 on lego)
    person_scale: float = 0.45
    spot_radius: float = 1.25  # novel-blender: feet within this distance of the object's centre
    transients_per_view: int = 5  # novel-blender: one-off passers-by in every view
    heterogeneous: bool = False  # novel-blender: half the users heavily, half lightly occluded
    heavy_scale: float = 1.35  # heavy users' persons are this much taller
    hull_resolution: int = 128  # novel-blender: voxels per axis of the hull that gives depth
    margin: float = 0.08  # front: the person keeps this fraction of the image size from edges
    min_person_pixels: int = 12  # at 100x100; scaled with the image area
    transient_probability: float = 0.0  # front: chance that a view also shows a passer-by
    max_tries: int = 4000

    def __post_init__(self) -> None:
        if self.layout not in LAYOUTS:
            raise CrowdError(f"layout must be one of {LAYOUTS}, got {self.layout!r}")
        if self.partition is None:
            object.__setattr__(self, "partition", DEFAULT_PARTITION[self.layout])
        if self.partition not in PARTITIONS:
            raise CrowdError(f"partition must be one of {PARTITIONS}, got {self.partition!r}")
        if self.users < 1 or self.views_per_user < 1:
            raise CrowdError(
                f"users ({self.users}) and views per user ({self.views_per_user}) must be >= 1"
            )
        if not 0.0 <= self.transient_probability <= 1.0:
            raise CrowdError(
                f"transient probability must be in [0, 1]: {self.transient_probability}"
            )
        if self.transients_per_view < 0:
            raise CrowdError(f"transients_per_view must be >= 0, got {self.transients_per_view}")
        for key in ("person_scale", "spot_radius", "person_height"):
            if not getattr(self, key) > 0:
                raise CrowdError(f"{key} must be > 0, got {getattr(self, key)}")
        if self.heavy_scale < 1.0:
            raise CrowdError(f"heavy_scale must be >= 1, got {self.heavy_scale}")
        if self.hull_resolution < 16:
            raise CrowdError(f"hull_resolution must be >= 16, got {self.hull_resolution}")
        if self.layout == "front" and self.heterogeneous:
            raise CrowdError("heterogeneous=True needs layout 'novel-blender', got 'front'")
        if self.layout == "novel-blender" and self.transient_probability > 0:
            raise CrowdError(
                f"transient_probability ({self.transient_probability}) is for layout 'front'; "
                "layout 'novel-blender' uses transients_per_view"
            )
        if self.heterogeneous and self.users < 2:
            raise CrowdError(f"heterogeneous needs users >= 2, got {self.users}")


@dataclass(frozen=True)
class PersonSpec:
    """Everything needed to rebuild a person exactly: its random draw and where it stands."""

    seed: int
    height: float
    feet: tuple[float, float, float]
    yaw: float

    def build(self) -> SurfaceObject:
        """The placed person as ray-castable surfaces."""
        figure = person(np.random.default_rng(self.seed), height=self.height)
        return place(figure, torch.tensor(self.feet, dtype=torch.float32), self.yaw)

    @property
    def anchor(self) -> tuple[float, float, float]:
        """The point inside the person's torso on its vertical axis: where it 'is' in 3D.

        `figures.TORSO_SPAN` guarantees the torso covers this height in every draw.
        """
        return (self.feet[0], self.feet[1], self.feet[2] + ANCHOR_HEIGHT * self.height)


@dataclass
class UserViews:
    """One user's views: composited images with their persons, masks, and the clean views."""

    user: int
    views: tuple[int, ...]  # indices into the source scene
    person: PersonSpec  # the static person: the user's personal content
    rgba: Tensor  # [V, H, W, 4] composited, straight alpha
    clean_rgba: Tensor  # [V, H, W, 4] the source views
    masks: Tensor  # [V, H, W] bool, every changed pixel (static person and passers-by)
    transients: tuple[tuple[PersonSpec, ...], ...]  # per view, its passers-by
    personal_masks: Tensor  # [V, H, W] bool, the static person's pixels
    transient_masks: Tensor  # [V, H, W] bool, the passers-by's pixels
    occlusion: str = "uniform"  # "heavy" or "light" in a heterogeneous crowd

    def coverage(self, position: int | None = None) -> dict[str, float]:
        """Fractions of object pixels (scene alpha > 0.5) that persons hide: all views or one."""
        chosen = slice(None) if position is None else slice(position, position + 1)
        scene = self.clean_rgba[chosen, ..., 3] > OBJECT_ALPHA
        total = max(int(scene.sum()), 1)
        return {
            name: int((mask[chosen] & scene).sum()) / total
            for name, mask in (
                ("static", self.personal_masks),
                ("transient", self.transient_masks),
                ("total", self.masks),
            )
        }


@dataclass
class Crowd:
    """A crowd built from one scene: its users, partition, and where persons were placed."""

    users: list[UserViews]
    partition: Partition
    sphere: BoundingSphere
    cameras: Cameras
    scene: Scene
    layout: str = "front"
    ground: Ground | None = None  # novel-blender only


def bounding_sphere(scene: Scene, resolution: int = 64) -> BoundingSphere:
    """A sphere containing the scene: around its silhouettes' visual hull when images carry alpha.

    Without alpha (all masks one) it is the sphere around the scene's box, which is loose but safe.
    """
    aabb = scene.aabb.double()
    if bool((scene.masks >= 1.0).all()):
        centre = 0.5 * (aabb[0] + aabb[1])
        return BoundingSphere(_triple(centre), float(0.5 * (aabb[1] - aabb[0]).norm()))
    occupied, voxel_centres, half_diagonal = visual_hull(scene, resolution)
    points = voxel_centres[occupied]
    if points.shape[0] == 0:
        raise CrowdError("the scene's silhouettes carve away every voxel; are its masks empty?")
    centre = 0.5 * (points.amin(0) + points.amax(0))
    radius = float((points - centre).norm(dim=-1).max()) + half_diagonal
    return BoundingSphere(_triple(centre), radius)


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
    centres = _voxel_centres(scene.aabb, resolution)
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


def partition_views(scene: Scene, sphere: BoundingSphere, config: CrowdConfig) -> Partition:
    """Split the scene's views among users with the configured partitioner."""
    _check_view_count(scene, config)
    directions = viewing_directions(scene.cameras.camera_to_world.numpy(), sphere.centre)
    if config.partition == "directions":
        return direction_clusters(directions, config.users, config.views_per_user, config.seed)
    if config.partition == "yaw":
        return yaw_sectors(directions, config.users, config.views_per_user, config.seed)
    return random_partition(len(scene), config.users, config.views_per_user, config.seed)


def _check_view_count(scene: Scene, config: CrowdConfig) -> None:
    """Refuse early when the users need more views than the scene has."""
    needed = config.users * config.views_per_user
    if needed > len(scene):
        raise CrowdError(
            f"{config.users} users x {config.views_per_user} views needs {needed} views, "
            f"the scene has {len(scene)}"
        )


def build_crowd(scene: Scene, config: CrowdConfig, progress: bool = True) -> Crowd:
    """Partition the views among users and composite their persons (`config.layout`).

    `scene` must be loaded on a black background so its images are alpha-premultiplied.
    """
    if any(value != 0.0 for value in scene.background):
        raise ValueError("build_crowd needs the scene loaded with background=(0, 0, 0)")
    _check_view_count(scene, config)
    if config.layout == "front":
        return _build_front(scene, config, progress)
    return _build_novel_blender(scene, config, progress)


def _build_front(scene: Scene, config: CrowdConfig, progress: bool) -> Crowd:
    """One person per user outside the bounding sphere, between the user's cameras and scene."""
    sphere = bounding_sphere(scene)
    partition = partition_views(scene, sphere, config)
    rng = np.random.default_rng(config.seed)
    clean = _straight_rgba(scene)
    users = []
    for user, views in enumerate(tqdm(partition.groups, desc="persons", disable=not progress)):
        views = tuple(int(v) for v in views)
        spec, shown = _place_person(scene, views, sphere, config, rng, f"user {user}")
        masks, rgba = _composite(scene, clean[list(views)], views, spec.build())
        hidden = torch.tensor([not ok for ok in shown])
        masks[hidden] = False
        rgba[hidden] = clean[[view for view, ok in zip(views, shown, strict=True) if not ok]]
        personal = masks.clone()
        transient_masks = torch.zeros_like(masks)
        transients: list[tuple[PersonSpec, ...]] = []
        for position, view in enumerate(views):
            passers_by: tuple[PersonSpec, ...] = ()
            if rng.random() < config.transient_probability:
                passer_by, _ = _place_person(
                    scene, (view,), sphere, config, rng, f"passer-by in view {view}"
                )
                extra_mask, extra_rgba = _composite(
                    scene, rgba[position : position + 1], (view,), passer_by.build()
                )
                transient_masks[position] = extra_mask[0]
                personal[position] &= ~extra_mask[0]
                masks[position] |= extra_mask[0]
                rgba[position] = extra_rgba[0]
                passers_by = (passer_by,)
            transients.append(passers_by)
        users.append(
            UserViews(
                user,
                views,
                spec,
                rgba,
                clean[list(views)],
                masks,
                tuple(transients),
                personal,
                transient_masks,
            )
        )
    return Crowd(users, partition, sphere, scene.cameras, scene, layout="front")


def _build_novel_blender(scene: Scene, config: CrowdConfig, progress: bool) -> Crowd:
    """DecentNeRF's layout: per view one static person of the user and transient passers-by.

    Everyone stands on the object's ground around it; occlusion against the scene uses the
    depth of a tight visual hull, so persons behind the object are hidden by it.
    """
    occupied = silhouette_hull(scene, config.hull_resolution)
    aabb = scene.aabb.float()
    points = _voxel_centres(aabb, config.hull_resolution)[occupied.reshape(-1)]
    if points.shape[0] == 0:
        raise CrowdError("the scene's silhouettes (alpha > 0.5) carve away every hull voxel")
    voxel = float((aabb[1, 0] - aabb[0, 0]) / config.hull_resolution)
    ground = ground_of(occupied, aabb)
    centre = 0.5 * (points.amin(0) + points.amax(0))
    radius = float((points - centre).norm(dim=-1).max()) + 0.5 * math.sqrt(3.0) * voxel
    sphere = BoundingSphere(_triple(centre), radius)
    partition = partition_views(scene, sphere, config)
    rng = np.random.default_rng(config.seed)
    heavy = set(
        rng.choice(config.users, config.users // 2, replace=False).tolist()
        if config.heterogeneous
        else []
    )
    clean = _straight_rgba(scene)
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


def composite_persons(
    clean: Tensor, scene_depth: Tensor, person_rgba: Tensor, person_depth: Tensor
) -> Tensor:
    """Persons ray-cast at `person_depth` (inf: none) composited into straight-alpha `clean`.

    A person shows where it is nearer than the scene or the scene has no alpha; where the scene
    is nearer, its partial alpha a lays it over the person (rgb = a scene + (1 - a) person);
    alpha becomes 1 wherever a person is. Works on [..., H, W] stacks.
    """
    hit = torch.isfinite(person_depth)
    alpha = clean[..., 3:]
    in_front = hit & ((person_depth < scene_depth) | (alpha[..., 0] == 0))
    behind = hit & ~in_front
    person_rgb = person_rgba[..., :3].to(clean.dtype)
    rgb = torch.where(
        in_front[..., None],
        person_rgb,
        torch.where(
            behind[..., None], alpha * clean[..., :3] + (1.0 - alpha) * person_rgb, clean[..., :3]
        ),
    )
    return torch.cat([rgb, torch.where(hit[..., None], 1.0, alpha)], dim=-1)


def written_change(rgba: Tensor, clean: Tensor) -> Tensor:
    """[..., H, W] bool: pixels whose 8-bit RGBA as written to PNG differs between the two."""
    return (_bytes(rgba) != _bytes(clean)).any(dim=-1)


def _bytes(pixels: Tensor) -> Tensor:
    """Floats in [0, 1] as the 8-bit values `_png` writes."""
    return (pixels.clamp(0.0, 1.0) * 255.0 + 0.5).to(torch.uint8)


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


def _voxel_centres(aabb: Tensor, resolution: int) -> Tensor:
    """[R^3, 3] voxel centres in the x-major order of `visual_hull`."""
    steps = [torch.linspace(0.0, 1.0, 2 * resolution + 1, dtype=torch.float64)[1::2]] * 3
    grid = torch.stack(torch.meshgrid(*steps, indexing="ij"), dim=-1).reshape(-1, 3)
    return (aabb[0].double() + grid * (aabb[1] - aabb[0]).double()).float()


def _place_person(
    scene: Scene,
    views: tuple[int, ...],
    sphere: BoundingSphere,
    config: CrowdConfig,
    rng: np.random.Generator,
    who: str,
) -> tuple[PersonSpec, tuple[bool, ...]]:
    """A random person at a spot that `views` see in front of the scene; which views show it.

    The first spot valid in every view wins. When `max_tries` random spots find none (views
    from directions too far apart, as yaw sectors of an upper-hemisphere capture give), the
    spot valid in the most views is kept with a warning; views that cannot show the person
    physically (behind the scene or out of frame) stay clean. Cheap projections come first.
    """
    cameras = scene.cameras
    centre = torch.tensor(sphere.centre, dtype=torch.float64)
    origins = cameras.camera_to_world[list(views), :3, 3].double()
    towards_users = torch.nn.functional.normalize((origins - centre).mean(0), dim=0)
    nearest_camera = float((origins - centre).norm(dim=-1).min())
    height = config.person_height * sphere.radius
    reach = 0.6 * height  # the figure (arms included) fits in this ball around its anchor
    inner = sphere.radius + reach * 1.05
    outer = nearest_camera - 2.0 * reach
    if outer <= inner:
        raise CrowdError(f"{who}: cameras sit too close to the scene to fit a person")
    area_scale = cameras.width * cameras.height / 10_000
    min_pixels = max(1, round(config.min_person_pixels * area_scale))
    best: tuple[PersonSpec, tuple[bool, ...]] | None = None
    for _ in range(config.max_tries):
        direction = towards_users + torch.from_numpy(rng.normal(scale=0.45, size=3))
        distance = inner + (outer - inner) * rng.random() ** 2
        anchor = centre + distance * torch.nn.functional.normalize(direction, dim=0)
        spec = PersonSpec(
            seed=int(rng.integers(2**31)),
            height=height,
            feet=_triple(anchor - torch.tensor([0.0, 0.0, ANCHOR_HEIGHT * height])),
            yaw=float(math.atan2(towards_users[1], towards_users[0]) + rng.uniform(-0.6, 0.6)),
        )
        fits = [_fits_in_view(cameras, view, anchor, reach, config.margin) for view in views]
        if sum(fits) <= (0 if best is None else sum(best[1])):
            continue
        figure = spec.build()
        figure_centre, figure_radius = figure.bounding_sphere()
        if float((figure_centre.double() - centre).norm()) <= sphere.radius + figure_radius:
            continue
        shown = tuple(
            fit and valid
            for fit, valid in zip(
                fits, _valid_in_views(scene, views, figure, sphere, min_pixels), strict=True
            )
        )
        if all(shown):
            return spec, shown
        if sum(shown) > (0 if best is None else sum(best[1])):
            best = (spec, shown)
    if best is None:
        raise CrowdError(f"{who}: no spot for a person in any of its views {list(views)}")
    missing = [view for view, ok in zip(views, best[1], strict=True) if not ok]
    warnings.warn(
        f"{who}: no spot outside the scene's bounding sphere (radius {sphere.radius:.2f}) is "
        f"visible in all of its views after {config.max_tries} tries; its person is missing "
        f"from views {missing} (views from directions too far apart; --partition directions "
        "avoids this)",
        stacklevel=2,
    )
    return best


def _fits_in_view(cameras: Cameras, view: int, anchor: Tensor, reach: float, margin: float) -> bool:
    """Whether `anchor` projects into the view at least `margin` (a fraction) from its edges.

    The figure may be cut by an edge, as people at the border of a photo are; the camera must
    stay more than `reach` away so that no part of the person is behind it.
    """
    pixels, depth = project(cameras, view, anchor[None])
    x, y = float(pixels[0, 0]), float(pixels[0, 1])
    border_x, border_y = margin * cameras.width, margin * cameras.height
    return (
        float(depth[0]) > 2.0 * reach
        and border_x <= x <= cameras.width - border_x
        and border_y <= y <= cameras.height - border_y
    )


def _valid_in_views(
    scene: Scene,
    views: tuple[int, ...],
    figure: SurfaceObject,
    sphere: BoundingSphere,
    min_pixels: int,
) -> list[bool]:
    """Per view, whether the figure shows enough pixels and is nearer than the scene there.

    A pixel where the scene has any alpha may only show the person if the person is hit before
    the ray enters the bounding sphere; where the scene's alpha is zero nothing is occluded.
    """
    rendered = render_surfaces([figure], scene.cameras, views=list(views))
    valid = []
    for position, view in enumerate(views):
        depth = rendered.depth[position].reshape(-1)
        hit = torch.isfinite(depth)
        covered = hit & (scene.masks[view].reshape(-1) > 0)
        in_front = True
        if bool(covered.any()):
            rays = image_rays(scene.cameras, view)[covered]
            entry = _sphere_entry(rays.origins.double(), rays.directions.double(), sphere)
            in_front = bool((depth[covered].double() < entry).all())
        valid.append(int(hit.sum()) >= min_pixels and in_front)
    return valid


def _sphere_entry(origins: Tensor, directions: Tensor, sphere: BoundingSphere) -> Tensor:
    """Distance along unit-direction rays to where they enter the sphere (inf when they miss)."""
    offset = origins - torch.tensor(sphere.centre, dtype=origins.dtype)
    b = (offset * directions).sum(-1)
    c = (offset * offset).sum(-1) - sphere.radius**2
    discriminant = b * b - c
    entry = -b - discriminant.clamp(min=0).sqrt()
    return torch.where(discriminant > 0, entry, torch.full_like(entry, math.inf))


def _composite(
    scene: Scene, base_rgba: Tensor, views: tuple[int, ...], figure: SurfaceObject
) -> tuple[Tensor, Tensor]:
    """(masks [V, H, W], rgba [V, H, W, 4]): the figure drawn opaquely over `base_rgba`."""
    rendered = render_surfaces([figure], scene.cameras, views=list(views))
    masks = torch.isfinite(rendered.depth)
    rgba = base_rgba.clone()
    rgba[masks] = rendered.rgba[masks].to(rgba.dtype)
    rgba[..., 3][masks] = 1.0
    return masks, rgba


def _straight_rgba(scene: Scene) -> Tensor:
    """[N, H, W, 4] straight-alpha RGBA from a scene loaded on black (premultiplied colours)."""
    alpha = scene.masks[..., None]
    rgb = torch.where(
        alpha > 0, scene.images / alpha.clamp(min=1e-8), torch.zeros_like(scene.images)
    )
    return torch.cat([rgb.clamp(0.0, 1.0), alpha], dim=-1)


def _triple(vector: Tensor | Sequence[float]) -> tuple[float, float, float]:
    """A plain (x, y, z) tuple of floats, for JSON and frozen dataclasses."""
    values = [float(v) for v in vector]
    return (values[0], values[1], values[2])


def _png(path: Path, pixels: Tensor) -> None:
    """Write [H, W, C] floats in [0, 1] (C = 1, 3 or 4) as an 8-bit PNG."""
    array = (pixels.clamp(0.0, 1.0).numpy() * 255.0 + 0.5).astype(np.uint8)
    mode = {1: "L", 3: "RGB", 4: "RGBA"}[array.shape[-1]]
    Image.fromarray(array[..., 0] if mode == "L" else array, mode=mode).save(path)


def write_crowd(crowd: Crowd, out: Path, source: dict[str, Any] | None = None) -> None:
    """Write `out/user_NN/transforms.json` with images, masks and clean views, crowd.json and
    contact_sheet.png. Everything lands in a temporary folder renamed into place at the end."""
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise CrowdError(f"{out}: output folder exists and is not empty")
    staging = out.with_name(f".{out.name}.partial")
    if staging.exists():
        _remove_tree(staging)
    staging.mkdir(parents=True)
    cameras = crowd.cameras
    for user in crowd.users:
        _write_user(staging / f"user_{user.user:02d}", user, crowd, source or {})
    if crowd.partition.left_out:
        _write_heldout(staging / "heldout", crowd)
    summary = {
        "format": CROWD_FORMAT,
        "source": source or {},
        "users": len(crowd.users),
        "image_size": [cameras.width, cameras.height],
        "layout": crowd.layout,
        "ground": None if crowd.ground is None else asdict(crowd.ground),
        "bounding_sphere": asdict(crowd.sphere),
        "partition": {"method": crowd.partition.method, **crowd.partition.stats()},
        "heldout_views": list(crowd.partition.left_out),
        "persons": [
            {
                "user": user.user,
                "views": list(user.views),
                **asdict(user.person),
                "anchor": list(user.person.anchor),
                "occlusion": user.occlusion,
                "coverage": user.coverage(),
            }
            for user in crowd.users
        ],
        "mean_coverage": {
            key: float(np.mean([user.coverage()[key] for user in crowd.users]))
            for key in ("static", "transient", "total")
        },
    }
    (staging / "crowd.json").write_text(json.dumps(summary, indent=2))
    contact_sheet(crowd).save(staging / "contact_sheet.png")
    if out.exists():
        out.rmdir()
    staging.rename(out)


def _write_heldout(folder: Path, crowd: Crowd) -> None:
    """The views no user holds, without personal content: novel views for evaluation."""
    (folder / "images").mkdir(parents=True)
    cameras = crowd.cameras
    clean = _straight_rgba(crowd.scene)
    frames = []
    for view in crowd.partition.left_out:
        stem = f"r_{view:03d}.png"
        _png(folder / "images" / stem, clean[view])
        frames.append(
            {
                "file_path": f"images/{stem}",
                "transform_matrix": cameras.camera_to_world[view].tolist(),
                "source_view": view,
            }
        )
    meta = {
        **_intrinsics_and_bounds(crowd),
        "frames": frames,
    }
    (folder / "transforms.json").write_text(json.dumps(meta, indent=2))


def _intrinsics_and_bounds(crowd: Crowd) -> dict[str, Any]:
    """Top-level transforms.json keys shared by all written views (one camera model)."""
    cameras, scene = crowd.cameras, crowd.scene
    return {
        "w": cameras.width,
        "h": cameras.height,
        "fl_x": float(cameras.fx[0]),
        "fl_y": float(cameras.fy[0]),
        "cx": float(cameras.cx[0]),
        "cy": float(cameras.cy[0]),
        "aabb": scene.aabb.tolist(),
        "near": scene.near,
        "far": scene.far,
    }


def _write_user(folder: Path, user: UserViews, crowd: Crowd, source: dict[str, Any]) -> None:
    """One user's transforms.json plus images/, clean/ and masks/ (union), personal_masks/
    (the static person) and transient_masks/ (passers-by) PNGs."""
    for name in ("images", "masks", "personal_masks", "transient_masks", "clean"):
        (folder / name).mkdir(parents=True)
    cameras = crowd.cameras
    frames = []
    for position, view in enumerate(user.views):
        stem = f"r_{view:03d}.png"
        _png(folder / "images" / stem, user.rgba[position])
        _png(folder / "clean" / stem, user.clean_rgba[position])
        _png(folder / "masks" / stem, user.masks[position, ..., None].float())
        _png(folder / "personal_masks" / stem, user.personal_masks[position, ..., None].float())
        _png(folder / "transient_masks" / stem, user.transient_masks[position, ..., None].float())
        anchor_pixel, _ = project(cameras, view, torch.tensor([user.person.anchor]))
        frames.append(
            {
                "file_path": f"images/{stem}",
                "mask_path": f"masks/{stem}",
                "personal_mask_path": f"personal_masks/{stem}",
                "transient_mask_path": f"transient_masks/{stem}",
                "clean_path": f"clean/{stem}",
                "transform_matrix": cameras.camera_to_world[view].tolist(),
                "fl_x": float(cameras.fx[view]),
                "fl_y": float(cameras.fy[view]),
                "cx": float(cameras.cx[view]),
                "cy": float(cameras.cy[view]),
                "source_view": view,
                "anchor_pixel": anchor_pixel[0].tolist(),
                "personal_pixels": int(user.masks[position].sum()),
                "transient_persons": [asdict(spec) for spec in user.transients[position]],
                "coverage": user.coverage(position),
            }
        )
    meta = {
        **_intrinsics_and_bounds(crowd),
        "user": user.user,
        "person": {**asdict(user.person), "anchor": list(user.person.anchor)},
        "occlusion": user.occlusion,
        "coverage": user.coverage(),
        "bounding_sphere": asdict(crowd.sphere),
        "source": source,
        "frames": frames,
    }
    (folder / "transforms.json").write_text(json.dumps(meta, indent=2))


def _remove_tree(path: Path) -> None:
    """Delete a staging folder left by an interrupted run."""
    for child in sorted(path.rglob("*"), key=lambda p: len(p.parts), reverse=True):
        child.rmdir() if child.is_dir() else child.unlink()
    path.rmdir()


def contact_sheet(crowd: Crowd, columns_of_users: int = 2, zoom: int = 2) -> Image.Image:
    """A grid with one row of views per user, tiles enlarged `zoom` times, masks outlined."""
    cameras = crowd.cameras
    tile_w, tile_h = zoom * cameras.width, zoom * cameras.height
    label_w = 28
    views = max(len(user.views) for user in crowd.users)
    rows = math.ceil(len(crowd.users) / columns_of_users)
    block_w = label_w + views * (tile_w + 2)
    sheet = Image.new("RGB", (columns_of_users * block_w, rows * (tile_h + 2)), "white")
    draw = ImageDraw.Draw(sheet)
    outline_colour = torch.tensor([1.0, 0.0, 1.0])
    for index, user in enumerate(crowd.users):
        x0 = (index // rows) * block_w
        y0 = (index % rows) * (tile_h + 2)
        draw.text((x0 + 2, y0 + tile_h // 2 - 5), f"{user.user:02d}", fill="black")
        for position in range(len(user.views)):
            rgba = user.rgba[position].repeat_interleave(zoom, 0).repeat_interleave(zoom, 1)
            mask = user.masks[position].repeat_interleave(zoom, 0).repeat_interleave(zoom, 1)
            rgb = rgba[..., :3] * rgba[..., 3:] + (1.0 - rgba[..., 3:])
            rgb[_outline(~mask)] = outline_colour  # just outside the mask
            tile = Image.fromarray((rgb.clamp(0, 1).numpy() * 255 + 0.5).astype(np.uint8))
            sheet.paste(tile, (x0 + label_w + position * (tile_w + 2), y0))
    return sheet


def _outline(mask: Tensor) -> Tensor:
    """Pixels of `mask` that touch a pixel outside it (8-neighbourhood; image edges don't count)."""
    padded = torch.nn.functional.pad(mask[None, None].float(), (1, 1, 1, 1), mode="replicate")
    eroded = -torch.nn.functional.max_pool2d(-padded, 3, stride=1)[0, 0]
    return mask & (eroded < 0.5)


@dataclass
class CrowdUser:
    """One user's dataset read back: the scene with personal content, its masks and clean views."""

    scene: Scene  # composited images (what the user photographed)
    personal_masks: Tensor  # [V, H, W] bool, the user's static person: where leakage is measured
    clean_images: Tensor  # [V, H, W, 3] composited on the scene's background
    person: dict[str, Any]
    transient_masks: Tensor  # [V, H, W] bool, passers-by (none in datasets without the key)


def load_crowd_user(
    folder: str | Path,
    downscale: float = 1.0,
    background: tuple[float, float, float] = (1.0, 1.0, 1.0),
) -> CrowdUser:
    """Read `user_NN/` written by `write_crowd`: images, static and transient masks, clean views.

    Datasets written before personal_masks/ existed give their masks/ as the personal masks.
    """
    folder = Path(folder)
    scene = load_scene(folder, downscale=downscale, background=background)
    meta = json.loads((folder / "transforms.json").read_text())
    masks, passers_by, clean = [], [], []
    for index, frame in enumerate(meta["frames"]):
        for key in ("mask_path", "clean_path"):
            if key not in frame or not (folder / frame[key]).is_file():
                raise SceneError(
                    f"{folder / 'transforms.json'}: frame {index} has no readable '{key}'"
                )
        personal = folder / frame.get("personal_mask_path", frame["mask_path"])
        masks.append(_read_resized(personal, scene.cameras, "L")[..., 0] > 0.0)
        if "transient_mask_path" in frame:
            transient = _read_resized(folder / frame["transient_mask_path"], scene.cameras, "L")
            passers_by.append(transient[..., 0] > 0.0)
        else:
            passers_by.append(torch.zeros_like(masks[-1]))
        rgba = _read_resized(folder / frame["clean_path"], scene.cameras, "RGBA")
        bg = torch.tensor(background, dtype=torch.float32)
        clean.append(rgba[..., :3] * rgba[..., 3:] + (1.0 - rgba[..., 3:]) * bg)
    return CrowdUser(
        scene,
        torch.stack(masks),
        torch.stack(clean),
        meta.get("person", {}),
        torch.stack(passers_by),
    )


def _read_resized(path: Path, cameras: Cameras, mode: str) -> Tensor:
    """[H, W, C] floats of an image resized by area averaging to the cameras' size.

    RGBA is averaged premultiplied (as the scene loader does) and returned straight.
    """
    with Image.open(path) as image:
        array = np.asarray(image.convert(mode), dtype=np.float32) / 255.0
    tensor = torch.from_numpy(array.reshape(array.shape[0], array.shape[1], -1))
    if mode == "RGBA":
        tensor = torch.cat([tensor[..., :3] * tensor[..., 3:], tensor[..., 3:]], dim=-1)
    if (tensor.shape[1], tensor.shape[0]) != (cameras.width, cameras.height):
        tensor = torch.nn.functional.interpolate(
            tensor.permute(2, 0, 1)[None],
            size=(cameras.height, cameras.width),
            mode="area",
        )[0].permute(1, 2, 0)
    if mode == "RGBA":
        alpha = tensor[..., 3:]
        rgb = torch.where(alpha > 0, tensor[..., :3] / alpha.clamp(min=1e-8), 0.0)
        tensor = torch.cat([rgb, alpha], dim=-1)
    return tensor


def crowd_from_scene_dir(
    scene_dir: str | Path, config: CrowdConfig, downscale: float = 1.0, progress: bool = True
) -> Crowd:
    """Load a scene on black (premultiplied) and build its crowd."""
    scene = load_scene(scene_dir, downscale=downscale, background=(0.0, 0.0, 0.0))
    return build_crowd(scene, config, progress=progress)


@dataclass
class CrowdData:
    """Every user's views with their masks and clean images, and the held-out clean views."""

    users: list[CrowdUser]
    heldout: Scene | None

    @classmethod
    def load(cls, data_dir: str | Path, downscale: float) -> CrowdData:
        """Read a `fedfields data crowd` folder; a clear error if it is not one."""
        root = Path(data_dir)
        folders = sorted(root.glob("user_*"))
        if not folders:
            raise FileNotFoundError(
                f"{root}: no user_NN folders; build one with `fedfields data crowd`"
            )
        users = [load_crowd_user(folder, downscale=downscale) for folder in folders]
        heldout = None
        if (root / "heldout" / "transforms.json").is_file():
            heldout = load_scene(root / "heldout", downscale=downscale)
        return cls(users, heldout)
