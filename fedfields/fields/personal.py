"""DecentNeRF's personal field and its composite with a global field (NeRF-W's transient branch).

Each user keeps a personal field p_k that never leaves the device next to the federated
global field g_k. Along a ray both are one medium: densities add and the colour of a sample
is the density-weighted mix of both colours (DecentNeRF Sec. 4.2; NeRF-W Sec. 4.2 composites
the two alphas separately, which agrees to first order in the step length). As in NeRF-W
(Sec. 4.2, Eq. 10), the personal branch is conditioned on a per-image transient embedding
and reports an uncertainty beta per sample, which the local loss (`fedfields.train.nerfw`)
uses to keep what one photo alone shows out of the global field.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from fedfields.fields.base import (
    Field,
    FieldOutputs,
    build_field,
    mlp,
    normalise_to_box,
    trunc_exp,
)
from fedfields.fields.encodings import HashGridConfig, HashGridEncoding, PositionalEncoding


def _personal_encoding() -> HashGridConfig:
    return HashGridConfig(num_levels=8, log2_hashmap_size=14, max_resolution=256)


# Personal density starts near exp(-4): a personal field is empty until its data needs it, so
# at the start it neither hides the global field nor keeps occupancy grids dense.
INITIAL_DENSITY_SHIFT = 4.0

# `PersonalField.density` bounds at most this many images per call: a field over all 80 photos
# (centralised NeRF-W) would otherwise run its head 80 times per occupancy refresh.
DENSITY_BOUND_IMAGES = 8


@dataclass(frozen=True)
class PersonalFieldConfig:
    """A small hash grid with density, uncertainty and colour heads, and per image an
    appearance embedding (colour) and a transient embedding (density, colour, uncertainty).

    `position_frequencies` > 0 encodes points with NeRF's positional encoding instead of the
    hash grid (DecentNeRF's personal MLP: 10 frequencies, `density_layers` 4 of `hidden` 128).
    """

    num_images: int
    embedding_dim: int = 8
    transient_embedding_dim: int = 8
    encoding: HashGridConfig = field(default_factory=_personal_encoding)
    geometry_features: int = 15
    hidden: int = 32
    density_layers: int = 1
    position_frequencies: int = 0
    aabb: tuple[float, ...] = (-1.5, -1.5, -1.5, 1.5, 1.5, 1.5)


class PersonalField(Field):
    """sigma_p(x, t_i) and beta(x, t_i) from hashed features and image i's transient embedding
    t_i; c_p from geometry features, t_i and the appearance embedding e_i (NeRF-W Eq. 10).

    Content that stays put in a user's views (the user's own person) can ignore t_i; a
    passer-by in one photo uses it. Colour is view-independent, as NeRF-W's transient branch.
    `density(points)` without an image is the maximum over the user's images (over a fresh
    random `DENSITY_BOUND_IMAGES` of them when there are more), so an occupancy grid, which
    keeps a decaying maximum across refreshes, skips no sample any image needs.
    """

    kind = "personal"

    def __init__(self, config: PersonalFieldConfig) -> None:
        super().__init__()
        if config.num_images < 1:
            raise ValueError(f"num_images must be positive, got {config.num_images}")
        if config.density_layers < 1 or config.position_frequencies < 0:
            raise ValueError(
                f"density_layers must be >= 1 and position_frequencies >= 0, got "
                f"{config.density_layers} and {config.position_frequencies}"
            )
        self.config = config
        self.register_buffer("aabb", torch.tensor(config.aabb, dtype=torch.float32).view(2, 3))
        self.encoding: nn.Module
        if config.position_frequencies > 0:
            self.encoding = PositionalEncoding(3, config.position_frequencies)
        else:
            self.encoding = HashGridEncoding(config.encoding)
        # outputs: density, uncertainty, geometry features
        self.density_head = mlp(
            self.encoding.out_dim + config.transient_embedding_dim,
            config.hidden,
            config.density_layers,
            2 + config.geometry_features,
        )
        self.color_head = mlp(config.geometry_features + config.embedding_dim, config.hidden, 1, 3)
        self.appearance = nn.Embedding(config.num_images, config.embedding_dim)
        self.transient = nn.Embedding(config.num_images, config.transient_embedding_dim)
        nn.init.normal_(self.appearance.weight, std=0.01)
        nn.init.normal_(self.transient.weight, std=0.01)

    def _encoded(self, points: Tensor) -> Tensor:
        """Hash-grid features of the points in the unit box, or NeRF's encoding of the points."""
        if isinstance(self.encoding, PositionalEncoding):
            return self.encoding(points)
        return self.encoding(normalise_to_box(points, self.aabb))

    def _head(self, encoded: Tensor, transient: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """(density [N], uncertainty beta >= 0 [N], geometry features [N, F])."""
        features = self.density_head(torch.cat([encoded, transient], dim=-1))
        density = trunc_exp(features[:, 0] - INITIAL_DENSITY_SHIFT)
        return density, nn.functional.softplus(features[:, 1]), features[:, 2:]

    def density(self, points: Tensor) -> Tensor:
        """The largest density any of the user's images (or a random DENSITY_BOUND_IMAGES of
        them) gives these points."""
        encoded = self._encoded(points)
        embeddings = self.transient.weight
        if embeddings.shape[0] > DENSITY_BOUND_IMAGES:
            chosen = torch.randperm(embeddings.shape[0], device=embeddings.device)
            embeddings = embeddings[chosen[:DENSITY_BOUND_IMAGES]]
        densities = [
            self._head(encoded, embedding.expand(points.shape[0], -1))[0]
            for embedding in embeddings
        ]
        return torch.stack(densities).amax(0)

    def forward(
        self, points: Tensor, directions: Tensor, image_index: Tensor | None = None
    ) -> FieldOutputs:
        """Density, colour and uncertainty seen in images `image_index` [N] (None: the
        mean embeddings)."""
        encoded = self._encoded(points)
        if image_index is None:
            count = points.shape[0]
            appearance = self.appearance.weight.mean(0).expand(count, -1)
            transient = self.transient.weight.mean(0).expand(count, -1)
        else:
            appearance, transient = self.appearance(image_index), self.transient(image_index)
        density, uncertainty, geometry = self._head(encoded, transient)
        rgb = torch.sigmoid(self.color_head(torch.cat([geometry, appearance], dim=-1)))
        return FieldOutputs(density=density, rgb=rgb, uncertainty=uncertainty)

    @classmethod
    def from_options(cls, options: dict[str, Any]) -> PersonalField:
        options = dict(options)
        encoding = HashGridConfig(**options.pop("encoding", {}))
        options["aabb"] = tuple(options.get("aabb", PersonalFieldConfig.aabb))
        return cls(PersonalFieldConfig(encoding=encoding, **options))


class GlobalPersonalField(Field):
    """g_k and p_k rendered as one medium: sigma = sigma_g + sigma_p, colour mixed by density.

    Outputs carry sigma_p as `personal_density` for NeRF-W's L1 sparsity loss, which leaves
    content both branches can explain to the global (federated) field, and the personal
    uncertainty beta_i weighted by the personal share of the density, whose volume rendering
    is NeRF-W's per-ray beta (Eq. 11, to first order in the step length).
    """

    kind = "global_personal"

    def __init__(self, global_field: Field, personal_field: PersonalField) -> None:
        super().__init__()
        self.global_field = global_field
        self.personal_field = personal_field

    def density(self, points: Tensor) -> Tensor:
        return self.global_field.density(points) + self.personal_field.density(points)

    def forward(
        self, points: Tensor, directions: Tensor, image_index: Tensor | None = None
    ) -> FieldOutputs:
        """Colour (sigma_g c_g + sigma_p c_p) / (sigma_g + sigma_p), c_p as seen in images
        `image_index` [N] (None: the mean embedding)."""
        shared = self.global_field(points, directions)
        personal = self.personal_field(points, directions, image_index)
        density = shared.density + personal.density
        mixed = shared.density[:, None] * shared.rgb + personal.density[:, None] * personal.rgb
        share = personal.density / (density + 1e-10)
        uncertainty = None if personal.uncertainty is None else share * personal.uncertainty
        return FieldOutputs(
            density=density,
            rgb=mixed / (density[:, None] + 1e-10),
            personal_density=personal.density,
            uncertainty=uncertainty,
        )

    @classmethod
    def from_options(cls, options: dict[str, Any]) -> GlobalPersonalField:
        personal = build_field(options["personal_field"])
        if not isinstance(personal, PersonalField):
            raise ValueError("a global_personal field's personal_field must be of kind 'personal'")
        return cls(build_field(options["global_field"]), personal)

    def config_dict(self) -> dict:
        return {
            "kind": self.kind,
            "global_field": self.global_field.config_dict(),
            "personal_field": self.personal_field.config_dict(),
        }
