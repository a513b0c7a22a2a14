"""Input encodings: NeRF positional encoding, spherical harmonics, multi-resolution hash grid.

Hash-grid backends (`HashGridConfig.implementation`):
- "torch": pure PyTorch, the reference and the CPU path;
- "triton": Triton kernels (fedfields.fields.hashgrid_triton) for CUDA tensors, compiled at
  run time (no nvcc); with TRITON_INTERPRET=1 they also run on CPU tensors (slowly, for tests);
- "auto" (default): triton when the table is on a CUDA device where a tiny triton launch
  works (`triton_works`, checked once per device), else torch with one warning, decided at
  every forward, so a grid built on CPU and moved with .to("cuda") goes fast;
- "tcnn": tinycudann, only when asked: its parameters are laid out its own way, so it
  exchanges weights only with other tcnn grids.
torch and triton share the `table` parameter and its indexing, so their state_dicts match and
CPU and GPU nodes federate.
"""

from __future__ import annotations

import math
import os
import warnings
from dataclasses import dataclass
from functools import cache
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fedfields.devices import canonical_device

# Instant-NGP's spatial hash primes (Muller et al. 2022, Eq. 4); the first is 1.
_HASH_PRIMES = (1, 2654435761, 805459861)
_CORNERS = [(i, j, k) for i in (0, 1) for j in (0, 1) for k in (0, 1)]  # x, y, z bits


class PositionalEncoding(nn.Module):
    """NeRF's frequency encoding: x, sin(2^k x), cos(2^k x) for k < num_frequencies."""

    def __init__(self, in_dim: int, num_frequencies: int, include_input: bool = True) -> None:
        super().__init__()
        self.in_dim = in_dim
        self.include_input = include_input
        self.register_buffer(
            "frequencies", 2.0 ** torch.arange(num_frequencies, dtype=torch.float32), False
        )
        self.out_dim = in_dim * (2 * num_frequencies + int(include_input))

    def forward(self, x: Tensor) -> Tensor:
        scaled = (x[..., None, :] * self.frequencies[:, None]).flatten(-2)
        parts = [torch.sin(scaled), torch.cos(scaled)]
        if self.include_input:
            parts.insert(0, x)
        return torch.cat(parts, dim=-1)


class SphericalHarmonicsEncoding(nn.Module):
    """Real spherical harmonics of unit directions up to degree 4 (16 terms), as Instant-NGP."""

    out_dim = 16

    def forward(self, directions: Tensor) -> Tensor:
        x, y, z = directions.unbind(-1)
        xx, yy, zz, xy, yz, xz = x * x, y * y, z * z, x * y, y * z, x * z
        return torch.stack(
            [
                torch.full_like(x, 0.28209479177387814),
                -0.48860251190291987 * y,
                0.48860251190291987 * z,
                -0.48860251190291987 * x,
                1.0925484305920792 * xy,
                -1.0925484305920792 * yz,
                0.94617469575755997 * zz - 0.31539156525251999,
                -1.0925484305920792 * xz,
                0.54627421529603959 * (xx - yy),
                0.59004358992664352 * y * (-3.0 * xx + yy),
                2.8906114426405538 * xy * z,
                0.45704579946446572 * y * (1.0 - 5.0 * zz),
                0.3731763325901154 * z * (5.0 * zz - 3.0),
                0.45704579946446572 * x * (1.0 - 5.0 * zz),
                1.4453057213202769 * z * (xx - yy),
                0.59004358992664352 * x * (-xx + 3.0 * yy),
            ],
            dim=-1,
        )


@dataclass(frozen=True)
class HashGridConfig:
    """Multi-resolution hash encoding (Instant-NGP) of points normalised to the unit cube."""

    num_levels: int = 16
    features_per_level: int = 2
    log2_hashmap_size: int = 19
    base_resolution: int = 16
    max_resolution: int = 2048
    implementation: Literal["auto", "torch", "triton", "tcnn"] = "auto"

    @property
    def per_level_scale(self) -> float:
        if self.num_levels == 1:
            return 1.0
        ratio = self.max_resolution / self.base_resolution
        return math.exp(math.log(ratio) / (self.num_levels - 1))

    def resolutions(self) -> list[int]:
        """Grid resolution of each level: floor(base * scale^level), as Instant-NGP.

        The small epsilon keeps the finest level at max_resolution despite rounding.
        """
        return [
            int(math.floor(self.base_resolution * self.per_level_scale**level + 1e-6))
            for level in range(self.num_levels)
        ]


@cache
def tcnn_available() -> bool:
    """True when tinycudann imports and a CUDA device is present."""
    if not torch.cuda.is_available():
        return False
    try:
        import tinycudann  # noqa: F401
    except ImportError:
        return False
    return True


