"""Update compression: low-rank, b-bit stochastic quantisation and top-k, with error feedback.

A client compresses its update (the change of its state since the global it received) into a
*record*: a flat dict of named numpy arrays, what crosses the wire (a Flower ArrayRecord holds
it as it is). The server decompresses it against the global's shapes, refusing anything
malformed with one ValueError that says why. Three schemes (`CompressionConfig.scheme`):

  lowrank   each weight matrix (a tensor of two or more dimensions, read as
            shape[0] x the rest) as its rank-r truncated SVD U_r S_r V_r^T, sent as
            "<key>:u" = U_r S_r and "<key>:v" = V_r^T (FedNeRF, arXiv 2305.01163). Vectors,
            scalars and matrices for which r (m + n) >= m n saves nothing go whole, "<key>:whole".
  quantise  each tensor x as b-bit codes (b in 8, 4, 2) on the 2^b evenly spaced levels of
            [-s, s], s = max |x| the per-tensor scale; each entry is rounded up or down at
            random with the probabilities that make the decoded value unbiased,
            E[decode(encode(x))] = x. Sent as "<key>:codes" (uint8, 8/b codes a byte),
            "<key>:scale" (float32 [1]) and "<key>:bits" (uint8 [1], checked against b).
  topk      the k = ceil(f n) entries of largest magnitude of each tensor of n entries, as
            "<key>:indices" (int64 flat positions) and "<key>:values" (float32).

Error feedback (`compress_with_feedback`): what compression lost this round (the residual)
is added to the next round's update before compressing, so no part of an update is lost for
good, only delayed. The residual is a dict of tensors the node keeps in its private state.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

SCHEMES = ("none", "lowrank", "quantise", "topk")
BIT_WIDTHS = (8, 4, 2)
SEPARATOR = ":"
"""Joins a state key and the name of one of its parts in a record ("layer.weight:u")."""

Record = dict[str, np.ndarray]
Shapes = Mapping[str, tuple[int, ...]]


@dataclass(frozen=True)
class CompressionConfig:
    """Which scheme compresses updates and how strongly: `rank` r for lowrank, `bits` b for
    quantise, `fraction` f for topk (each used by its scheme only). "none" sends updates whole.
    With `download` the global goes down compressed the same way, as the change since the
    version a node holds, kept `download_history` rounds (`fedfields.download_chain`)."""

    scheme: str = "none"
    rank: int = 4
    bits: int = 8
    fraction: float = 0.1
    download: bool = False
    download_history: int = 8

    def __post_init__(self) -> None:
        if self.scheme not in SCHEMES:
            raise ValueError(f"compression must be one of {SCHEMES}, got {self.scheme!r}")
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise ValueError(f"compression-rank must be a positive integer, got {self.rank!r}")
        if self.bits not in BIT_WIDTHS or isinstance(self.bits, bool):
            raise ValueError(f"compression-bits must be one of {BIT_WIDTHS}, got {self.bits!r}")
        if not (isinstance(self.fraction, (int, float)) and 0 < self.fraction <= 1):
            raise ValueError(f"compression-fraction must be in (0, 1], got {self.fraction!r}")
        if not isinstance(self.download, bool):
            raise ValueError(f"compression-download must be true or false, got {self.download!r}")
        history = self.download_history
        if isinstance(history, bool) or not isinstance(history, int) or history < 1:
            raise ValueError(
                f"compression-download-history must be a positive integer, got {history!r}"
            )

    @property
    def enabled(self) -> bool:
        """Whether updates are compressed at all."""
        return self.scheme != "none"


# ------------------------------------------------------------------ shared helpers
def part(key: str, name: str) -> str:
    """The record entry holding part `name` of state key `key`."""
    return f"{key}{SEPARATOR}{name}"


def matrix_shape(shape: tuple[int, ...]) -> tuple[int, int] | None:
    """A tensor's shape as the matrix low-rank compresses (shape[0] x the rest); None for
    scalars and vectors, which have no matrix shape."""
    if len(shape) < 2:
        return None
    return shape[0], math.prod(shape[1:])


def lowrank_rank(shape: tuple[int, ...], rank: int) -> int:
    """The rank a tensor of `shape` is sent at: min(r, m, n), or 0 (sent whole) when it has no
    matrix shape or the two factors would be no smaller than the matrix."""
    matrix = matrix_shape(shape)
    if matrix is None:
        return 0
    rows, cols = matrix
    kept = min(rank, rows, cols)
    return kept if kept * (rows + cols) < rows * cols else 0


def topk_count(numel: int, fraction: float) -> int:
    """k: the entries top-k keeps of `numel` entries (at least one of a non-empty tensor)."""
    return min(numel, max(1, math.ceil(fraction * numel))) if numel else 0


def record_bytes(record: Mapping[str, np.ndarray]) -> int:
    """Bytes of a record's array data (what the arrays cost on the wire, keys aside)."""
    return sum(int(np.asarray(array).nbytes) for array in record.values())


