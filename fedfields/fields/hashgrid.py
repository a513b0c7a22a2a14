"""Instant-NGP style field: multi-resolution hash encoding with small density and colour heads."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from fedfields.fields.base import Field, FieldOutputs, mlp, normalise_to_box, trunc_exp
from fedfields.fields.encodings import HashGridConfig, HashGridEncoding, SphericalHarmonicsEncoding


@dataclass(frozen=True)
class HashGridFieldConfig:
    """Hash grid + 1-hidden-layer density head + 2-hidden-layer colour head (Muller et al.)."""

    encoding: HashGridConfig = field(default_factory=HashGridConfig)
    geometry_features: int = 15
    density_hidden: int = 64
    color_hidden: int = 64
    color_layers: int = 2
    aabb: tuple[float, ...] = (-1.5, -1.5, -1.5, 1.5, 1.5, 1.5)


class HashGridField(Field):
    """Density from hashed features of the normalised point; colour from geometry + SH(dir)."""

    kind = "hashgrid"

    def __init__(self, config: HashGridFieldConfig = HashGridFieldConfig()) -> None:
        super().__init__()
        self.config = config
        self.register_buffer("aabb", torch.tensor(config.aabb, dtype=torch.float32).view(2, 3))
        self.encoding = HashGridEncoding(config.encoding)
        self.density_head = mlp(
            self.encoding.out_dim, config.density_hidden, 1, 1 + config.geometry_features
        )
        self.direction_encoding = SphericalHarmonicsEncoding()
        self.color_head = mlp(
            config.geometry_features + self.direction_encoding.out_dim,
            config.color_hidden,
            config.color_layers,
            3,
        )

    def _geometry(self, points: Tensor) -> tuple[Tensor, Tensor]:
        features = self.density_head(self.encoding(normalise_to_box(points, self.aabb)))
        return trunc_exp(features[:, 0] - 1.0), features[:, 1:]

    def density(self, points: Tensor) -> Tensor:
        return self._geometry(points)[0]

    def forward(
        self, points: Tensor, directions: Tensor, image_index: Tensor | None = None
    ) -> FieldOutputs:
        """Density and colour; no per-image appearance, so `image_index` is ignored."""
        density, geometry = self._geometry(points)
        color_input = torch.cat([geometry, self.direction_encoding(directions)], dim=-1)
        return FieldOutputs(density=density, rgb=torch.sigmoid(self.color_head(color_input)))

    @classmethod
    def from_options(cls, options: dict[str, Any]) -> HashGridField:
        options = dict(options)
        encoding = HashGridConfig(**options.pop("encoding", {}))
        options["aabb"] = tuple(options.get("aabb", HashGridFieldConfig.aabb))
        return cls(HashGridFieldConfig(encoding=encoding, **options))
