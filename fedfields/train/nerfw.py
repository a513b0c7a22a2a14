"""NeRF-W's local objective (Martin-Brualla et al. 2021, Eq. 13), as each DecentNeRF user runs it.

Per ray r: ||C(r) - C_hat(r)||^2 / (2 beta(r)^2) + log beta(r) + lambda_u * mean_k sigma_k^(tau),
with beta(r) = beta_min + beta_hat(r), the volume-rendered uncertainty of the transient
(personal) branch. Pixels the personal field claims get a large beta, so their colour error
barely reaches the global field: what one photo alone shows stays out of the federated field.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from fedfields.render.renderer import RayOutputs

BETA_MIN = 0.03
"""NeRF-W's beta_min (Sec. 4.2)."""
TRANSIENT_DENSITY_WEIGHT = 0.01
"""NeRF-W's lambda_u on the mean transient density."""


@dataclass(frozen=True)
class PersonalLoss:
    """NeRF-W's objective for a global+personal field (DecentNeRF): `nerfw_loss`'s weights."""

    beta_min: float = BETA_MIN
    density_weight: float = TRANSIENT_DENSITY_WEIGHT


@dataclass(frozen=True)
class NerfWLoss:
    """The three terms of Eq. 13 averaged over rays, and the plain MSE for reporting."""

    total: Tensor
    colour: Tensor  # mean ||C - C_hat||^2 / (2 beta^2)
    log_beta: Tensor  # mean log beta
    transient_density: Tensor  # lambda_u * mean sigma^(tau)
    mse: Tensor  # mean over rays and channels, unweighted


def nerfw_loss(
    predicted: Tensor,
    target: Tensor,
    uncertainty: Tensor,
    transient_density: Tensor,
    beta_min: float = BETA_MIN,
    transient_density_weight: float = TRANSIENT_DENSITY_WEIGHT,
    rays: Tensor | None = None,
    samples: Tensor | None = None,
) -> NerfWLoss:
    """Eq. 13 for colours [R, 3], rendered uncertainty beta_hat [R] and the transient
    densities of every sample drawn [S] (empty when the batch drew none).

    `rays` [R] and `samples` [S] (bool) restrict the means to the rays and samples they mark,
    in fixed shapes (a static step's complete rays and filled slots): nothing is read back.
    """
    if beta_min <= 0:
        raise ValueError(f"beta_min must be positive, got {beta_min}")
    beta = beta_min + uncertainty
    squared = (predicted - target).square()
    colour = _mean(squared.sum(-1) / (2.0 * beta.square()), rays)
    log_beta = _mean(torch.log(beta), rays)
    if transient_density.numel():
        sparsity = _mean(transient_density, samples)
    else:
        sparsity = predicted.new_zeros(())
    density_term = transient_density_weight * sparsity
    return NerfWLoss(
        total=colour + log_beta + density_term,
        colour=colour,
        log_beta=log_beta,
        transient_density=density_term,
        mse=squared.mean() if rays is None else _mean(squared.mean(-1), rays),
    )


def _mean(values: Tensor, mask: Tensor | None) -> Tensor:
    """The mean of `values` [N], or of those `mask` [N] marks (0 when it marks none)."""
    if mask is None:
        return values.mean()
    return torch.where(mask, values, 0.0).sum() / mask.sum().clamp(min=1)


def local_loss(
    rendered: RayOutputs,
    colors: Tensor,
    personal: PersonalLoss | None,
    rays: Tensor | None = None,
    samples: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """(photometric MSE, loss to minimise) of a local step: the MSE alone, or with `personal`
    NeRF-W's loss (`rendered` from a global+personal field); `rays` and `samples` as in
    `nerfw_loss` (a static step's complete rays and filled slots)."""
    if personal is None:
        squared = (rendered.rgb - colors).square()
        photometric = squared.mean() if rays is None else _mean(squared.mean(-1), rays)
        return photometric, photometric
    if rendered.uncertainty is None or rendered.personal_density is None:
        raise ValueError("a personal loss needs a global+personal field (GlobalPersonalField)")
    terms = nerfw_loss(
        rendered.rgb, colors, rendered.uncertainty, rendered.personal_density,
        personal.beta_min, personal.density_weight, rays, samples,
    )  # fmt: skip
    return terms.mse, terms.total
