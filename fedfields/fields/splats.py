"""A field of 3D Gaussians (3D Gaussian splatting), behind the same Field interface.

Each Gaussian has a mean, per-axis log-scales, a rotation quaternion, an opacity logit and
spherical-harmonic colour coefficients (3DGS, Kerbl et al. 2023, sec. 4).
`fedfields.render.splatting.render_splats` rasterises them (the torch path; gsplat's CUDA
rasteriser follows the same conventions). `density` and `forward` read the same Gaussians as
a volume, sum_i o_i G_i(x) times `density_scale`, so occupancy grids and the volume
renderer's tools work on a splat field too; training renders by rasterisation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor, nn

from fedfields.fields.base import Field, FieldOutputs

MAX_SH_DEGREE = 3
SH_C0 = 0.28209479177387814
SH_C1 = 0.4886025119029199
SH_C2 = (1.0925484305920792, -1.0925484305920792, 0.31539156525252005, -1.0925484305920792,
         0.5462742152960396)  # fmt: skip
SH_C3 = (-0.5900435899266435, 2.890611442640554, -0.4570457994644658, 0.3731763325901154,
         -0.4570457994644658, 1.445305721320277, -0.5900435899266435)  # fmt: skip
"""Real spherical-harmonic constants of degrees 0-3, as 3DGS and gsplat evaluate them."""


def quaternion_rotations(quaternions: Tensor) -> Tensor:
    """[N, 3, 3] rotation matrices of quaternions (w, x, y, z) [N, 4], normalised first."""
    w, x, y, z = torch.nn.functional.normalize(quaternions, dim=-1).unbind(-1)
    rows = (
        1 - 2 * (y * y + z * z), 2 * (x * y - w * z), 2 * (x * z + w * y),
        2 * (x * y + w * z), 1 - 2 * (x * x + z * z), 2 * (y * z - w * x),
        2 * (x * z - w * y), 2 * (y * z + w * x), 1 - 2 * (x * x + y * y),
    )  # fmt: skip
    return torch.stack(rows, dim=-1).view(*quaternions.shape[:-1], 3, 3)


def covariances(quaternions: Tensor, scales: Tensor) -> Tensor:
    """[N, 3, 3] world covariances R S S^T R^T (3DGS eq. 6) from [N, 4] and [N, 3]."""
    rotation_scale = quaternion_rotations(quaternions) * scales[..., None, :]
    return rotation_scale @ rotation_scale.transpose(-1, -2)


def sh_basis(directions: Tensor, count: int) -> Tensor:
    """[..., K] real spherical-harmonic basis of unit directions [..., 3] for K = 1, 4, 9 or
    16 coefficients (degree 0-3), in 3DGS's order and signs."""
    if count not in (1, 4, 9, 16):
        raise ValueError(f"spherical harmonics need 1, 4, 9 or 16 coefficients, got {count}")
    x, y, z = directions.unbind(-1)
    basis = [torch.full_like(x, SH_C0)]
    if count > 1:
        basis += [-SH_C1 * y, SH_C1 * z, -SH_C1 * x]
    if count > 4:
        xx, yy, zz, xy, yz, xz = x * x, y * y, z * z, x * y, y * z, x * z
        basis += [SH_C2[0] * xy, SH_C2[1] * yz, SH_C2[2] * (2 * zz - xx - yy), SH_C2[3] * xz,
                  SH_C2[4] * (xx - yy)]  # fmt: skip
    if count > 9:
        basis += [
            SH_C3[0] * y * (3 * xx - yy), SH_C3[1] * xy * z, SH_C3[2] * y * (4 * zz - xx - yy),
            SH_C3[3] * z * (2 * zz - 3 * xx - 3 * yy), SH_C3[4] * x * (4 * zz - xx - yy),
            SH_C3[5] * z * (xx - yy), SH_C3[6] * x * (xx - 3 * yy),
        ]  # fmt: skip
    return torch.stack(basis, dim=-1)


