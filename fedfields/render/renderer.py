"""Render rays and images of any Field: occupancy-grid marching or stratified + hierarchical."""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cache

import torch
from torch import Tensor

from fedfields.fields.base import Field, FieldOutputs
from fedfields.fields.splats import SplatField
from fedfields.geometry.cameras import Cameras
from fedfields.geometry.rays import Rays, image_rays, intersect_aabb
from fedfields.render.occupancy import FixedSamples, OccupancyGrid
from fedfields.render.samplers import importance_bins, stratified_bins
from fedfields.render.splatting import render_splat_outputs
from fedfields.render.volume import (
    CompositeBackend,
    RenderOutputs,
    composite_dense,
    dense_weights,
    render_packed,
)


@dataclass(frozen=True)
class RenderConfig:
    """How rays are sampled: scene bounds, sample counts, marching step, background."""

    near: float = 2.0
    far: float = 6.0
    aabb: tuple[float, ...] = (-1.5, -1.5, -1.5, 1.5, 1.5, 1.5)
    background: tuple[float, float, float] = (1.0, 1.0, 1.0)
    num_samples: int = 64  # stratified samples per ray (without an occupancy grid)
    num_importance: int = 0  # hierarchical resamples per ray (0: off)
    step_size: float = 3.0 * 3**0.5 / 256  # marching step with an occupancy grid
    chunk: int = 8192  # rays per forward pass when rendering images
    composite: CompositeBackend = "auto"  # packed samples: triton on CUDA if it imports, else torch

    @property
    def aabb_tensor(self) -> Tensor:
        return torch.tensor(self.aabb, dtype=torch.float32).view(2, 3)

    def aabb_on(self, device: torch.device) -> Tensor:
        """The scene box [2, 3] resident on `device`: built once, never copied per step."""
        return device_constant(self.aabb, device).view(2, 3)

    def background_on(self, device: torch.device) -> Tensor:
        """The background colour [3] resident on `device`."""
        return device_constant(self.background, device)

    @property
    def max_ray_length(self) -> float:
        """Longest [t_near, t_far] of a unit-direction ray in the box: what marching covers."""
        return min(self.far - self.near, math.dist(self.aabb[:3], self.aabb[3:]))


@cache
def device_constant(values: tuple[float, ...], device: torch.device) -> Tensor:
    """A float32 tensor of `values` made once per device (a host-to-device copy at every call
    would wait for the stream); shared, so never written to."""
    return torch.tensor(values, dtype=torch.float32, device=device)


@dataclass
class RayOutputs(RenderOutputs):
    """`render_rays`' per-ray outputs plus the personal density [S] of every sample it drew.

    For a global+personal field `personal_density` is set (for NeRF-W's L1 sparsity loss on
    transient density) and `uncertainty` [R] is the volume-rendered beta of each ray (NeRF-W
    Eq. 11, without beta_min); other fields leave both None.
    """

    personal_density: Tensor | None = None
    uncertainty: Tensor | None = None


def render_rays(
    field: Field,
    rays: Rays,
    config: RenderConfig,
    occupancy: OccupancyGrid | None = None,
    perturb: bool = False,
    background: Tensor | None = None,
    image_index: Tensor | None = None,
) -> tuple[RayOutputs, int]:
    """Render a batch of rays; returns the outputs and the number of field samples used.

    `background` ([3] or per ray [R, 3]) overrides the config's background colour.
    `image_index` ([R] int64), when given, is passed per sample to `Field.forward` (the image
    whose appearance embedding colours the ray, NeRF-W).
    A background (and the grid, `OccupancyGrid.march`) elsewhere follows the rays' device.
    """
    device = rays.origins.device
    t_near, t_far = intersect_aabb(rays, config.aabb_on(device), config.near, config.far)
    background = config.background_on(device) if background is None else background.to(device)
    if occupancy is not None:
        samples = occupancy.march(
            rays, t_near, t_far, config.step_size, perturb, config.max_ray_length
        )
        directions = rays.directions[samples.ray_index]
        points = rays.origins[samples.ray_index] + samples.t_mid[:, None] * directions
        sample_images = None if image_index is None else image_index[samples.ray_index]
        outputs = field(points, directions, sample_images)
        rendered, weights = render_packed(
            outputs.density, samples.deltas, outputs.rgb, samples.t_mid, samples.ray_index,
            len(rays), background, config.composite,
        )  # fmt: skip
        uncertainty = _packed_uncertainty(outputs, weights, samples.ray_index, len(rays))
        return _with_samples(rendered, outputs, uncertainty), samples.t_mid.numel()
    t_far = torch.maximum(t_far, t_near + 1e-4)  # rays missing the box render the background
    edges = stratified_bins(t_near, t_far, config.num_samples, perturb)
    if config.num_importance > 0:
        with torch.no_grad():
            mids = 0.5 * (edges[:, 1:] + edges[:, :-1])
            density = _coarse_density(field, rays, mids, image_index)
            coarse = dense_weights(density, edges[:, 1:] - edges[:, :-1])
        edges = importance_bins(edges, coarse, config.num_importance, perturb)
    mids = 0.5 * (edges[:, 1:] + edges[:, :-1])
    points = _points(rays, mids)
    directions = rays.directions[:, None, :].expand_as(points)
    sample_images = _sample_images(image_index, mids)
    outputs = field(points.reshape(-1, 3), directions.reshape(-1, 3), sample_images)
    weights = dense_weights(outputs.density.view(mids.shape), edges[:, 1:] - edges[:, :-1])
    rendered = composite_dense(weights, outputs.rgb.view(*mids.shape, 3), mids, background)
    uncertainty = None
    if outputs.uncertainty is not None:
        uncertainty = (weights * outputs.uncertainty.view(mids.shape)).sum(-1)
    return _with_samples(rendered, outputs, uncertainty), mids.numel()


