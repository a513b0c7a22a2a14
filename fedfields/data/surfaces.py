"""Ground-truth surfaces: analytic primitives, exact ray casting and Lambertian shading.

Images, depth and instance masks come from closed-form ray-primitive intersections, not
from the volume renderer, so they are exact references for injecting personal content into
scenes and for procedural object collections. World z is up; cameras are OpenGL
camera-to-world; depth is the Euclidean distance t along unit ray directions.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from fedfields.geometry.cameras import Cameras
from fedfields.geometry.rays import pixel_rays

T_MIN = 1e-6  # hits at or nearer than this along a ray are ignored
LIGHT_DIRECTION = (0.3, 0.5, 0.8)  # toward the light, normalised when shading
AMBIENT = 0.35
TEXTURES = ("plain", "checker", "stripes")
_CULL_MARGIN = 1.0 + 1e-4  # bounding spheres grow by this factor so rounding never culls a hit
_TEXTURE_EDGE = 1e-4  # keeps coordinates on faces (exactly +-1) off pattern cell boundaries

Vec3 = tuple[float, float, float]
Mat3 = tuple[Vec3, Vec3, Vec3]
VectorLike = Tensor | Sequence[float]
MatrixLike = Tensor | Sequence[Sequence[float]]
IDENTITY: Mat3 = ((1.0, 0.0, 0.0), (0.0, 1.0, 0.0), (0.0, 0.0, 1.0))
_NUMBERS = (float, int)
"""Python number types `_vec3` converts without torch (bool excluded: type(True) is bool)."""
_SEQUENCES = (tuple, list)
_ROTATION_TOLERANCE = 1e-5
"""|R R^T - I| allowed per entry: torch.allclose's default rtol with atol 1e-5."""


# ------------------------------------------------------------------ values


def _tensor(values: object, like: Tensor) -> Tensor:
    """Values as a tensor with the dtype and device of `like`."""
    return torch.tensor(values, dtype=like.dtype, device=like.device)


def _vec3(value: VectorLike) -> Vec3:
    """Three floats from a tensor, array or sequence.

    Three Python numbers skip torch (the crowd builder makes about a million of these
    calls); float() gives the same float64 values as torch's conversion.
    """
    if _three_numbers(value):
        return (float(value[0]), float(value[1]), float(value[2]))  # type: ignore[index]
    values = torch.as_tensor(value, dtype=torch.float64).reshape(-1).tolist()
    if len(values) != 3:
        raise ValueError(f"expected 3 numbers, got {value!r}")
    return (values[0], values[1], values[2])


def _three_numbers(value: object) -> bool:
    """Whether `value` is a tuple or list of exactly three Python floats or ints."""
    return (
        type(value) in _SEQUENCES
        and len(value) == 3  # type: ignore[arg-type]
        and type(value[0]) in _NUMBERS  # type: ignore[index]
        and type(value[1]) in _NUMBERS  # type: ignore[index]
        and type(value[2]) in _NUMBERS  # type: ignore[index]
    )


def _colour(value: VectorLike) -> Vec3:
    """An RGB triple, checked to lie in [0, 1]."""
    colour = _vec3(value)
    if not all(0.0 <= c <= 1.0 for c in colour):
        raise ValueError(f"colour components must lie in [0, 1], got {colour}")
    return colour


def _rotation(value: MatrixLike) -> Mat3:
    """A proper rotation as nested tuples; rejects matrices that are not orthonormal."""
    if type(value) in _SEQUENCES and len(value) == 3 and all(map(_three_numbers, value)):
        rows = tuple(_vec3(row) for row in value)  # type: ignore[union-attr]
    else:
        matrix = torch.as_tensor(value, dtype=torch.float64)
        if matrix.shape != (3, 3):
            raise ValueError(f"rotation must be 3x3, got shape {tuple(matrix.shape)}")
        rows = tuple(_vec3(row) for row in matrix.tolist())
    _check_rotation(rows)  # type: ignore[arg-type]
    return rows  # type: ignore[return-value]