def sh_colours(coefficients: Tensor, directions: Tensor) -> Tensor:
    """[N, 3] colours of spherical-harmonic coefficients [N, K, 3] seen along unit directions
    [N, 3], plus 0.5 and clamped at 0 (3DGS's rule)."""
    basis = sh_basis(directions, coefficients.shape[-2])
    return (torch.einsum("nk,nkc->nc", basis, coefficients) + 0.5).clamp(min=0.0)


@dataclass(frozen=True)
class Gaussians:
    """Gaussians as a rasteriser reads them: means [N, 3], unit-free quaternions [N, 4]
    (w, x, y, z), scales [N, 3], opacities [N] in (0, 1) and SH coefficients [N, K, 3]."""

    means: Tensor
    quats: Tensor
    scales: Tensor
    opacities: Tensor
    sh: Tensor

    @property
    def sh_degree(self) -> int:
        """The highest SH degree the coefficients hold."""
        return round(self.sh.shape[1] ** 0.5) - 1

    def covariances(self) -> Tensor:
        """[N, 3, 3] world covariances."""
        return covariances(self.quats, self.scales)

    @staticmethod
    def joined(*parts: Gaussians) -> Gaussians:
        """One set of all `parts`' Gaussians (a user's global and personal splats rendered as
        one scene); gradients flow back to each part. The parts share their SH degree."""
        degrees = {part.sh_degree for part in parts}
        if len(degrees) != 1:
            raise ValueError(f"joined splats need one SH degree, got {sorted(degrees)}")
        return Gaussians(
            *(torch.cat([getattr(part, name) for part in parts]) for name in GAUSSIAN_TENSORS)
        )


GAUSSIAN_TENSORS = ("means", "quats", "scales", "opacities", "sh")


@dataclass(frozen=True)
class SplatFieldConfig:
    """How many Gaussians, their colour's spherical-harmonic degree and where they start."""

    count: int = 4096
    sh_degree: int = 3
    aabb: tuple[float, ...] = (-1.5, -1.5, -1.5, 1.5, 1.5, 1.5)
    initial_scale: float = 0.02  # in box units: each Gaussian's first standard deviation
    initial_opacity: float = 0.1
    density_scale: float = 50.0  # volume reading: density = scale * sum_i o_i G_i(x)
    seed: int = 0  # the initial means' draw, uniform in the box

    def __post_init__(self) -> None:
        if self.count < 1 or not 0 <= self.sh_degree <= MAX_SH_DEGREE:
            raise ValueError(
                f"a splat field needs count >= 1 and sh_degree in [0, {MAX_SH_DEGREE}], got "
                f"{self.count} and {self.sh_degree}"
            )
        if not (0 < self.initial_opacity < 1 and self.initial_scale > 0):
            raise ValueError(
                f"initial_opacity must lie in (0, 1) and initial_scale be positive, got "
                f"{self.initial_opacity} and {self.initial_scale}"
            )


