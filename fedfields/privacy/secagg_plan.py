"""Planning a secure sum over Flower SecAgg+: payload layout, per-tensor scales, quantisation.

SecAgg+ clips every value to [-C, C], quantises it to Q levels and sums integers modulo M;
values beyond C are clipped silently and n * Q >= M wraps around silently. These pure
functions choose C, Q and per-tensor power-of-two scales so that neither can happen, and
pack named tensors into the flat arrays SecAgg+ carries. The Flower glue lives in
`fedfields.flower.secagg_workflow` (server) and `fedfields.flower.secure_aggregation` (clients).

Automatic bounds: each client reports, per tensor, a one-hot vector of the exponent e with
max|x| <= 2^e; the *secure sum* of those vectors tells the server how many clients fall in
each power-of-two bucket (never which client) and the largest e per tensor. Scaling each
tensor by 2^-e_max puts every client's values in [-1, 1], so C = 1 clips nothing.

A client can lie in that histogram. Declaring a huge e would make the scale huge and
quantise everyone else's values to nothing, so the scale is capped at 2^max_exponent
(run-config `secagg-max-exponent`): honest clients refuse (and drop out) rather than declare
more, and the server ignores buckets above the cap, so a liar can coarsen the quantisation
step to at most 2^(max_exponent + 1) / Q and no further. A histogram no set of one-hots can
give (non-integer or negative counts, a total other than the number of clients) falls back
to the cap, which clips no honest client. What a liar adds to its own masked vector is
bounded only by SecAgg+'s clipping ([-C, C] times the scale) for a client that runs the
protocol code, and not at all for one that does not: secure sums carry no range proofs.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

EXPONENT_MIN = -64
EXPONENT_MAX = 64
NUM_BUCKETS = EXPONENT_MAX - EXPONENT_MIN + 1
"""Length of one tensor's exponent one-hot vector (exponents clamped to [-64, 64])."""

MAX_SHARES = 1_000_000
"""The largest share count and threshold count: more than any federation's sample (a count
above a round's sampled clients leaves its threshold unreachable: that round's sum fails,
naming both keys)."""
MAX_TIMEOUT_SECONDS = 1e7
"""The longest wait a timeout may ask for (about 116 days): beyond it Python's waits overflow
(`threading.Event.wait(1e308)`: OverflowError), so a larger one is refused when parsed."""

DEFAULT_MAX_EXPONENT = 32
"""Default `secagg-max-exponent`: |values| up to 2^32 (~4.3e9) per tensor, enough for metrics
weighted by pixel counts; a liar can then coarsen a tensor's step to 2^33 / Q at most."""

MIN_QUANTIZATION_RANGE = 2**20
"""Fewer levels than this would cost more than ~1e-6 relative precision per client."""

CLIENT_WEIGHT = 1.0
"""Every client's plaintext SecAgg+ weight, equal to the workflow's max_weight: the masked
vector carries any real weight, and the workflow's mean times the survivors is the sum."""

LayoutEntry = tuple[str, str, tuple[int, ...]]
"""(record name, state key, shape) of one tensor in a secure-sum payload."""


class SecureAggregationError(RuntimeError):
    """A secure sum could not be completed (too few survivors, refused payloads)."""


class ValueFreeError(ValueError):
    """A client-side refusal whose message names settings, records and keys but carries no
    value of the client's data or model, so secure mode may forward it to the server as is
    (`fedfields.flower.secure_aggregation`)."""


