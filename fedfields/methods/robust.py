"""Robust aggregation: the coordinate-wise median and trimmed mean, Krum, Multi-Krum and
Bulyan of client states, and the norm of an update that the servers bound before aggregating.

FedAvg's weighted mean follows a single client that sends a huge update; the coordinate-wise
median and trimmed mean (Yin et al. 2018, "Byzantine-robust distributed learning") do not as
long as fewer than half (median) or fewer than the trimmed share (trimmed mean) of the clients
are bad. Both rules ignore the clients' example counts: every state counts once.

Krum (Blanchard et al. 2017) scores each of the n states by the summed squared distances to
its n - f - 2 nearest others (f: the malicious clients assumed) and keeps the best; Multi-Krum
keeps the m best and takes their example-weighted mean (Krum is m = 1). Bulyan (El Mhamdi et
al. 2018) keeps theta = n - 2f states by Multi-Krum, then per coordinate the mean of the
beta = theta - 2f values nearest their median; it needs n >= 4f + 3. All three follow Flower
1.41's `Krum`, `MultiKrum` and `Bulyan` (distances in float64 here).

Unlike the mean, which a server folds in one reply at a time (`RunningSum`), these rules need
every state at once, so a round holds all K replies in memory (K x model).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from fedfields.methods.base import State, check_states, like

AGGREGATION_RULES = ("mean", "trimmed-mean", "median", "krum", "multi-krum", "bulyan")
"""Values of the run-config `aggregation-rule`: "mean" is FedAvg's weighted mean."""


@dataclass(frozen=True)
class RobustRule:
    """A robust rule and its settings: `trim_fraction` for "trimmed-mean", `num_malicious`
    (f) for "krum", "multi-krum" and "bulyan", `krum_select` (m; 0: n - f) for "multi-krum"."""

    name: str
    trim_fraction: float = 0.2
    num_malicious: int = 0
    krum_select: int = 0

    def __post_init__(self) -> None:
        if self.name not in AGGREGATION_RULES[1:]:
            raise ValueError(
                f"robust rule must be one of {AGGREGATION_RULES[1:]}, got {self.name!r}"
            )
        check_trim_fraction(self.trim_fraction)
        for name in ("num_malicious", "krum_select"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}")

    def least_states(self) -> int:
        """The fewest states the rule aggregates: 4f + 3 for Bulyan, 2f + 3 for Krum and
        Multi-Krum (their guarantee needs n > 2f + 2), else 1."""
        if self.name == "bulyan":
            return 4 * self.num_malicious + 3
        if self.name in ("krum", "multi-krum"):
            return 2 * self.num_malicious + 3
        return 1

    def shortfall(self, count: int) -> str:
        """Why `count` states are too few for the rule ("" when they are enough): fewer than
        `least_states`, or fewer than Multi-Krum's m + f (it would average in the f it
        assumes malicious)."""
        if count < self.least_states():
            return (
                f"{self.name} with num-malicious = {self.num_malicious} needs "
                f"{self.least_states()} checked replies, got {count}"
            )
        if self.name == "multi-krum" and self.krum_select > count - self.num_malicious:
            return (
                f"multi-krum with krum-select = {self.krum_select} and num-malicious = "
                f"{self.num_malicious} needs {self.krum_select + self.num_malicious} checked "
                f"replies, got {count}"
            )
        return ""


DEFAULT_TRIM_FRACTION = 0.2
"""Share of the states cut from each end of each coordinate by the trimmed mean."""


def check_trim_fraction(trim_fraction: float) -> float:
    """`trim_fraction` as a float, ValueError unless 0 <= it < 0.5 (0.5 would cut everything)."""
    value = float(trim_fraction)
    if not (math.isfinite(value) and 0.0 <= value < 0.5):
        raise ValueError(f"trim_fraction must be in [0, 0.5), got {trim_fraction}")
    return value


def trimmed_count(count: int, trim_fraction: float) -> int:
    """States cut from each end: floor(trim_fraction * count), as `scipy.stats.trim_mean`."""
    return int(check_trim_fraction(trim_fraction) * count)


def coordinate_median(states: Sequence[State]) -> dict[str, Tensor]:
    """Key- and element-wise median of `states` (the mean of the two middle values for an
    even count, as `numpy.median`), in each key's dtype; example counts play no part."""
    check_states(states)
    result = {}
    for key, reference in states[0].items():
        result[key] = like(_middle(_sorted_stack(states, key)), reference)
    return result


