"""Triton kernels of the hash-grid encoding: a gather forward and an atomic-scatter backward.

They index exactly as `HashGridEncoding.corner_indices_and_weights` (clamp to [0, 1], lower
corner clamped to resolution - 1, dense levels x + y(r+1) + z(r+1)^2, hashed levels the xor of
int32 prime terms masked to the table) and read the same `table`, so a field trained here
exchanges weights with the torch backend. Imported only when that backend runs (needs triton).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.autograd.function import once_differentiable

from fedfields.devices import triton_launch_guard

BLOCK = 128  # points per program; each program handles one level


@triton.jit
def _axis(points_ptr, rows, valid, axis: tl.constexpr, resolution, stride):
    """One axis of a block of points: lower and upper corner index terms and their weights."""
    coordinate = tl.load(points_ptr + rows * 3 + axis, mask=valid, other=0.0)
    scaled = tl.minimum(tl.maximum(coordinate, 0.0), 1.0) * resolution
    lower = tl.minimum(tl.floor(scaled), resolution - 1.0)
    fraction = scaled - lower
    term = lower.to(tl.int32) * stride
    return term, term + stride, 1.0 - fraction, fraction


@triton.jit
def _pick(lower, upper, lower_weight, upper_weight, take_upper: tl.constexpr):
    """The lower or the upper corner's term and weight along one axis."""
    if take_upper:
        return upper, upper_weight
    else:
        return lower, lower_weight


@triton.jit(do_not_specialize=["num_points"])  # one variant for every batch size
def _level_sums(
    points_ptr, table_ptr, grad_ptr, resolutions_ptr, strides_ptr, offsets_ptr,
    num_points, num_dense_levels, hash_mask,
    FEATURES: tl.constexpr, FEATURES_POW2: tl.constexpr, LEVELS: tl.constexpr,
    BLOCK: tl.constexpr, BACKWARD: tl.constexpr,
):  # fmt: skip
    """One program: a block of points at one level (program axis 1).

    Forward gathers the 8 corners' table rows into the features at `grad_ptr`; backward
    scatters the features' gradient read from `grad_ptr` into the table gradient at `table_ptr`.
    """
    level = tl.program_id(1)
    rows = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    valid = rows < num_points
    features = tl.arange(0, FEATURES_POW2)
    mask = valid[:, None] & (features < FEATURES)[None, :]
    resolution = tl.load(resolutions_ptr + level)
    x_lo, x_hi, wx_lo, wx_hi = _axis(
        points_ptr, rows, valid, 0, resolution, tl.load(strides_ptr + level * 3)
    )
    y_lo, y_hi, wy_lo, wy_hi = _axis(
        points_ptr, rows, valid, 1, resolution, tl.load(strides_ptr + level * 3 + 1)
    )
    z_lo, z_hi, wz_lo, wz_hi = _axis(
        points_ptr, rows, valid, 2, resolution, tl.load(strides_ptr + level * 3 + 2)
    )
    dense = level < num_dense_levels
    offset = tl.load(offsets_ptr + level)
    out_ptrs = grad_ptr + rows[:, None] * (LEVELS * FEATURES) + level * FEATURES + features[None, :]
    if BACKWARD:
        grad = tl.load(out_ptrs, mask=mask, other=0.0).to(tl.float32)
    total = tl.zeros((BLOCK, FEATURES_POW2), dtype=tl.float32)
    for corner in tl.static_range(8):
        x, wx = _pick(x_lo, x_hi, wx_lo, wx_hi, corner & 4)
        y, wy = _pick(y_lo, y_hi, wy_lo, wy_hi, corner & 2)
        z, wz = _pick(z_lo, z_hi, wz_lo, wz_hi, corner & 1)
        index = tl.where(dense, x + y + z, (x ^ y ^ z) & hash_mask) + offset
        weight = wx * wy * wz
        rows_ptrs = table_ptr + index.to(tl.int64)[:, None] * FEATURES + features[None, :]
        if BACKWARD:
            tl.atomic_add(rows_ptrs, weight[:, None] * grad, mask=mask)
        else:
            value = tl.load(rows_ptrs, mask=mask, other=0.0)
            total += weight[:, None] * value.to(tl.float32)
    if not BACKWARD:
        tl.store(out_ptrs, total, mask=mask)


class HashGridTriton(torch.autograd.Function):
    """Features [N, levels * features] of points [N, 3]; gradients reach the table only."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx,
        table: Tensor,
        points: Tensor,
        resolutions: Tensor,
        strides: Tensor,
        level_offsets: Tensor,
        num_dense_levels: int,
        hash_mask: int,
    ) -> Tensor:
        points = points.detach().float().contiguous()
        levels = (resolutions.float().contiguous(), strides.int().contiguous(),
                  level_offsets.int().contiguous())  # fmt: skip
        out = torch.empty(points.shape[0], levels[0].numel() * table.shape[1], device=table.device)
        ctx.save_for_backward(points, *levels)
        ctx.settings = (num_dense_levels, hash_mask)
        ctx.table_shape, ctx.table_dtype = table.shape, table.dtype
        _launch(points, table.contiguous(), out, levels, ctx.settings, backward=False)
        return out.to(table.dtype)

    @staticmethod
    @once_differentiable  # the kernels are not recorded: a second derivative must fail
    def backward(ctx, grad_out: Tensor):  # type: ignore[override]
        points, *levels = ctx.saved_tensors
        grad_table = torch.zeros(ctx.table_shape, device=grad_out.device)
        _launch(points, grad_table, grad_out.float().contiguous(), levels, ctx.settings, True)
        return grad_table.to(ctx.table_dtype), None, None, None, None, None, None


def _launch(
    points: Tensor,
    table: Tensor,
    features: Tensor,
    levels: tuple[Tensor, ...] | list[Tensor],
    settings: tuple[int, int],
    backward: bool,
) -> None:
    """Run `_level_sums` over every block of points and every level (none for no points)."""
    if points.shape[0] == 0:
        return
    resolutions, strides, offsets = levels
    width = table.shape[1]
    with triton_launch_guard(points.device):
        _level_sums[(triton.cdiv(points.shape[0], BLOCK), resolutions.numel())](
            points, table, features, resolutions, strides, offsets, points.shape[0], *settings,
            FEATURES=width, FEATURES_POW2=triton.next_power_of_2(width),
            LEVELS=resolutions.numel(), BLOCK=BLOCK, BACKWARD=backward,
        )  # fmt: skip


def check_launch(device: torch.device) -> None:
    """Compile and launch the forward on one point of a 2^3 grid; raise unless it gives the
    mean of the 8 corner rows (what trilinear weights give at the cell's centre)."""
    table = torch.arange(16.0, device=device).view(8, 2)
    levels = (torch.ones(1, device=device), torch.tensor([[1, 2, 4]], dtype=torch.int32,
              device=device), torch.zeros(1, dtype=torch.int32, device=device))  # fmt: skip
    features = torch.empty(1, 2, device=device)
    _launch(torch.full((1, 3), 0.5, device=device), table, features, levels, (1, 7), False)
    if not torch.allclose(features.cpu(), table.mean(0).cpu()[None]):
        raise RuntimeError(f"the check kernel gave {features.tolist()}, not the corner mean")
