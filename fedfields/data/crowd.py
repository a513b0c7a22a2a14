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
from fedfields.data.surfaces import SurfaceObject, render_surfaces
from fedfields.geometry.cameras import Cameras, project
from fedfields.geometry.rays import image_rays

PARTITIONS = ("directions", "yaw", "random")
CROWD_FORMAT = "fedfields-crowd-1"
ANCHOR_HEIGHT = sum(TORSO_SPAN) / 2  # inside every torso, as a fraction of the height


class CrowdError(ValueError):
    """A crowd cannot be built as asked (too few views, no spot for a user's person)."""


@dataclass(frozen=True)
class BoundingSphere:
    """A sphere that contains the scene's content: persons must stay outside it."""

    centre: tuple[float, float, float]
    radius: float


@dataclass(frozen=True)
class CrowdConfig:
    """How a crowd is drawn: users, their views, their persons, and transient passers-by."""

    users: int = 16
    views_per_user: int = 5
    partition: str = "directions"
    seed: int = 0
    person_height: float = 0.35  # as a fraction of the bounding sphere's radius
    margin: float = 0.08  # the person keeps this fraction of the image size from every edge
    min_person_pixels: int = 12  # at 100x100; scaled with the image area
    transient_probability: float = 0.0  # chance that a view also shows a one-off passer-by
    max_tries: int = 4000

    def __post_init__(self) -> None:
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
    """One user's views: composited images with their person, masks, and the clean views."""

    user: int
    views: tuple[int, ...]  # indices into the source scene
    person: PersonSpec
    rgba: Tensor  # [V, H, W, 4] composited, straight alpha
    clean_rgba: Tensor  # [V, H, W, 4] the source views
    masks: Tensor  # [V, H, W] bool, personal pixels (the user's person and any passers-by)
    transients: tuple[PersonSpec | None, ...]  # per view, the passer-by if one was drawn


@dataclass
class Crowd:
    """A crowd built from one scene: its users, partition and the sphere persons avoid."""

    users: list[UserViews]
    partition: Partition
    sphere: BoundingSphere
    cameras: Cameras
    scene: Scene


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