@cache
def triton_available() -> bool:
    """True when triton imports (it ships with PyTorch's CUDA wheels on Linux)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def triton_runs_on(device: torch.device) -> bool:
    """True when triton kernels can run on tensors of `device`: CUDA, or the interpreter."""
    on_device = device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"
    return on_device and triton_available()


_TRITON_WORKS: dict[torch.device, bool] = {}


def triton_works(device: torch.device) -> bool:
    """'auto''s check, once per device: a CUDA device where triton imports and a tiny hash-grid
    kernel compiles, launches and gives the torch result. A failure warns once and 'auto'
    falls back to torch (a missing C compiler or driver surfaces here, not mid-training)."""
    if device.type != "cuda" or not triton_available():
        return False
    device = canonical_device(device)  # "cuda" and "cuda:0": one check, one warning
    if device not in _TRITON_WORKS:
        try:
            from fedfields.fields.hashgrid_triton import check_launch

            check_launch(device)
            _TRITON_WORKS[device] = True
        except Exception as error:  # any toolchain failure: fall back, say why once
            warnings.warn(
                f"triton cannot run on {device} ({type(error).__name__}: {error}); the 'auto' "
                "backends use torch there",
                RuntimeWarning,
                stacklevel=2,
            )
            _TRITON_WORKS[device] = False
    return _TRITON_WORKS[device]


def resolve_implementation(
    config: HashGridConfig, device: torch.device | str | None = None
) -> Literal["torch", "triton", "tcnn"]:
    """The backend that runs a grid whose table is on `device` (default: CUDA when visible).

    'auto' never picks tcnn (its weights do not federate with torch or triton grids). A
    backend that cannot run there raises one clear error naming what is missing.
    """
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if config.implementation == "tcnn":
        if not tcnn_available():
            raise RuntimeError(
                "hash grid implementation 'tcnn' needs tinycudann and a CUDA device; "
                "install the 'tcnn' extra on a CUDA machine or use implementation='torch'"
            )
        return "tcnn"
    if config.implementation == "triton":
        if not triton_runs_on(device):
            raise RuntimeError(
                f"hash grid implementation 'triton' cannot run on {device}: it needs triton "
                f"(installed: {triton_available()}) and CUDA tensors (or TRITON_INTERPRET=1 "
                "set before triton is imported); use implementation='auto' or 'torch'"
            )
        return "triton"
    if config.implementation == "auto" and triton_works(device):
        return "triton"
    return "torch"


BINCOUNT_DEVICES = ("cpu",)
"""Device types whose hash-grid backward adds by bincount; the others add with index_add_."""


class _EmbeddingBagSum(torch.autograd.Function):
    """Weighted sum of table rows per bag; backward adds the weighted output gradients into
    the table's rows: a weighted `bincount` per feature on the CPU, `index_add_` elsewhere.

    torch's own embedding_bag backward sorts the indices, which is several times slower on
    CPU. `bincount` reads its input's range back to the host on CUDA and cannot be captured
    in a CUDA graph (`fedfields.train.cuda_syncs`), so CUDA adds with `index_add_`; on the
    CPU `index_add_` adds in index order, so both give the same gradients bit for bit there
    (tests/test_fields.py), and the bincount is the faster by 2-3x in a lego training run.
    """

    @staticmethod
    def forward(ctx, table: Tensor, indices: Tensor, weights: Tensor) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(indices, weights)
        ctx.table_shape = table.shape
        return F.embedding_bag(indices, table, per_sample_weights=weights, mode="sum")

    @staticmethod
    def backward(ctx, grad_output: Tensor):  # type: ignore[override]
        indices, weights = ctx.saved_tensors
        rows, width = ctx.table_shape
        flat = indices.reshape(-1)
        if grad_output.device.type in BINCOUNT_DEVICES:
            columns = [
                torch.bincount(flat, (weights * grad_output[:, f, None]).reshape(-1), rows)
                for f in range(width)
            ]
            return torch.stack(columns, dim=1).to(grad_output.dtype), None, None
        contributions = (weights[:, :, None] * grad_output[:, None, :]).reshape(-1, width)
        grad_table = contributions.new_zeros(rows, width)
        grad_table.index_add_(0, flat, contributions)
        return grad_table.to(grad_output.dtype), None, None


class HashGridEncoding(nn.Module):
    """Multi-resolution hash grid with trilinear interpolation; coarse levels index densely.

    Input: points in [0, 1]^3 (outside values are clamped). Output: [N, levels * features].
    """

    def __init__(self, config: HashGridConfig = HashGridConfig()) -> None:
        super().__init__()
        self.config = config
        self.out_dim = config.num_levels * config.features_per_level
        # checked now for the machine (a node that cannot run it refuses before training);
        # resolved again at each forward for the table's device
        self.implementation = config.implementation
        if resolve_implementation(config) == "tcnn":
            self.tcnn_encoding = _make_tcnn_encoding(config)
            return
        hashmap_size = 2**config.log2_hashmap_size
        resolutions = config.resolutions()
        dense = [(r + 1) ** 3 <= hashmap_size for r in resolutions]
        sizes = [
            (r + 1) ** 3 if is_dense else hashmap_size
            for r, is_dense in zip(resolutions, dense, strict=True)
        ]
        offsets = [0]
        for size in sizes:
            offsets.append(offsets[-1] + size)
        # Per-level int32 strides: dense levels index x + y(r+1) + z(r+1)^2; hashed levels use
        # the primes reduced mod the table size, exact for the low bits that the mask keeps.
        strides = [
            (1, r + 1, (r + 1) ** 2) if is_dense else tuple(p % hashmap_size for p in _HASH_PRIMES)
            for r, is_dense in zip(resolutions, dense, strict=True)
        ]
        self.num_dense_levels = sum(dense)
        self.register_buffer("resolutions", torch.tensor(resolutions, dtype=torch.float32), False)
        self.register_buffer("strides", torch.tensor(strides, dtype=torch.int32), False)
        self.register_buffer("level_offsets", torch.tensor(offsets[:-1], dtype=torch.int32), False)
        self.hash_mask = hashmap_size - 1
        self.table = nn.Parameter(
            torch.empty(offsets[-1], config.features_per_level).uniform_(-1e-4, 1e-4)
        )

    def forward(self, points: Tensor) -> Tensor:
        if self.implementation == "tcnn":
            return self.tcnn_encoding(points.clamp(0.0, 1.0)).float()
        if resolve_implementation(self.config, self.table.device) == "triton":
            from fedfields.fields.hashgrid_triton import HashGridTriton

            return HashGridTriton.apply(
                self.table, points, self.resolutions, self.strides, self.level_offsets,
                self.num_dense_levels, self.hash_mask,
            )  # fmt: skip
        indices, weights = self.corner_indices_and_weights(points)
        features = _EmbeddingBagSum.apply(self.table, indices, weights)
        return features.view(points.shape[0], self.out_dim)

    @torch.no_grad()
    def corner_indices_and_weights(self, points: Tensor) -> tuple[Tensor, Tensor]:
        """Table rows and trilinear weights of the 8 corners per level: [N * levels, 8] each.

        Corner indices are separable (sum of per-axis terms on dense levels, xor on hashed
        ones) and so are the weights (product of per-axis weights), so each corner is built
        from contiguous [N, levels] per-axis terms: a size-2 corner axis in the broadcast
        made every elementwise op two to three times slower on CPU.
        """
        resolution = self.resolutions
        scaled = points.clamp(0.0, 1.0)[:, None, :] * resolution[None, :, None]  # [N, L, 3]
        lower = torch.minimum(scaled.floor(), (resolution - 1)[None, :, None])
        frac = scaled - lower
        lower_terms = lower.int() * self.strides  # int32, wrapping as the hash wants
        # per axis: (lower, upper) corner's index term and weight, [N, L] each
        terms = [(t := lower_terms[..., a].contiguous(), t + self.strides[:, a]) for a in range(3)]
        weights = [(1.0 - (f := frac[..., a].contiguous()), f) for a in range(3)]
        split, count, levels = self.num_dense_levels, points.shape[0], self.config.num_levels
        index = torch.empty(8, count, levels, dtype=torch.int32, device=points.device)
        weight = torch.empty(8, count, levels, dtype=frac.dtype, device=points.device)
        for corner, (i, j, k) in enumerate(_CORNERS):
            x, y, z = terms[0][i], terms[1][j], terms[2][k]
            dense, hashed = index[corner, :, :split], index[corner, :, split:]
            torch.add(x[:, :split], y[:, :split], out=dense)
            dense += z[:, :split]
            torch.bitwise_xor(x[:, split:], y[:, split:], out=hashed)
            hashed ^= z[:, split:]
            torch.mul(weights[0][i], weights[1][j], out=weight[corner])
            weight[corner] *= weights[2][k]
        index[:, :, split:] &= self.hash_mask
        index += self.level_offsets
        rows = count * levels
        return index.view(8, rows).t().contiguous(), weight.view(8, rows).t().contiguous()


def _make_tcnn_encoding(config: HashGridConfig) -> nn.Module:
    """tinycudann HashGrid with the same levels, features, table size and scale."""
    import tinycudann as tcnn

    return tcnn.Encoding(
        n_input_dims=3,
        encoding_config={
            "otype": "HashGrid",
            "n_levels": config.num_levels,
            "n_features_per_level": config.features_per_level,
            "log2_hashmap_size": config.log2_hashmap_size,
            "base_resolution": config.base_resolution,
            "per_level_scale": config.per_level_scale,
        },
    )