def full_bytes(state: Mapping[str, Tensor]) -> int:
    """Bytes of `state` sent whole as float32, the uncompressed upload."""
    return sum(4 * tensor.numel() for tensor in state.values())


# ------------------------------------------------------------------ compress
def compress(
    update: Mapping[str, Tensor], config: CompressionConfig, generator: torch.Generator
) -> Record:
    """The record of `update` under `config` (float32 data; `generator` draws the random
    rounding of quantise, so one seed gives one record)."""
    record: Record = {}
    for key, tensor in update.items():
        values = tensor.detach().to(device="cpu", dtype=torch.float32)
        if config.scheme == "lowrank":
            record |= _lowrank_parts(key, values, config.rank)
        elif config.scheme == "quantise":
            record |= _quantised_parts(key, values, config.bits, generator)
        elif config.scheme == "topk":
            record |= _topk_parts(key, values, config.fraction)
        else:
            record[part(key, "whole")] = values.numpy().copy()
    return record


def _lowrank_parts(key: str, values: Tensor, rank: int) -> Record:
    """`values` as its truncated SVD's two factors, or whole (`lowrank_rank` 0)."""
    kept = lowrank_rank(tuple(values.shape), rank)
    if kept == 0:
        return {part(key, "whole"): values.numpy().copy()}
    matrix = values.reshape(matrix_shape(tuple(values.shape)))
    left, singular, right = torch.linalg.svd(matrix.double(), full_matrices=False)
    factor_u = (left[:, :kept] * singular[:kept]).float()
    return {part(key, "u"): factor_u.numpy(), part(key, "v"): right[:kept].float().numpy()}


def _quantised_parts(key: str, values: Tensor, bits: int, generator: torch.Generator) -> Record:
    """`values` as unbiased stochastic b-bit codes on [-s, s] plus the scale s and b."""
    flat = values.flatten().double()
    scale = float(flat.abs().max()) if flat.numel() else 0.0
    top = 2**bits - 1
    if scale > 0:
        position = (flat + scale) / (2 * scale) * top
        floor = position.floor()
        up = torch.rand(flat.numel(), generator=generator, dtype=torch.float64) < position - floor
        codes = (floor + up.double()).clamp(0, top).to(torch.uint8)
    else:  # every entry zero: any code decodes to 0 with scale 0
        codes = torch.zeros(flat.numel(), dtype=torch.uint8)
    return {
        part(key, "codes"): pack_codes(codes.numpy(), bits),
        part(key, "scale"): np.array([scale], dtype=np.float32),
        part(key, "bits"): np.array([bits], dtype=np.uint8),
    }


def _topk_parts(key: str, values: Tensor, fraction: float) -> Record:
    """The k largest-magnitude entries of `values` with their flat positions, in ascending order."""
    flat = values.flatten()
    count = topk_count(flat.numel(), fraction)
    indices = torch.topk(flat.abs(), count, sorted=False).indices.sort().values
    return {part(key, "indices"): indices.numpy(), part(key, "values"): flat[indices].numpy()}


def pack_codes(codes: np.ndarray, bits: int) -> np.ndarray:
    """b-bit codes (uint8, each below 2^b) packed 8/b to a byte, the first in the lowest bits."""
    per_byte = 8 // bits
    padded = np.zeros(math.ceil(codes.size / per_byte) * per_byte, dtype=np.uint8)
    padded[: codes.size] = codes
    grouped = padded.reshape(-1, per_byte).astype(np.uint16)
    shifts = (np.arange(per_byte) * bits).astype(np.uint16)
    return (grouped << shifts).sum(axis=1).astype(np.uint8)


