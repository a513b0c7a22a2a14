"""Quantised updates summed as SecAgg+'s integers: b-bit codes packed several to a masked entry.

SecAgg+ sums integers modulo M (secagg-modulus-range, at most 2^32) entry by entry. A secure
sum of float values spends one masked entry per value (Flower quantises each to Q levels).
With compression 'quantise' the clients instead round each value v in [-1, 1] (the tensor
divided by the scale the bounds stage chose for everyone) to a b-bit code

    c = stochastic_round((v + 1) / 2 * (2^b - 1)),   unbiased: E[c] = (v + 1) / 2 * (2^b - 1),

and pack `per_entry` codes into one integer, `width` bits apart, where `width` bits hold the
sum of n clients' codes, n (2^b - 1) < 2^width. Adding packed integers adds every field at
once without a carry into the next, so the unmasked sum unpacks to the n clients' code sums,
and sum_k v_k = code_sum * 2 / (2^b - 1) - n. A masked entry then carries `per_entry` values
instead of one: the masked upload shrinks by that factor (2 for b = 8, 4 for b = 4 and 6 for
b = 2 at 8 clients and M = 2^32).

Flower's SecAgg+ mod quantises the floats it is given; the clients give it each packed integer
p as p * 2 / Q - 1 with Q = `levels` a power of two, which its quantiser maps back to p
exactly (float64 arithmetic on dyadic values, no rounding), so its own random rounding never
touches the codes. Entries that must keep SecAgg+'s full precision (the sum's weight and
metrics, one-element tensors such as DecentNeRF's alpha_k) take one masked entry each, rounded
to Q levels the same way.

A client that does not run this code can put any integer in its masked entries: its carries
then spill into the neighbouring fields of the sum. As for every SecAgg+ sum (secure sums carry
no range proofs; `fedfields.privacy.secagg_plan`), what a liar adds to its own vector is not
bounded; a packing a server sends that does not fit its levels is refused by the clients.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

MAX_PACKED_BITS = 31
"""Flower's quantiser casts to int32: a packed integer stays below 2^31."""


@dataclass(frozen=True)
class Packing:
    """How a client packs b-bit codes into masked integers for one secure sum.

    bits: b, the code width; width: bits per field, enough for the sum of the sum's clients'
    codes; per_entry: codes per masked integer; levels: Q, the power-of-two integer range
    SecAgg+ is run with (n Q < M), each packed integer in [0, Q].
    """

    bits: int
    width: int
    per_entry: int
    levels: int

    def __post_init__(self) -> None:
        if self.bits < 1 or self.width < self.bits or self.per_entry < 1:
            raise ValueError(f"malformed packing {self}: need 1 <= bits <= width, per_entry >= 1")
        if self.levels < 2 or self.levels & (self.levels - 1) or self.levels > 2**MAX_PACKED_BITS:
            raise ValueError(f"packing levels must be a power of two <= 2^31, got {self.levels}")
        top = (self.per_entry - 1) * self.width + self.bits
        if 2**top > self.levels + 1:
            raise ValueError(
                f"{self.per_entry} fields of {self.width} bits exceed the {self.levels} levels"
            )

    def as_list(self) -> list[int]:
        """The packing as a train-config value (bits, width, per_entry, levels)."""
        return [self.bits, self.width, self.per_entry, self.levels]

    @classmethod
    def from_list(cls, values: list[int]) -> Packing:
        """The packing `as_list` wrote; ValueError when it is not four integers or malformed."""
        if len(values) != 4 or not all(float(v).is_integer() for v in values):
            raise ValueError(f"a packing is four integers, got {values!r}")
        return cls(*(int(v) for v in values))

    def packed_count(self, count: int) -> int:
        """Masked integers that carry `count` codes."""
        return math.ceil(count / self.per_entry)