def visual_hull(scene: Scene, resolution: int = 64) -> tuple[Tensor, Tensor, float]:
    """(occupied [M] bool, voxel centres [M, 3], voxel half-diagonal) carved from the alpha masks.

    A voxel survives when every view that sees its centre finds silhouette within the voxel's
    projected radius there, so the hull contains every point of the object (conservative).
    """
    aabb = scene.aabb.double()
    steps = [torch.linspace(0.0, 1.0, 2 * resolution + 1, dtype=torch.float64)[1::2]] * 3
    grid = torch.stack(torch.meshgrid(*steps, indexing="ij"), dim=-1).reshape(-1, 3)
    centres = aabb[0] + grid * (aabb[1] - aabb[0])
    half_diagonal = float(0.5 * ((aabb[1] - aabb[0]) / resolution).norm())
    occupied = torch.ones(centres.shape[0], dtype=torch.bool)
    cameras = scene.cameras
    for view in range(len(scene)):
        pixels, depth = project(cameras, view, centres)
        silhouette = scene.masks[view].double() > 0.0
        radius = math.ceil(half_diagonal * float(cameras.fx[view]) / max(float(depth.min()), 1e-6))
        dilated = torch.nn.functional.max_pool2d(
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
        keep = torch.ones_like(occupied)
        keep[inside] = dilated[row[inside], column[inside]]
        occupied &= keep
    return occupied, centres.float(), half_diagonal


def partition_views(scene: Scene, sphere: BoundingSphere, config: CrowdConfig) -> Partition:
    """Split the scene's views among users with the configured partitioner."""
    needed = config.users * config.views_per_user
    if needed > len(scene):
        raise CrowdError(
            f"{config.users} users x {config.views_per_user} views needs {needed} views, "
            f"the scene has {len(scene)}"
        )
    directions = viewing_directions(scene.cameras.camera_to_world.numpy(), sphere.centre)
    if config.partition == "directions":
        return direction_clusters(directions, config.users, config.views_per_user, config.seed)
    if config.partition == "yaw":
        return yaw_sectors(directions, config.users, config.views_per_user, config.seed)
    return random_partition(len(scene), config.users, config.views_per_user, config.seed)


def build_crowd(scene: Scene, config: CrowdConfig, progress: bool = True) -> Crowd:
    """Partition the views, place one person per user and composite it into that user's views.

    `scene` must be loaded on a black background so its images are alpha-premultiplied.
    """
    if any(value != 0.0 for value in scene.background):
        raise ValueError("build_crowd needs the scene loaded with background=(0, 0, 0)")
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
        transients: list[PersonSpec | None] = []
        for position, view in enumerate(views):
            passer_by = None
            if rng.random() < config.transient_probability:
                passer_by, _ = _place_person(
                    scene, (view,), sphere, config, rng, f"passer-by in view {view}"
                )
                extra_mask, extra_rgba = _composite(
                    scene, rgba[position : position + 1], (view,), passer_by.build()
                )
                masks[position] |= extra_mask[0]
                rgba[position] = extra_rgba[0]
            transients.append(passer_by)
        users.append(
            UserViews(user, views, spec, rgba, clean[list(views)], masks, tuple(transients))
        )
    return Crowd(users, partition, sphere, scene.cameras, scene)


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
        "bounding_sphere": asdict(crowd.sphere),
        "partition": {"method": crowd.partition.method, **crowd.partition.stats()},
        "heldout_views": list(crowd.partition.left_out),
        "persons": [
            {
                "user": user.user,
                "views": list(user.views),
                **asdict(user.person),
                "anchor": list(user.person.anchor),
            }
            for user in crowd.users
        ],
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
    """One user's transforms.json plus images/, masks/ and clean/ PNGs."""
    for name in ("images", "masks", "clean"):
        (folder / name).mkdir(parents=True)
    cameras = crowd.cameras
    frames = []
    for position, view in enumerate(user.views):
        stem = f"r_{view:03d}.png"
        _png(folder / "images" / stem, user.rgba[position])
        _png(folder / "clean" / stem, user.clean_rgba[position])
        _png(folder / "masks" / stem, user.masks[position, ..., None].float())
        anchor_pixel, _ = project(cameras, view, torch.tensor([user.person.anchor]))
        transient = user.transients[position]
        frames.append(
            {
                "file_path": f"images/{stem}",
                "mask_path": f"masks/{stem}",
                "clean_path": f"clean/{stem}",
                "transform_matrix": cameras.camera_to_world[view].tolist(),
                "fl_x": float(cameras.fx[view]),
                "fl_y": float(cameras.fy[view]),
                "cx": float(cameras.cx[view]),
                "cy": float(cameras.cy[view]),
                "source_view": view,
                "anchor_pixel": anchor_pixel[0].tolist(),
                "personal_pixels": int(user.masks[position].sum()),
                "transient_person": None if transient is None else asdict(transient),
            }
        )
    meta = {
        **_intrinsics_and_bounds(crowd),
        "user": user.user,
        "person": {**asdict(user.person), "anchor": list(user.person.anchor)},
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
    personal_masks: Tensor  # [V, H, W] bool
    clean_images: Tensor  # [V, H, W, 3] composited on the scene's background
    person: dict[str, Any]


def load_crowd_user(
    folder: str | Path,
    downscale: float = 1.0,
    background: tuple[float, float, float] = (1.0, 1.0, 1.0),
) -> CrowdUser:
    """Read `user_NN/` written by `write_crowd`: images, personal masks and clean views."""
    folder = Path(folder)
    scene = load_scene(folder, downscale=downscale, background=background)
    meta = json.loads((folder / "transforms.json").read_text())
    masks, clean = [], []
    for index, frame in enumerate(meta["frames"]):
        for key in ("mask_path", "clean_path"):
            if key not in frame or not (folder / frame[key]).is_file():
                raise SceneError(
                    f"{folder / 'transforms.json'}: frame {index} has no readable '{key}'"
                )
        mask = _read_resized(folder / frame["mask_path"], scene.cameras, "L")[..., 0]
        masks.append(mask > 0.0)
        rgba = _read_resized(folder / frame["clean_path"], scene.cameras, "RGBA")
        bg = torch.tensor(background, dtype=torch.float32)
        clean.append(rgba[..., :3] * rgba[..., 3:] + (1.0 - rgba[..., 3:]) * bg)
    return CrowdUser(scene, torch.stack(masks), torch.stack(clean), meta.get("person", {}))


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