@functools.lru_cache(maxsize=4096)
def _check_rotation(rows: Mat3) -> None:
    """Raise unless `rows` is orthonormal (R R^T = I within 1e-5) with determinant +1.

    Cached: an object's primitives are all moved by one rotation. Equal keys that differ in a
    zero's sign pass or fail alike, and only the verdict is cached, never the rows.
    """
    for i, row in enumerate(rows):
        for j, other in enumerate(rows):
            expected = 1.0 if i == j else 0.0
            if not abs(_dot(row, other) - expected) <= _ROTATION_TOLERANCE * (1.0 + expected):
                raise ValueError(f"not a rotation matrix: {[list(r) for r in rows]}")
    if _dot(rows[0], _cross(rows[1], rows[2])) < 0:
        raise ValueError(f"not a rotation matrix: {[list(r) for r in rows]}")


def _positive(value: float, name: str) -> float:
    """`value` as a float, rejecting values that are not > 0."""
    if not value > 0:
        raise ValueError(f"{name} must be > 0, got {value}")
    return float(value)


def _unit(value: VectorLike) -> Vec3:
    """The direction of a non-zero vector."""
    x, y, z = _vec3(value)
    norm = math.sqrt(x * x + y * y + z * z)
    if norm == 0:
        raise ValueError("direction must be non-zero")
    return (x / norm, y / norm, z / norm)


def _dot(a: Sequence[float], b: Sequence[float]) -> float:
    """Dot product of two 3-vectors given as floats, summed from 0.0 left to right."""
    return 0.0 + a[0] * b[0] + a[1] * b[1] + a[2] * b[2]


def _negated(a: Vec3) -> Vec3:
    """-a, zeros turned to -0.0 as torch's negation turns them."""
    return (-a[0], -a[1], -a[2])


def _cross(a: Vec3, b: Vec3) -> Vec3:
    """Cross product a x b."""
    return (a[1] * b[2] - a[2] * b[1], a[2] * b[0] - a[0] * b[2], a[0] * b[1] - a[1] * b[0])


# ------------------------------------------------------------------ primitives


@dataclass(frozen=True)
class Material:
    """Surface colour with an optional two-colour solid texture.

    The texture is a function of the primitive's texture coordinates, which span [-1, 1]
    along each local axis; `texture_scale` is the number of pattern cells across that span.
    "stripes" are bands along local z (a box's z axis, the axis of cylinders and capsules,
    world z for spheres); "checker" alternates over all three coordinates.
    """

    colour: Vec3
    texture: Literal["plain", "checker", "stripes"] = "plain"
    texture_colour: Vec3 = (0.0, 0.0, 0.0)
    texture_scale: float = 4.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "colour", _colour(self.colour))
        object.__setattr__(self, "texture_colour", _colour(self.texture_colour))
        if self.texture not in TEXTURES:
            raise ValueError(f"texture must be one of {TEXTURES}, got {self.texture!r}")
        if not self.texture_scale > 0:
            raise ValueError(f"texture_scale must be > 0, got {self.texture_scale}")

    def colour_at(self, coordinates: Tensor) -> Tensor:
        """Colours [R, 3] at texture coordinates [R, 3] in [-1, 1]."""
        base = _tensor(self.colour, coordinates).expand(coordinates.shape[0], 3)
        if self.texture == "plain":
            return base.clone()
        unit = ((coordinates + 1.0) / 2.0).clamp(_TEXTURE_EDGE, 1.0 - _TEXTURE_EDGE)
        cells = torch.floor(self.texture_scale * unit)
        index = cells[:, 2] if self.texture == "stripes" else cells.sum(-1)
        odd = torch.remainder(index, 2.0) == 1.0
        return torch.where(odd[:, None], _tensor(self.texture_colour, coordinates), base)


DEFAULT_MATERIAL = Material((0.8, 0.8, 0.8))


