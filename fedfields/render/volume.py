"""Volume rendering (emission-absorption quadrature, Max 1995 / NeRF Eq. 3).

Two layouts of the same sum: dense [R, S] samples (stratified / hierarchical sampling) and
packed samples with a ray index each (occupancy-grid marching skips empty space).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class RenderOutputs:
    """Per-ray rendering: colour [R, 3] (background composited), depth [R], opacity [R]."""

    rgb: Tensor
    depth: Tensor
    opacity: Tensor


def dense_weights(densities: Tensor, deltas: Tensor) -> Tensor:
    """w_i = T_i (1 - exp(-sigma_i delta_i)), T_i = exp(-sum_{j<i} sigma_j delta_j); [R, S]."""
    optical_depth = densities * deltas
    alpha = 1.0 - torch.exp(-optical_depth)
    transmittance = torch.exp(-(torch.cumsum(optical_depth, dim=-1) - optical_depth))
    return alpha * transmittance


def composite_dense(
    weights: Tensor, rgb: Tensor, t_mid: Tensor, background: Tensor
) -> RenderOutputs:
    """Accumulate colour and expected depth of [R, S] samples, then add the background."""
    opacity = weights.sum(-1)
    color = (weights[..., None] * rgb).sum(-2) + (1.0 - opacity)[..., None] * background
    depth = (weights * t_mid).sum(-1)
    return RenderOutputs(rgb=color, depth=depth, opacity=opacity)


def packed_weights(densities: Tensor, deltas: Tensor, ray_index: Tensor, num_rays: int) -> Tensor:
    """The same weights for packed samples sorted by ray (ray_index non-decreasing); [S].

    The exclusive per-ray cumulative optical depth is a global cumulative sum (in float64,
    so long batches keep precision) minus its value where each ray starts.
    """
    optical_depth = densities * deltas
    cumulative = torch.cumsum(optical_depth.double(), dim=0)
    ray_total = optical_depth.new_zeros(num_rays, dtype=torch.float64).index_add_(
        0, ray_index, optical_depth.double()
    )
    ray_end = torch.cumsum(ray_total, dim=0)
    ray_start = ray_end - ray_total
    exclusive = (cumulative - optical_depth.double() - ray_start[ray_index]).float()
    return (1.0 - torch.exp(-optical_depth)) * torch.exp(-exclusive)


def composite_packed(
    weights: Tensor,
    rgb: Tensor,
    t_mid: Tensor,
    ray_index: Tensor,
    num_rays: int,
    background: Tensor,
) -> RenderOutputs:
    """Accumulate packed samples into their rays, then add the background."""
    opacity = weights.new_zeros(num_rays).index_add(0, ray_index, weights)
    color = weights.new_zeros(num_rays, 3).index_add(0, ray_index, weights[:, None] * rgb)
    depth = weights.new_zeros(num_rays).index_add(0, ray_index, weights * t_mid)
    color = color + (1.0 - opacity)[:, None] * background
    return RenderOutputs(rgb=color, depth=depth, opacity=opacity)
