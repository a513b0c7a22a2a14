"""Rays, samplers, occupancy marching and volume rendering against analytic and naive references."""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import pytest
import torch
from torch import Tensor

from fedfields.fields.base import Field, FieldOutputs
from fedfields.geometry import Cameras, Rays, image_rays, intersect_aabb, pixel_rays
from fedfields.render import OccupancyGrid, RenderConfig, render_rays
from fedfields.render.samplers import importance_bins, stratified_bins
from fedfields.render.volume import composite_dense, composite_packed, dense_weights, packed_weights
from fedfields.train.evaluation import FieldRenderer
from fedfields.train.federated import federated_state
from strategies import parse_app_config

UNIT_BOX = (-1.0, -1.0, -1.0, 1.0, 1.0, 1.0)
COLOUR = (0.2, 0.5, 0.8)


class AnalyticField(Field):
    """Density `sigma` where `inside(points)` holds and 0 elsewhere; one constant colour."""

    def __init__(self, inside: Callable[[Tensor], Tensor], sigma: float) -> None:
        super().__init__()
        self.inside = inside
        self.sigma = sigma

    def density(self, points: Tensor) -> Tensor:
        return torch.where(self.inside(points), self.sigma, 0.0)

    def forward(
        self, points: Tensor, directions: Tensor, image_index: Tensor | None = None
    ) -> FieldOutputs:
        rgb = torch.tensor(COLOUR).expand(points.shape[0], 3)
        return FieldOutputs(density=self.density(points), rgb=rgb)


# ------------------------------------------------------------------ analytic slab


# The slab's faces lie on cell faces of a 32^3 grid over UNIT_BOX (cells 1/16 wide), so an
# occupancy grid built by `update` marks exactly the slab's cells whatever points it draws.
SLAB_LOW, SLAB_HIGH, SLAB_SIGMA = -0.25, 0.375, 3.0
SLAB_ORIGIN_Z = 2.0


def _slab_rays() -> Rays:
    """Rays straight down -z from z=2 at several (x, y) inside the box."""
    xy = torch.tensor([[-0.7, -0.3], [0.0, 0.0], [0.45, 0.8], [0.9, -0.9], [-0.95, 0.6]])
    origins = torch.cat([xy, torch.full((len(xy), 1), SLAB_ORIGIN_Z)], dim=-1)
    directions = torch.tensor([0.0, 0.0, -1.0]).expand(len(xy), 3).clone()
    return Rays(origins, directions)


def _slab_reference(step: float) -> tuple[float, float, float, float]:
    """Exact opacity and depth of the slab, and tolerances for quadrature with spacing `step`.

    opacity = 1 - e^{-sL}; depth = int t s e^{-s(t-t0)} dt = t0(1-e^{-sL}) + (1-e^{-sL})/s
    - L e^{-sL}. Midpoint quadrature integrates a slab whose ends are each moved by at most
    step/2, so the error is at most step times the largest partial derivatives (taken at the
    shortest such slab, L - step): d opacity/dL = s e^{-sL}, |d depth/d t0| <= 1 and
    d depth/d t1 = s e^{-sL} (t0 + L); a 2x margin covers the O(step^2) in-bin error.
    """
    s, length = SLAB_SIGMA, SLAB_HIGH - SLAB_LOW
    t0 = SLAB_ORIGIN_Z - SLAB_HIGH
    attenuation = math.exp(-s * length)
    opacity = 1.0 - attenuation
    depth = t0 * opacity + opacity / s - length * attenuation
    worst = math.exp(-s * (length - step))
    opacity_tol = step * s * worst
    depth_tol = step * (1.0 + s * worst * (t0 + length))
    return opacity, depth, opacity_tol, depth_tol


def _slab_field() -> AnalyticField:
    return AnalyticField(lambda p: (p[:, 2] >= SLAB_LOW) & (p[:, 2] <= SLAB_HIGH), SLAB_SIGMA)


