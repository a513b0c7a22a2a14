"""State-dict checks and arithmetic shared by the aggregation rules.

A state is `dict[str, Tensor]` ordered like a module's `state_dict()`. The rules compute in
float64 and hand back each key's input dtype; non-floating tensors (step counters, masks)
are rounded to the nearest integer (half to even) on the way back.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

State = Mapping[str, Tensor]


def check_states(states: Sequence[State], names: Sequence[str] | None = None) -> None:
    """Raise one ValueError naming the state and key unless all share keys and shapes.

    Floating tensors must be finite. `names` label the states (default "client 0", ...).
    """
    if len(states) == 0:
        raise ValueError("no states given")
    labels = list(names) if names is not None else [f"client {i}" for i in range(len(states))]
    reference = states[0]
    if len(reference) == 0:
        raise ValueError(f"{labels[0]}: state has no tensors")
    for label, state in zip(labels, states, strict=True):
        missing = [key for key in reference if key not in state]
        extra = [key for key in state if key not in reference]
        if missing or extra:
            raise ValueError(
                f"{label}: keys differ from {labels[0]}'s (missing {missing}, unexpected {extra})"
            )
        for key, tensor in state.items():
            if tensor.shape != reference[key].shape:
                raise ValueError(
                    f"{label}, key {key!r}: shape {tuple(tensor.shape)} differs from "
                    f"{labels[0]}'s {tuple(reference[key].shape)}"
                )
            if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
                raise ValueError(f"{label}, key {key!r}: non-finite values")


def check_scalar(value: float, name: str, *, positive: bool = True) -> float:
    """Return `value` as a float, raising ValueError unless finite (and > 0 if `positive`)."""
    value = float(value)
    if not math.isfinite(value) or (positive and value <= 0):
        requirement = "positive and finite" if positive else "finite"
        raise ValueError(f"{name} must be {requirement}, got {value}")
    return value


def like(value: Tensor, reference: Tensor) -> Tensor:
    """Cast a float64 result back to `reference`'s dtype, rounding for non-floating dtypes."""
    if not reference.is_floating_point():
        value = torch.round(value)
    return value.to(reference.dtype)


def state_sum(states: Sequence[State]) -> dict[str, Tensor]:
    """Key-wise sum of client states: the plain (non-secure) counterpart of a secure sum."""
    check_states(states)
    return {
        key: like(sum(state[key].detach().double() for state in states), reference)
        for key, reference in states[0].items()
    }
