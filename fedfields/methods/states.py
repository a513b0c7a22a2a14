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


class RunningSum:
    """sum_k w_k x_k and sum_k w_k accumulated one state at a time.

    What a server needs to aggregate replies as they arrive: memory is one float64 copy of
    the model whatever the number of states. Accumulating in float64 (not float32, which is
    faster: docs/BENCHMARKS.md) keeps the result independent of the order replies arrive in,
    so a seeded run repeats exactly; `sum()` / `mean()` hand back each key's input dtype
    (tests/paper_reference.py's list forms are the reference they are checked against).
    """

    def __init__(self) -> None:
        self.total: dict[str, Tensor] = {}
        self.dtypes: dict[str, torch.dtype] = {}  # each key's input dtype, handed back
        self.total_weight = 0.0
        self.count = 0

    def add(self, state: State, weight: float = 1.0, *, checked: bool = False) -> None:
        """Add w * state; the first state fixes keys and shapes, a mismatch raises ValueError.

        Non-finite values raise too, unless the caller already `checked` them (a server's
        `reply_state` does, naming the node). `state` is only read, never kept: read-only
        views of a message's bytes are fine.
        """
        label = f"state {self.count}"
        weight = check_scalar(weight, f"{label}: weight", positive=False)
        if self.count == 0:
            if len(state) == 0:
                raise ValueError(f"{label}: state has no tensors")
            self.dtypes = {key: value.dtype for key, value in state.items()}
            self.total = {
                key: torch.empty(value.shape, dtype=torch.float64) for key, value in state.items()
            }
        else:
            self._check_like_first(state)
        for key, value in state.items():  # all checks before any addition: never half a state
            if not checked and value.is_floating_point() and not bool(torch.isfinite(value).all()):
                raise ValueError(f"{label}, key {key!r}: non-finite values")
        for key, value in state.items():
            if self.count == 0:  # copy exactly into float64, then scale in float64
                self.total[key].copy_(value.detach()).mul_(weight)
            else:
                self.total[key].add_(value.detach(), alpha=weight)
        self.total_weight += weight
        self.count += 1

    def _check_like_first(self, state: State) -> None:
        """One ValueError naming the state and key unless keys and shapes match the first's."""
        label = f"state {self.count}"
        missing = [key for key in self.total if key not in state]
        extra = [key for key in state if key not in self.total]
        if missing or extra:
            raise ValueError(
                f"{label}: keys differ from state 0's (missing {missing}, unexpected {extra})"
            )
        for key, value in state.items():
            if value.shape != self.total[key].shape:
                raise ValueError(
                    f"{label}, key {key!r}: shape {tuple(value.shape)} differs from state 0's "
                    f"{tuple(self.total[key].shape)}"
                )

    def accumulated(self) -> dict[str, Tensor]:
        """sum_k w_k x_k in float64, for rules that compute further on it."""
        if self.count == 0:
            raise ValueError("no states given")
        return dict(self.total)

    def sum(self) -> dict[str, Tensor]:
        """sum_k w_k x_k in each key's input dtype; ValueError if nothing was added."""
        return {
            key: _handed_back(value, self.dtypes[key]) for key, value in self.accumulated().items()
        }

    def mean(self) -> dict[str, Tensor]:
        """sum_k w_k x_k / sum_k w_k in each key's input dtype (FedAvg's weighted mean)."""
        total = self.accumulated()
        if self.total_weight <= 0:
            raise ValueError(f"weights sum to {self.total_weight}, not a positive number")
        return {
            key: _handed_back(value / self.total_weight, self.dtypes[key])
            for key, value in total.items()
        }


def _handed_back(value: Tensor, dtype: torch.dtype) -> Tensor:
    """An accumulated value in the input `dtype`, rounded to nearest for integer dtypes."""
    if not dtype.is_floating_point:
        value = torch.round(value)
    return value.to(dtype)


def difference(minuend: State, subtrahend: State) -> dict[str, Tensor]:
    """minuend - subtrahend key-wise in float64 (keys of `minuend`)."""
    return {key: value.double() - subtrahend[key].double() for key, value in minuend.items()}


def squared_norm(state: State) -> float:
    """sum of squares over every tensor of `state`, in float64."""
    return sum(float(value.double().square().sum()) for value in state.values())


def to_wire(tensor: Tensor) -> Tensor:
    """A detached CPU copy, float32 if floating: the form every tensor a client uploads takes."""
    dtype = torch.float32 if tensor.is_floating_point() else tensor.dtype
    return tensor.detach().to("cpu", dtype, copy=True)


def check_state(state: Mapping[str, Tensor], parameters: Mapping[str, Tensor], what: str) -> None:
    """Raise a ValueError naming missing or unexpected keys, or a key with the wrong shape."""
    missing = [name for name in parameters if name not in state]
    unexpected = [name for name in state if name not in parameters]
    if missing or unexpected:
        raise ValueError(f"{what}: missing keys {missing}, unexpected keys {unexpected}")
    for name, parameter in parameters.items():
        if state[name].shape != parameter.shape:
            raise ValueError(
                f"{what}, key {name!r}: shape {tuple(state[name].shape)} differs from the "
                f"field's {tuple(parameter.shape)}"
            )


def on_device(
    state: Mapping[str, Tensor] | None, parameters: Mapping[str, Tensor], what: str
) -> dict[str, Tensor]:
    """`state` checked against the parameters and moved to their device and dtype.

    None stands for the parameters' current values.
    """
    if state is None:
        return {name: p.detach().clone() for name, p in parameters.items()}
    check_state(state, parameters, what)
    return {name: state[name].to(p.device, p.dtype) for name, p in parameters.items()}


def update_norm(state: State, reference: State | None = None, scale: float = 1.0) -> float:
    """||state / scale - reference|| in float64 over `reference`'s keys (||state|| over all of
    its keys without a reference): how far a reply moved from the model it was sent; `scale`
    divides out a payload's scale (a weight the client multiplied its state by)."""
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