def test_slab_opacity_and_depth_with_dense_stratified_samples() -> None:
    rays = _slab_rays()
    config = RenderConfig(near=0.0, far=10.0, aabb=UNIT_BOX, num_samples=1500, background=(0, 0, 0))
    outputs, num_samples = render_rays(_slab_field(), rays, config, perturb=False)
    step = 2.0 / config.num_samples  # every ray crosses the box over t in [1, 3]
    opacity, depth, opacity_tol, depth_tol = _slab_reference(step)
    assert num_samples == len(rays) * config.num_samples
    torch.testing.assert_close(
        outputs.opacity, torch.full((len(rays),), opacity), atol=opacity_tol, rtol=0
    )
    torch.testing.assert_close(
        outputs.depth, torch.full((len(rays),), depth), atol=depth_tol, rtol=0
    )
    # Constant colour on a black background: rgb = colour * opacity.
    torch.testing.assert_close(outputs.rgb, outputs.opacity[:, None] * torch.tensor(COLOUR))


def test_slab_opacity_and_depth_with_occupancy_grid() -> None:
    torch.manual_seed(0)
    field = _slab_field()
    rays = _slab_rays()
    step = 0.0015
    config = RenderConfig(near=0.0, far=10.0, aabb=UNIT_BOX, step_size=step, background=(1, 1, 1))
    grid = OccupancyGrid(config.aabb_tensor, resolution=32)
    grid.update(field.density, step)
    assert grid.occupied[:, :, 12:22].all() and grid.occupied.sum() == 32 * 32 * 10
    outputs, num_samples = render_rays(field, rays, config, grid, perturb=False)
    opacity, depth, opacity_tol, depth_tol = _slab_reference(step)
    torch.testing.assert_close(
        outputs.opacity, torch.full((len(rays),), opacity), atol=opacity_tol, rtol=0
    )
    torch.testing.assert_close(
        outputs.depth, torch.full((len(rays),), depth), atol=depth_tol, rtol=0
    )
    expected_rgb = outputs.opacity[:, None] * torch.tensor(COLOUR) + (1 - outputs.opacity[:, None])
    torch.testing.assert_close(outputs.rgb, expected_rgb)
    # Empty space is skipped: only the steps inside the 0.625-long slab are evaluated.
    slab_steps = (SLAB_HIGH - SLAB_LOW) / step
    assert num_samples <= len(rays) * (slab_steps + 2)


# ------------------------------------------------------------------ opaque sphere

SPHERE_CENTRE = (0.1, -0.2, 0.05)
SPHERE_RADIUS = 0.5


def _sphere_field() -> AnalyticField:
    centre = torch.tensor(SPHERE_CENTRE)
    return AnalyticField(lambda p: ((p - centre) ** 2).sum(-1) <= SPHERE_RADIUS**2, 1e4)


def _sphere_rays(num: int, impact: tuple[float, float], seed: int) -> tuple[Rays, Tensor]:
    """Rays from 3 units away aimed past the centre at impact parameters in `impact` (as a
    fraction of the radius); returns the rays and their analytic first-hit distance (float64,
    NaN for misses)."""
    generator = torch.Generator().manual_seed(seed)
    centre = torch.tensor(SPHERE_CENTRE)
    towards = torch.nn.functional.normalize(torch.randn(num, 3, generator=generator), dim=-1)
    side = torch.cross(towards, torch.randn(num, 3, generator=generator), dim=-1)
    side = torch.nn.functional.normalize(side, dim=-1)
    low, high = impact
    offset = SPHERE_RADIUS * (low + (high - low) * torch.rand(num, generator=generator))
    origins = centre + 3.0 * towards
    directions = torch.nn.functional.normalize(centre + offset[:, None] * side - origins, dim=-1)
    relative = (origins - centre).double()
    half_b = (relative * directions.double()).sum(-1)
    discriminant = half_b**2 - (relative**2).sum(-1) + SPHERE_RADIUS**2
    return Rays(origins, directions), -half_b - torch.sqrt(discriminant)