@dataclass(frozen=True)
class Sphere:
    """Sphere; its texture frame is world-aligned, centred at `centre` and scaled by `radius`."""

    centre: Vec3
    radius: float
    material: Material = DEFAULT_MATERIAL

    def __post_init__(self) -> None:
        object.__setattr__(self, "centre", _vec3(self.centre))
        object.__setattr__(self, "radius", _positive(self.radius, "radius"))

    def intersect(self, origins: Tensor, directions: Tensor) -> tuple[Tensor, Tensor]:
        """Nearest hit distance t [R] (inf on miss) and outward unit normal [R, 3]."""
        centre = _tensor(self.centre, origins)
        t = _nearest_positive(*_sphere_interval(origins - centre, directions, self.radius))[0]
        normal = torch.nn.functional.normalize(origins + t[:, None] * directions - centre, dim=-1)
        return t, _zero_missed(t, normal)

    def albedo(self, points: Tensor) -> Tensor:
        """Textured material colour [R, 3] at surface points [R, 3]."""
        return self.material.colour_at((points - _tensor(self.centre, points)) / self.radius)

    def transformed(
        self, rotation: MatrixLike, translation: VectorLike, scale: float = 1.0
    ) -> Sphere:
        """This sphere moved by x -> scale * rotation @ x + translation."""
        move = _Similarity.of(rotation, translation, scale)
        return Sphere(move.point(self.centre), self.radius * move.scale, self.material)

    def bounding_sphere(self) -> tuple[Tensor, float]:
        """(centre [3], radius) of a sphere containing the primitive."""
        return torch.tensor(self.centre), self.radius

    def support(self, direction: VectorLike) -> float:
        """Largest projection x . direction over the primitive (direction normalised)."""
        return _dot(self.centre, _unit(direction)) + self.radius


@dataclass(frozen=True)
class Box:
    """Oriented box; `rotation` maps local to world axes, texture coordinates are local / half."""

    centre: Vec3
    half_size: Vec3
    rotation: Mat3 = IDENTITY
    material: Material = DEFAULT_MATERIAL

    def __post_init__(self) -> None:
        object.__setattr__(self, "centre", _vec3(self.centre))
        half_size = _vec3(self.half_size)
        for value in half_size:
            _positive(value, "half_size")
        object.__setattr__(self, "half_size", half_size)
        object.__setattr__(self, "rotation", _rotation(self.rotation))

    def intersect(self, origins: Tensor, directions: Tensor) -> tuple[Tensor, Tensor]:
        """Nearest hit distance t [R] (inf on miss) and outward unit normal [R, 3]."""
        rotation = _tensor(self.rotation, origins)
        half = _tensor(self.half_size, origins)
        local_origins = (origins - _tensor(self.centre, origins)) @ rotation
        local_directions = directions @ rotation
        low, high = _slab(local_origins, local_directions, -half, half)
        near, near_axis = low.max(-1)
        far, far_axis = high.min(-1)
        t, entering = _nearest_positive(near, far)
        axis = torch.where(entering, near_axis, far_axis)
        along = local_directions.gather(1, axis[:, None]).squeeze(1)
        sign = torch.where(entering, -1.0, 1.0) * torch.where(along < 0, -1.0, 1.0)
        local_normal = torch.nn.functional.one_hot(axis, 3).to(origins.dtype) * sign[:, None]
        return t, _zero_missed(t, local_normal @ rotation.T)

    def albedo(self, points: Tensor) -> Tensor:
        """Textured material colour [R, 3] at surface points [R, 3]."""
        local = (points - _tensor(self.centre, points)) @ _tensor(self.rotation, points)
        return self.material.colour_at(local / _tensor(self.half_size, points))

    def transformed(self, rotation: MatrixLike, translation: VectorLike, scale: float = 1.0) -> Box:
        """This box moved by x -> scale * rotation @ x + translation."""
        move = _Similarity.of(rotation, translation, scale)
        half_size = tuple(h * move.scale for h in self.half_size)
        return Box(move.point(self.centre), half_size, move.frame(self.rotation), self.material)

    def bounding_sphere(self) -> tuple[Tensor, float]:
        """(centre [3], radius) of a sphere containing the primitive."""
        return torch.tensor(self.centre), math.hypot(*self.half_size)

    def support(self, direction: VectorLike) -> float:
        """Largest projection x . direction over the primitive (direction normalised)."""
        unit = _unit(direction)
        local = [_dot(column, unit) for column in zip(*self.rotation, strict=True)]
        return _dot(self.centre, unit) + sum(
            h * abs(c) for h, c in zip(self.half_size, local, strict=True)
        )