@dataclass(frozen=True)
class SecureAggregationConfig:
    """SecAgg+ settings of one federation (run-config keys "secagg-*").

    Args:
        num_shares: secret shares per client: a fraction (0, 1] of the sampled clients or an
            integer count > 2 (Flower's `num_shares`); 1.0 makes everyone a neighbour.
        reconstruction_threshold: shares needed to unmask, as a fraction of `num_shares` or
            an integer count; fewer surviving neighbours fail the sum.
        timeout: seconds each SecAgg+ stage waits for replies (0 waits forever).
        clipping_range: 0 chooses per-tensor bounds securely (module docstring); > 0 is a
            fixed bound C that clients check, refusing (and dropping out) rather than clip.
        modulus_range: M, a power of two <= 2^32; Q is the largest with n * Q < M.
        max_exponent: cap e_cap on the automatic bounds: a tensor's scale is at most
            2^e_cap, whatever a client declares (module docstring); clients whose values
            exceed it refuse. Integer in [EXPONENT_MIN, EXPONENT_MAX] (the latter: no cap).
    """

    num_shares: float = 1.0
    reconstruction_threshold: float = 0.67
    timeout: float = 600.0
    clipping_range: float = 0.0
    modulus_range: int = 2**32
    max_exponent: int = DEFAULT_MAX_EXPONENT

    def __post_init__(self) -> None:
        shares, threshold = self.num_shares, self.reconstruction_threshold
        if _is_integer(shares):
            if not 2 < shares <= MAX_SHARES:
                raise ValueError(
                    f"secagg-num-shares as a count must be in (2, {MAX_SHARES}], got {shares}"
                )
        elif not 0 < shares <= 1:
            raise ValueError(f"secagg-num-shares must be in (0, 1] or a count > 2, got {shares}")
        if _is_integer(threshold):
            if not 2 <= threshold < MAX_SHARES or (_is_integer(shares) and threshold >= shares):
                raise ValueError(
                    f"secagg-reconstruction-threshold as a count must be >= 2 and below "
                    f"secagg-num-shares, got {threshold}"
                )
        elif not 0 < threshold <= 1:
            raise ValueError(
                f"secagg-reconstruction-threshold must be in (0, 1] or a count, got {threshold}"
            )
        if not (math.isfinite(self.timeout) and 0 <= self.timeout <= MAX_TIMEOUT_SECONDS):
            raise ValueError(
                f"secagg-timeout must be in [0, {MAX_TIMEOUT_SECONDS:g}] seconds, "
                f"got {self.timeout}"
            )
        if not (math.isfinite(self.clipping_range) and 0 <= self.clipping_range <= MAX_SHARES):
            raise ValueError(
                f"secagg-clipping-range must be in [0, {MAX_SHARES:g}] (a fixed bound beyond it "
                f"leaves every sum below its own resolution), got {self.clipping_range}"
            )
        modulus = self.modulus_range
        if modulus < 2**24 or modulus > 2**32 or modulus & (modulus - 1):
            raise ValueError(
                f"secagg-modulus-range must be a power of two in [2^24, 2^32], got {modulus}"
            )
        exponent = self.max_exponent
        if (
            isinstance(exponent, bool)
            or not float(exponent).is_integer()
            or not EXPONENT_MIN <= exponent <= EXPONENT_MAX
        ):
            raise ValueError(
                f"secagg-max-exponent must be an integer in [{EXPONENT_MIN}, {EXPONENT_MAX}], "
                f"got {exponent}"
            )
        object.__setattr__(self, "max_exponent", int(exponent))

    def quantization_range(self, num_clients: int) -> int:
        """Q for `num_clients`: the largest with num_clients * Q < M (no silent overflow).

        Raises ValueError when so many clients leave fewer than 2^20 levels.
        """
        if num_clients < 2:
            raise ValueError(f"a secure sum needs at least 2 clients, got {num_clients}")
        levels = (self.modulus_range - 1) // num_clients
        if levels < MIN_QUANTIZATION_RANGE:
            raise ValueError(
                f"{num_clients} clients leave {levels} quantisation levels under modulus "
                f"{self.modulus_range} (need >= {MIN_QUANTIZATION_RANGE}); sample fewer clients"
            )
        return levels

    def shares_and_threshold(self, num_clients: int) -> tuple[int, int]:
        """Shares per client and reconstruction threshold as Flower's workflow computes them."""
        if _is_integer(self.num_shares):
            shares = int(self.num_shares)
        else:
            shares = round(self.num_shares * num_clients)
            if shares < num_clients and shares % 2 == 0:
                shares += 1
            if shares <= 2:
                shares = num_clients
        if _is_integer(self.reconstruction_threshold):
            return shares, int(self.reconstruction_threshold)
        return shares, max(round(self.reconstruction_threshold * shares), 2)

    def min_holders(self, num_sampled: int) -> int:
        """t: the fewest clients whose masked vectors a sum over `num_sampled` sampled clients
        may be unmasked from, fixed when the round samples: the reconstruction threshold of that
        sample (at least 2). Every SecAgg+ run of the round uses it, whoever survived the run
        before, so a released sum always holds >= t clients' shares."""
        return max(self.shares_and_threshold(max(num_sampled, 2))[1], 2)

    @property
    def flower_num_shares(self) -> int | float:
        """`num_shares` typed as Flower reads it (int = count, float = fraction)."""
        return int(self.num_shares) if _is_integer(self.num_shares) else float(self.num_shares)