class SplatField(Field):
    """Gaussians with trainable means, log-scales, quaternions, opacity logits and SH colour.

    The tensors live in `params` under gsplat's names ("means", "scales" as logs, "quats",
    "opacities" as logits, "sh"), so gsplat's densification strategies grow and prune them
    in place (`fedfields.train.splats`); `count` follows them (`structure_changed`)."""

    kind = "splats"

    def __init__(self, config: SplatFieldConfig = SplatFieldConfig()) -> None:
        super().__init__()
        self.config = config
        self.register_buffer("aabb", torch.tensor(config.aabb, dtype=torch.float32).view(2, 3))
        generator = torch.Generator().manual_seed(config.seed)
        unit = torch.rand(config.count, 3, generator=generator)
        extent = float((self.aabb[1] - self.aabb[0]).max())
        scale = torch.log(torch.tensor(config.initial_scale * extent))
        logit = torch.logit(torch.tensor(config.initial_opacity))
        self.params = nn.ParameterDict(
            {
                "means": self.aabb[0] + unit * (self.aabb[1] - self.aabb[0]),
                "scales": scale.expand(config.count, 3).clone(),
                "quats": torch.tensor([1.0, 0.0, 0.0, 0.0]).repeat(config.count, 1),
                "opacities": logit.expand(config.count).clone(),
                # degree 0 at 0: colour 0.5 grey
                "sh": torch.zeros(config.count, (config.sh_degree + 1) ** 2, 3),
            }
        )

    @property
    def means(self) -> Tensor:
        """[N, 3] world-space centres."""
        return self.params["means"]

    @property
    def sh(self) -> Tensor:
        """[N, K, 3] spherical-harmonic colour coefficients."""
        return self.params["sh"]

    @property
    def opacities(self) -> Tensor:
        """[N] opacities in (0, 1)."""
        return torch.sigmoid(self.params["opacities"])

    def gaussians(self) -> Gaussians:
        """The field's Gaussians with their activations applied, as rasterisers read them."""
        params = self.params
        return Gaussians(
            self.means, params["quats"], params["scales"].exp(), self.opacities, self.sh
        )

    def structure_changed(self) -> None:
        """Record the Gaussian count after densification or pruning, so that `config_dict`
        rebuilds a field of this size."""
        self.config = replace(self.config, count=int(self.means.shape[0]))

    def _kernels(self, points: Tensor) -> Tensor:
        """[P, N] opacity-weighted kernels o_i exp(-(x - mu_i)^T Sigma_i^-1 (x - mu_i) / 2)."""
        precision = torch.linalg.inv(self.gaussians().covariances())
        offset = points[:, None, :] - self.means[None]
        exponent = torch.einsum("pni,nij,pnj->pn", offset, precision, offset)
        return self.opacities * torch.exp(-0.5 * exponent)

    def density(self, points: Tensor) -> Tensor:
        return self.config.density_scale * self._kernels(points).sum(dim=-1)

    def forward(
        self, points: Tensor, directions: Tensor, image_index: Tensor | None = None
    ) -> FieldOutputs:
        """Density and the kernel-weighted mean of the Gaussians' colours seen along each
        point's direction (`image_index` is ignored: splats have no per-image appearance)."""
        kernels = self._kernels(points)
        weights = kernels / kernels.sum(dim=-1, keepdim=True).clamp(min=1e-12)
        basis = sh_basis(directions, self.sh.shape[1])  # [P, K]
        colours = (torch.einsum("pk,nkc->pnc", basis, self.sh) + 0.5).clamp(min=0.0)
        rgb = torch.einsum("pn,pnc->pc", weights, colours).clamp(0.0, 1.0)
        return FieldOutputs(density=self.config.density_scale * kernels.sum(dim=-1), rgb=rgb)

    @classmethod
    def from_options(cls, options: dict[str, Any]) -> SplatField:
        options = dict(options)
        options["aabb"] = tuple(options.get("aabb", SplatFieldConfig.aabb))
        return cls(SplatFieldConfig(**options))


class SplatAppearance(nn.Module):
    """Per-view appearance for splats: an affine map of each rendered view's colours,
    c' = A_v c + b_v (3 x 4 per view, the identity at first), which a user keeps on its node
    beside its personal Gaussians, as NeRF-W's appearance embedding is kept, so that a view's
    exposure or white balance is not learnt into the shared Gaussians."""

    def __init__(self, num_views: int) -> None:
        super().__init__()
        if num_views < 1:
            raise ValueError(f"SplatAppearance needs at least one view, got {num_views}")
        identity = torch.cat([torch.eye(3), torch.zeros(3, 1)], dim=1)
        self.affine = nn.Parameter(identity.repeat(num_views, 1, 1))

    def forward(self, image: Tensor, view: int) -> Tensor:
        """`image` [H, W, 3] of view `view` with that view's colour map applied."""
        matrix = self.affine[view]
        return image @ matrix[:, :3].T + matrix[:, 3]


# --- Structure: 3DGS-MCMC's relocation of dead Gaussians (Kheradmand et al. 2024, sec. 4.2) ---

STATE_PREFIX = "params."
"""Where a splat field's tensors sit in its `state_dict` (and a federated state's keys)."""


def relocation_binomials(most_copies: int) -> Tensor:
    """[n, n] binomial coefficients C(i, k) for i, k < n, float64 (eq. 9's table)."""
    table = torch.zeros(most_copies, most_copies, dtype=torch.float64)
    for i in range(most_copies):
        for k in range(i + 1):
            table[i, k] = math.comb(i, k)
    return table


