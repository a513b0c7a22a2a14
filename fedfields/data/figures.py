"""Procedural figures built from surface primitives: small people and everyday objects.

People are the personal content that DecentNeRF's "Novel Blender" benchmark puts into each
user's views; objects give distinct shapes for few-shot NeRF collections (FedMeNF). Each
figure is a deterministic function of its numpy Generator. World z is up.
"""

from __future__ import annotations

import colorsys
import itertools
import math
from collections.abc import Callable

import numpy as np

from fedfields.data.surfaces import (
    IDENTITY,
    TEXTURES,
    Box,
    Capsule,
    Cylinder,
    Mat3,
    Material,
    Primitive,
    Sphere,
    SurfaceObject,
    VectorLike,
)

OBJECT_KINDS = ("car", "chair", "table", "lamp", "robot")
# Extremes of the draws below: hips at most 0.544 and shoulders at least 0.658 of `height`.
TORSO_SPAN = (0.55, 0.65)
OBJECT_RADIUS = 0.99  # bounding-sphere radius of random objects: inside the unit sphere
LIGHTEST_SKIN, DARKEST_SKIN = (0.98, 0.84, 0.72), (0.36, 0.22, 0.14)
HAIR_COLOURS = (
    (0.08, 0.06, 0.05),
    (0.35, 0.2, 0.1),
    (0.85, 0.7, 0.4),
    (0.6, 0.25, 0.1),
    (0.62, 0.62, 0.6),
)


def person(rng: np.random.Generator, height: float = 0.5) -> SurfaceObject:
    """A standing person with feet on z = 0, facing +x, at most `height` tall.

    Proportions, arm pose, skin, clothes (shirt texture, sleeve length) and headwear (hair,
    hat or none) come from `rng`, so different draws look clearly different. In every draw
    the torso spans at least TORSO_SPAN (fractions of `height`) on the vertical axis.
    """
    if not height > 0:
        raise ValueError(f"height must be > 0, got {height}")
    skin = Material(_skin(rng))
    shirt_hue = rng.random()
    shirt = Material(
        _hsv(shirt_hue, rng.uniform(0.5, 0.9), rng.uniform(0.55, 0.95)),
        texture=str(rng.choice(TEXTURES)),
        texture_colour=_hsv((shirt_hue + 0.5) % 1.0, rng.uniform(0.1, 0.6), rng.uniform(0.8, 1.0)),
        texture_scale=rng.uniform(3.0, 6.0),
    )
    trouser_hue = (shirt_hue + rng.uniform(0.25, 0.75)) % 1.0
    trousers = Material(_hsv(trouser_hue, rng.uniform(0.3, 0.8), rng.uniform(0.2, 0.55)))
    shoes = Material(_hsv(rng.random(), rng.uniform(0.0, 0.5), rng.uniform(0.05, 0.3)))
    forearms = shirt if rng.random() < 0.5 else skin  # long or short sleeves

    # Body plan for a figure about 1 tall; scaled to the drawn height at the end.
    hip = rng.uniform(0.42, 0.5)
    torso = rng.uniform(0.28, 0.34)
    half_width, half_depth = rng.uniform(0.1, 0.14), rng.uniform(0.055, 0.075)
    leg_radius = rng.uniform(0.3, 0.4) * half_width
    leg_offset = rng.uniform(0.45, 0.6) * half_width
    shoe_height, shoe_length = rng.uniform(0.03, 0.05), rng.uniform(0.05, 0.07)
    arm_radius = rng.uniform(0.025, 0.035)
    upper_arm, forearm = rng.uniform(0.14, 0.17), rng.uniform(0.13, 0.16)
    head_radius, neck = rng.uniform(0.065, 0.08), rng.uniform(0.02, 0.04)
    shoulder_z = hip + torso

    primitives: list[Primitive] = [
        Box((0.0, 0.0, hip + torso / 2), (half_depth, half_width, torso / 2), material=shirt)
    ]
    for side in (-1.0, 1.0):
        y = side * leg_offset
        primitives.append(Capsule((0.0, y, leg_radius), (0.0, y, hip), leg_radius, trousers))
        shoe_centre = (shoe_length - leg_radius, y, shoe_height / 2)
        shoe_half = (shoe_length, 1.1 * leg_radius, shoe_height / 2)
        primitives.append(Box(shoe_centre, shoe_half, material=shoes))
        spread, swing = rng.uniform(0.08, 0.3), rng.uniform(-0.35, 0.35)
        shoulder = np.array([0.0, side * (half_width + arm_radius), shoulder_z - 1.5 * arm_radius])
        elbow = shoulder + upper_arm * _limb(swing, side * spread)
        hand = elbow + forearm * _limb(swing + rng.uniform(0.0, 0.6), side * spread)
        primitives.append(Capsule(shoulder, elbow, arm_radius, shirt))
        primitives.append(Capsule(elbow, hand, arm_radius, forearms))
        primitives.append(Sphere(hand, 1.25 * arm_radius, skin))

    head = np.array([0.0, 0.0, shoulder_z + neck + 0.85 * head_radius])
    primitives.append(Cylinder((0.0, 0.0, shoulder_z - 0.01), head, 0.45 * head_radius, skin))
    primitives.append(Sphere(head, head_radius, skin))
    eyes = Material((0.05, 0.05, 0.08))
    for side in (-1.0, 1.0):
        eye = head + 0.93 * head_radius * _normalised_vector((1.0, side * 0.38, 0.2))
        primitives.append(Sphere(eye, 0.14 * head_radius, eyes))
    primitives.extend(_headwear(rng, head, head_radius))

    figure = SurfaceObject("person", tuple(primitives))
    scale = height * rng.uniform(0.85, 1.0) / float(figure.bounds()[1, 2])
    return figure.transformed(IDENTITY, (0.0, 0.0, 0.0), scale)


