"""Volume rendering (emission-absorption quadrature, Max 1995 / NeRF Eq. 3).

Two layouts of the same sum: dense [R, S] samples (stratified / hierarchical sampling) and
packed samples with a ray index each (occupancy-grid marching skips empty space). Packed
samples have two backends behind `render_packed`: the torch functions here (the reference and
the CPU path) and Triton kernels (fedfields.render.composite_triton) for CUDA tensors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from fedfields.fields.encodings import triton_available, triton_runs_on, triton_works

CompositeBackend = Literal["auto", "torch", "triton"]


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


def composite_backend(
    backend: CompositeBackend, device: torch.device
) -> Literal["torch", "triton"]:
    """'auto': triton for CUDA tensors where it works (`triton_works`), else torch; 'triton'
    where it cannot run raises one clear error."""
    if backend == "triton":
        if not triton_runs_on(device):
            raise RuntimeError(
                f"packed compositing backend 'triton' cannot run on {device}: it needs triton "
                f"(installed: {triton_available()}) and CUDA tensors (or TRITON_INTERPRET=1 "
                "set before triton is imported); use 'auto' or 'torch'"
            )
        return "triton"
    if backend == "auto" and triton_works(device):
        return "triton"
    return "torch"


def render_packed(
    densities: Tensor,
    deltas: Tensor,
    rgb: Tensor,
    t_mid: Tensor,
    ray_index: Tensor,
    num_rays: int,
    background: Tensor,
    backend: CompositeBackend = "auto",
    kept: Tensor | None = None,
) -> tuple[RenderOutputs, Tensor]:
    """Per-ray outputs and per-sample weights [S] of packed samples sorted by ray.

    The same sums as `packed_weights` then `composite_packed`, differentiable in densities,
    colours (and deltas, depths, background when they need gradients) on either backend.
    `kept` ([] int64), when given: samples from that index on are padding of zero density
    and delta on the last ray; the triton kernels skip them (the torch sums add zeros).
    """
    if composite_backend(backend, densities.device) == "torch":
        weights = packed_weights(densities, deltas, ray_index, num_rays)
        rendered = composite_packed(weights, rgb, t_mid, ray_index, num_rays, background)
        return rendered, weights
    from fedfields.render.composite_triton import PackedComposite

    # where each ray's samples start (and the last ends), without a host sync
    rays = torch.arange(num_rays + 1, device=ray_index.device, dtype=ray_index.dtype)
    starts = torch.searchsorted(ray_index, rays)
    if kept is not None:
        starts[num_rays] = kept
    weights, color, depth, opacity = PackedComposite.apply(densities, deltas, t_mid, rgb, starts)
    color = color + (1.0 - opacity)[:, None] * background
    return RenderOutputs(rgb=color, depth=depth, opacity=opacity), weights