@pytest.mark.parametrize("background", [(0.0, 0.0, 0.0), (1.0, 1.0, 1.0)])
def test_opaque_sphere_hits_and_misses(background: tuple[float, float, float]) -> None:
    hits, t_hit = _sphere_rays(24, (0.0, 0.8), seed=1)
    misses, _ = _sphere_rays(24, (1.2, 1.9), seed=2)
    # Two more misses: one leaves the box behind it, one runs parallel to the box outside it.
    outside = Rays(
        torch.tensor([[0.0, 0.0, 3.0], [2.0, 0.0, 0.0]]),
        torch.tensor([[0.0, 0.0, 1.0], [0.0, 1.0, 0.0]]),
    )
    rays = Rays(
        torch.cat([hits.origins, misses.origins, outside.origins]),
        torch.cat([hits.directions, misses.directions, outside.directions]),
    )
    config = RenderConfig(near=0.0, far=8.0, aabb=UNIT_BOX, num_samples=1024, background=background)
    outputs, _ = render_rays(_sphere_field(), rays, config, perturb=False)

    num_hits = len(hits)
    t_near, t_far = intersect_aabb(hits, config.aabb_tensor, config.near, config.far)
    step = (t_far - t_near).double() / config.num_samples
    opacity = outputs.opacity[:num_hits]
    assert (opacity > 1 - 1e-6).all()
    # The first sample inside the sphere takes all the weight; its midpoint lies within one
    # step past the true surface.
    depth = outputs.depth[:num_hits].double() / opacity.double()
    assert (depth >= t_hit - 1e-4).all() and (depth <= t_hit + step + 1e-4).all()
    torch.testing.assert_close(outputs.rgb[:num_hits], torch.tensor(COLOUR).expand(num_hits, 3))

    assert (outputs.opacity[num_hits:] == 0).all()
    expected = torch.tensor(background).expand(len(rays) - num_hits, 3)
    torch.testing.assert_close(outputs.rgb[num_hits:], expected)


def _sphere_cells(resolution: int) -> Tensor:
    """Cells of a grid over UNIT_BOX that touch the sphere (closest point within the radius)."""
    edges = torch.linspace(-1.0, 1.0, resolution + 1)
    low = torch.stack(torch.meshgrid(edges[:-1], edges[:-1], edges[:-1], indexing="ij"), -1)
    high = low + 2.0 / resolution
    centre = torch.tensor(SPHERE_CENTRE)
    closest = torch.minimum(torch.maximum(centre, low), high)
    return ((closest - centre) ** 2).sum(-1) <= SPHERE_RADIUS**2


def test_opaque_sphere_with_conservative_occupancy_grid() -> None:
    rays, t_hit = _sphere_rays(32, (0.0, 0.8), seed=3)
    step = 0.004
    config = RenderConfig(near=0.0, far=8.0, aabb=UNIT_BOX, step_size=step)
    grid = OccupancyGrid(config.aabb_tensor, resolution=16)
    grid.occupied = _sphere_cells(16)
    grid.density = torch.where(grid.occupied, 1e4, 0.0)
    outputs, _ = render_rays(_sphere_field(), rays, config, grid, perturb=False)
    assert (outputs.opacity > 1 - 1e-6).all()
    depth = outputs.depth.double() / outputs.opacity.double()
    assert (depth >= t_hit - 1e-4).all() and (depth <= t_hit + step + 1e-4).all()


def test_updated_grid_keeps_surface_behind_partly_filled_cells() -> None:
    torch.manual_seed(0)
    field = _sphere_field()
    rays, _ = _sphere_rays(32, (0.0, 0.8), seed=4)
    config = RenderConfig(near=0.0, far=8.0, aabb=UNIT_BOX, step_size=0.004)
    grid = OccupancyGrid(config.aabb_tensor, resolution=16)
    for _ in range(5):
        grid.update(field.density, config.step_size)
    outputs, _ = render_rays(field, rays, config, grid, perturb=False)
    assert (outputs.opacity > 0.99).all(), f"{(outputs.opacity < 0.99).sum()} of 32 rays lost"