def unpack_codes(packed: np.ndarray, bits: int, count: int) -> np.ndarray:
    """The first `count` b-bit codes of `pack_codes`'s bytes."""
    per_byte = 8 // bits
    shifts = (np.arange(per_byte) * bits).astype(np.uint8)
    codes = (packed[:, None] >> shifts) & np.uint8(2**bits - 1)
    return codes.reshape(-1)[:count]


# ------------------------------------------------------------------ decompress
def decompress(
    record: Mapping[str, np.ndarray], shapes: Shapes, config: CompressionConfig
) -> dict[str, Tensor]:
    """The float32 update a record stands for, shaped as `shapes` (the global's).

    ValueError with the key and the reason for anything the scheme could not have sent:
    entries missing or extra, a factor of the wrong rank or shape, a scale that is not finite
    or negative, a bit width other than `config.bits`, codes of the wrong length, top-k
    indices out of range, repeated or of the wrong count, non-finite values.
    """
    expected = {
        part(key, name)
        for key, shape in shapes.items()
        for name in _part_names(tuple(shape), config)
    }
    if missing := sorted(expected - set(record)):
        raise ValueError(f"the compressed update lacks the entries {missing}")
    if extra := sorted(set(record) - expected):
        raise ValueError(f"the compressed update holds unexpected entries {extra}")
    arrays = {name: np.asarray(array) for name, array in record.items()}
    update = {}
    for key, shape in shapes.items():
        shape = tuple(shape)
        if config.scheme == "quantise":
            values = _dequantised(key, arrays, shape, config.bits)
        elif config.scheme == "topk":
            values = _scattered(key, arrays, shape, config.fraction)
        elif lowrank_rank(shape, config.rank) and config.scheme == "lowrank":
            values = _from_factors(key, arrays, shape, lowrank_rank(shape, config.rank))
        else:
            values = _whole(key, arrays, shape)
        if not bool(torch.isfinite(values).all()):
            raise ValueError(f"key {key!r}: the compressed update holds NaN or infinite values")
        update[key] = values
    return update


def _part_names(shape: tuple[int, ...], config: CompressionConfig) -> tuple[str, ...]:
    """The names of the parts a tensor of `shape` is sent as under `config`."""
    if config.scheme == "quantise":
        return ("codes", "scale", "bits")
    if config.scheme == "topk":
        return ("indices", "values")
    if config.scheme == "lowrank" and lowrank_rank(shape, config.rank):
        return ("u", "v")
    return ("whole",)


def _float_array(key: str, name: str, array: np.ndarray, shape: tuple[int, ...]) -> Tensor:
    """Part `name` of `key` as float32, refused unless floating point of exactly `shape`."""
    if array.dtype.kind != "f":
        raise ValueError(f"key {key!r}: part {name!r} has dtype {array.dtype}, expected a float")
    if tuple(array.shape) != shape:
        raise ValueError(
            f"key {key!r}: part {name!r} has shape {tuple(array.shape)}, expected {shape}"
        )
    return torch.from_numpy(array.astype(np.float32))


def _whole(key: str, arrays: Mapping[str, np.ndarray], shape: tuple[int, ...]) -> Tensor:
    """A tensor sent whole."""
    return _float_array(key, "whole", arrays[part(key, "whole")], shape)


def _from_factors(
    key: str, arrays: Mapping[str, np.ndarray], shape: tuple[int, ...], rank: int
) -> Tensor:
    """U V from a low-rank pair, refused unless both factors have rank `rank` (the one asked)."""
    rows, cols = matrix_shape(shape) or (0, 0)
    factor_u, factor_v = arrays[part(key, "u")], arrays[part(key, "v")]
    if factor_u.ndim == 2 and factor_u.shape[0] == rows and factor_u.shape[1] != rank:
        raise ValueError(
            f"key {key!r}: low-rank factors of rank {factor_u.shape[1]}, expected rank {rank}"
        )
    left = _float_array(key, "u", factor_u, (rows, rank))
    right = _float_array(key, "v", factor_v, (rank, cols))
    return (left @ right).reshape(shape)