def random_object(rng: np.random.Generator, kind: str | None = None) -> SurfaceObject:
    """A random object of `kind` (one of OBJECT_KINDS; random when None), facing +x.

    Its bounding sphere is centred at the origin with radius OBJECT_RADIUS (< 1).
    """
    if kind is None:
        kind = str(rng.choice(OBJECT_KINDS))
    if kind not in OBJECT_KINDS:
        raise ValueError(f"kind must be one of {OBJECT_KINDS}, got {kind!r}")
    obj = SurfaceObject(kind, tuple(_BUILDERS[kind](rng)))
    centre, radius = obj.bounding_sphere()
    scale = OBJECT_RADIUS / radius
    return obj.transformed(IDENTITY, -scale * centre.double(), scale)


def place(obj: SurfaceObject, position: VectorLike, yaw: float) -> SurfaceObject:
    """`obj` turned by `yaw` radians about +z, then moved to `position`.

    A figure facing +x then faces (cos yaw, sin yaw, 0); yaw = atan2(dy, dx) of the offset
    to a camera turns it toward that camera.
    """
    return obj.transformed(_rotation_z(yaw), position, 1.0)


# ------------------------------------------------------------------ object builders


def _car(rng: np.random.Generator) -> list[Primitive]:
    """Body and cabin boxes, four wheels, head and tail lights; wheels on z = 0."""
    length, width = rng.uniform(1.6, 2.2), rng.uniform(0.75, 0.95)
    wheel_radius, wheel_width = rng.uniform(0.15, 0.22), rng.uniform(0.12, 0.18)
    clearance = wheel_radius * rng.uniform(0.55, 0.85)
    body_height = rng.uniform(0.25, 0.4)
    body_top = clearance + body_height
    paint = Material(_hsv(rng.random(), rng.uniform(0.5, 1.0), rng.uniform(0.4, 0.95)))
    glass = Material(_hsv(0.58, rng.uniform(0.1, 0.4), rng.uniform(0.25, 0.55)))
    cabin_height = rng.uniform(0.2, 0.35)
    cabin_centre = (length * rng.uniform(-0.15, 0.05), 0.0, body_top + cabin_height / 2)
    cabin_half = (length * rng.uniform(0.2, 0.3), width * rng.uniform(0.4, 0.47), cabin_height / 2)
    parts: list[Primitive] = [
        Box(
            (0.0, 0.0, clearance + body_height / 2),
            (length / 2, width / 2, body_height / 2),
            material=paint,
        ),
        Box(cabin_centre, cabin_half, material=glass if rng.random() < 0.5 else paint),
    ]
    tyre = Material(_hsv(0.0, 0.0, rng.uniform(0.05, 0.15)))
    lamps = {1.0: Material((1.0, 0.95, 0.7)), -1.0: Material((0.8, 0.05, 0.05))}
    lamp_radius = 0.15 * body_height
    for front in (-1.0, 1.0):
        x = front * (length / 2 - 1.3 * wheel_radius)
        for side in (-1.0, 1.0):
            inner = (x, side * (width / 2 - 0.6 * wheel_width), wheel_radius)
            outer = (x, side * (width / 2 + 0.4 * wheel_width), wheel_radius)
            parts.append(Cylinder(inner, outer, wheel_radius, tyre))
            lamp = (front * length / 2, side * 0.3 * width, clearance + 0.65 * body_height)
            parts.append(Sphere(lamp, lamp_radius, lamps[front]))
    return parts