def _is_integer(value: float) -> bool:
    """True for counts (ints, or floats > 1 with no fractional part); 1.0 is a fraction."""
    return value > 1 and float(value).is_integer()


# ------------------------------------------------------------------ layout
def payload_layout(records: Mapping[str, Mapping[str, Sequence[int]]]) -> list[LayoutEntry]:
    """The tensors of a payload in a fixed order (record, then key), which both sides use."""
    return [
        (record, key, tuple(int(n) for n in shape))
        for record in sorted(records)
        for key, shape in sorted(records[record].items())
    ]


def encode_layout(layout: Sequence[LayoutEntry]) -> str:
    """The layout as JSON, to travel in a config record."""
    return json.dumps([[record, key, list(shape)] for record, key, shape in layout])


def decode_layout(text: str) -> list[LayoutEntry]:
    """Inverse of `encode_layout`; ValueError on malformed text."""
    try:
        entries = json.loads(text)
        return [(str(r), str(k), tuple(int(n) for n in shape)) for r, k, shape in entries]
    except (TypeError, ValueError) as error:
        raise ValueError(f"malformed secure-sum layout: {error}") from None


def check_payload(
    payload: Mapping[str, Mapping[str, Tensor]], layout: Sequence[LayoutEntry]
) -> None:
    """ValueError naming every record/key that is missing, mis-shaped or non-finite."""
    problems = []
    for record, key, shape in layout:
        tensor = payload.get(record, {}).get(key)
        if tensor is None:
            problems.append(f"{record}/{key} missing")
        elif tuple(tensor.shape) != shape:
            problems.append(f"{record}/{key} has shape {tuple(tensor.shape)}, expected {shape}")
        elif not bool(torch.isfinite(tensor).all()):
            problems.append(f"{record}/{key} has non-finite values")
    expected = {(record, key) for record, key, _ in layout}
    extra = [f"{r}/{k}" for r, keys in payload.items() for k in keys if (r, k) not in expected]
    if extra:
        problems.append(f"unexpected tensors {extra}")
    if problems:
        raise ValueError("secure-sum payload does not match the layout: " + "; ".join(problems))


# ------------------------------------------------------------------ bounds
def exponent_bound(tensor: Tensor) -> int:
    """The smallest e in [EXPONENT_MIN, EXPONENT_MAX] with max|x| <= 2^e (clamped).

    Raises ValueFreeError beyond 2^EXPONENT_MAX (the message holds no value)."""
    peak = float(tensor.detach().abs().max()) if tensor.numel() else 0.0
    if peak == 0.0:
        return EXPONENT_MIN
    mantissa, exponent = math.frexp(peak)  # peak = mantissa * 2^exponent, 0.5 <= mantissa < 1
    if mantissa == 0.5:
        exponent -= 1  # exact powers of two fit their own exponent
    if exponent > EXPONENT_MAX:
        raise ValueFreeError(f"a value exceeds 2^{EXPONENT_MAX}: cannot be summed securely")
    return max(exponent, EXPONENT_MIN)


def exponent_one_hot(tensor: Tensor) -> np.ndarray:
    """One-hot vector (NUM_BUCKETS,) marking `exponent_bound(tensor)`."""
    return exponent_one_hot_of(exponent_bound(tensor))


def bound_vectors(
    payload: Mapping[str, Mapping[str, Tensor]],
    layout: Sequence[LayoutEntry],
    max_exponent: int = EXPONENT_MAX,
) -> list[np.ndarray]:
    """A client's bounds-stage vectors: one exponent one-hot per tensor of the layout.

    An honest client never declares more than `max_exponent` (secagg-max-exponent): a
    tensor that needs more raises ValueFreeError naming it, and the client drops out.
    """
    vectors = []
    for record, key, _ in layout:
        exponent = exponent_bound(payload[record][key])
        if exponent > max_exponent:
            raise ValueFreeError(
                f"{record}/{key} exceeds 2^{max_exponent}, the cap on secure bounds "
                f"(secagg-max-exponent): raise it, or scale the values down"
            )
        vectors.append(exponent_one_hot_of(exponent))
    return vectors


def exponent_one_hot_of(exponent: int) -> np.ndarray:
    """One-hot vector (NUM_BUCKETS,) marking `exponent` (in [EXPONENT_MIN, EXPONENT_MAX])."""
    one_hot = np.zeros(NUM_BUCKETS)
    one_hot[exponent - EXPONENT_MIN] = 1.0
    return one_hot


HISTOGRAM_TOLERANCE = 0.25
"""How far a summed count may sit from an integer (SecAgg+'s error is ~n * 2 / Q)."""


