"""Robust aggregation: the coordinate-wise median and trimmed mean of client states, and the
norm of an update that the servers bound before aggregating.

FedAvg's weighted mean follows a single client that sends a huge update; the coordinate-wise
median and trimmed mean (Yin et al. 2018, "Byzantine-robust distributed learning") do not as
long as fewer than half (median) or fewer than the trimmed share (trimmed mean) of the clients
are bad. Both rules ignore the clients' example counts: every state counts once. Unlike the
mean, which a server folds in one reply at a time (`RunningSum`), they need every state at
once, so a round holds all K replies in memory (K x model).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from fedfields.aggregate.states import State, check_states, like

AGGREGATION_RULES = ("mean", "trimmed-mean", "median")
"""Values of the run-config `aggregation-rule`: "mean" is FedAvg's weighted mean."""

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
        ordered = _sorted_stack(states, key)
        count = ordered.shape[0]
        middle = ordered[(count - 1) // 2 : count // 2 + 1].mean(dim=0)
        result[key] = like(middle, reference)
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


def robust_aggregate(
    rule: str, states: Sequence[State], trim_fraction: float = DEFAULT_TRIM_FRACTION
) -> dict[str, Tensor]:
    """The unweighted `rule` ("median" or "trimmed-mean") of `states`."""
    if rule == "median":
        return coordinate_median(states)
    if rule == "trimmed-mean":
        return coordinate_trimmed_mean(states, trim_fraction)
    raise ValueError(f"robust rule must be 'median' or 'trimmed-mean', got {rule!r}")


def update_norm(state: State, reference: State | None = None, scale: float = 1.0) -> float:
    """||state / scale - reference|| in float64 over `reference`'s keys (||state|| over all of
    its keys without a reference): how far a reply moved from the model it was sent; `scale`
    divides out DecentNeRF's alpha_k from its payload alpha_k g_k."""
    keys = state.keys() if reference is None else reference.keys()
    total = 0.0
    for key in keys:
        value = state[key].detach().double()
        if scale != 1.0:
            value = value / scale
        if reference is not None:
            value = value - reference[key].detach().double()
        total += float(value.square().sum())
    return math.sqrt(total)


def _sorted_stack(states: Sequence[State], key: str) -> Tensor:
    """The states' `key` stacked along a new first axis in float64, sorted along it."""
    stacked = torch.stack([state[key].detach().double() for state in states])
    return torch.sort(stacked, dim=0).values
