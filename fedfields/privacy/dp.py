"""Client-level differential privacy for federated averaging (DP-FedAvg, McMahan et al. 2018).

Each sampled client's update (its model minus the global, over all its tensors jointly) is
clipped to L2 norm C, so adding or removing one client moves the sum of clipped updates by at
most C. Gaussian noise of std z*C on that sum makes each round a sampled Gaussian mechanism
with noise multiplier z:

- central DP: the server adds N(0, (z C)^2) to the sum (`central_noise_std`). Divided by the
  n sampled clients this is Flower's std z*C/n on the mean (`mean_noise_std`, Flower's
  `compute_stdv`), the same mechanism when the mean is uniform over n clients.
- distributed DP (secure aggregation): the server fixes t >= 2, the fewest clients a sum
  may be unmasked from, before the round; each client adds N(0, z^2 C^2 / (t - 1)) to its
  clipped update before masking (`share_std`, `distributed_noise_std`), so only the noised sum
  ever exists and any t - 1 shares already sum to std z C: a sum of h >= t holders carries
  z sqrt(h / (t - 1)), and its neighbour with one holder fewer (add-or-remove) still
  z sqrt((h - 1) / (t - 1)) >= z, which is what the accountant is charged
  (`effective_noise_multiplier`); a sum of fewer than t is never unmasked.

The accountant that charges each round is `fedfields.privacy.accountant`. Pure PyTorch;
updates are state dicts (`dict[str, Tensor]`).
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from fedfields.privacy.adaptive_clipping import AdaptiveClipping

State = Mapping[str, Tensor]

NOISE_MULTIPLIER_KEY = "dp-noise-multiplier"
CLIP_NORM_KEY = "dp-clip-norm"
DELTA_KEY = "dp-delta"
TARGET_EPSILON_KEY = "dp-target-epsilon"
MAX_NOISE_RATIO_KEY = "dp-max-noise-ratio"
GRADIENT_CLIP_NORM_KEY = "dp-gradient-clip-norm"
DEFAULT_MAX_NOISE_RATIO = 10.0
"""z sqrt(d) / n above which a DP run is refused: the noise on the mean update is then ten
times the largest update a client may send, and rounds move the model by noise."""
NOISE_MULTIPLIERS = (1e-12, 1e3)
"""The least and largest z > 0 a run takes: at 5e-324 or 1e300, 1 / z^2, which the charge of
several sums a round composes, leaves float64's range (issue 57's extremes walk); a z this
small is no privacy, but isolates clipping in tests."""
MAX_CLIP_NORM = 1e6
"""The largest C (and gradient C): noise z C above it leaves float32's range in the sum."""


class NonFiniteUpdateError(ValueError):
    """An update holds NaN or infinite values: its norm, and so its clip, is undefined."""


@dataclass(frozen=True)
class DPConfig:
    """Client-level DP settings, validated; each error names its run-config key.

    noise_multiplier z (0: DP off), clip_norm C (> 0 when z > 0; the first C under
    `adaptive` clipping), delta of the reported (epsilon, delta) in (0, 1), target_epsilon (0:
    no target) the run must not exceed, max_noise_ratio (0: no limit) the pre-flight bound on
    z sqrt(d) / n (`noise_ratio`), `adaptive` clipping (`fedfields.privacy.adaptive_clipping`;
    None: C fixed), gradient_clip_norm (a gradient query's G_k, fixed; 0: C).
    """

    noise_multiplier: float = 0.0
    clip_norm: float = 0.0
    delta: float = 1e-5
    target_epsilon: float = 0.0
    max_noise_ratio: float = DEFAULT_MAX_NOISE_RATIO
    adaptive: AdaptiveClipping | None = None
    gradient_clip_norm: float = 0.0

    def __post_init__(self) -> None:
        least, most = NOISE_MULTIPLIERS
        _require(
            self.noise_multiplier,
            NOISE_MULTIPLIER_KEY,
            lambda v: v == 0 or least <= v <= most,
            f"0 (off) or in [{least:g}, {most:g}]",
        )
        _require(self.clip_norm, CLIP_NORM_KEY, lambda v: 0 <= v <= MAX_CLIP_NORM,
                 f"in [0, {MAX_CLIP_NORM:g}]")  # fmt: skip
        _require(self.delta, DELTA_KEY, lambda v: 0.0 < v < 1.0, "in (0, 1)")
        _require(self.target_epsilon, TARGET_EPSILON_KEY, _finite_at_least(0.0), ">= 0")
        _require(self.max_noise_ratio, MAX_NOISE_RATIO_KEY, _finite_at_least(0.0), ">= 0")
        _require(self.gradient_clip_norm, GRADIENT_CLIP_NORM_KEY,
                 lambda v: 0 <= v <= MAX_CLIP_NORM, f"in [0, {MAX_CLIP_NORM:g}]")  # fmt: skip
        if self.enabled and self.clip_norm == 0:
            raise ValueError(
                f"'{CLIP_NORM_KEY}' must be > 0 when '{NOISE_MULTIPLIER_KEY}' = "
                f"{self.noise_multiplier} > 0: the noise is scaled to the clip norm C"
            )

    @property
    def enabled(self) -> bool:
        """Whether updates are clipped and noised (noise multiplier > 0)."""
        return self.noise_multiplier > 0