def _dequantised(
    key: str, arrays: Mapping[str, np.ndarray], shape: tuple[int, ...], bits: int
) -> Tensor:
    """The decoded values of b-bit codes, refused unless the bit width is the one asked,
    the scale a finite non-negative float and the codes exactly as many as the tensor's entries."""
    sent_bits = arrays[part(key, "bits")]
    if sent_bits.shape != (1,) or sent_bits.dtype.kind not in "ui" or int(sent_bits[0]) != bits:
        raise ValueError(
            f"key {key!r}: quantised with bit width {sent_bits.tolist()}, expected {bits} "
            "(the compression-bits the server asked for)"
        )
    scale_array = arrays[part(key, "scale")]
    if scale_array.shape != (1,) or scale_array.dtype.kind != "f":
        raise ValueError(f"key {key!r}: the scale must be one float, got {scale_array.shape}")
    scale = float(scale_array[0])
    if not (math.isfinite(scale) and scale >= 0):
        raise ValueError(f"key {key!r}: the quantisation scale is not a finite value >= 0")
    count = math.prod(shape)
    packed = arrays[part(key, "codes")]
    needed = math.ceil(count / (8 // bits))
    if packed.dtype != np.uint8 or packed.shape != (needed,):
        raise ValueError(
            f"key {key!r}: {bits}-bit codes of {count} entries take {needed} uint8 bytes, "
            f"got {packed.shape} of {packed.dtype}"
        )
    codes = torch.from_numpy(unpack_codes(packed, bits, count).astype(np.float64))
    values = -scale + codes * (2 * scale / (2**bits - 1))
    return values.float().reshape(shape)


def _scattered(
    key: str, arrays: Mapping[str, np.ndarray], shape: tuple[int, ...], fraction: float
) -> Tensor:
    """The dense tensor of a top-k pair, refused unless it has exactly k distinct in-range
    integer indices and as many float values."""
    count = math.prod(shape)
    wanted = topk_count(count, fraction)
    indices = arrays[part(key, "indices")]
    if indices.dtype.kind not in "ui" or indices.shape != (wanted,):
        raise ValueError(
            f"key {key!r}: top-k sends {wanted} integer indices (fraction {fraction:g} of "
            f"{count}), got {indices.shape} of {indices.dtype}"
        )
    if wanted and (int(indices.min()) < 0 or int(indices.max()) >= count):
        raise ValueError(f"key {key!r}: top-k indices out of range [0, {count})")
    if np.unique(indices).size != indices.size:
        raise ValueError(f"key {key!r}: top-k indices are repeated")
    values = _float_array(key, "values", arrays[part(key, "values")], (wanted,))
    dense = torch.zeros(count, dtype=torch.float32)
    dense[torch.from_numpy(indices.astype(np.int64))] = values
    return dense.reshape(shape)


# ------------------------------------------------------------------ error feedback
def compress_with_feedback(
    update: Mapping[str, Tensor],
    residual: Mapping[str, Tensor] | None,
    config: CompressionConfig,
    generator: torch.Generator,
) -> tuple[Record, dict[str, Tensor]]:
    """The record of update + residual, and the new residual: what the record lost of it.

    The residual (None or {}: none yet, the first round) is the node's private state; a key
    of another shape (the model changed) is refused rather than silently dropped.
    """
    corrected = {}
    for key, tensor in update.items():
        value = tensor.detach().to(device="cpu", dtype=torch.float32)
        carried = (residual or {}).get(key)
        if carried is not None:
            if tuple(carried.shape) != tuple(value.shape):
                raise ValueError(
                    f"key {key!r}: the kept residual has shape {tuple(carried.shape)}, the "
                    f"update {tuple(value.shape)}: the node's residual is from another model"
                )
            value = value + carried.to(torch.float32)
        corrected[key] = value
    record = compress(corrected, config, generator)
    shapes = {key: tuple(value.shape) for key, value in corrected.items()}
    sent = decompress(record, shapes, config)
    return record, {key: corrected[key] - sent[key] for key in corrected}