def plan_packing(bits: int, num_clients: int, modulus_range: int) -> Packing:
    """The packing of b-bit codes for a sum over up to `num_clients` clients under modulus M:
    Q the largest power of two with n Q < M, fields just wide enough for n codes' sum, and as
    many fields per integer as fit below Q. ValueError when not one field fits."""
    if num_clients < 2:
        raise ValueError(f"a secure sum needs at least 2 clients, got {num_clients}")
    levels = min(1 << (((modulus_range - 1) // num_clients).bit_length() - 1), 2**MAX_PACKED_BITS)
    width = (num_clients * (2**bits - 1)).bit_length()
    available = levels.bit_length() - 1  # log2 Q
    if available < bits:
        raise ValueError(
            f"{num_clients} clients leave {levels} levels under modulus {modulus_range}: "
            f"too few for {bits}-bit codes"
        )
    return Packing(bits, width, (available - bits) // width + 1, levels)


def coded_entries(layout: list[tuple[str, str, tuple[int, ...]]], whole_record: str) -> list[bool]:
    """Per entry of a secure-sum layout, whether it goes as b-bit codes: every tensor of more
    than one value outside `whole_record` (the weight and metrics), which keep full precision."""
    return [record != whole_record and math.prod(shape) > 1 for record, _, shape in layout]


def stochastic_codes(values: Tensor, top: int, generator: torch.Generator) -> Tensor:
    """Integers in [0, top]: (values + 1) / 2 * top rounded up or down at random so that the
    expected code is exact (values in [-1, 1]; float64 in, int64 out)."""
    position = (values.double().clamp(-1.0, 1.0) + 1.0) / 2.0 * top
    floor = position.floor()
    up = torch.rand(position.shape, generator=generator, dtype=torch.float64) < position - floor
    return (floor + up.double()).clamp(0, top).to(torch.int64)


def decoded_codes(codes: Tensor, top: int, count: int = 1) -> Tensor:
    """The value (sum) `count` clients' codes stand for: codes * 2 / top - count, float64."""
    return codes.double() * (2.0 / top) - count


def pack(codes: Tensor, packing: Packing) -> np.ndarray:
    """b-bit codes (int64, flat) as int64 integers of `per_entry` fields, the first lowest."""
    padded = np.zeros(packing.packed_count(codes.numel()) * packing.per_entry, dtype=np.int64)
    padded[: codes.numel()] = codes.numpy()
    shifts = np.arange(packing.per_entry, dtype=np.int64) * packing.width
    return (padded.reshape(-1, packing.per_entry) << shifts).sum(axis=1)


def unpack(packed: np.ndarray, packing: Packing, count: int) -> Tensor:
    """The first `count` fields of summed packed integers (each field a sum of codes)."""
    shifts = np.arange(packing.per_entry, dtype=np.int64) * packing.width
    fields = (packed.astype(np.int64)[:, None] >> shifts) & ((1 << packing.width) - 1)
    return torch.from_numpy(fields.reshape(-1)[:count].copy())


def to_flower(integers: np.ndarray, levels: int) -> np.ndarray:
    """Integers in [0, Q] as the floats Flower's SecAgg+ quantiser (clipping range 1, Q
    levels) maps back to exactly those integers: p * 2 / Q - 1."""
    return integers.astype(np.float64) * (2.0 / levels) - 1.0


def from_flower(summed: np.ndarray, levels: int, num_clients: int) -> np.ndarray:
    """The integer sum S of n clients' `to_flower` values from what the workflow unmasks (its
    mean times n, S * 2 / Q - n)."""
    return np.rint((np.asarray(summed, dtype=np.float64) + num_clients) * (levels / 2.0)).astype(
        np.int64
    )


def packed_vectors(
    values: list[Tensor],
    scales: list[float],
    coded: list[bool],
    packing: Packing,
    generator: torch.Generator,
) -> tuple[list[np.ndarray], list[Tensor]]:
    """A client's masked-stage vectors: each tensor divided by its scale, as packed b-bit codes
    where `coded`, else one Q-level integer per value, in the floats Flower carries
    (`to_flower`); and what the server will decode of each tensor (for error feedback).
    ValueError naming the tensor's position when a value lies beyond its scale."""
    vectors, decoded = [], []
    for index, (value, scale, is_coded) in enumerate(zip(values, scales, coded, strict=True)):
        unit = value.detach().double().cpu().flatten() / scale
        if unit.numel() and float(unit.abs().max()) > 1.0:
            raise ValueError(f"tensor {index} of the payload exceeds its secure-sum scale")
        top = 2**packing.bits - 1 if is_coded else packing.levels
        codes = stochastic_codes(unit, top, generator)
        decoded.append((decoded_codes(codes, top) * scale).reshape(value.shape))
        integers = pack(codes, packing) if is_coded else codes.numpy()
        vectors.append(to_flower(integers, packing.levels))
    return vectors, decoded


def summed_values(
    vectors: list[np.ndarray],
    counts: list[int],
    coded: list[bool],
    packing: Packing,
    num_clients: int,
) -> list[Tensor]:
    """The sums (flat float64, in units of each tensor's scale) of `num_clients` clients'
    `packed_vectors`, from the vectors the workflow unmasked; `counts` the entries per tensor."""
    sums = []
    for vector, count, is_coded in zip(vectors, counts, coded, strict=True):
        integers = from_flower(vector, packing.levels, num_clients).reshape(-1)
        if is_coded:
            codes, top = unpack(integers, packing, count), 2**packing.bits - 1
        else:
            codes, top = torch.from_numpy(integers[:count].copy()), packing.levels
        sums.append(decoded_codes(codes, top, num_clients))
    return sums