@dataclass(frozen=True)
class Cylinder:
    """Capped cylinder from `start` to `end`; texture z runs along the axis."""

    start: Vec3
    end: Vec3
    radius: float
    material: Material = DEFAULT_MATERIAL

    def __post_init__(self) -> None:
        _init_segment(self)

    def intersect(self, origins: Tensor, directions: Tensor) -> tuple[Tensor, Tensor]:
        """Nearest hit distance t [R] (inf on miss) and outward unit normal [R, 3]."""
        frame, length = _segment_frame(self.start, self.end, origins)
        local_origins = (origins - _tensor(self.start, origins)) @ frame.T
        local_directions = directions @ frame.T
        side_near, side_far = _tube(local_origins, local_directions, self.radius)
        cap_near, cap_far = _slab(local_origins[:, 2], local_directions[:, 2], 0.0, length)
        near = torch.maximum(side_near, cap_near)
        far = torch.minimum(side_far, cap_far)
        t, entering = _nearest_positive(near, far)
        on_side = torch.where(entering, side_near >= cap_near, side_far <= cap_far)
        local_points = local_origins + t[:, None] * local_directions
        radial = torch.nn.functional.pad(local_points[:, :2], (0, 1))
        along = torch.where(local_directions[:, 2] < 0, -1.0, 1.0)
        cap = torch.where(entering, -along, along)[:, None] * frame.new_tensor([0.0, 0.0, 1.0])
        local_normal = torch.where(
            on_side[:, None], torch.nn.functional.normalize(radial, dim=-1), cap
        )
        return t, _zero_missed(t, local_normal @ frame)

    def albedo(self, points: Tensor) -> Tensor:
        """Textured material colour [R, 3] at surface points [R, 3]."""
        return self.material.colour_at(_segment_coordinates(self, points, 0.0))

    def transformed(
        self, rotation: MatrixLike, translation: VectorLike, scale: float = 1.0
    ) -> Cylinder:
        """This cylinder moved by x -> scale * rotation @ x + translation."""
        move = _Similarity.of(rotation, translation, scale)
        return Cylinder(
            move.point(self.start), move.point(self.end), self.radius * move.scale, self.material
        )

    def bounding_sphere(self) -> tuple[Tensor, float]:
        """(centre [3], radius) of a sphere containing the primitive."""
        half_length = math.dist(self.start, self.end) / 2
        return _midpoint(self.start, self.end), math.hypot(half_length, self.radius)

    def support(self, direction: VectorLike) -> float:
        """Largest projection x . direction over the primitive (direction normalised)."""
        unit = _unit(direction)
        axis = _unit([e - s for s, e in zip(self.start, self.end, strict=True)])
        radial = math.sqrt(max(0.0, 1.0 - _dot(axis, unit) ** 2))
        return max(_dot(self.start, unit), _dot(self.end, unit)) + self.radius * radial


