"""FedAvgM (Hsu et al. 2019): server momentum on the clients' mean, as Flower 1.41's FedAvgM.

With the pseudo-gradient d = x - mean (the global minus the clients' mean),
    v <- beta v + d (v = d in the first round),   x <- x - eta v;
beta = 0 drops the momentum (x <- x - eta d), and eta = 1 with beta = 0 is FedAvg's mean.
Floating-point tensors only: a non-float one (a counter) takes the mean.
"""

from __future__ import annotations

from torch import Tensor

from fedfields.methods.states import State, check_states, like

FEDAVGM_LEARNING_RATE = 1.0
FEDAVGM_MOMENTUM = 0.0
"""Flower's defaults: FedAvgM without momentum at step 1, i.e. FedAvg."""


def fedavgm_update(
    global_state: State,
    client_mean: State,
    momentum: State | None,
    learning_rate: float,
    server_momentum: float,
) -> tuple[dict[str, Tensor], dict[str, Tensor] | None]:
    """(new x, new v) from the global x, the clients' mean and the momentum v (None before
    the first round, and always without momentum)."""
    check_states([global_state, client_mean], ["global_state", "mean"])
    if learning_rate == 1.0 and server_momentum == 0.0:
        return dict(client_mean), None
    step = {
        key: x.double() - client_mean[key].double()
        for key, x in global_state.items()
        if x.is_floating_point()
    }
    if server_momentum > 0.0:
        if momentum is not None:
            step = {key: server_momentum * momentum[key].double() + d for key, d in step.items()}
        new_momentum: dict[str, Tensor] | None = step
    else:
        new_momentum = None
    new_global = {
        key: like(x.double() - learning_rate * step[key], x) if key in step else client_mean[key]
        for key, x in global_state.items()
    }
    return new_global, new_momentum