@dataclass(frozen=True)
class ScalePlan:
    """Per-tensor scales chosen from the bounds histograms, and what was overruled.

    `capped` lists the tensors some client declared a bound above the cap for (a liar, or a
    misconfigured client: an honest one refuses instead); `malformed` those whose histogram
    no set of one-hots gives. Both get the cap's scale; neither says which client it was.
    """

    scales: list[float]
    capped: list[int]
    malformed: list[int]


def plan_scales(
    histograms: Sequence[np.ndarray],
    max_exponent: int = EXPONENT_MAX,
    num_clients: int | None = None,
) -> ScalePlan:
    """Scale 2^min(e_max, max_exponent) per tensor from the securely summed one-hots.

    With `num_clients`, a histogram whose counts are not integers in [0, n] summing to n is
    malformed and gets 2^max_exponent, which clips no honest client.
    """
    cap = max_exponent - EXPONENT_MIN
    scales, capped, malformed = [], [], []
    for index, histogram in enumerate(histograms):
        counts = np.asarray(histogram, dtype=np.float64)
        if num_clients is not None and not _plausible(counts, num_clients):
            malformed.append(index)
            scales.append(math.ldexp(1.0, max_exponent))
            continue
        occupied = np.flatnonzero(counts > 0.5)
        if occupied.size == 0:
            raise SecureAggregationError("bounds histogram is empty: no client reported a bound")
        top = int(occupied[-1])
        if top > cap:
            capped.append(index)
        scales.append(math.ldexp(1.0, min(top, cap) + EXPONENT_MIN))
    return ScalePlan(scales, capped, malformed)


def _plausible(counts: np.ndarray, num_clients: int) -> bool:
    """Whether `counts` can be a sum of `num_clients` one-hots (up to SecAgg+'s error)."""
    rounded = np.round(counts)
    return bool(
        counts.shape == (NUM_BUCKETS,)
        and np.all(np.abs(counts - rounded) <= HISTOGRAM_TOLERANCE)
        and np.all(rounded >= 0)
        and rounded.sum() == num_clients
    )


def scales_from_histograms(
    histograms: Sequence[np.ndarray], max_exponent: int = EXPONENT_MAX
) -> list[float]:
    """Per-tensor scale 2^min(e_max, max_exponent) from the summed one-hots (`plan_scales`)."""
    return plan_scales(histograms, max_exponent).scales


# ------------------------------------------------------------------ payload
def scaled_vectors(
    payload: Mapping[str, Mapping[str, Tensor]],
    layout: Sequence[LayoutEntry],
    scales: Sequence[float],
    clipping_range: float,
) -> list[np.ndarray]:
    """Each tensor of the layout divided by its scale, as float64 arrays.

    Raises ValueFreeError (naming the tensor, not its values) instead of letting SecAgg+
    clip a value beyond `clipping_range`: clipping would silently change this client's
    share of the sum, while a refusal shows as its dropout.
    """
    if len(scales) != len(layout):
        raise ValueError(f"{len(scales)} scales for {len(layout)} tensors")
    vectors = []
    for (record, key, _), scale in zip(layout, scales, strict=True):
        vector = payload[record][key].detach().double().cpu().numpy() / scale
        peak = float(np.abs(vector).max()) if vector.size else 0.0
        if peak > clipping_range:
            raise ValueFreeError(
                f"{record}/{key} has values beyond the SecAgg+ clipping range "
                f"{clipping_range:g} (times its scale {scale:g}); raise secagg-clipping-range "
                f"or set it to 0 (automatic)"
            )
        vectors.append(vector)
    return vectors


def unpack_sum(
    vectors: Sequence[np.ndarray], layout: Sequence[LayoutEntry], scales: Sequence[float]
) -> dict[str, dict[str, Tensor]]:
    """Summed vectors back to record -> key -> float64 tensor, undoing the scales."""
    if len(vectors) != len(layout):
        raise SecureAggregationError(f"secure sum returned {len(vectors)} arrays for {len(layout)}")
    sums: dict[str, dict[str, Tensor]] = {}
    for (record, key, shape), vector, scale in zip(layout, vectors, scales, strict=True):
        array = np.asarray(vector, dtype=np.float64)
        if array.size != math.prod(shape):
            raise SecureAggregationError(
                f"secure sum of {record}/{key} has {array.size} values, expected shape {shape}"
            )
        sums.setdefault(record, {})[key] = torch.from_numpy(array.reshape(shape) * scale)
    return sums