@dataclass(frozen=True)
class Capsule:
    """Segment from `start` to `end` swept by a ball of `radius`; texture z runs along the axis."""

    start: Vec3
    end: Vec3
    radius: float
    material: Material = DEFAULT_MATERIAL

    def __post_init__(self) -> None:
        _init_segment(self)

    def intersect(self, origins: Tensor, directions: Tensor) -> tuple[Tensor, Tensor]:
        """Nearest hit distance t [R] (inf on miss) and outward unit normal [R, 3].

        The capsule is convex, so a ray's inside interval is the union of those through its
        body (tube between the end planes) and its two end balls.
        """
        frame, length = _segment_frame(self.start, self.end, origins)
        local_origins = (origins - _tensor(self.start, origins)) @ frame.T
        local_directions = directions @ frame.T
        tube_near, tube_far = _tube(local_origins, local_directions, self.radius)
        slab_near, slab_far = _slab(local_origins[:, 2], local_directions[:, 2], 0.0, length)
        body_near = torch.maximum(tube_near, slab_near)
        body_far = torch.minimum(tube_far, slab_far)
        empty = body_near > body_far
        intervals = [
            (torch.where(empty, torch.inf, body_near), torch.where(empty, -torch.inf, body_far))
        ]
        end_offset = local_origins.new_tensor([0.0, 0.0, length])
        for offset in (local_origins, local_origins - end_offset):
            intervals.append(_sphere_interval(offset, local_directions, self.radius))
        near = torch.stack([n for n, _ in intervals], dim=-1).amin(-1)
        far = torch.stack([f for _, f in intervals], dim=-1).amax(-1)
        t = _nearest_positive(near, far)[0]
        local_points = local_origins + t[:, None] * local_directions
        axial = local_points[:, 2].clamp(0.0, length)
        nearest_on_axis = torch.nn.functional.pad(axial[:, None], (2, 0))
        local_normal = torch.nn.functional.normalize(local_points - nearest_on_axis, dim=-1)
        return t, _zero_missed(t, local_normal @ frame)

    def albedo(self, points: Tensor) -> Tensor:
        """Textured material colour [R, 3] at surface points [R, 3]."""
        return self.material.colour_at(_segment_coordinates(self, points, self.radius))

    def transformed(
        self, rotation: MatrixLike, translation: VectorLike, scale: float = 1.0
    ) -> Capsule:
        """This capsule moved by x -> scale * rotation @ x + translation."""
        move = _Similarity.of(rotation, translation, scale)
        return Capsule(
            move.point(self.start), move.point(self.end), self.radius * move.scale, self.material
        )

    def bounding_sphere(self) -> tuple[Tensor, float]:
        """(centre [3], radius) of a sphere containing the primitive."""
        return _midpoint(self.start, self.end), math.dist(self.start, self.end) / 2 + self.radius

    def support(self, direction: VectorLike) -> float:
        """Largest projection x . direction over the primitive (direction normalised)."""
        unit = _unit(direction)
        return max(_dot(self.start, unit), _dot(self.end, unit)) + self.radius


Primitive = Sphere | Box | Cylinder | Capsule


@dataclass(frozen=True)
class SurfaceObject:
    """A named rigid collection of primitives, rendered as one instance."""

    name: str
    primitives: tuple[Primitive, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "primitives", tuple(self.primitives))
        if not self.primitives:
            raise ValueError(f"surface object {self.name!r} has no primitives")

    def transformed(
        self, rotation: MatrixLike, translation: VectorLike, scale: float = 1.0
    ) -> SurfaceObject:
        """This object moved by x -> scale * rotation @ x + translation."""
        return SurfaceObject(
            self.name, tuple(p.transformed(rotation, translation, scale) for p in self.primitives)
        )

    def bounds(self) -> Tensor:
        """Exact axis-aligned bounding box [2, 3] (min and max corners), float32."""
        high = [max(p.support(axis) for p in self.primitives) for axis in IDENTITY]
        low = [-max(p.support(_negated(axis)) for p in self.primitives) for axis in IDENTITY]
        return torch.tensor([low, high], dtype=torch.float32)

    def lowest_z(self) -> float:
        """Height of the object's lowest point, e.g. to stand it on a floor."""
        return -max(p.support((0.0, 0.0, -1.0)) for p in self.primitives)

    def bounding_sphere(self) -> tuple[Tensor, float]:
        """(centre [3], radius) of a sphere containing every primitive; centred on bounds()."""
        bounds = self.bounds().to(torch.float64)
        centre = bounds.mean(0)
        radius = max(
            float(torch.linalg.vector_norm(c.to(torch.float64) - centre)) + r
            for c, r in (p.bounding_sphere() for p in self.primitives)
        )
        return centre.to(torch.float32), radius