def render_rays_fixed(
    field: Field,
    rays: Rays,
    config: RenderConfig,
    occupancy: OccupancyGrid,
    capacity: int,
    perturb: bool,
    background: Tensor,
    image_index: Tensor | None = None,
) -> tuple[RayOutputs, FixedSamples]:
    """`render_rays` through the grid with `capacity` sample slots: shapes fixed by the batch
    and the capacity, no host sync. Padding slots get zero density, so they add nothing to
    the outputs or gradients; rays not `complete` (overflow) render only their kept samples.
    `image_index` as in `render_rays`; a global+personal field's `personal_density` then
    covers every slot (the caller masks it with `FixedSamples.valid`).
    """
    device = rays.origins.device
    t_near, t_far = intersect_aabb(rays, config.aabb_on(device), config.near, config.far)
    samples = occupancy.march_fixed(
        rays, t_near, t_far, config.step_size, perturb, config.max_ray_length, capacity
    )
    directions = rays.directions[samples.ray_index]
    points = rays.origins[samples.ray_index] + samples.t_mid[:, None] * directions
    sample_images = None if image_index is None else image_index[samples.ray_index]
    outputs = field(points, directions, sample_images)
    density = torch.where(samples.valid, outputs.density, 0.0)
    rendered, weights = render_packed(
        density, samples.deltas, outputs.rgb, samples.t_mid, samples.ray_index, len(rays),
        background, config.composite, samples.kept,
    )  # fmt: skip
    uncertainty = _packed_uncertainty(outputs, weights, samples.ray_index, len(rays))
    return _with_samples(rendered, outputs, uncertainty), samples


def _packed_uncertainty(
    outputs: FieldOutputs, weights: Tensor, ray_index: Tensor, num_rays: int
) -> Tensor | None:
    """Each ray's volume-rendered uncertainty beta_hat [R] from packed samples' weights (a
    padding slot weighs 0), or None for a field without one."""
    if outputs.uncertainty is None:
        return None
    return weights.new_zeros(num_rays).index_add(0, ray_index, weights * outputs.uncertainty)


def _device_of(field: Field) -> torch.device:
    """Where the field's parameters live (CPU for a parameter-free field)."""
    return next(field.parameters(), torch.empty(0)).device


def _sample_images(image_index: Tensor | None, mids: Tensor) -> Tensor | None:
    """Each dense sample's image [R * S] (its ray's), or None without images."""
    return None if image_index is None else image_index[:, None].expand(mids.shape).reshape(-1)


def _coarse_density(field: Field, rays: Rays, mids: Tensor, image_index: Tensor | None) -> Tensor:
    """Density [R, S] at the coarse samples that place the hierarchical ones: as seen in each
    ray's image when images are given (a personal field's transient content), else the
    field's image-free `density`."""
    points = _points(rays, mids).reshape(-1, 3)
    if image_index is None:
        return field.density(points).view(mids.shape)
    directions = rays.directions[:, None, :].expand(*mids.shape, 3).reshape(-1, 3)
    return field(points, directions, _sample_images(image_index, mids)).density.view(mids.shape)


def _points(rays: Rays, t: Tensor) -> Tensor:
    return rays.origins[:, None, :] + t[..., None] * rays.directions[:, None, :]


def _with_samples(
    rendered: RenderOutputs, outputs: FieldOutputs, uncertainty: Tensor | None
) -> RayOutputs:
    """Per-ray outputs with the values the caller's losses need."""
    return RayOutputs(
        rgb=rendered.rgb,
        depth=rendered.depth,
        opacity=rendered.opacity,
        personal_density=outputs.personal_density,
        uncertainty=uncertainty,
    )


@torch.no_grad()
def render_image(
    field: Field,
    cameras: Cameras,
    view: int,
    config: RenderConfig,
    occupancy: OccupancyGrid | None = None,
) -> RenderOutputs:
    """Render one full view in chunks on the field's device; outputs are shaped [H, W, 3] and
    [H, W]. A splat field is rasterised instead (`render_splat_outputs`)."""
    if isinstance(field, SplatField):
        background = config.background_on(_device_of(field))
        return render_splat_outputs(field, cameras.to(_device_of(field)), view, background)
    rays = image_rays(cameras.to(_device_of(field)), view)
    parts = [
        render_rays(field, rays[start : start + config.chunk], config, occupancy)[0]
        for start in range(0, len(rays), config.chunk)
    ]
    height, width = cameras.height, cameras.width
    return RenderOutputs(
        rgb=torch.cat([p.rgb for p in parts]).view(height, width, 3),
        depth=torch.cat([p.depth for p in parts]).view(height, width),
        opacity=torch.cat([p.opacity for p in parts]).view(height, width),
    )