def _chair(rng: np.random.Generator) -> list[Primitive]:
    """Seat, four legs and a backrest tilted back toward -x."""
    seat_height, seat_thickness = rng.uniform(0.42, 0.5), rng.uniform(0.03, 0.06)
    half_x, half_y = rng.uniform(0.2, 0.26), rng.uniform(0.2, 0.26)
    wood = Material(_hsv(rng.uniform(0.05, 0.11), rng.uniform(0.4, 0.7), rng.uniform(0.3, 0.7)))
    parts: list[Primitive] = [
        Box(
            (0.0, 0.0, seat_height - seat_thickness / 2),
            (half_x, half_y, seat_thickness / 2),
            material=_fabric(rng),
        ),
        *_legs(rng, half_x, half_y, seat_height - seat_thickness, wood),
    ]
    tilt, back_height = rng.uniform(0.0, 0.25), rng.uniform(0.35, 0.55)
    back_thickness = rng.uniform(0.025, 0.05)
    rotation = _rotation_y(-tilt)
    pivot = np.array([-half_x + back_thickness / 2, 0.0, seat_height])
    centre = pivot + np.array(rotation) @ np.array([0.0, 0.0, back_height / 2])
    back_half = (back_thickness / 2, half_y, back_height / 2)
    parts.append(Box(centre, back_half, rotation, wood))
    return parts


def _table(rng: np.random.Generator) -> list[Primitive]:
    """A rectangular table on four legs or a round one on a pedestal."""
    top_height, thickness = rng.uniform(0.45, 0.75), rng.uniform(0.03, 0.06)
    wood = Material(_hsv(rng.uniform(0.05, 0.11), rng.uniform(0.3, 0.7), rng.uniform(0.3, 0.8)))
    top_material = _fabric(rng) if rng.random() < 0.4 else wood
    underside = top_height - thickness
    if rng.random() < 0.5:
        half_x, half_y = rng.uniform(0.45, 0.75), rng.uniform(0.3, 0.5)
        top = Box(
            (0.0, 0.0, top_height - thickness / 2),
            (half_x, half_y, thickness / 2),
            material=top_material,
        )
        return [top, *_legs(rng, half_x, half_y, underside, wood)]
    base_thickness = rng.uniform(0.02, 0.04)
    return [
        Cylinder(
            (0.0, 0.0, underside), (0.0, 0.0, top_height), rng.uniform(0.35, 0.6), top_material
        ),
        Cylinder((0.0, 0.0, base_thickness), (0.0, 0.0, underside), rng.uniform(0.03, 0.06), wood),
        Cylinder((0.0, 0.0, 0.0), (0.0, 0.0, base_thickness), rng.uniform(0.15, 0.3), wood),
    ]