@dataclass
class RayHits:
    """Nearest surface hit of each ray; misses have t = inf, zero normal/albedo, instance -1."""

    t: Tensor  # [R]
    normal: Tensor  # [R, 3] outward unit normal
    albedo: Tensor  # [R, 3]
    instance: Tensor  # [R] int64 index of the object hit

    @property
    def hit(self) -> Tensor:
        """[R] bool: the ray hit a surface."""
        return torch.isfinite(self.t)


@dataclass
class SurfaceRender:
    """Shaded images (alpha 1 on hits), depth (inf on misses) and instance ids (-1 on misses)."""

    rgba: Tensor  # [N, H, W, 4]
    depth: Tensor  # [N, H, W]
    instance: Tensor  # [N, H, W] int64


def cast_rays(objects: Sequence[SurfaceObject], origins: Tensor, directions: Tensor) -> RayHits:
    """Nearest hit over all primitives of all objects for rays [R, 3] with unit directions.

    Objects, then their primitives, are tested only on rays that enter their bounding
    sphere before the nearest hit so far, so small figures in large images cost little.
    """
    count = origins.shape[0]
    t = origins.new_full((count,), torch.inf)
    normal = origins.new_zeros((count, 3))
    owner = torch.full((count,), -1, dtype=torch.int64, device=origins.device)  # primitive
    primitives = [p for obj in objects for p in obj.primitives]
    # object index of each primitive, with a trailing -1 that owner == -1 (miss) picks
    object_of = torch.tensor(
        [i for i, obj in enumerate(objects) for _ in obj.primitives] + [-1],
        dtype=torch.int64,
        device=origins.device,
    )
    first = 0
    for obj in objects:
        rows = _rays_reaching(obj.bounding_sphere(), origins, directions, t)
        object_origins, object_directions = origins[rows], directions[rows]
        best_t, best_normal, best_owner = t[rows], normal[rows], owner[rows]
        for index, primitive in enumerate(obj.primitives, start=first):
            tested = _rays_reaching(
                primitive.bounding_sphere(), object_origins, object_directions, best_t
            )
            distance, surface_normal = primitive.intersect(
                object_origins[tested], object_directions[tested]
            )
            nearer = distance < best_t[tested]
            improved = tested[nearer]
            best_t[improved] = distance[nearer]
            best_normal[improved] = surface_normal[nearer]
            best_owner[improved] = index
        t[rows], normal[rows], owner[rows] = best_t, best_normal, best_owner
        first += len(obj.primitives)
    albedo = origins.new_zeros((count, 3))
    for index, primitive in enumerate(primitives):
        rows = (owner == index).nonzero().squeeze(1)
        albedo[rows] = primitive.albedo(origins[rows] + t[rows, None] * directions[rows])
    return RayHits(t=t, normal=normal, albedo=albedo, instance=object_of[owner])


def shade(
    hits: RayHits,
    directions: Tensor,
    light_direction: Sequence[float] = LIGHT_DIRECTION,
    ambient: float = AMBIENT,
) -> Tensor:
    """Lambertian plus ambient colours [R, 3] in [0, 1]; black where rays missed.

    Normals facing away from the viewer (rays starting inside a surface) are flipped, so
    the visible side is the one lit.
    """
    light = torch.nn.functional.normalize(_tensor(light_direction, directions), dim=0)
    facing = torch.where((hits.normal * directions).sum(-1) > 0, -1.0, 1.0)
    lambert = ((hits.normal @ light) * facing).clamp(min=0.0)
    return (hits.albedo * (ambient + (1.0 - ambient) * lambert)[:, None]).clamp(0.0, 1.0)


