"""The papers' update rules written over lists of client states: the references tests hold
the library's production paths to (the round's running sums, `RoundSum`, `FedNovaSums`,
`FedExPSums`, `scaffold_server_update_from_sums`, the node's Scaffold control), computed
another way. Not in the wheel: production never needed the list form."""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor

from fedfields.methods.base import State, check_scalar, check_states, like
from fedfields.methods.fedexp import FEDEXP_EPSILON, FedExPSums
from fedfields.methods.fednova import FedNovaSums
from fedfields.methods.scaffold import scaffold_server_update_from_sums


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


def state_sum(states: Sequence[State]) -> dict[str, Tensor]:
    """Key-wise sum of client states: the plain (non-secure) counterpart of a secure sum."""
    check_states(states)
    return {
        key: like(sum(state[key].detach().double() for state in states), reference)
        for key, reference in states[0].items()
    }


def fednova_update(
    global_state: State,
    local_states: Sequence[State],
    weights: Sequence[float],
    local_steps: Sequence[float],
) -> dict[str, Tensor]:
    """The new global state from the clients' y_i, example counts n_i and steps tau_i."""
    labels = ["global_state"] + [f"client {i}" for i in range(len(local_states))]
    check_states([global_state, *local_states], labels)
    if not len(local_states) == len(weights) == len(local_steps):
        raise ValueError(
            f"{len(local_states)} states, {len(weights)} weights, {len(local_steps)} step counts"
        )
    sums = FedNovaSums(global_state)
    for state, weight, steps in zip(local_states, weights, local_steps, strict=True):
        sums.add(state, weight, steps, checked=True)
    return sums.update()


def fedexp_update(
    global_state: State,
    local_states: Sequence[State],
    weights: Sequence[float],
    epsilon: float = FEDEXP_EPSILON,
) -> tuple[dict[str, Tensor], float]:
    """(new global state, eta_g) from the clients' y_i and example counts n_i."""
    labels = ["global_state"] + [f"client {i}" for i in range(len(local_states))]
    check_states([global_state, *local_states], labels)
    if len(local_states) != len(weights):
        raise ValueError(f"{len(local_states)} states but {len(weights)} weights")
    sums = FedExPSums(global_state, epsilon)
    for state, weight in zip(local_states, weights, strict=True):
        sums.add(state, weight, checked=True)
    return sums.update(), sums.server_step()


def scaffold_client_control_update(
    client_control: State,
    server_control: State,
    global_state: State,
    local_state: State,
    local_steps: int,
    learning_rate: float,
) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """Control variate c_i+ = c_i - c + (x - y_i) / (K lr) (Algorithm 1, option II).

    Returns (c_i+, delta c_i = c_i+ - c_i), both in `client_control`'s dtypes.
    """
    check_states(
        [client_control, server_control, global_state, local_state],
        names=["client_control", "server_control", "global_state", "local_state"],
    )
    if int(local_steps) != local_steps or local_steps < 1:
        raise ValueError(f"local_steps must be a positive integer, got {local_steps}")
    step = check_scalar(learning_rate, "learning_rate") * int(local_steps)
    new_control, control_delta = {}, {}
    for key, c_i in client_control.items():
        c_i64 = c_i.detach().double()
        drift = (global_state[key].detach().double() - local_state[key].detach().double()) / step
        updated = c_i64 - server_control[key].detach().double() + drift
        new_control[key] = like(updated, c_i)
        control_delta[key] = like(updated - c_i64, c_i)
    return new_control, control_delta


def scaffold_server_update(
    global_state: State,
    model_deltas: Sequence[State],
    control_deltas: Sequence[State],
    server_control: State,
    num_clients_total: int,
    global_lr: float = 1.0,
) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """x <- x + lr_g mean(y_i - x), c <- c + |S|/N mean(delta c_i) (Algorithm 1).

    Returns (new global state, new server control) in the input dtypes.
    """
    if len(model_deltas) != len(control_deltas):
        raise ValueError(
            f"{len(model_deltas)} model deltas but {len(control_deltas)} control deltas"
        )
    sampled = len(model_deltas)
    if sampled == 0:
        raise ValueError("no client deltas given")
    check_states([global_state, *model_deltas], names=["global_state"] + _clients(sampled))
    check_states([server_control, *control_deltas], names=["server_control"] + _clients(sampled))
    if int(num_clients_total) != num_clients_total or num_clients_total < sampled:
        raise ValueError(
            f"num_clients_total must be an integer >= the {sampled} sampled clients, "
            f"got {num_clients_total}"
        )
    return scaffold_server_update_from_sums(
        global_state,
        {key: _sum(model_deltas, key) for key in global_state},
        {key: _sum(control_deltas, key) for key in server_control},
        sampled,
        server_control,
        num_clients_total,
        global_lr,
    )


def _clients(count: int) -> list[str]:
    return [f"client {i}" for i in range(count)]


def _sum(states: Sequence[State], key: str) -> Tensor:
    return sum(state[key].detach().double() for state in states)