def _lamp(rng: np.random.Generator) -> list[Primitive]:
    """A floor lamp (pole and shade) or a desk lamp (two jointed arms and a head)."""
    metal = Material(_hsv(rng.random(), rng.uniform(0.0, 0.3), rng.uniform(0.2, 0.8)))
    shade = Material(
        _hsv(rng.random(), rng.uniform(0.1, 0.6), rng.uniform(0.7, 1.0)),
        texture=str(rng.choice(("plain", "stripes"))),
        texture_colour=_hsv(rng.random(), rng.uniform(0.3, 0.8), rng.uniform(0.3, 0.7)),
        texture_scale=rng.uniform(3.0, 8.0),
    )
    base_height = rng.uniform(0.03, 0.06)
    parts: list[Primitive] = [
        Cylinder((0.0, 0.0, 0.0), (0.0, 0.0, base_height), rng.uniform(0.14, 0.24), metal)
    ]
    if rng.random() < 0.5:
        pole_height, shade_height = rng.uniform(0.7, 1.3), rng.uniform(0.14, 0.28)
        shade_top = pole_height + 0.4 * shade_height
        finial = rng.uniform(0.015, 0.03)
        parts += [
            Cylinder(
                (0.0, 0.0, base_height), (0.0, 0.0, pole_height), rng.uniform(0.012, 0.025), metal
            ),
            Cylinder(
                (0.0, 0.0, pole_height - 0.6 * shade_height),
                (0.0, 0.0, shade_top),
                rng.uniform(0.14, 0.26),
                shade,
            ),
            Sphere((0.0, 0.0, shade_top + finial), finial, metal),
        ]
        return parts
    arm_radius = rng.uniform(0.015, 0.025)
    joints = [np.array([0.0, 0.0, base_height])]
    for angle, length in (
        (rng.uniform(-0.5, 0.2), rng.uniform(0.35, 0.5)),
        (rng.uniform(0.8, 1.6), rng.uniform(0.3, 0.45)),
    ):
        joints.append(joints[-1] + length * _pitched(angle))
    for lower, upper in itertools.pairwise(joints):
        parts.append(Capsule(lower, upper, arm_radius, metal))
        parts.append(Sphere(upper, 1.6 * arm_radius, metal))
    head_end = joints[-1] + rng.uniform(0.12, 0.2) * _pitched(rng.uniform(1.9, 2.6))
    parts.append(Cylinder(joints[-1], head_end, rng.uniform(0.06, 0.1), shade))
    return parts


def _robot(rng: np.random.Generator) -> list[Primitive]:
    """Box body and head on cylinder legs, capsule arms, glowing eyes and an antenna."""
    metal = Material(_hsv(rng.random(), rng.uniform(0.0, 0.5), rng.uniform(0.4, 0.9)))
    accent = Material(_hsv(rng.random(), rng.uniform(0.6, 1.0), rng.uniform(0.7, 1.0)))
    leg_length, leg_radius = rng.uniform(0.3, 0.5), rng.uniform(0.05, 0.08)
    body_half = np.array([rng.uniform(0.12, 0.2), rng.uniform(0.16, 0.26), rng.uniform(0.18, 0.3)])
    head_half = np.array(
        [rng.uniform(0.08, 0.13), rng.uniform(0.09, 0.15), rng.uniform(0.07, 0.12)]
    )
    body_top = leg_length + 2 * body_half[2]
    head_centre = np.array([0.0, 0.0, body_top + rng.uniform(0.01, 0.05) + head_half[2]])
    parts: list[Primitive] = [
        Box((0.0, 0.0, leg_length + body_half[2]), body_half, material=metal),
        Box(head_centre, head_half, material=metal),
    ]
    arm_radius, arm_length = rng.uniform(0.03, 0.05), rng.uniform(0.3, 0.5)
    eye_radius = 0.25 * min(head_half[1], head_half[2])
    for side in (-1.0, 1.0):
        leg_y = side * 0.5 * body_half[1]
        parts.append(Cylinder((0.0, leg_y, 0.0), (0.0, leg_y, leg_length), leg_radius, metal))
        shoulder = np.array([0.0, side * (body_half[1] + arm_radius), body_top - arm_radius])
        hand = shoulder + arm_length * _limb(rng.uniform(-0.3, 0.9), side * rng.uniform(0.05, 0.4))
        parts.append(Capsule(shoulder, hand, arm_radius, metal))
        eye = head_centre + np.array([head_half[0], side * 0.45 * head_half[1], 0.2 * head_half[2]])
        parts.append(Sphere(eye, eye_radius, accent))
    antenna_base = head_centre + np.array([0.0, 0.0, head_half[2]])
    antenna_tip = antenna_base + np.array([0.0, 0.0, rng.uniform(0.08, 0.15)])
    parts.append(Cylinder(antenna_base, antenna_tip, 0.012, metal))
    parts.append(Sphere(antenna_tip, rng.uniform(0.02, 0.035), accent))
    return parts


_BUILDERS: dict[str, Callable[[np.random.Generator], list[Primitive]]] = {
    "car": _car,
    "chair": _chair,
    "table": _table,
    "lamp": _lamp,
    "robot": _robot,
}


