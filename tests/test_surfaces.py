"""Ray-cast surfaces and procedural figures against closed-form geometry."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np
import pytest
import torch
from torch import Tensor

from fedfields.data.figures import OBJECT_KINDS, TORSO_SPAN, person, place, random_object
from fedfields.data.surfaces import (
    Box,
    Capsule,
    Cylinder,
    Material,
    RayHits,
    Sphere,
    SurfaceObject,
    cast_rays,
    render_surfaces,
    shade,
)
from fedfields.geometry.cameras import Cameras
from fedfields.geometry.rays import image_rays

SIZE, FOCAL, DISTANCE = 64, 80.0, 4.0
TURN_30 = (
    (math.cos(math.pi / 6), -math.sin(math.pi / 6), 0.0),
    (math.sin(math.pi / 6), math.cos(math.pi / 6), 0.0),
    (0.0, 0.0, 1.0),
)


def _rays(origins: Sequence[Sequence[float]], directions: Sequence[Sequence[float]]):
    """float32 origins and unit directions [R, 3]."""
    directions_tensor = torch.nn.functional.normalize(
        torch.tensor(directions, dtype=torch.float32), dim=-1
    )
    return torch.tensor(origins, dtype=torch.float32), directions_tensor


def _look_at(eyes: Sequence[Sequence[float]], size: int = SIZE, focal: float = FOCAL) -> Cameras:
    """Cameras at `eyes` looking at the origin with world z up (OpenGL camera-to-world)."""
    poses = []
    for eye in eyes:
        position = np.asarray(eye, dtype=np.float64)
        back = position / np.linalg.norm(position)
        up_hint = np.array([0.0, 0.0, 1.0]) if abs(back[2]) < 0.99 else np.array([0.0, 1.0, 0.0])
        right = np.cross(up_hint, back)
        right /= np.linalg.norm(right)
        pose = np.eye(4)
        pose[:3, 0], pose[:3, 1], pose[:3, 2], pose[:3, 3] = right, np.cross(back, right), back, eye
        poses.append(pose)
    count = len(poses)
    return Cameras(
        camera_to_world=torch.tensor(np.stack(poses), dtype=torch.float32),
        fx=torch.full((count,), focal),
        fy=torch.full((count,), focal),
        cx=torch.full((count,), size / 2),
        cy=torch.full((count,), size / 2),
        width=size,
        height=size,
    )


def _moved_cameras(
    cameras: Cameras, rotation: np.ndarray, translation: Sequence[float], scale: float
) -> Cameras:
    """Cameras carried along by x -> scale * rotation @ x + translation."""
    pose = cameras.camera_to_world.double().clone()
    matrix = torch.tensor(rotation, dtype=torch.float64)
    pose[:, :3, :3] = matrix @ pose[:, :3, :3]
    pose[:, :3, 3] = scale * pose[:, :3, 3] @ matrix.T + torch.tensor(translation).double()
    return Cameras(pose.float(), cameras.fx, cameras.fy, cameras.cx, cameras.cy, SIZE, SIZE)


def _sphere_t(origins: Tensor, directions: Tensor, centre: Sequence[float], radius: float):
    """Closed-form nearest positive distance to a sphere (float64), inf on a miss."""
    offset = origins.double() - torch.tensor(centre, dtype=torch.float64)
    b = (offset * directions.double()).sum(-1)
    discriminant = b**2 - ((offset * offset).sum(-1) - radius**2)
    root = discriminant.clamp(min=0).sqrt()
    t = torch.where(-b - root > 0, -b - root, -b + root)
    return torch.where((discriminant >= 0) & (t > 0), t, torch.inf)


def _random_rays_at(centre: Tensor, spread: float, count: int, seed: int):
    """Rays from a sphere of radius 3 around `centre` aimed at points within `spread` of it."""
    generator = torch.Generator().manual_seed(seed)
    origins = centre + 3.0 * torch.nn.functional.normalize(
        torch.randn(count, 3, generator=generator), dim=-1
    )
    targets = centre + spread * (2 * torch.rand(count, 3, generator=generator) - 1)
    return origins, torch.nn.functional.normalize(targets - origins, dim=-1)


# ------------------------------------------------------------------ signed distances


def _sdf_sphere(sphere: Sphere) -> Callable[[Tensor], Tensor]:
    centre = torch.tensor(sphere.centre, dtype=torch.float64)
    return lambda p: torch.linalg.vector_norm(p - centre, dim=-1) - sphere.radius


def _sdf_box(box: Box) -> Callable[[Tensor], Tensor]:
    centre = torch.tensor(box.centre, dtype=torch.float64)
    rotation = torch.tensor(box.rotation, dtype=torch.float64)
    half = torch.tensor(box.half_size, dtype=torch.float64)

    def sdf(p: Tensor) -> Tensor:
        q = ((p - centre) @ rotation).abs() - half
        outside = torch.linalg.vector_norm(q.clamp(min=0), dim=-1)
        return outside + q.amax(-1).clamp(max=0)

    return sdf


def _segment_axial(start: Sequence[float], end: Sequence[float], p: Tensor):
    """(axial fraction along start->end, radial distance, length) of points p."""
    a = torch.tensor(start, dtype=torch.float64)
    axis = torch.tensor(end, dtype=torch.float64) - a
    length = float(torch.linalg.vector_norm(axis))
    fraction = ((p - a) @ axis) / length**2
    radial = torch.linalg.vector_norm(p - a - fraction[:, None] * axis, dim=-1)
    return fraction, radial, length


def _sdf_capsule(capsule: Capsule) -> Callable[[Tensor], Tensor]:
    def sdf(p: Tensor) -> Tensor:
        fraction, radial, length = _segment_axial(capsule.start, capsule.end, p)
        beyond = (fraction.clamp(0, 1) - fraction).abs() * length
        return torch.sqrt(radial**2 + beyond**2) - capsule.radius

    return sdf


def _sdf_cylinder(cylinder: Cylinder) -> Callable[[Tensor], Tensor]:
    def sdf(p: Tensor) -> Tensor:
        fraction, radial, length = _segment_axial(cylinder.start, cylinder.end, p)
        q = torch.stack(
            [radial - cylinder.radius, (fraction - 0.5).abs() * length - length / 2], -1
        )
        return torch.linalg.vector_norm(q.clamp(min=0), dim=-1) + q.amax(-1).clamp(max=0)

    return sdf


PRIMITIVES = [
    (Sphere((0.1, -0.2, 0.3), 0.7), _sdf_sphere),
    (Box((0.2, 0.1, -0.1), (0.6, 0.3, 0.45), TURN_30), _sdf_box),
    (Cylinder((-0.3, 0.2, -0.5), (0.4, -0.1, 0.6), 0.35), _sdf_cylinder),
    (Cylinder((0.0, 0.0, -0.4), (0.0, 0.0, 0.4), 0.5), _sdf_cylinder),
    (Capsule((-0.3, 0.2, -0.4), (0.4, -0.1, 0.5), 0.3), _sdf_capsule),
]


# ------------------------------------------------------------------ primitives


def test_sphere_depth_matches_closed_form_on_and_off_axis() -> None:
    d, r, offset = 3.0, 0.8, 0.5
    angle = 0.2
    origins, directions = _rays(
        [(d, 0, 0), (d, offset, 0), (d, 0, 0), (0, 0, 0)],
        [(-1, 0, 0), (-1, 0, 0), (-math.cos(angle), math.sin(angle), 0), (0, 1, 0)],
    )
    t, normal = Sphere((0, 0, 0), r).intersect(origins, directions)
    along, across = d * math.cos(angle), d * math.sin(angle)
    expected = [d - r, d - math.sqrt(r**2 - offset**2), along - math.sqrt(r**2 - across**2), r]
    assert t.tolist() == pytest.approx(expected, abs=1e-5)
    assert normal[0].tolist() == pytest.approx([1, 0, 0], abs=1e-6)
    hit = origins[1] + t[1] * directions[1]
    assert normal[1].tolist() == pytest.approx((hit / r).tolist(), abs=1e-5)
    assert normal[3].tolist() == pytest.approx([0, 1, 0], abs=1e-6)  # outward from inside


def test_box_faces_axis_aligned_and_rotated() -> None:
    box = Box((0.2, -0.1, 0.3), (0.5, 0.3, 0.2))
    origins, directions = _rays(
        [(3, 0, 0.35), (0.3, -0.1, 5), (0.2, -3, 0.3)], [(-1, 0, 0), (0, 0, -1), (0, 1, 0)]
    )
    t, normal = box.intersect(origins, directions)
    assert t.tolist() == pytest.approx([3 - 0.7, 5 - 0.5, 3 - 0.4], abs=1e-5)
    expected_normals = torch.tensor([[1.0, 0, 0], [0, 0, 1], [0, -1, 0]])
    torch.testing.assert_close(normal, expected_normals, atol=1e-6, rtol=0)

    # Turned 30 degrees about z, the ray along -x leaves the centre line through the local
    # y = -0.5 face at distance 0.5 / sin 30 = 1 from the centre (the x face is 1 / cos 30).
    turned = Box((0, 0, 0), (1.0, 0.5, 0.5), TURN_30)
    t, normal = turned.intersect(*_rays([(5, 0, 0)], [(-1, 0, 0)]))
    assert t.item() == pytest.approx(4.0, abs=1e-5)
    sin30, cos30 = math.sin(math.pi / 6), math.cos(math.pi / 6)
    assert normal[0].tolist() == pytest.approx([sin30, -cos30, 0], abs=1e-5)


def test_cylinder_side_and_cap_hits() -> None:
    cylinder = Cylinder((0, 0, -1), (0, 0, 1), 0.5)
    origins, directions = _rays(
        [(3, 0.3, 0), (0.2, 0.1, 4), (0, 0, -3), (3, 0, 1.5), (3, 0, 1.2)],
        [(-1, 0, 0), (0, 0, -1), (0, 0, 1), (-3, 0, -1), (-1, 0, 0)],
    )
    t, normal = cylinder.intersect(origins, directions)
    # the slanted ray reaches x = 0.5 after 2.5 along x, at z = 1.5 - 2.5 / 3 < 1: the side
    expected = [3 - 0.4, 3.0, 2.0, 2.5 * math.sqrt(10) / 3, math.inf]
    assert t.tolist() == pytest.approx(expected, abs=1e-5)
    expected_normals = torch.tensor([[0.8, 0.6, 0], [0, 0, 1], [0, 0, -1], [1, 0, 0], [0, 0, 0]])
    torch.testing.assert_close(normal, expected_normals, atol=1e-5, rtol=0)

    # From inside, the exit: through the side although the ray came in through the top cap,
    # and through the top cap although it came in through the side.
    origins, directions = _rays([(0, 0, 0.95), (0, 0, 0.5)], [(1, 0, -0.2), (0.1, 0, 1)])
    t, normal = cylinder.intersect(origins, directions)
    assert t.tolist() == pytest.approx(
        [0.5 * math.hypot(1, 0.2), 0.5 * math.hypot(0.1, 1)], abs=1e-5
    )
    torch.testing.assert_close(normal, torch.tensor([[1.0, 0, 0], [0, 0, 1]]), atol=1e-5, rtol=0)


def test_capsule_is_nearest_of_its_balls_and_body() -> None:
    capsule = Capsule((0, 0, -0.5), (0, 0, 0.5), 0.4)
    origins, directions = _rays(
        [(3, 0, 0.2), (3, 0, 0.7), (0, 0, 3)], [(-1, 0, 0)] * 2 + [(0, 0, -1)]
    )
    t, normal = capsule.intersect(origins, directions)
    assert t.tolist() == pytest.approx([2.6, 3 - math.sqrt(0.4**2 - 0.2**2), 2.1], abs=1e-5)
    assert normal[2].tolist() == pytest.approx([0, 0, 1], abs=1e-6)

    # A tilted capsule is the union of its capped cylinder and two end balls.
    tilted = Capsule((-0.3, 0.2, -0.4), (0.4, -0.1, 0.5), 0.3)
    origins, directions = _random_rays_at(torch.zeros(3), 1.0, 500, seed=1)
    t, normal = tilted.intersect(origins, directions)
    parts = [
        Sphere(tilted.start, 0.3),
        Sphere(tilted.end, 0.3),
        Cylinder(tilted.start, tilted.end, 0.3),
    ]
    nearest = torch.stack([part.intersect(origins, directions)[0] for part in parts]).amin(0)
    assert torch.isfinite(t).sum() > 100
    torch.testing.assert_close(t, nearest, atol=1e-5, rtol=0)
    points = (origins + t[:, None] * directions).double()[torch.isfinite(t)]
    fraction, _, _ = _segment_axial(tilted.start, tilted.end, points)
    start, end = torch.tensor(tilted.start).double(), torch.tensor(tilted.end).double()
    on_axis = start + fraction.clamp(0, 1)[:, None] * (end - start)
    expected = torch.nn.functional.normalize(points - on_axis, dim=-1)
    torch.testing.assert_close(normal[torch.isfinite(t)].double(), expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize(("primitive", "sdf_of"), PRIMITIVES)
def test_hits_lie_on_surface_with_nothing_nearer(primitive, sdf_of) -> None:
    origins, directions = _random_rays_at(torch.zeros(3), 1.0, 400, seed=0)
    t, normal = primitive.intersect(origins, directions)
    sdf = sdf_of(primitive)
    hit = torch.isfinite(t)
    assert 50 < hit.sum() < 400
    points = (origins + t[:, None] * directions).double()
    assert sdf(points[hit]).abs().max() < 1e-5
    # Marching every ray up to its hit (or 6 units on a miss) never goes inside first.
    far = torch.where(hit, t, 6.0).double()
    fractions = torch.linspace(0, 0.999, 200, dtype=torch.float64)
    samples = (
        origins.double()[:, None]
        + (far[:, None] * fractions)[..., None] * directions[:, None].double()
    )
    assert sdf(samples.reshape(-1, 3)).min() > -1e-6
    assert torch.linalg.vector_norm(normal[hit], dim=-1).tolist() == pytest.approx(
        [1.0] * int(hit.sum()), abs=1e-5
    )
    assert ((normal[hit] * directions[hit]).sum(-1) < 0).all()
    assert (normal[~hit] == 0).all()


def test_misses_are_inf_with_instance_minus_one() -> None:
    sphere = SurfaceObject("ball", (Sphere((0, 0, 0), 0.5),))
    # beside the sphere, and pointing away from a sphere that lies behind the origin
    origins, directions = _rays(
        [(3, 0.6, 0), (3, 0, 0), (3, 0, 0)], [(-1, 0, 0), (1, 0, 0), (-1, 0, 0)]
    )
    hits = cast_rays([sphere], origins, directions)
    assert hits.t[:2].tolist() == [math.inf, math.inf]
    assert hits.instance.tolist() == [-1, -1, 0]
    assert hits.hit.tolist() == [False, False, True]
    assert (hits.normal[:2] == 0).all() and (hits.albedo[:2] == 0).all()
    assert hits.t[2].item() == pytest.approx(2.5)
    empty = cast_rays([], origins, directions)
    assert empty.instance.tolist() == [-1, -1, -1] and not empty.hit.any()


# ------------------------------------------------------------------ textures and shading


def test_checker_and_stripes_follow_local_cells() -> None:
    red, white = (1.0, 0.0, 0.0), (1.0, 1.0, 1.0)
    checker = Material(red, "checker", white, texture_scale=2.0)
    box = Box((1.0, 0.0, 0.0), (1.0, 1.0, 1.0), TURN_30, checker)
    rotation = torch.tensor(TURN_30)
    # Local points on the +z face: cells (0, 0, 1) odd, (1, 0, 1) even, (1, 1, 1) odd.
    local = torch.tensor([[-0.5, -0.5, 1.0], [0.5, -0.5, 1.0], [0.5, 0.5, 1.0]])
    colours = box.albedo(local @ rotation.T + torch.tensor([1.0, 0.0, 0.0]))
    assert colours.tolist() == [list(white), list(red), list(white)]

    striped = Cylinder(
        (0, 0, 0), (0, 0, 2), 0.5, Material(red, "stripes", white, texture_scale=4.0)
    )
    # four bands along the axis: z in [0, 0.5) red, [0.5, 1) white, [1, 1.5) red, [1.5, 2] white
    points = torch.tensor([[0.5, 0.0, z] for z in (0.25, 0.75, 1.25, 1.75, 2.0)])
    colours = striped.albedo(points)
    assert colours.tolist() == [list(red), list(white), list(red), list(white), list(white)]
    assert Sphere((0, 0, 0), 1.0, Material(red)).albedo(points).tolist() == [list(red)] * 5


def test_shade_is_lambert_plus_ambient() -> None:
    light = torch.nn.functional.normalize(torch.tensor([0.3, 0.5, 0.8]), dim=0)
    side = torch.nn.functional.normalize(
        torch.cross(light, torch.tensor([1.0, 0, 0]), dim=0), dim=0
    )
    albedo = torch.tensor([[0.8, 0.4, 0.2]] * 4)
    hits = RayHits(
        t=torch.tensor([1.0, 1.0, 1.0, math.inf]),
        normal=torch.stack([light, side, -light, torch.zeros(3)]),
        albedo=albedo * torch.tensor([[1.0], [1.0], [1.0], [0.0]]),
        instance=torch.tensor([0, 0, 0, -1]),
    )
    # rays meet the first two against their normals; the third sees a back face from inside
    directions = torch.stack([-light, -light, -light, -light])
    rgb = shade(hits, directions, ambient=0.25)
    assert rgb[0].tolist() == pytest.approx([0.8, 0.4, 0.2], abs=1e-6)
    assert rgb[1].tolist() == pytest.approx([0.2, 0.1, 0.05], abs=1e-6)
    assert rgb[2].tolist() == pytest.approx([0.8, 0.4, 0.2], abs=1e-6)
    assert rgb[3].tolist() == [0.0, 0.0, 0.0]


# ------------------------------------------------------------------ rendering


def test_render_sphere_depth_and_silhouette() -> None:
    radius = 0.8
    cameras = _look_at([(DISTANCE, 0, 0)])
    render = render_surfaces([SurfaceObject("ball", (Sphere((0, 0, 0), radius),))], cameras)
    assert render.rgba.shape == (1, SIZE, SIZE, 4)
    centre = SIZE // 2
    rays = image_rays(cameras, 0)
    expected = _sphere_t(rays.origins, rays.directions, (0, 0, 0), radius).reshape(SIZE, SIZE)
    assert render.depth[0, centre, centre].item() == pytest.approx(
        expected[centre, centre].item(), abs=1e-5
    )
    assert render.depth[0, centre, centre].item() == pytest.approx(DISTANCE - radius, abs=1e-3)
    # Pixel-exact mask: alpha is 1 exactly where the closed form hits.
    alpha = render.rgba[0, ..., 3]
    torch.testing.assert_close(alpha, torch.isfinite(expected).float())
    torch.testing.assert_close(render.depth[0].double(), expected, atol=1e-4, rtol=0)
    assert ((render.instance[0] == 0) == (alpha == 1)).all()
    assert (render.instance[0][alpha == 0] == -1).all()
    disc = math.pi * (FOCAL * radius / math.sqrt(DISTANCE**2 - radius**2)) ** 2
    assert alpha.sum().item() == pytest.approx(disc, rel=0.03)


def test_background_fills_missed_pixels() -> None:
    render = render_surfaces(
        [SurfaceObject("ball", (Sphere((0, 0, 0), 0.5),))],
        _look_at([(DISTANCE, 0, 0), (0, DISTANCE, 0)]),
        views=[1],
        background=(0.1, 0.2, 0.3),
        chunk=1000,
    )
    missed = render.rgba[0, 0, 0]
    assert render.rgba.shape[0] == 1
    assert missed.tolist() == pytest.approx([0.1, 0.2, 0.3, 0.0])
    assert math.isinf(render.depth[0, 0, 0].item())


def test_instance_ids_follow_occlusion() -> None:
    behind = SurfaceObject("behind", (Sphere((0, 0, 0), 0.6),))
    front = SurfaceObject("front", (Sphere((1.5, 0, 0), 0.25),))
    cameras = _look_at([(DISTANCE, 0, 0)])
    render = render_surfaces([behind, front], cameras)
    rays = image_rays(cameras, 0)
    t_behind = _sphere_t(rays.origins, rays.directions, (0, 0, 0), 0.6)
    t_front = _sphere_t(rays.origins, rays.directions, (1.5, 0, 0), 0.25)
    expected = torch.where(
        t_front < t_behind, 1, torch.where(torch.isfinite(t_behind), 0, -1)
    ).reshape(SIZE, SIZE)
    assert set(expected.unique().tolist()) == {-1, 0, 1}
    assert (render.instance[0] == expected).all()
    nearest = torch.minimum(t_front, t_behind).reshape(SIZE, SIZE)
    torch.testing.assert_close(render.depth[0].double(), nearest, atol=1e-4, rtol=0)
    swapped = render_surfaces([front, behind], cameras).instance[0]
    assert (swapped == torch.where(expected >= 0, 1 - expected, -1)).all()


def test_transformed_moves_hits_consistently() -> None:
    figure = person(np.random.default_rng(3), height=2.0).transformed(np.eye(3), (0, 0, -1.0), 1.0)
    cameras = _look_at([(DISTANCE, 0, 0.5), (0.5, -DISTANCE, 1.0)])
    base = render_surfaces([figure], cameras)
    hit = base.rgba[..., 3] == 1
    assert hit.sum() > 200

    # Moving the figure along one pixel's ray by delta adds delta to that pixel's depth.
    view, row, column = (int(i) for i in hit.nonzero()[len(hit.nonzero()) // 2])
    rays = image_rays(cameras, view)
    ray = row * SIZE + column
    delta = 0.37
    moved = figure.transformed(np.eye(3), delta * rays.directions[ray], 1.0)
    hits = cast_rays([moved], rays.origins[ray : ray + 1], rays.directions[ray : ray + 1])
    assert hits.t.item() == pytest.approx(base.depth[view, row, column].item() + delta, abs=1e-5)

    # Moving figure and cameras together (turn, scale, shift) leaves the images unchanged,
    # depth scaled with the scene.
    rotation = np.array(TURN_30)
    shift, scale = (0.3, -0.2, 0.4), 1.5
    carried = render_surfaces(
        [figure.transformed(rotation, shift, scale)],
        _moved_cameras(cameras, rotation, shift, scale),
    )
    mismatched = (carried.instance != base.instance).sum().item()
    assert mismatched <= 2  # pixel centres grazing an edge may flip under rounding
    same = (carried.instance == base.instance) & hit
    torch.testing.assert_close(carried.depth[same], scale * base.depth[same], atol=1e-4, rtol=1e-4)


def test_place_turns_about_z_then_moves() -> None:
    marker = SurfaceObject(
        "marker", (Sphere((1.0, 0.0, 0.5), 0.1), Box((0, 0, 0), (0.2, 0.1, 0.3)))
    )
    placed = place(marker, (2.0, 3.0, 1.0), yaw=math.pi / 2)
    assert placed.primitives[0].centre == pytest.approx((2.0, 4.0, 1.5))
    assert placed.primitives[1].rotation[0] == pytest.approx((0.0, -1.0, 0.0))
    assert placed.lowest_z() == pytest.approx(1.0 - 0.3)
    assert placed.name == "marker"


# ------------------------------------------------------------------ figures


@pytest.mark.parametrize("height", [0.5, 1.7])
def test_person_fits_height_stands_on_floor_and_is_deterministic(height: float) -> None:
    palettes = set()
    for seed in range(6):
        figure = person(np.random.default_rng(seed), height)
        low, high = figure.bounds()
        assert high[2].item() <= height + 1e-6
        assert high[2].item() >= 0.8 * height
        assert figure.lowest_z() == pytest.approx(0.0, abs=1e-6)
        assert 10 <= len(figure.primitives) <= 24
        assert figure == person(np.random.default_rng(seed), height)
        palettes.add(frozenset(p.material.colour for p in figure.primitives))
    assert len(palettes) == 6


def test_person_torso_covers_torso_span() -> None:
    height = 0.8
    heights = [fraction * height for fraction in TORSO_SPAN]
    # Horizontal rays at both ends of the span, aimed at the vertical axis from front and side.
    origins, directions = _rays(
        [(5, 0, z) for z in heights] + [(0, -5, z) for z in heights],
        [(-1, 0, 0)] * 2 + [(0, 1, 0)] * 2,
    )
    for seed in range(20):
        hits = cast_rays([person(np.random.default_rng(seed), height)], origins, directions)
        assert (hits.t < 5.0).all()


def test_person_faces_plus_x() -> None:
    figure = person(np.random.default_rng(0))
    # eyes are the small dark spheres; they sit on the +x side of the head
    eyes = [p for p in figure.primitives if p.material.colour == (0.05, 0.05, 0.08)]
    assert len(eyes) == 2
    head = max(
        (p for p in figure.primitives if isinstance(p, Sphere) and p not in eyes),
        key=lambda p: p.radius,
    )
    assert all(eye.centre[0] > head.centre[0] + 0.5 * head.radius for eye in eyes)


@pytest.mark.parametrize("kind", OBJECT_KINDS)
def test_random_object_fits_unit_sphere_and_is_deterministic(kind: str) -> None:
    directions = torch.nn.functional.normalize(
        torch.randn(300, 3, generator=torch.Generator().manual_seed(0), dtype=torch.float64),
        dim=-1,
    )
    for seed in range(4):
        obj = random_object(np.random.default_rng(seed), kind)
        assert obj.name == kind
        centre, radius = obj.bounding_sphere()
        assert radius <= 1.0
        assert torch.linalg.vector_norm(centre).item() < 1e-5
        support = [max(p.support(d) for p in obj.primitives) for d in directions]
        assert max(support) <= 1.0
        assert max(support) > 0.6  # fills a good part of the sphere
        assert obj == random_object(np.random.default_rng(seed), kind)
    assert random_object(np.random.default_rng(0), kind) != random_object(
        np.random.default_rng(1), kind
    )


def test_random_object_kind_choice_and_validation() -> None:
    kinds = {random_object(np.random.default_rng(seed)).name for seed in range(20)}
    assert kinds <= set(OBJECT_KINDS) and len(kinds) >= 3
    with pytest.raises(ValueError, match="kind"):
        random_object(np.random.default_rng(0), "spaceship")


def test_invalid_primitives_are_rejected() -> None:
    with pytest.raises(ValueError, match="rotation"):
        Box((0, 0, 0), (1, 1, 1), ((1, 0, 0), (0, 2, 0), (0, 0, 1)))
    with pytest.raises(ValueError, match="distinct"):
        Capsule((0, 0, 0), (0, 0, 0), 0.1)
    with pytest.raises(ValueError, match="radius"):
        Sphere((0, 0, 0), 0.0)
    with pytest.raises(ValueError, match="texture"):
        Material((0.5, 0.5, 0.5), texture="dots")  # type: ignore[arg-type]


def _bits(values) -> list[str]:
    """Each float's exact bits (float.hex keeps a zero's sign)."""
    return [float(v).hex() for v in np.asarray(values, dtype=np.float64).reshape(-1)]


def test_python_and_tensor_inputs_give_the_same_bits_and_the_same_verdicts() -> None:
    """The crowd builder's pure-Python fast paths (three numbers, nested tuples, cached
    rotation checks) keep torch's float64 values, zero signs included, and its refusals."""
    c, s = math.cos(0.3), math.sin(0.3)
    turn = ((c, -s, -0.0), (s, c, 0.0), (0, 0, 1))
    flipped = ((c, -s, 0.0), (s, c, 0.0), (0.0, 0.0, 1.0))  # equal to `turn` as a cache key
    for rotation in (turn, flipped):
        forms = (rotation, [list(r) for r in rotation], torch.tensor(rotation, dtype=torch.float64))
        boxes = [Box((0.1, -0.0, 2), (1, 1, 1), form) for form in forms]
        assert len({tuple(_bits(box.rotation)) for box in boxes}) == 1
        assert _bits(boxes[0].rotation) == _bits(torch.tensor(rotation, dtype=torch.float64))
        assert _bits(boxes[0].centre) == _bits(torch.tensor([0.1, -0.0, 2.0], dtype=torch.float64))
    for bad in (
        ((1, 0, 0), (0, 1.00003, 0), (0, 0, 1)),  # beyond allclose's 1e-5 + 1e-5 on the diagonal
        ((1, 0, 0), (0, 1, 0), (0, 0, -1)),  # a reflection: determinant -1
        ((1, 0, 0), (0, float("nan"), 0), (0, 0, 1)),
    ):
        for form in (bad, torch.tensor(bad)):
            with pytest.raises(ValueError, match="not a rotation matrix"):
                Box((0, 0, 0), (1, 1, 1), form)
    Box((0, 0, 0), (1, 1, 1), ((1, 0, 0), (0, 1.000008, 0), (0, 0, 1)))  # R R^T within 2e-5
    with pytest.raises(ValueError, match="rotation must be 3x3"):
        Box((0, 0, 0), (1, 1, 1), ((1, 0), (0, 1)))
    with pytest.raises(ValueError, match="expected 3 numbers"):
        Sphere((0, 0), 1.0)
    assert Sphere((True, 0, 0), 1.0).centre == (1.0, 0.0, 0.0)  # bools go through torch


def test_bounds_equal_the_supports_along_torch_axes() -> None:
    """bounds() walks tuple axes; the supports along torch's eye(3) and its negation agree."""
    figure = SurfaceObject(
        "mixed",
        (
            Box((0.2, -0.1, 0.3), (0.3, 0.2, 0.1), TURN_30),
            Capsule((0.0, 0.0, 0.0), (0.0, 0.5, 0.5), 0.1),
            Cylinder((0.4, 0.0, -0.2), (0.4, 0.0, 0.2), 0.05),
            Sphere((-0.5, 0.2, 0.0), 0.2),
        ),
    )
    axes = torch.eye(3, dtype=torch.float64)
    high = [max(p.support(axis) for p in figure.primitives) for axis in axes]
    low = [-max(p.support(-axis) for p in figure.primitives) for axis in axes]
    assert _bits(figure.bounds()) == _bits(torch.tensor([low, high], dtype=torch.float32))
