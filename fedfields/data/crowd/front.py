"""The front layout: one person per user between its cameras and the scene's sphere."""

from __future__ import annotations

import math
import warnings

import numpy as np
import torch
from torch import Tensor
from tqdm.auto import tqdm

from fedfields.data.crowd.compositing import straight_rgba
from fedfields.data.crowd.config import ANCHOR_HEIGHT, CrowdConfig, CrowdError
from fedfields.data.crowd.geometry import BoundingSphere, as_triple, bounding_sphere
from fedfields.data.crowd.partition import partition_views
from fedfields.data.crowd.records import Crowd, PersonSpec, UserViews
from fedfields.data.scene import Scene
from fedfields.data.surfaces import SurfaceObject, render_surfaces
from fedfields.geometry.cameras import Cameras, project
from fedfields.geometry.rays import image_rays


def build_front(scene: Scene, config: CrowdConfig, progress: bool) -> Crowd:
    """One person per user outside the bounding sphere, between the user's cameras and scene."""
    sphere = bounding_sphere(scene)
    partition = partition_views(scene, sphere, config)
    rng = np.random.default_rng(config.seed)
    clean = straight_rgba(scene)
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
            feet=as_triple(anchor - torch.tensor([0.0, 0.0, ANCHOR_HEIGHT * height])),
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