# ------------------------------------------------------------------ rays


def _cameras(camera_to_world: Tensor, width: int = 7, height: int = 5) -> Cameras:
    """Cameras with distinct fx, fy and a principal point away from the image centre."""
    n = camera_to_world.shape[0]
    return Cameras(
        camera_to_world=camera_to_world.float(),
        fx=torch.full((n,), 6.0),
        fy=torch.full((n,), 4.5),
        cx=torch.full((n,), width / 2),
        cy=torch.full((n,), height / 2),
        width=width,
        height=height,
    )


def _look_at(eye: tuple[float, ...], target: tuple[float, ...]) -> Tensor:
    """OpenGL camera-to-world at `eye` looking at `target` with world +z up."""
    eye_t, target_t = torch.tensor(eye), torch.tensor(target)
    back = torch.nn.functional.normalize(eye_t - target_t, dim=0)
    right = torch.nn.functional.normalize(
        torch.linalg.cross(torch.tensor([0.0, 0.0, 1.0]), back), dim=0
    )
    up = torch.linalg.cross(back, right)
    pose = torch.eye(4)
    pose[:3, :3] = torch.stack([right, up, back], dim=1)
    pose[:3, 3] = eye_t
    return pose


def test_identity_camera_centre_and_corner_rays() -> None:
    cameras = _cameras(torch.eye(4)[None])
    rays = image_rays(cameras, 0)
    centre = rays[torch.tensor([2 * 7 + 3])]  # row 2, column 3 of a 5 x 7 image
    torch.testing.assert_close(centre.directions[0], torch.tensor([0.0, 0.0, -1.0]))
    corner = torch.tensor([(0.5 - 3.5) / 6.0, -(0.5 - 2.5) / 4.5, -1.0])
    torch.testing.assert_close(rays.directions[0], corner / corner.norm())
    torch.testing.assert_close(rays.origins, torch.zeros(35, 3))


