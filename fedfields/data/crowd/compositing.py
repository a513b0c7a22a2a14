"""Persons composited into straight-alpha views, and which pixels a PNG shows changed."""

from __future__ import annotations

import torch
from torch import Tensor

from fedfields.data.scene import Scene


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
    """Floats in [0, 1] as the 8-bit values the writer's `_png` writes."""
    return (pixels.clamp(0.0, 1.0) * 255.0 + 0.5).to(torch.uint8)


def straight_rgba(scene: Scene) -> Tensor:
    """[N, H, W, 4] straight-alpha RGBA from a scene loaded on black (premultiplied colours)."""
    alpha = scene.masks[..., None]
    rgb = torch.where(
        alpha > 0, scene.images / alpha.clamp(min=1e-8), torch.zeros_like(scene.images)
    )
    return torch.cat([rgb.clamp(0.0, 1.0), alpha], dim=-1)
