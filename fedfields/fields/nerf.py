"""The original NeRF MLP (Mildenhall et al. 2020) over positional encodings."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from fedfields.fields.base import Field, FieldOutputs, mlp
from fedfields.fields.encodings import PositionalEncoding


@dataclass(frozen=True)
class NeRFFieldConfig:
    """Depth x width trunk with a skip connection; optional view-dependent colour branch with
    `color_layers` hidden layers of `color_width` (NeRF: 1 x 128; DecentNeRF: 4 x 128)."""

    depth: int = 8
    width: int = 256
    skips: tuple[int, ...] = (4,)
    position_frequencies: int = 10
    direction_frequencies: int = 4
    view_dependent: bool = True
    color_width: int = 128
    color_layers: int = 1


class NeRFField(Field):
    """sigma = ReLU(trunk(PE(x))); rgb = sigmoid(head(trunk features, PE(d)))."""

    kind = "nerf"

    def __init__(self, config: NeRFFieldConfig = NeRFFieldConfig()) -> None:
        super().__init__()
        self.config = config
        self.position_encoding = PositionalEncoding(3, config.position_frequencies)
        in_dim = self.position_encoding.out_dim
        self.trunk = nn.ModuleList()
        width = in_dim
        for layer in range(config.depth):
            self.trunk.append(nn.Linear(width, config.width))
            width = config.width + (in_dim if layer in config.skips else 0)
        self.density_out = nn.Linear(config.width, 1)
        if config.view_dependent:
            self.direction_encoding = PositionalEncoding(3, config.direction_frequencies)
            self.feature_out = nn.Linear(config.width, config.width)
            self.color_head = mlp(
                config.width + self.direction_encoding.out_dim,
                config.color_width,
                config.color_layers,
                3,
            )
        else:
            self.color_head = nn.Linear(config.width, 3)

    def _trunk(self, points: Tensor) -> Tensor:
        encoded = self.position_encoding(points)
        hidden = encoded
        for layer, linear in enumerate(self.trunk):
            hidden = torch.relu(linear(hidden))
            if layer in self.config.skips:
                hidden = torch.cat([hidden, encoded], dim=-1)
        return hidden

    def density(self, points: Tensor) -> Tensor:
        return torch.relu(self.density_out(self._trunk(points))[:, 0])

    def forward(
        self, points: Tensor, directions: Tensor, image_index: Tensor | None = None
    ) -> FieldOutputs:
        """Density and colour; no per-image appearance, so `image_index` is ignored."""
        hidden = self._trunk(points)
        density = torch.relu(self.density_out(hidden)[:, 0])
        if self.config.view_dependent:
            features = torch.cat(
                [self.feature_out(hidden), self.direction_encoding(directions)], -1
            )
            rgb = torch.sigmoid(self.color_head(features))
        else:
            rgb = torch.sigmoid(self.color_head(hidden))
        return FieldOutputs(density=density, rgb=rgb)

    @classmethod
    def from_options(cls, options: dict[str, Any]) -> NeRFField:
        return cls(NeRFFieldConfig(**{**options, "skips": tuple(options.get("skips", ()))}))
