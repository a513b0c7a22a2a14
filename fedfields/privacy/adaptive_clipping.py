"""Adaptive clipping: the clip norm follows a quantile of the clients' update norms, learned
under the same DP guarantee (Andrew, Thakkar, McMahan, Ramaswamy, "Differentially Private
Learning with Adaptive Clipping", NeurIPS 2021, arXiv:1905.03871).

Each round every summed client also reports b_i = 1[||Delta_i|| <= C] (its update was not
clipped). The server learns the count with Gaussian noise of std sigma_b and moves C
geometrically towards the gamma-quantile of the norms (Algorithm 1, the geometric update):

    b_bar = (sum_i b_i + N(0, sigma_b^2)) / n,    C <- C exp(-eta (b_bar - gamma)).

The count is a second query on the same clients (sensitivity 1), so the updates' sum takes a
larger multiplier z_Delta = (z^-2 - (2 sigma_b)^-2)^(-1/2) and the pair costs what one
Gaussian query of multiplier z costs (Theorem 1): the accountant charges z. Flower 1.41
computes z_Delta and sigma_b the same way (`compute_adaptive_noise_params`, default sigma_b =
n / 20) but feeds the *clipped* fraction into the update, so its C shrinks when every update
is clipped; this module follows the paper (tests/test_adaptive_clipping.py shows both).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

TARGET_QUANTILE_KEY = "dp-target-quantile"
CLIP_NORM_LR_KEY = "dp-clip-norm-lr"
COUNT_STDDEV_KEY = "dp-clipped-count-stddev"
MAX_CLIP_NORM_LR = 10.0
"""Largest eta: C moves by at most a factor exp(eta |b_bar - gamma|) a round (0.2 in the paper)."""
CLIP_NORM_RANGE = (1e-12, 1e12)
"""The adapted C is held inside this range, so no setting drives it to 0 (every update then
clipped to nothing) or past float range; where C lies is post-processing of the noised count
and costs no privacy."""
DEFAULT_COUNT_STDDEV_FRACTION = 1 / 20
"""sigma_b = n / 20 when not set: Andrew et al.'s suggestion and Flower's default."""


@dataclass(frozen=True)
class AdaptiveClipping:
    """gamma (`target_quantile`, the fraction of updates left unclipped), eta
    (`learning_rate`) and sigma_b (`count_stddev`; 0: n / 20 for n sampled clients)."""

    target_quantile: float = 0.5
    learning_rate: float = 0.2
    count_stddev: float = 0.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.target_quantile <= 1.0:
            raise ValueError(
                f"'{TARGET_QUANTILE_KEY}' must be in [0, 1], got {self.target_quantile}"
            )
        if not 0 < self.learning_rate <= MAX_CLIP_NORM_LR:
            raise ValueError(
                f"'{CLIP_NORM_LR_KEY}' must be in (0, {MAX_CLIP_NORM_LR:g}], got "
                f"{self.learning_rate}"
            )
        if not (math.isfinite(self.count_stddev) and self.count_stddev >= 0):
            raise ValueError(
                f"'{COUNT_STDDEV_KEY}' must be finite and >= 0, got {self.count_stddev}"
            )

    def count_noise_std(self, num_sampled: int) -> float:
        """sigma_b: as set, else `num_sampled` / 20."""
        return self.count_stddev or num_sampled * DEFAULT_COUNT_STDDEV_FRACTION


def update_noise_multiplier(noise_multiplier: float, count_stddev: float) -> float:
    """z_Delta = (z^-2 - (2 sigma_b)^-2)^(-1/2), the updates' multiplier that, with the count's
    noise sigma_b, composes to z (Theorem 1); ValueError naming the keys when sigma_b is too
    small for z (z >= 2 sigma_b)."""
    if not noise_multiplier < 2 * count_stddev:
        raise ValueError(
            f"adaptive clipping: the clipped count's noise {COUNT_STDDEV_KEY} = {count_stddev:g} "
            f"(default: sampled clients / 20) is too small for dp-noise-multiplier = "
            f"{noise_multiplier:g}: it must exceed z / 2; raise it or sample more clients"
        )
    return (noise_multiplier**-2 - (2 * count_stddev) ** -2) ** -0.5


def combined_noise_multiplier(update_multiplier: float, count_stddev: float) -> float:
    """z from z_Delta and sigma_b: (z_Delta^-2 + (2 sigma_b)^-2)^(-1/2), what the pair of
    queries costs; z_Delta itself when there is no count (sigma_b = 0)."""
    if count_stddev == 0 or update_multiplier == 0:
        return update_multiplier
    return (update_multiplier**-2 + (2 * count_stddev) ** -2) ** -0.5


def next_clip_norm(
    clip_norm: float, noised_unclipped: float, num_summed: int, config: AdaptiveClipping
) -> float:
    """C exp(-eta (b_bar - gamma)) with b_bar = `noised_unclipped` / `num_summed` (the geometric
    update), held inside `CLIP_NORM_RANGE`; b_bar is not clamped to [0, 1], as in the paper,
    so the noise stays unbiased."""
    if num_summed < 1:
        raise ValueError("no client was summed: the clip norm has nothing to follow")
    fraction = noised_unclipped / num_summed
    low, high = CLIP_NORM_RANGE
    exponent = -config.learning_rate * (fraction - config.target_quantile)
    if math.isnan(exponent):  # a count that is not a number moves nothing
        return clip_norm
    if exponent >= math.log(high / clip_norm):
        return high
    if exponent <= math.log(low / clip_norm):
        return low
    return min(max(clip_norm * math.exp(exponent), low), high)
