"""SIREN (Sitzmann et al. 2020): sine-activated MLP for images, videos and small radiance fields."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from fedfields.fields.base import Field, FieldOutputs


@dataclass(frozen=True)
class SirenConfig:
    """Coordinates -> values through `depth` sine layers of `width` units with frequency w0."""

    in_features: int = 2
    out_features: int = 3
    width: int = 128
    depth: int = 6
    w0: float = 30.0
    w0_first: float = 30.0


class SineLayer(nn.Module):
    """sin(w0 (W x + b)), initialised as SIREN: U(+-1/n) first, U(+-sqrt(6/n)/w0) after."""

    def __init__(self, in_features: int, out_features: int, w0: float, first: bool) -> None:
        super().__init__()
        self.w0 = w0
        self.linear = nn.Linear(in_features, out_features)
        bound = 1.0 / in_features if first else math.sqrt(6.0 / in_features) / w0
        nn.init.uniform_(self.linear.weight, -bound, bound)

    def forward(self, x: Tensor) -> Tensor:
        return torch.sin(self.w0 * self.linear(x))


class Siren(nn.Module):
    """A SIREN network: `depth` hidden sine layers then a linear output layer."""

    def __init__(self, config: SirenConfig = SirenConfig()) -> None:
        super().__init__()
        self.config = config
        layers: list[nn.Module] = [
            SineLayer(config.in_features, config.width, config.w0_first, first=True)
        ]
        layers += [
            SineLayer(config.width, config.width, config.w0, first=False)
            for _ in range(config.depth - 1)
        ]
        self.hidden = nn.Sequential(*layers)
        self.output = nn.Linear(config.width, config.out_features)
        bound = math.sqrt(6.0 / config.width) / config.w0
        nn.init.uniform_(self.output.weight, -bound, bound)

    def forward(self, coordinates: Tensor) -> Tensor:
        return self.output(self.hidden(coordinates))


class SirenField(Field):
    """A radiance field from one SIREN over (x, y, z): outputs raw density and rgb."""

    kind = "siren"

    def __init__(self, config: SirenConfig = SirenConfig(in_features=3, out_features=4)) -> None:
        super().__init__()
        if config.in_features != 3 or config.out_features != 4:
            raise ValueError("SirenField needs in_features=3 and out_features=4 (density, rgb)")
        self.config = config
        self.network = Siren(config)

    def density(self, points: Tensor) -> Tensor:
        return torch.relu(self.network(points)[:, 0])

    def forward(
        self, points: Tensor, directions: Tensor, image_index: Tensor | None = None
    ) -> FieldOutputs:
        """Density and colour of (x, y, z) alone: directions and `image_index` are ignored."""
        raw = self.network(points)
        return FieldOutputs(density=torch.relu(raw[:, 0]), rgb=torch.sigmoid(raw[:, 1:]))

    @classmethod
    def from_options(cls, options: dict[str, Any]) -> SirenField:
        return cls(SirenConfig(**options))
