"""FedAvg aggregation (McMahan et al. 2017): the example-weighted mean of client states."""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor

from fedfields.aggregate.states import State, check_scalar, check_states, like


def weighted_mean(states: Sequence[State], weights: Sequence[float]) -> dict[str, Tensor]:
    """sum_k w_k x_k / sum_k w_k key-wise (FedAvg with w_k = example counts), in float64.

    Integer tensors (e.g. step counters) are averaged the same way and rounded to nearest.
    """
    check_states(states)
    if len(weights) != len(states):
        raise ValueError(f"{len(weights)} weights for {len(states)} client states")
    scaled = [check_scalar(w, f"client {i}: weight") for i, w in enumerate(weights)]
    fractions = [w / sum(scaled) for w in scaled]
    return {
        key: like(
            sum(s[key].detach().double() * f for s, f in zip(states, fractions, strict=True)),
            reference,
        )
        for key, reference in states[0].items()
    }