def relocated_opacities_and_scales(
    opacities: Tensor, scales: Tensor, copies: Tensor
) -> tuple[Tensor, Tensor]:
    """3DGS-MCMC's eq. 9: the opacity and scales each of N = `copies` Gaussians at one place
    take so that together they render as the one they replace:
    o' = 1 - (1 - o)^(1/N) and s' = o / (sum_{i=1}^{N} sum_{k=0}^{i-1} C(i-1, k) (-1)^k
    o'^(k+1) / sqrt(k+1)) * s, as gsplat's `relocation` kernel computes it (in float64 here).

    `opacities` [M] in (0, 1), `scales` [M, 3] (not logs), `copies` [M] integers >= 1."""
    most = int(copies.max())
    binomials = relocation_binomials(most)
    opacity = opacities.double()
    new_opacity = 1.0 - (1.0 - opacity).pow(1.0 / copies.double())
    k = torch.arange(most, dtype=torch.float64)
    # term[m, k] = (-1)^k o'^(k+1) / sqrt(k+1); row i-1 of the table sums over k <= i-1
    terms = (-1.0) ** k / torch.sqrt(k + 1.0) * new_opacity[:, None].pow(k + 1.0)
    per_row = terms @ binomials.T  # [M, most]: sum_k C(i-1, k) term_k for i = 1..most
    rows = torch.arange(1, most + 1)[None, :] <= copies[:, None]
    denominator = (per_row * rows).sum(dim=1)
    new_scales = (opacity / denominator)[:, None] * scales.double()
    return new_opacity.to(opacities.dtype), new_scales.to(scales.dtype)


@dataclass(frozen=True)
class Relocation:
    """What one relocation did: the dead Gaussians (opacity at most the threshold) moved onto
    live ones, and the live ones they were drawn from."""

    dead: Tensor
    sources: Tensor


def relocate_dead(
    state: dict[str, Tensor], min_opacity: float, generator: torch.Generator
) -> tuple[dict[str, Tensor], Relocation]:
    """A splat state (`STATE_PREFIX` keys, opacities as logits, scales as logs) whose dead
    Gaussians, opacity <= `min_opacity`, are moved onto live ones drawn with probability
    proportional to opacity (with replacement, from `generator`), as gsplat's MCMC strategy
    relocates: each drawn Gaussian and its copies share its place and take eq. 9's opacity
    and scales (`relocated_opacities_and_scales`), the opacity kept within
    [`min_opacity`, 1 - eps]. The count and every shape stay; no Gaussian dead or none live:
    the state as it is. `state` is not changed."""
    logits = state[STATE_PREFIX + "opacities"]
    opacities = torch.sigmoid(logits.double())
    dead_mask = opacities <= min_opacity
    dead = dead_mask.nonzero().flatten()
    alive = (~dead_mask).nonzero().flatten()
    if len(dead) == 0 or len(alive) == 0:
        return dict(state), Relocation(dead[:0], dead[:0])
    drawn = torch.multinomial(opacities[alive], len(dead), replacement=True, generator=generator)
    sources = alive[drawn]
    copies = torch.bincount(sources, minlength=len(opacities))[sources] + 1
    new_opacity, new_scales = relocated_opacities_and_scales(
        opacities[sources], state[STATE_PREFIX + "scales"][sources].double().exp(), copies
    )
    eps = torch.finfo(torch.float32).eps
    new_opacity = new_opacity.clamp(min=min_opacity, max=1.0 - eps)
    moved = {name: tensor.clone() for name, tensor in state.items()}
    opacity_key, scale_key = STATE_PREFIX + "opacities", STATE_PREFIX + "scales"
    moved[opacity_key][sources] = torch.logit(new_opacity).to(logits.dtype)
    moved[scale_key][sources] = new_scales.log().to(moved[scale_key].dtype)
    for name in GAUSSIAN_TENSORS:
        tensor = moved[STATE_PREFIX + name]
        tensor[dead] = tensor[sources]
    return moved, Relocation(dead, sources)