def _finite_at_least(least: float) -> Callable[[float], bool]:
    return lambda value: math.isfinite(value) and value >= least


def _require(value: float, run_key: str, ok: Callable[[float], bool], rule: str) -> None:
    """ValueError naming the run-config key unless `ok(value)`."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not ok(value):
        raise ValueError(f"'{run_key}' must be finite and {rule}, got {value!r}")


def _check_update(update: State) -> None:
    """ValueError unless `update` holds floating tensors only, all finite."""
    if len(update) == 0:
        raise ValueError("update has no tensors")
    for key, tensor in update.items():
        if not tensor.is_floating_point():
            raise ValueError(f"update key {key!r}: {tensor.dtype} is not floating point")
        if not bool(torch.isfinite(tensor).all()):
            raise NonFiniteUpdateError(f"update key {key!r}: NaN or infinite values")


def update_norm(update: State) -> float:
    """L2 norm over all tensors of `update` jointly, in float64, without overflow."""
    _check_update(update)
    values = [tensor.detach().double() for tensor in update.values()]
    squares = math.fsum(float(value.square().sum()) for value in values)
    if math.isfinite(squares):
        return math.sqrt(squares)
    largest = max(float(value.abs().max()) for value in values if value.numel())
    scaled = math.fsum(float((value / largest).square().sum()) for value in values)
    return largest * math.sqrt(scaled)


def _unit_roundoff(dtype: torch.dtype) -> float:
    return float(torch.finfo(dtype).eps) / 2


def clip_update(update: State, clip_norm: float) -> tuple[dict[str, Tensor], float]:
    """(update scaled to L2 norm <= clip_norm over all tensors jointly, its pre-clip norm).

    Flower's FlatClip (`compute_clip_model_update`): factor min(1, C / norm). A clipped update
    is shrunk by a few units of its dtype's roundoff more, so rounding back to float16 or
    float32 cannot push its norm above C. Raises NonFiniteUpdateError on NaN or Inf.
    """
    dtypes = {key: tensor.dtype for key, tensor in update.items()}
    return _clip({key: t.detach().double() for key, t in update.items()}, dtypes, clip_norm)


def clip_model_update(
    local: State, reference: State, clip_norm: float
) -> tuple[dict[str, Tensor], float]:
    """A client's clipped update local - reference (reference's keys, local's dtypes) and its
    pre-clip norm; the difference and the clip are computed in float64."""
    missing = [key for key in reference if key not in local]
    if missing:
        raise ValueError(f"local state lacks keys {missing}")
    difference = {
        key: local[key].detach().double() - value.detach().double()
        for key, value in reference.items()
    }
    return _clip(difference, {key: local[key].dtype for key in reference}, clip_norm)


def _clip(
    update: dict[str, Tensor], dtypes: Mapping[str, torch.dtype], clip_norm: float
) -> tuple[dict[str, Tensor], float]:
    """`update` (float64) clipped to `clip_norm`, each key cast to its `dtypes` entry."""
    if not (math.isfinite(clip_norm) and clip_norm > 0):
        raise ValueError(f"clip norm must be finite and > 0, got {clip_norm!r}")
    for key, dtype in dtypes.items():
        if not dtype.is_floating_point:
            raise ValueError(f"update key {key!r}: {dtype} is not floating point")
    norm = update_norm(update)
    if norm <= clip_norm:
        return {key: value.to(dtypes[key], copy=True) for key, value in update.items()}, norm
    margin = max(4 * max(_unit_roundoff(dtype) for dtype in dtypes.values()), 1e-12)
    factor = clip_norm / norm * (1 - margin)
    return {key: (value * factor).to(dtypes[key]) for key, value in update.items()}, norm


def scaled_difference(state: State, reference: State, scale_key: str = "") -> dict[str, Tensor]:
    """x - s g in float64 for the keys of `reference` (g), with s = state[scale_key] (a
    one-element tensor: a client's own weight, `fedfields.methods.base.ScaleSpec`) or 1; keys
    of `state` outside `reference` (s itself) are kept as they are."""
    scale = float(state[scale_key].double().reshape(())) if scale_key in state else 1.0
    missing = [key for key in reference if key not in state]
    if missing:
        raise ValueError(f"state lacks keys {missing}")
    return {
        key: value.detach().double() - scale * reference[key].detach().double()
        if key in reference
        else value.detach().double()
        for key, value in state.items()
    }


RECORD_SEPARATOR = "\x00"
"""Joins a record's name and a tensor's key when records are clipped jointly."""


def clip_records(
    records: Mapping[str, State], clip_norm: float
) -> tuple[dict[str, dict[str, Tensor]], float]:
    """All records of one reply (e.g. an update y_k - x and a control delta c_k) clipped to L2 norm
    <= clip_norm jointly, as one update: the reply is one query of sensitivity C."""
    flat = {
        f"{name}{RECORD_SEPARATOR}{key}": tensor
        for name, state in records.items()
        for key, tensor in state.items()
    }
    clipped, norm = clip_update(flat, clip_norm)
    nested: dict[str, dict[str, Tensor]] = {name: {} for name in records}
    for joined, tensor in clipped.items():
        name, key = joined.split(RECORD_SEPARATOR, 1)
        nested[name][key] = tensor
    return nested, norm


def noised_records(
    records: Mapping[str, State], std: float, generator: torch.Generator
) -> dict[str, dict[str, Tensor]]:
    """Each record + N(0, std^2) per entry (float64 added, dtypes kept), in record order."""
    return {name: add_gaussian_noise(state, std, generator) for name, state in records.items()}


def combined_noise_multiplier(multipliers: Sequence[float]) -> float:
    """The one multiplier equivalent to several Gaussian sums over the same sampled clients,
    each of sensitivity C and noise z_j C: the joint query has sensitivity C sqrt(J), so
    z = (sum_j z_j^-2)^(-1/2) (z / sqrt(2) for two sums of multiplier z)."""
    if not multipliers:
        raise ValueError("no noised sum to combine")
    if any(z <= 0 for z in multipliers):
        return 0.0
    return 1.0 / math.sqrt(math.fsum(1.0 / z**2 for z in multipliers))


def noise_ratio(noise_multiplier: float, num_params: int, num_sampled: int) -> float:
    """z sqrt(d) / n: the norm of the DP noise on the mean of n clipped updates (z C sqrt(d)
    / n over d entries) against the largest update one client may send (C). Above 1 a round
    moves the model by more noise than any client's signal."""
    return noise_multiplier * math.sqrt(num_params) / _positive_count(num_sampled, "num_sampled")


def central_noise_std(noise_multiplier: float, clip_norm: float) -> float:
    """Std of the Gaussian noise the server adds to the SUM of clipped updates: z C."""
    return noise_multiplier * clip_norm


def mean_noise_std(noise_multiplier: float, clip_norm: float, num_sampled: int) -> float:
    """The same noise on the uniform MEAN over the n sampled clients: z C / n (Flower's
    `compute_stdv`, which Flower's DP wrappers add to the aggregated arrays)."""
    return noise_multiplier * clip_norm / _positive_count(num_sampled, "sampled clients")


NOISE_TAIL = 8.0
"""A noise share's entry exceeds this many stds with probability 1.2e-15 (|N(0, 1)| > 8): the
room a SecAgg+ range leaves for the noise (`distributed_noise_range`)."""


def share_std(total_std: float, num_holders: int) -> float:
    """Std of one client's share of a noise of std `total_std` calibrated to t = `num_holders`:
    any t - 1 shares sum to `total_std`, so one holder fewer than the least a sum is unmasked
    from still carries it: total / sqrt(t - 1)."""
    if num_holders < 2:
        raise ValueError(f"holders must be >= 2, got {num_holders}")
    return total_std / math.sqrt(num_holders - 1)


def distributed_noise_std(noise_multiplier: float, clip_norm: float, num_holders: int) -> float:
    """Std each client adds to its clipped update before secure aggregation, so that any t - 1
    of the shares (t = `num_holders`) sum to std z C: z C / sqrt(t - 1)."""
    return share_std(noise_multiplier * clip_norm, num_holders)


def distributed_noise_range(noise_multiplier: float, clip_norm: float, num_holders: int) -> float:
    """The largest |entry| a client's noised share may hold: a clipped value (at most C) plus
    NOISE_TAIL noise-share stds (`distributed_noise_std`). It follows from C, z and t alone,
    so a secure DP sum needs no bounds stage that would read the noised values."""
    return clip_norm + NOISE_TAIL * distributed_noise_std(noise_multiplier, clip_norm, num_holders)


def effective_noise_multiplier(
    noise_multiplier: float, num_calibrated: int, num_summed: int
) -> float:
    """The multiplier charged for a secure sum of h = `num_summed` shares, each calibrated to
    t = `num_calibrated` (`share_std`): that of the sum's neighbour with one holder fewer,
    z sqrt((h - 1) / (t - 1)), at least z for h >= t. The sum itself carries more
    (z sqrt(h / (t - 1))), so the charge holds for replace-one and add-or-remove neighbours."""
    if num_calibrated < 2:
        raise ValueError(f"calibrated holders must be >= 2, got {num_calibrated}")
    if num_summed < 1:
        raise ValueError(f"summed clients must be >= 1, got {num_summed}")
    return noise_multiplier * math.sqrt((num_summed - 1) / (num_calibrated - 1))


def _positive_count(count: int, what: str) -> int:
    if count < 1:
        raise ValueError(f"{what} must be >= 1, got {count}")
    return count


def noise_generator(seed: int | None = None) -> torch.Generator:
    """A CPU generator for DP noise: seeded for tests, else from the OS's secret randomness.

    Never seed real DP noise from run-config: whoever knows the seed can subtract the noise.
    """
    return torch.Generator().manual_seed(secrets.randbits(63) if seed is None else seed)


def gaussian_noise(like: State, std: float, generator: torch.Generator) -> dict[str, Tensor]:
    """N(0, std^2) per entry, float64 CPU tensors shaped like `like`'s, drawn in key order."""
    if not (math.isfinite(std) and std >= 0):
        raise ValueError(f"noise std must be finite and >= 0, got {std!r}")
    return {
        key: torch.randn(tuple(tensor.shape), generator=generator, dtype=torch.float64) * std
        for key, tensor in like.items()
    }


def add_gaussian_noise(state: State, std: float, generator: torch.Generator) -> dict[str, Tensor]:
    """`state` + N(0, std^2) per entry, added in float64, each key back in its dtype."""
    _check_update(state)
    noise = gaussian_noise(state, std, generator)
    return {
        key: (tensor.detach().double() + noise[key].to(tensor.device)).to(tensor.dtype)
        for key, tensor in state.items()
    }