# ------------------------------------------------------------------ parts and colours


def _legs(
    rng: np.random.Generator, half_x: float, half_y: float, top: float, material: Material
) -> list[Primitive]:
    """Four round or square legs from the floor to `top`, inset under a top of half size."""
    radius = rng.uniform(0.018, 0.035)
    round_legs = rng.random() < 0.5
    legs: list[Primitive] = []
    for x in (-1.0, 1.0):
        for y in (-1.0, 1.0):
            foot = (x * (half_x - 1.5 * radius), y * (half_y - 1.5 * radius))
            if round_legs:
                legs.append(Cylinder((*foot, 0.0), (*foot, top), radius, material))
            else:
                legs.append(Box((*foot, top / 2), (radius, radius, top / 2), material=material))
    return legs


def _headwear(rng: np.random.Generator, head: np.ndarray, radius: float) -> list[Primitive]:
    """Hair (a cap over the back and top of the head), a brimmed hat, or nothing."""
    style = rng.choice(("hair", "hat", "none"), p=(0.6, 0.25, 0.15))
    if style == "hair":
        colour = HAIR_COLOURS[rng.integers(len(HAIR_COLOURS))]
        return [
            Sphere(head + radius * np.array([-0.18, 0.0, 0.12]), 1.02 * radius, Material(colour))
        ]
    if style == "hat":
        hat = Material(_hsv(rng.random(), rng.uniform(0.2, 0.9), rng.uniform(0.2, 0.9)))
        brim = head + np.array([0.0, 0.0, 0.45 * radius])
        return [
            Cylinder(brim, brim + np.array([0.0, 0.0, 0.07 * radius]), 1.45 * radius, hat),
            Cylinder(brim, brim + np.array([0.0, 0.0, 0.75 * radius]), 0.92 * radius, hat),
        ]
    return []


def _fabric(rng: np.random.Generator) -> Material:
    """A cushion or cloth colour, plain or checked."""
    hue = rng.random()
    return Material(
        _hsv(hue, rng.uniform(0.3, 0.9), rng.uniform(0.4, 0.9)),
        texture=str(rng.choice(("plain", "checker"))),
        texture_colour=_hsv((hue + 0.5) % 1.0, rng.uniform(0.0, 0.4), rng.uniform(0.8, 1.0)),
        texture_scale=rng.uniform(3.0, 8.0),
    )


def _skin(rng: np.random.Generator) -> tuple[float, float, float]:
    """A skin tone between the lightest and darkest tones."""
    light, dark = np.array(LIGHTEST_SKIN), np.array(DARKEST_SKIN)
    return _rgb(tuple(light + rng.random() * (dark - light)))


def _hsv(hue: float, saturation: float, value: float) -> tuple[float, float, float]:
    """RGB of an HSV colour."""
    return _rgb(colorsys.hsv_to_rgb(hue, saturation, value))


def _rgb(values: tuple[float, ...]) -> tuple[float, float, float]:
    """Three plain floats."""
    return (float(values[0]), float(values[1]), float(values[2]))


def _limb(forward: float, outward: float) -> np.ndarray:
    """Unit direction of a hanging limb swung `forward` (toward +x) and `outward` (toward +y)."""
    return np.array(
        [
            math.sin(forward) * math.cos(outward),
            math.sin(outward),
            -math.cos(forward) * math.cos(outward),
        ]
    )


def _pitched(angle: float) -> np.ndarray:
    """Unit direction tilted `angle` radians from +z toward +x."""
    return np.array([math.sin(angle), 0.0, math.cos(angle)])


def _normalised_vector(vector: tuple[float, float, float]) -> np.ndarray:
    """`vector` scaled to unit length."""
    array = np.asarray(vector, dtype=np.float64)
    return array / np.linalg.norm(array)


def _rotation_y(angle: float) -> Mat3:
    """Rotation by `angle` radians about +y (z turns toward +x)."""
    c, s = math.cos(angle), math.sin(angle)
    return ((c, 0.0, s), (0.0, 1.0, 0.0), (-s, 0.0, c))


def _rotation_z(angle: float) -> Mat3:
    """Rotation by `angle` radians about +z (x turns toward +y)."""
    c, s = math.cos(angle), math.sin(angle)
    return ((c, -s, 0.0), (s, c, 0.0), (0.0, 0.0, 1.0))
