"""FedACG (Kim et al. 2024, Algorithm 1): server momentum sent ahead to the clients.

The server broadcasts the lookahead x~ = x + lambda m; each client minimises its loss plus
beta/2 ||y - x~||^2 (FedProx's term around x~); the server then sets
    Delta = mean_i (y_i - x~),   m <- lambda m + Delta,   x <- x + m,
which makes the new x the clients' mean and m the last global step. FedMeNF's Table 7:
lambda = 0.2, beta = 0.1 (Reptile: 1e-4).
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import Tensor

from fedfields.methods.states import State, check_scalar, check_states, like

FEDACG_LAMBDA = 0.2
FEDACG_BETA = 0.1


def fedacg_lookahead(
    global_state: State, momentum: State, momentum_weight: float
) -> dict[str, Tensor]:
    """x~ = x + lambda m, in x's dtypes (what the clients start from and stay near)."""
    check_states([global_state, momentum], ["global_state", "momentum"])
    weight = check_scalar(momentum_weight, "lambda", positive=False)
    return {
        key: like(x.detach().double() + weight * momentum[key].double(), x)
        for key, x in global_state.items()
    }


def fedacg_update(
    global_state: State, momentum: State, client_mean: Mapping[str, Tensor], momentum_weight: float
) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """(new x, new m) from the clients' mean y: m <- lambda m + (y - x~), x <- x + m."""
    check_states([global_state, momentum, client_mean], ["global_state", "momentum", "mean"])
    weight = check_scalar(momentum_weight, "lambda", positive=False)
    new_momentum, new_global = {}, {}
    for key, x in global_state.items():
        lookahead = x.double() + weight * momentum[key].double()
        step = weight * momentum[key].double() + (client_mean[key].double() - lookahead)
        new_momentum[key] = like(step, momentum[key])
        new_global[key] = like(x.double() + step, x)
    return new_global, new_momentum
