"""The one interface every radiance field implements, so renderers and trainers take any field."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

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


class Field(nn.Module, ABC):
    """A radiance field over world-space points (nerfstudio's get_density / get_outputs split).

    `density(points)` answers where matter is (used for occupancy grids and proposal passes);
    `forward(points, directions)` gives density and view-dependent colour together. Fields
    with per-image appearance (NeRF-W) take the images' indices [N] as a third argument.
    """

    @abstractmethod
    def density(self, points: Tensor) -> Tensor:
        """Volume density at world points [N, 3] -> [N]."""

    @abstractmethod
    def forward(self, points: Tensor, directions: Tensor) -> FieldOutputs:
        """Density and colour at world points [N, 3] seen along unit directions [N, 3]."""

    def config_dict(self) -> dict:
        """Everything needed to rebuild this field with `fedfields.fields.build_field`."""
        raise NotImplementedError

    @property
    def device(self) -> torch.device:
        """The device holding the field's parameters (CPU for parameter-free fields)."""
        return next(self.parameters(), torch.empty(0)).device


class _TruncExp(torch.autograd.Function):
    """exp with its gradient clamped at exp(15): Instant-NGP's stable density activation."""

    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(x)
        return torch.exp(x)

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:  # type: ignore[override]
        (x,) = ctx.saved_tensors
        return grad * torch.exp(x.clamp(max=15.0))


def trunc_exp(x: Tensor) -> Tensor:
    """Density activation exp(x) whose backward cannot overflow."""
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
