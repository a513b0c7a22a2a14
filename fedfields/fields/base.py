"""The one interface every radiance field implements, so renderers and trainers take any field."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor, nn


@dataclass
class FieldOutputs:
    """Per-sample field values: volume density (>= 0) and colour in [0, 1].

    A global+personal field also reports the personal branch's density, which NeRF-W's
    sparsity loss penalises, and its uncertainty; other fields leave them None.
    """

    density: Tensor  # [N]
    rgb: Tensor  # [N, 3]
    personal_density: Tensor | None = None  # [N]
    uncertainty: Tensor | None = None  # [N] NeRF-W's beta_i (personal share for a composite)


FIELD_KINDS: dict[str, type[Field]] = {}
"""Every field class by its `kind`: what `build_field` rebuilds from a checkpoint's config."""


class Field(nn.Module, ABC):
    """A radiance field over world-space points (nerfstudio's get_density / get_outputs split).

    `density(points)` answers where matter is (used for occupancy grids and proposal passes);
    `forward(points, directions, image_index)` gives density and view-dependent colour
    together, as seen in the images `image_index` for fields with per-image appearance
    (NeRF-W); the others ignore it. A subclass that sets `kind` is registered for
    `build_field`, which calls its `from_options`.
    """

    kind: ClassVar[str] = ""
    config: Any

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.kind:
            FIELD_KINDS[cls.kind] = cls

    @abstractmethod
    def density(self, points: Tensor) -> Tensor:
        """Volume density at world points [N, 3] -> [N]."""

    @abstractmethod
    def forward(
        self, points: Tensor, directions: Tensor, image_index: Tensor | None = None
    ) -> FieldOutputs:
        """Density and colour at world points [N, 3] seen along unit directions [N, 3] in
        images `image_index` [N] (int64; None: the mean appearance, or no appearance)."""

    def config_dict(self) -> dict:
        """Everything needed to rebuild this field with `build_field`: its kind and config."""
        return {"kind": self.kind, **asdict(self.config)}

    @classmethod
    def from_options(cls, options: dict[str, Any]) -> Field:
        """The field from `config_dict()`'s entries other than "kind"."""
        raise NotImplementedError(f"{cls.__name__} cannot be rebuilt from a config")

    @property
    def device(self) -> torch.device:
        """The device holding the field's parameters (CPU for parameter-free fields)."""
        return next(self.parameters(), torch.empty(0)).device


def build_field(config: dict[str, Any]) -> Field:
    """Rebuild a field from `Field.config_dict()` output (as stored in checkpoints)."""
    options = dict(config)
    kind = options.pop("kind", None)
    if kind not in FIELD_KINDS:
        raise ValueError(f"unknown field kind {kind!r}; expected one of {sorted(FIELD_KINDS)}")
    return FIELD_KINDS[kind].from_options(options)


DENSITY_EXPONENT_MAX = 60.0
"""Largest exponent a density takes: exp(60) ~ 1e26 is opaque over any step, and 128 such
samples sum to ~1e28, far from float32's 3.4e38. Past exp(88.7) the density was inf and
volume rendering's transmittance inf - inf = NaN: a 4 x 32 personal MLP (DecentNeRF's, at
NeRF-W's beta_min 0.03) got there within 72 central steps
(docs/experiments/2026-12-06-objectives.md)."""


class _TruncExp(torch.autograd.Function):
    """exp with its gradient clamped at exp(15): Instant-NGP's stable density activation; its
    value capped at exp(DENSITY_EXPONENT_MAX) so that no density overflows to inf."""

    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(x)
        return torch.exp(x.clamp(max=DENSITY_EXPONENT_MAX))

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:  # type: ignore[override]
        (x,) = ctx.saved_tensors
        return grad * torch.exp(x.clamp(max=15.0))


def trunc_exp(x: Tensor) -> Tensor:
    """Density activation exp(x) whose value and backward cannot overflow."""
    return _TruncExp.apply(x)


def mlp(in_dim: int, hidden_dim: int, num_hidden_layers: int, out_dim: int) -> nn.Sequential:
    """ReLU MLP with `num_hidden_layers` hidden layers of width `hidden_dim`."""
    layers: list[nn.Module] = []
    width = in_dim
    for _ in range(num_hidden_layers):
        layers += [nn.Linear(width, hidden_dim), nn.ReLU(inplace=True)]
        width = hidden_dim
    layers.append(nn.Linear(width, out_dim))
    return nn.Sequential(*layers)


def normalise_to_box(points: Tensor, aabb: Tensor) -> Tensor:
    """Map world points into the unit cube of the scene box [2, 3]."""
    return (points - aabb[0]) / (aabb[1] - aabb[0])
