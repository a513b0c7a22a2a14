"""Triton kernels compositing packed samples: one lane per ray walks its samples in order.

The forward gives each sample's weight w_i = T_i (1 - exp(-sigma_i delta_i)) and each ray's
colour, depth and opacity (before the background); the backward gives the gradients of the
densities, colours, and where asked of the deltas and sample depths. Transmittance sums run
in float64, as `fedfields.render.volume.packed_weights` does. Imported only on that path.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.autograd.function import once_differentiable

from fedfields.devices import triton_launch_guard

BLOCK = 64  # rays per program


@triton.jit(do_not_specialize=["num_rays"])  # one variant for every batch size
def _composite_forward(
    densities_ptr, deltas_ptr, t_ptr, rgb_ptr, starts_ptr,
    weights_ptr, color_ptr, depth_ptr, opacity_ptr, num_rays,
    BLOCK: tl.constexpr,
):  # fmt: skip
    rays = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    valid = rays < num_rays
    start = tl.load(starts_ptr + rays, mask=valid, other=0)
    count = tl.load(starts_ptr + rays + 1, mask=valid, other=0) - start
    optical = tl.zeros((BLOCK,), dtype=tl.float64)  # exclusive optical depth so far
    red = tl.zeros((BLOCK,), dtype=tl.float32)
    green = tl.zeros((BLOCK,), dtype=tl.float32)
    blue = tl.zeros((BLOCK,), dtype=tl.float32)
    depth = tl.zeros((BLOCK,), dtype=tl.float32)
    opacity = tl.zeros((BLOCK,), dtype=tl.float32)
    for step in range(0, tl.max(count, axis=0)):
        active = step < count
        sample = start + step
        sample_depth = tl.load(densities_ptr + sample, mask=active, other=0.0) * tl.load(
            deltas_ptr + sample, mask=active, other=0.0
        )
        weight = (1.0 - tl.exp(-sample_depth)) * tl.exp(-optical.to(tl.float32))
        tl.store(weights_ptr + sample, weight, mask=active)
        red += weight * tl.load(rgb_ptr + sample * 3, mask=active, other=0.0)
        green += weight * tl.load(rgb_ptr + sample * 3 + 1, mask=active, other=0.0)
        blue += weight * tl.load(rgb_ptr + sample * 3 + 2, mask=active, other=0.0)
        depth += weight * tl.load(t_ptr + sample, mask=active, other=0.0)
        opacity += weight
        optical += sample_depth.to(tl.float64)
    tl.store(color_ptr + rays * 3, red, mask=valid)
    tl.store(color_ptr + rays * 3 + 1, green, mask=valid)
    tl.store(color_ptr + rays * 3 + 2, blue, mask=valid)
    tl.store(depth_ptr + rays, depth, mask=valid)
    tl.store(opacity_ptr + rays, opacity, mask=valid)


@triton.jit
def _sample_grad(
    sample, active, red_grad, green_grad, blue_grad, depth_grad, opacity_grad,
    t_ptr, rgb_ptr, grad_weights_ptr, HAS_GRAD_WEIGHTS: tl.constexpr,
):  # fmt: skip
    """dLoss/dw_i of one sample per lane: its own weight gradient plus its ray's outputs'."""
    grad = opacity_grad + depth_grad * tl.load(t_ptr + sample, mask=active, other=0.0)
    grad += red_grad * tl.load(rgb_ptr + sample * 3, mask=active, other=0.0)
    grad += green_grad * tl.load(rgb_ptr + sample * 3 + 1, mask=active, other=0.0)
    grad += blue_grad * tl.load(rgb_ptr + sample * 3 + 2, mask=active, other=0.0)
    if HAS_GRAD_WEIGHTS:
        grad += tl.load(grad_weights_ptr + sample, mask=active, other=0.0)
    return grad


@triton.jit(do_not_specialize=["num_rays"])
def _composite_backward(
    densities_ptr, deltas_ptr, t_ptr, rgb_ptr, starts_ptr, weights_ptr,
    grad_weights_ptr, grad_color_ptr, grad_depth_ptr, grad_opacity_ptr,
    grad_densities_ptr, grad_deltas_ptr, grad_t_ptr, grad_rgb_ptr, num_rays,
    HAS_GRAD_WEIGHTS: tl.constexpr, NEED_DELTAS: tl.constexpr, NEED_T: tl.constexpr,
    BLOCK: tl.constexpr,
):  # fmt: skip
    """dw_i/dsigma_k = delta_k (T_{k+1} [i = k] - w_i [i > k]); deltas alike with sigma_k."""
    rays = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    valid = rays < num_rays
    start = tl.load(starts_ptr + rays, mask=valid, other=0)
    count = tl.load(starts_ptr + rays + 1, mask=valid, other=0) - start
    red_grad = tl.load(grad_color_ptr + rays * 3, mask=valid, other=0.0)
    green_grad = tl.load(grad_color_ptr + rays * 3 + 1, mask=valid, other=0.0)
    blue_grad = tl.load(grad_color_ptr + rays * 3 + 2, mask=valid, other=0.0)
    depth_grad = tl.load(grad_depth_ptr + rays, mask=valid, other=0.0)
    opacity_grad = tl.load(grad_opacity_ptr + rays, mask=valid, other=0.0)
    longest = tl.max(count, axis=0)
    total = tl.zeros((BLOCK,), dtype=tl.float64)  # sum_i g_i w_i over the ray
    for step in range(0, longest):
        active = step < count
        sample = start + step
        grad = _sample_grad(
            sample, active, red_grad, green_grad, blue_grad, depth_grad, opacity_grad,
            t_ptr, rgb_ptr, grad_weights_ptr, HAS_GRAD_WEIGHTS,
        )  # fmt: skip
        weight = tl.load(weights_ptr + sample, mask=active, other=0.0)
        total += (grad * weight).to(tl.float64)
    optical = tl.zeros((BLOCK,), dtype=tl.float64)
    for step in range(0, longest):
        active = step < count
        sample = start + step
        grad = _sample_grad(
            sample, active, red_grad, green_grad, blue_grad, depth_grad, opacity_grad,
            t_ptr, rgb_ptr, grad_weights_ptr, HAS_GRAD_WEIGHTS,
        )  # fmt: skip
        weight = tl.load(weights_ptr + sample, mask=active, other=0.0)
        density = tl.load(densities_ptr + sample, mask=active, other=0.0)
        delta = tl.load(deltas_ptr + sample, mask=active, other=0.0)
        optical += (density * delta).to(tl.float64)
        total -= (grad * weight).to(tl.float64)  # now the sum over the samples after this one
        core = grad * tl.exp(-optical.to(tl.float32)) - total.to(tl.float32)
        tl.store(grad_densities_ptr + sample, delta * core, mask=active)
        if NEED_DELTAS:
            tl.store(grad_deltas_ptr + sample, density * core, mask=active)
        if NEED_T:
            tl.store(grad_t_ptr + sample, weight * depth_grad, mask=active)
        tl.store(grad_rgb_ptr + sample * 3, weight * red_grad, mask=active)
        tl.store(grad_rgb_ptr + sample * 3 + 1, weight * green_grad, mask=active)
        tl.store(grad_rgb_ptr + sample * 3 + 2, weight * blue_grad, mask=active)


def _grid(num_rays: int) -> tuple[int]:
    return (triton.cdiv(num_rays, BLOCK),)


class PackedComposite(torch.autograd.Function):
    """(weights [S], colour [R, 3], depth [R], opacity [R]) of packed samples, no background.

    `starts` [R + 1] holds where each ray's samples begin (the last entry: S).
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx, densities: Tensor, deltas: Tensor, t_mid: Tensor, rgb: Tensor, starts: Tensor
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        ctx.set_materialize_grads(False)
        inputs = [x.float().contiguous() for x in (densities, deltas, t_mid, rgb)]
        starts = starts.contiguous()
        num_rays = starts.numel() - 1
        weights = torch.zeros_like(inputs[0])
        color = inputs[0].new_zeros(num_rays, 3)
        depth, opacity = inputs[0].new_zeros(num_rays), inputs[0].new_zeros(num_rays)
        if num_rays > 0 and weights.numel() > 0:  # no kernel on empty tensors (null pointers)
            with triton_launch_guard(starts.device):
                _composite_forward[_grid(num_rays)](
                    *inputs, starts, weights, color, depth, opacity, num_rays, BLOCK=BLOCK
                )
        ctx.save_for_backward(*inputs, starts, weights)
        return weights, color, depth, opacity

    @staticmethod
    @once_differentiable  # the kernels are not recorded: a second derivative must fail
    def backward(ctx, grad_weights, grad_color, grad_depth, grad_opacity):  # type: ignore[override]
        densities, deltas, t_mid, rgb, starts, weights = ctx.saved_tensors
        num_rays = starts.numel() - 1
        per_ray = [
            densities.new_zeros(shape) if grad is None else grad.float().contiguous()
            for grad, shape in ((grad_color, (num_rays, 3)), (grad_depth, num_rays),
                                (grad_opacity, num_rays))
        ]  # fmt: skip
        need_deltas, need_t = ctx.needs_input_grad[1], ctx.needs_input_grad[2]
        grad_densities, grad_rgb = torch.zeros_like(densities), torch.zeros_like(rgb)
        grad_deltas = torch.zeros_like(deltas) if need_deltas else grad_densities
        grad_t = torch.zeros_like(t_mid) if need_t else grad_densities
        if num_rays > 0 and densities.numel() > 0:
            has_weights_grad = grad_weights is not None
            with triton_launch_guard(starts.device):
                _composite_backward[_grid(num_rays)](
                    densities, deltas, t_mid, rgb, starts, weights,
                    grad_weights.float().contiguous() if has_weights_grad else weights,
                    *per_ray, grad_densities, grad_deltas, grad_t, grad_rgb, num_rays,
                    HAS_GRAD_WEIGHTS=has_weights_grad, NEED_DELTAS=need_deltas, NEED_T=need_t,
                    BLOCK=BLOCK,
                )  # fmt: skip
        return (
            grad_densities,
            grad_deltas if need_deltas else None,
            grad_t if need_t else None,
            grad_rgb,
            None,
        )