def render_surfaces(
    objects: Sequence[SurfaceObject],
    cameras: Cameras,
    views: Sequence[int] | None = None,
    background: Sequence[float] | None = None,
    light_direction: Sequence[float] = LIGHT_DIRECTION,
    ambient: float = AMBIENT,
    chunk: int = 65536,
) -> SurfaceRender:
    """Render `objects` from `views` (all by default) at pixel centres, without antialiasing.

    A pixel's alpha is 1 exactly when its centre ray hits, so masks are exact; missed pixels
    are `background` (black when None).
    """
    device = cameras.camera_to_world.device
    view_list = list(range(len(cameras))) if views is None else list(views)
    view_ids = torch.tensor(view_list, dtype=torch.int64, device=device)
    width, height = cameras.width, cameras.height
    pixels = width * height
    total = len(view_list) * pixels
    rgba = torch.empty((total, 4), device=device)
    depth = torch.empty(total, device=device)
    instance = torch.empty(total, dtype=torch.int64, device=device)
    for start in range(0, total, chunk):
        end = min(start + chunk, total)
        index = torch.arange(start, end, device=device)
        pixel = index % pixels
        rays = pixel_rays(cameras, view_ids[index // pixels], pixel // width, pixel % width)
        hits = cast_rays(objects, rays.origins, rays.directions)
        rgb = shade(hits, rays.directions, light_direction, ambient)
        if background is not None:
            rgb = torch.where(hits.hit[:, None], rgb, _tensor(_colour(background), rgb))
        rgba[start:end] = torch.cat([rgb, hits.hit.to(rgb.dtype)[:, None]], dim=-1)
        depth[start:end] = hits.t
        instance[start:end] = hits.instance
    shape = (len(view_list), height, width)
    return SurfaceRender(rgba.view(*shape, 4), depth.view(shape), instance.view(shape))


# ------------------------------------------------------------------ geometry helpers


@dataclass(frozen=True)
class _Similarity:
    """x -> scale * rotation @ x + translation, in float64."""

    rotation: Tensor
    translation: Tensor
    scale: float

    @classmethod
    def of(cls, rotation: MatrixLike, translation: VectorLike, scale: float) -> _Similarity:
        """Validated transform: rotation orthonormal with det +1, scale > 0."""
        matrix = torch.tensor(_rotation(rotation), dtype=torch.float64)
        translation_vector = torch.tensor(_vec3(translation), dtype=torch.float64)
        return cls(matrix, translation_vector, _positive(scale, "scale"))

    def point(self, point: Vec3) -> Vec3:
        """The moved point."""
        moved = self.scale * self.rotation @ torch.tensor(point, dtype=torch.float64)
        return _vec3(moved + self.translation)

    def frame(self, rotation: Mat3) -> Mat3:
        """A local-to-world rotation composed with this transform's rotation."""
        return _rotation((self.rotation @ torch.tensor(rotation, dtype=torch.float64)).tolist())


def _rays_reaching(
    sphere: tuple[Tensor, float], origins: Tensor, directions: Tensor, nearest: Tensor
) -> Tensor:
    """Indices of rays entering the (slightly grown) sphere ahead of them and before `nearest`."""
    centre, radius = sphere
    offset = origins - centre.to(origins)
    near, far = _sphere_interval(offset, directions, radius * _CULL_MARGIN + T_MIN)
    return ((near <= far) & (far > T_MIN) & (near < nearest)).nonzero().squeeze(1)


def _sphere_interval(offset: Tensor, directions: Tensor, radius: float) -> tuple[Tensor, Tensor]:
    """Entry and exit t through a ball at offset = origin - centre; (inf, -inf) on a miss.

    The discriminant uses the perpendicular from the centre to the ray, which stays accurate
    when the ball is small compared to its distance.
    """
    along = (offset * directions).sum(-1)
    perpendicular = offset - along[:, None] * directions
    discriminant = radius**2 - (perpendicular * perpendicular).sum(-1)
    half = discriminant.clamp(min=0.0).sqrt()
    miss = discriminant < 0
    near = torch.where(miss, torch.inf, -along - half)
    return near, torch.where(miss, -torch.inf, -along + half)


def _slab(
    origins: Tensor, directions: Tensor, low: Tensor | float, high: Tensor | float
) -> tuple[Tensor, Tensor]:
    """Entry and exit t of rays through slabs low <= x <= high, coordinate-wise."""
    inverse = 1.0 / torch.where(directions.abs() < 1e-12, 1e-12, directions)
    t0 = (low - origins) * inverse
    t1 = (high - origins) * inverse
    return torch.minimum(t0, t1), torch.maximum(t0, t1)


def _tube(local_origins: Tensor, local_directions: Tensor, radius: float) -> tuple[Tensor, Tensor]:
    """Entry and exit t through the infinite cylinder x^2 + y^2 <= radius^2 (local frame).

    A miss gives (inf, -inf); a ray parallel to the axis inside it gives (-inf, inf).
    """
    origin_xy, direction_xy = local_origins[:, :2], local_directions[:, :2]
    speed = (direction_xy * direction_xy).sum(-1)
    parallel = speed < 1e-12
    speed = speed.clamp(min=1e-12)
    closest_t = -(origin_xy * direction_xy).sum(-1) / speed
    closest = origin_xy + closest_t[:, None] * direction_xy
    discriminant = radius**2 - (closest * closest).sum(-1)
    half = (discriminant.clamp(min=0.0) / speed).sqrt()
    inside = (origin_xy * origin_xy).sum(-1) <= radius**2
    miss = torch.where(parallel, ~inside, discriminant < 0)
    near = torch.where(parallel, -torch.inf, closest_t - half)
    far = torch.where(parallel, torch.inf, closest_t + half)
    return torch.where(miss, torch.inf, near), torch.where(miss, -torch.inf, far)


def _nearest_positive(near: Tensor, far: Tensor) -> tuple[Tensor, Tensor]:
    """(t, entering): the entry t when ahead of the origin, else the exit; inf on miss."""
    entering = near > T_MIN
    t = torch.where(entering, near, far)
    return torch.where((near <= far) & (t > T_MIN), t, torch.inf), entering


def _zero_missed(t: Tensor, normal: Tensor) -> Tensor:
    """Normals with misses zeroed (they are NaN or meaningless there)."""
    return torch.where(torch.isfinite(t)[:, None], normal, 0.0)


def _segment_frame(start: Vec3, end: Vec3, like: Tensor) -> tuple[Tensor, float]:
    """Rows (e1, e2, axis) [3, 3] of a right-handed frame whose z is start -> end, and length."""
    axis = _unit([e - s for s, e in zip(start, end, strict=True)])
    helper = (0.0, 0.0, 1.0) if abs(axis[2]) < 0.9 else (1.0, 0.0, 0.0)
    e1 = _unit(_cross(helper, axis))
    return _tensor((e1, _cross(axis, e1), axis), like), math.dist(start, end)


def _segment_coordinates(primitive: Cylinder | Capsule, points: Tensor, cap: float) -> Tensor:
    """Texture coordinates about the segment's midpoint: radial / radius, axial / half-extent."""
    frame, length = _segment_frame(primitive.start, primitive.end, points)
    local = (points - _tensor(primitive.start, points)) @ frame.T
    half = length / 2
    scale = points.new_tensor([primitive.radius, primitive.radius, half + cap])
    return (local - points.new_tensor([0.0, 0.0, half])) / scale


def _init_segment(primitive: Cylinder | Capsule) -> None:
    """Coerce and validate the fields shared by cylinders and capsules."""
    object.__setattr__(primitive, "start", _vec3(primitive.start))
    object.__setattr__(primitive, "end", _vec3(primitive.end))
    object.__setattr__(primitive, "radius", _positive(primitive.radius, "radius"))
    if math.dist(primitive.start, primitive.end) < 1e-9:
        raise ValueError(f"{type(primitive).__name__} needs distinct start and end")


def _midpoint(a: Vec3, b: Vec3) -> Tensor:
    """Midpoint [3] of two points."""
    return torch.tensor([(x + y) / 2 for x, y in zip(a, b, strict=True)])
