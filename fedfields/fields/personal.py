"""DecentNeRF's personal field and its composite with a global field (NeRF-W's transient branch).

Each user keeps a personal field p_k that never leaves the device next to the federated
global field g_k. Along a ray both are one medium: densities add and the colour of a sample
is the density-weighted mix of both colours (DecentNeRF Sec. 4.2; NeRF-W Sec. 4.2 composites
the two alphas separately, which agrees to first order in the step length).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch
from torch import Tensor, nn

from fedfields.fields.base import Field, FieldOutputs, mlp, normalise_to_box, trunc_exp
from fedfields.fields.encodings import HashGridConfig, HashGridEncoding


def _personal_encoding() -> HashGridConfig:
    return HashGridConfig(num_levels=8, log2_hashmap_size=14, max_resolution=256)


# Personal density starts near exp(-4): a personal field is empty until its data needs it, so
# at the start it neither hides the global field nor keeps occupancy grids dense.
INITIAL_DENSITY_SHIFT = 4.0


@dataclass(frozen=True)
class PersonalFieldConfig:
    """A small hash grid with density and colour heads and one appearance embedding per image."""

    num_images: int
    embedding_dim: int = 8
    encoding: HashGridConfig = field(default_factory=_personal_encoding)
    geometry_features: int = 15
    hidden: int = 32
    aabb: tuple[float, ...] = (-1.5, -1.5, -1.5, 1.5, 1.5, 1.5)


class PersonalField(Field):
    """sigma_p(x) from hashed features; c_p(x, e_i) from geometry features and image i's embedding.

    The density ignores the image, so content that stays put in a user's views (the user
    standing in front of the scene) is one 3D object an occupancy grid can see; only the
    colour follows the per-image appearance embedding e_i (NeRF-W's transient branch, whose
    colour is also view-independent).
    """

    def __init__(self, config: PersonalFieldConfig) -> None:
        super().__init__()
        if config.num_images < 1:
            raise ValueError(f"num_images must be positive, got {config.num_images}")
        self.config = config
        self.register_buffer("aabb", torch.tensor(config.aabb, dtype=torch.float32).view(2, 3))
        self.encoding = HashGridEncoding(config.encoding)
        self.density_head = mlp(
            self.encoding.out_dim, config.hidden, 1, 1 + config.geometry_features
        )
        self.color_head = mlp(config.geometry_features + config.embedding_dim, config.hidden, 1, 3)
        self.appearance = nn.Embedding(config.num_images, config.embedding_dim)
        nn.init.normal_(self.appearance.weight, std=0.01)

    def _geometry(self, points: Tensor) -> tuple[Tensor, Tensor]:
        features = self.density_head(self.encoding(normalise_to_box(points, self.aabb)))
        return trunc_exp(features[:, 0] - INITIAL_DENSITY_SHIFT), features[:, 1:]

    def density(self, points: Tensor) -> Tensor:
        return self._geometry(points)[0]

    def forward(
        self, points: Tensor, directions: Tensor, image_index: Tensor | None = None
    ) -> FieldOutputs:
        """Density and colour seen in images `image_index` [N] (None: the mean embedding)."""
        density, geometry = self._geometry(points)
        if image_index is None:
            embedding = self.appearance.weight.mean(0).expand(points.shape[0], -1)
        else:
            embedding = self.appearance(image_index)
        rgb = torch.sigmoid(self.color_head(torch.cat([geometry, embedding], dim=-1)))
        return FieldOutputs(density=density, rgb=rgb)

    def config_dict(self) -> dict:
        return {"kind": "personal", **asdict(self.config)}


class GlobalPersonalField(Field):
    """g_k and p_k rendered as one medium: sigma = sigma_g + sigma_p, colour mixed by density.

    Outputs carry sigma_p as `personal_density` for NeRF-W's L1 sparsity loss, which leaves
    content both branches can explain to the global (federated) field.
    """

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
        return FieldOutputs(
            density=density,
            rgb=mixed / (density[:, None] + 1e-10),
            personal_density=personal.density,
        )

    def config_dict(self) -> dict:
        return {
            "kind": "global_personal",
            "global_field": self.global_field.config_dict(),
            "personal_field": self.personal_field.config_dict(),
        }