def test_posed_camera_rays_project_back_onto_pixel_centres() -> None:
    eye, target = (2.0, -3.0, 1.5), (0.2, 0.1, -0.3)
    pose = _look_at(eye, target)
    cameras = _cameras(pose[None])
    cameras = Cameras(
        camera_to_world=cameras.camera_to_world,
        fx=cameras.fx,
        fy=cameras.fy,
        cx=torch.tensor([3.2]),
        cy=torch.tensor([2.9]),
        width=7,
        height=5,
    )
    rays = image_rays(cameras, 0)
    torch.testing.assert_close(rays.origins, torch.tensor(eye).expand(35, 3))
    torch.testing.assert_close(rays.directions.norm(dim=-1), torch.ones(35))

    # Pixel (row 0, col 0): ((0.5 - cx)/fx, -(0.5 - cy)/fy, -1) rotated into the world.
    corner = pose[:3, :3] @ torch.tensor([(0.5 - 3.2) / 6.0, -(0.5 - 2.9) / 4.5, -1.0])
    torch.testing.assert_close(rays.directions[0], corner / corner.norm())

    # Project every direction back with the pinhole model (camera looks down -z, y up,
    # image rows grow downwards): ray i must come from pixel centre (i % W + .5, i // W + .5).
    local = rays.directions @ pose[:3, :3]
    column = cameras.fx[0] * local[:, 0] / -local[:, 2] + cameras.cx[0]
    row = -cameras.fy[0] * local[:, 1] / -local[:, 2] + cameras.cy[0]
    index = torch.arange(35)
    torch.testing.assert_close(column, (index % 7).float() + 0.5)
    torch.testing.assert_close(row, (index // 7).float() + 0.5)


def test_odd_image_centre_ray_looks_at_target_and_top_row_looks_up() -> None:
    eye, target = (2.0, -3.0, 1.5), (0.2, 0.1, -0.3)
    rays = image_rays(_cameras(_look_at(eye, target)[None]), 0)
    forward = torch.nn.functional.normalize(torch.tensor(target) - torch.tensor(eye), dim=0)
    torch.testing.assert_close(rays.directions[2 * 7 + 3], forward)
    # Row 0 sees higher in the world (world +z is up) than row 4; column 0 is left of column 6.
    assert (
        rays.directions[0 * 7 + 3, 2]
        > rays.directions[2 * 7 + 3, 2]
        > rays.directions[4 * 7 + 3, 2]
    )
    right = torch.linalg.cross(forward, torch.tensor([0.0, 0.0, 1.0]))
    assert rays.directions[2 * 7 + 0] @ right < 0 < rays.directions[2 * 7 + 6] @ right


def test_pixel_rays_pick_the_view_of_each_pixel() -> None:
    poses = torch.stack([torch.eye(4), _look_at((0.0, 3.0, 1.0), (0.0, 0.0, 0.0))])
    cameras = _cameras(poses)
    generator = torch.Generator().manual_seed(0)
    view = torch.randint(0, 2, (20,), generator=generator)
    row = torch.randint(0, 5, (20,), generator=generator)
    column = torch.randint(0, 7, (20,), generator=generator)
    rays = pixel_rays(cameras, view, row, column)
    for i in range(20):
        full = image_rays(cameras, int(view[i]))
        k = int(row[i]) * 7 + int(column[i])
        torch.testing.assert_close(rays.origins[i], full.origins[k])
        torch.testing.assert_close(rays.directions[i], full.directions[k])


# ------------------------------------------------------------------ ray-box intersection


def test_intersect_aabb_matches_brute_force_marching() -> None:
    generator = torch.Generator().manual_seed(0)
    aabb = torch.tensor([[-1.0, -0.5, -0.8], [1.2, 0.7, 0.9]])
    num = 200
    origins = (torch.rand(num, 3, generator=generator) * 6 - 3).double()
    targets = aabb[0] + torch.rand(num, 3, generator=generator) * (aabb[1] - aabb[0]) * 1.6 - 0.3
    directions = torch.nn.functional.normalize(targets.double() - origins, dim=-1)
    directions[:10, 1:] = 0.0  # axis-parallel rays: zero direction components
    directions[:10, 0] = 1.0
    directions[10:20] = -directions[10:20]  # many of these point away from the box
    rays = Rays(origins.float(), directions.float())
    near, far, h = 0.0, 8.0, 1e-3
    t_near, t_far = intersect_aabb(rays, aabb, near, far)

    t = torch.arange(near, far + h / 2, h, dtype=torch.float64)
    points = origins[:, None, :] + t[None, :, None] * directions[:, None, :]
    inside = ((points >= aabb[0].double()) & (points <= aabb[1].double())).all(-1)
    hit = inside.any(-1)
    first = torch.where(inside, t, math.inf).amin(-1)
    last = torch.where(inside, t, -math.inf).amax(-1)
    assert 30 < hit.sum() < num - 30  # both cases well represented
    assert torch.allclose(t_near[hit].double(), first[hit], atol=h + 1e-5, rtol=0)
    assert torch.allclose(t_far[hit].double(), last[hit], atol=h + 1e-5, rtol=0)
    # A ray the marcher never finds inside either misses (t_near >= t_far) or grazes a chord
    # shorter than one march step.
    assert (t_far[~hit] - t_near[~hit] < h).all()


def test_intersect_aabb_clear_misses() -> None:
    aabb = torch.tensor([[-1.0, -1.0, -1.0], [1.0, 1.0, 1.0]])
    rays = Rays(
        torch.tensor([[0.0, 0.0, 3.0], [2.0, 0.0, 0.0], [3.0, 3.0, 0.0], [0.0, 0.0, 3.0]]),
        torch.nn.functional.normalize(
            torch.tensor([[0.0, 0.0, 1.0], [0.0, 1.0, 0.0], [1.0, -0.2, 0.0], [0.0, 0.0, -1.0]]),
            dim=-1,
        ),
    )
    t_near, t_far = intersect_aabb(rays, aabb, 0.0, 10.0)
    assert (t_near[:3] >= t_far[:3]).all()
    # The last ray hits the box from z=3; with far=1.5 it stops short of the box.
    torch.testing.assert_close(torch.stack([t_near[3], t_far[3]]), torch.tensor([2.0, 4.0]))
    t_near, t_far = intersect_aabb(rays[3:], aabb, 0.0, 1.5)
    assert t_near[0] >= t_far[0]


# ------------------------------------------------------------------ samplers


def test_stratified_bins_even_and_jittered() -> None:
    t_near, t_far = torch.tensor([0.5, 2.0, 1.0]), torch.tensor([1.5, 6.0, 1.25])
    edges = stratified_bins(t_near, t_far, 8, perturb=False)
    expected = torch.stack(
        [torch.linspace(float(a), float(b), 9) for a, b in zip(t_near, t_far, strict=True)]
    )
    torch.testing.assert_close(edges, expected)

    torch.manual_seed(0)
    jittered = stratified_bins(t_near, t_far, 8, perturb=True)
    assert jittered.shape == (3, 9)
    assert (jittered.diff(dim=-1) >= 0).all()
    torch.testing.assert_close(jittered[:, 0], t_near)
    torch.testing.assert_close(jittered[:, -1], t_far)
    assert (jittered >= t_near[:, None]).all() and (jittered <= t_far[:, None]).all()
    assert not torch.allclose(jittered, edges)
    # Each inner edge moves by at most half a bin.
    half_bin = ((t_far - t_near) / 16)[:, None]
    assert ((jittered - edges).abs() <= half_bin + 1e-6).all()


def test_importance_bins_concentrate_on_the_heavy_bin() -> None:
    edges = stratified_bins(torch.tensor([2.0, 1.0]), torch.tensor([6.0, 3.0]), 16, False)
    weights = torch.zeros(2, 16)
    weights[0, 5] = 0.9
    weights[1, 11] = 0.3
    merged = importance_bins(edges, weights, 64, perturb=False)
    assert merged.shape == (2, 17 + 64)
    assert (merged.diff(dim=-1) >= 0).all()
    for ray, heavy in enumerate([5, 11]):
        assert torch.isin(edges[ray], merged[ray]).all()
        low, high = edges[ray, heavy], edges[ray, heavy + 1]
        new_in_bin = ((merged[ray] > low) & (merged[ray] < high)).sum()
        assert new_in_bin >= 0.9 * 64


def test_importance_bins_follow_the_inverse_cdf() -> None:
    """With perturb=False the new edges are the inverse piecewise-linear CDF at evenly spaced
    quantiles; the reference is numpy's interpolation over (cdf, edges)."""
    generator = torch.Generator().manual_seed(0)
    edges = torch.sort(torch.rand(3, 11, generator=generator) * 4 + 2, dim=-1).values.double()
    weights = torch.rand(3, 10, generator=generator).double() ** 3
    merged = importance_bins(edges, weights, 32, perturb=False)
    np_weights = (weights + 1e-5).numpy()
    for ray in range(3):
        pdf = np_weights[ray] / np_weights[ray].sum()
        cdf = torch.cat([torch.zeros(1), torch.from_numpy(pdf).cumsum(0)]).numpy()
        u = torch.linspace(0, 1, 32).double().numpy() * (1 - 1e-6)
        new = np.interp(u, cdf, edges[ray].numpy())
        expected = np.sort(np.concatenate([edges[ray].numpy(), new]))
        torch.testing.assert_close(merged[ray], torch.from_numpy(expected))

    torch.manual_seed(1)
    jittered = importance_bins(edges, weights, 32, perturb=True)
    assert (jittered.diff(dim=-1) >= 0).all()
    assert (jittered >= edges[:, :1]).all() and (jittered <= edges[:, -1:]).all()


# ------------------------------------------------------------------ dense vs packed rendering


def test_dense_weights_match_a_naive_product() -> None:
    generator = torch.Generator().manual_seed(0)
    density = torch.rand(3, 7, generator=generator) * 4
    delta = torch.rand(3, 7, generator=generator) * 0.5
    weights = dense_weights(density, delta)
    for r in range(3):
        transmittance = 1.0
        for i in range(7):
            alpha = 1.0 - math.exp(-float(density[r, i] * delta[r, i]))
            assert float(weights[r, i]) == pytest.approx(transmittance * alpha, abs=1e-6)
            transmittance *= 1.0 - alpha


def test_packed_and_dense_rendering_agree_in_values_and_gradients() -> None:
    generator = torch.Generator().manual_seed(0)
    counts = [5, 0, 8, 1, 0, 3]  # samples per ray, with empty rays
    max_count, num_rays = max(counts), len(counts)
    density = torch.rand(num_rays, max_count, generator=generator) * 3
    delta = torch.rand(num_rays, max_count, generator=generator) * 0.4 + 0.05
    t_mid = 2.0 + delta.cumsum(-1) - delta / 2
    rgb = torch.rand(num_rays, max_count, 3, generator=generator)
    valid = torch.arange(max_count)[None, :] < torch.tensor(counts)[:, None]
    background = torch.tensor([0.3, 0.6, 0.9])
    cotangent = torch.rand(num_rays, 5, generator=generator)

    def loss(rendered) -> Tensor:
        values = torch.cat([rendered.rgb, rendered.depth[:, None], rendered.opacity[:, None]], -1)
        return (values * cotangent).sum()

    # Dense: padding samples have zero density, so they add nothing.
    dense_density = torch.where(valid, density, 0.0).requires_grad_()
    dense = composite_dense(dense_weights(dense_density, delta), rgb, t_mid, background)
    (dense_grad,) = torch.autograd.grad(loss(dense), dense_density)

    ray_index = torch.arange(num_rays)[:, None].expand(-1, max_count)[valid]
    packed_density = density[valid].clone().requires_grad_()
    weights = packed_weights(packed_density, delta[valid], ray_index, num_rays)
    packed = composite_packed(weights, rgb[valid], t_mid[valid], ray_index, num_rays, background)
    (packed_grad,) = torch.autograd.grad(loss(packed), packed_density)

    torch.testing.assert_close(packed.rgb, dense.rgb)
    torch.testing.assert_close(packed.depth, dense.depth)
    torch.testing.assert_close(packed.opacity, dense.opacity)
    torch.testing.assert_close(packed.rgb[[1, 4]], background.expand(2, 3))
    torch.testing.assert_close(packed_grad, dense_grad[valid])


# ------------------------------------------------------------------ occupancy marching

GRID_RES = 8
BOX_CELLS = (slice(2, 5), slice(3, 6), slice(1, 7))


def _box_grid(density: float = 1.0) -> OccupancyGrid:
    grid = OccupancyGrid(torch.tensor(UNIT_BOX).view(2, 3), resolution=GRID_RES)
    grid.occupied = torch.zeros((GRID_RES,) * 3, dtype=torch.bool)
    grid.occupied[BOX_CELLS] = True
    grid.density = torch.where(grid.occupied, density, 0.0)
    return grid


def _cell_of(points: Tensor) -> Tensor:
    """Integer cell coordinates [.., 3] of points in UNIT_BOX at GRID_RES."""
    return ((points + 1.0) / 2.0 * GRID_RES).floor().long().clamp(0, GRID_RES - 1)


def _naive_march(rays: Rays, t_near: Tensor, t_far: Tensor, step: float, keep) -> list[list[float]]:
    """Per ray, every midpoint step t_near + (k + 1/2) step < t_far for which `keep(cell)`."""
    result = []
    for r in range(len(rays)):
        kept, k = [], 0
        while float(t_near[r]) < float(t_far[r]):
            t = float(t_near[r]) + (k + 0.5) * step
            if t >= float(t_far[r]):
                break
            cell = _cell_of(rays.origins[r] + t * rays.directions[r])
            if keep(r, cell):
                kept.append(t)
            k += 1
        result.append(kept)
    return result


def _random_rays(num: int, seed: int) -> Rays:
    generator = torch.Generator().manual_seed(seed)
    origins = torch.nn.functional.normalize(torch.randn(num, 3, generator=generator), dim=-1) * 3
    targets = torch.rand(num, 3, generator=generator) * 1.2 - 0.6
    return Rays(origins, torch.nn.functional.normalize(targets - origins, dim=-1))


def test_march_returns_exactly_the_steps_in_occupied_cells() -> None:
    grid = _box_grid()
    rays = _random_rays(40, seed=0)
    t_near, t_far = intersect_aabb(rays, grid.aabb, 0.0, 10.0)
    step = 0.02
    samples = grid.march(rays, t_near, t_far, step, perturb=False)
    assert samples.t_mid.numel() > 0
    assert (samples.ray_index.diff() >= 0).all()
    torch.testing.assert_close(samples.deltas, torch.full_like(samples.t_mid, step))
    points = (
        rays.origins[samples.ray_index]
        + samples.t_mid[:, None] * rays.directions[samples.ray_index]
    )
    cells = _cell_of(points)
    assert grid.occupied[cells[:, 0], cells[:, 1], cells[:, 2]].all()
    assert (samples.t_mid >= t_near[samples.ray_index]).all()
    assert (samples.t_mid <= t_far[samples.ray_index]).all()

    expected = _naive_march(rays, t_near, t_far, step, lambda r, c: bool(grid.occupied[tuple(c)]))
    for r in range(len(rays)):
        got = samples.t_mid[samples.ray_index == r]
        torch.testing.assert_close(got, torch.tensor(expected[r]), atol=1e-5, rtol=0)

    torch.manual_seed(0)
    jittered = grid.march(rays, t_near, t_far, step, perturb=True)
    points = (
        rays.origins[jittered.ray_index]
        + jittered.t_mid[:, None] * rays.directions[jittered.ray_index]
    )
    cells = _cell_of(points)
    assert grid.occupied[cells[:, 0], cells[:, 1], cells[:, 2]].all()
    assert (jittered.t_mid >= t_near[jittered.ray_index]).all()
    assert (jittered.t_mid <= t_far[jittered.ray_index]).all()


def test_march_through_empty_space_returns_no_samples() -> None:
    grid = _box_grid()
    # Occupied cells span x in [-0.5, 0.25), y in [-0.25, 0.5), z in [-0.75, 0.75).
    rays = Rays(
        torch.tensor([[0.6, 0.0, 3.0], [-0.9, -0.9, -3.0], [0.0, 0.0, 5.0]]),
        torch.tensor([[0.0, 0.0, -1.0], [0.0, 0.0, 1.0], [0.0, 0.0, 1.0]]),
    )
    t_near, t_far = intersect_aabb(rays, grid.aabb, 0.0, 10.0)
    samples = grid.march(rays, t_near, t_far, 0.01, perturb=False)
    assert samples.t_mid.numel() == 0 and samples.ray_index.numel() == 0
    # No ray hits the box at all.
    samples = grid.march(rays[2:], t_near[2:], t_far[2:], 0.01, perturb=False)
    assert samples.t_mid.numel() == 0


def test_a_loaded_field_scores_the_same_whatever_ran_before_it() -> None:
    """FieldRenderer.load refreshes its occupancy grid from its own seeded points, so the
    server's score of one field does not depend on the global RNG (e.g. the order in which a
    round's uploads are scored); the global RNG alone would give a different grid."""
    config = parse_app_config({"hash-log2-size": 10, "hash-levels": 4})
    torch.manual_seed(3)
    renderer = FieldRenderer(config)
    state = federated_state(renderer.field)
    grids = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        renderer.load(state)
        grids.append(renderer.occupancy.density.clone())
    assert torch.equal(grids[0], grids[1])
    unseeded = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        grid = OccupancyGrid(renderer.field.aabb)
        grid.update(renderer.field.density, 0.01)
        unseeded.append(grid.density)
    assert not torch.equal(unseeded[0], unseeded[1])