def coordinate_trimmed_mean(
    states: Sequence[State], trim_fraction: float = DEFAULT_TRIM_FRACTION
) -> dict[str, Tensor]:
    """Key- and element-wise mean after cutting floor(trim_fraction * K) of the K values from
    each end (`scipy.stats.trim_mean`); 0 is the plain mean. Example counts play no part."""
    check_states(states)
    cut = trimmed_count(len(states), trim_fraction)
    result = {}
    for key, reference in states[0].items():
        ordered = _sorted_stack(states, key)
        kept = ordered[cut : ordered.shape[0] - cut]
        result[key] = like(kept.mean(dim=0), reference)
    return result


def squared_distances(states: Sequence[State]) -> Tensor:
    """The n x n matrix of ||x_i - x_j||^2 over all keys, float64."""
    flat = torch.stack(
        [
            torch.cat([state[key].detach().double().reshape(-1) for key in states[0]])
            for state in states
        ]
    )
    return torch.cdist(flat, flat).square()


def krum_selection(states: Sequence[State], num_malicious: int, num_selected: int) -> list[int]:
    """Indices of the `num_selected` states with the lowest Krum scores, best first: a
    state's score sums its squared distances to its max(1, n - f - 2) nearest others."""
    check_states(states)
    distances = squared_distances(states)
    nearest = max(1, len(states) - num_malicious - 2)
    ordered = torch.sort(distances, dim=1, stable=True).values
    scores = ordered[:, 1 : nearest + 1].sum(dim=1)  # column 0: a state's distance to itself
    return torch.argsort(scores, stable=True)[:num_selected].tolist()


def multi_krum(
    states: Sequence[State], weights: Sequence[float], num_malicious: int, num_selected: int
) -> dict[str, Tensor]:
    """The example-weighted mean of the `num_selected` best states by Krum score (Krum: 1)."""
    chosen = krum_selection(states, num_malicious, num_selected)
    total = sum(weights[i] for i in chosen)
    result = {}
    for key, reference in states[0].items():
        stacked = torch.stack([states[i][key].detach().double() for i in chosen])
        shares = torch.tensor([weights[i] / total for i in chosen], dtype=torch.float64)
        result[key] = like(torch.tensordot(shares, stacked, dims=1), reference)
    return result


def bulyan(states: Sequence[State], num_malicious: int) -> dict[str, Tensor]:
    """Bulyan: theta = n - 2f states by Multi-Krum, then per coordinate the mean of the
    beta = theta - 2f of them nearest their median; ValueError below n = 4f + 3."""
    least = 4 * num_malicious + 3
    if len(states) < least:
        raise ValueError(
            f"Bulyan with f = {num_malicious} needs at least 4f + 3 = {least} states, got "
            f"{len(states)}"
        )
    theta = len(states) - 2 * num_malicious
    beta = theta - 2 * num_malicious
    chosen = [states[i] for i in krum_selection(states, num_malicious, theta)]
    result = {}
    for key, reference in states[0].items():
        stacked = torch.stack([state[key].detach().double() for state in chosen])
        median = _middle(torch.sort(stacked, dim=0).values)
        nearest = torch.topk((stacked - median).abs(), beta, dim=0, largest=False).indices
        result[key] = like(stacked.gather(0, nearest).mean(dim=0), reference)
    return result


def robust_aggregate(
    rule: RobustRule, states: Sequence[State], weights: Sequence[float] | None = None
) -> dict[str, Tensor]:
    """`rule` over `states`; `weights` (example counts, default 1) only weigh Multi-Krum's
    and Krum's mean, as in Flower."""
    weights = [1.0] * len(states) if weights is None else weights
    if rule.name == "median":
        return coordinate_median(states)
    if rule.name == "trimmed-mean":
        return coordinate_trimmed_mean(states, rule.trim_fraction)
    if rule.name == "krum":
        return multi_krum(states, weights, rule.num_malicious, 1)
    if rule.name == "multi-krum":
        selected = rule.krum_select or max(1, len(states) - rule.num_malicious)
        return multi_krum(states, weights, rule.num_malicious, selected)
    return bulyan(states, rule.num_malicious)


def _sorted_stack(states: Sequence[State], key: str) -> Tensor:
    """The states' `key` stacked along a new first axis in float64, sorted along it."""
    stacked = torch.stack([state[key].detach().double() for state in states])
    return torch.sort(stacked, dim=0).values


def _middle(ordered: Tensor) -> Tensor:
    """The median along the first axis of values sorted along it (`numpy.median`: the mean of
    the two middle values for an even count)."""
    count = ordered.shape[0]
    return ordered[(count - 1) // 2 : count // 2 + 1].mean(dim=0)
