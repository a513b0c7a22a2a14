"""FedACG (Kim et al. 2024, Algorithm 1): server momentum sent ahead to the clients.

The server broadcasts the lookahead x~ = x + lambda m; each client minimises its loss plus
beta/2 ||y - x~||^2 (FedProx's term around x~); the server then sets
    Delta = mean_i (y_i - x~),   m <- lambda m + Delta,   x <- x + m,
which makes the new x the clients' mean and m the last global step. FedMeNF's Table 7:
lambda = 0.2, beta = 0.1 (Reptile: 1e-4). The mean is the round's (plaintext, SecAgg+'s,
noised under DP, or a robust rule's); beta goes to the clients as FedProx's "proximal-mu".
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from fedfields.methods.base import (
    ARRAYS,
    ClientHook,
    Kept,
    Method,
    RoundContext,
    ServerStep,
    State,
    check_scalar,
    check_states,
    like,
)
from fedfields.methods.fedprox import PROXIMAL_MU, proximal_hooks
from fedfields.methods.settings import (
    MAX_LOSS_WEIGHT,
    StrategySettings,
    setting,
    within,
)

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


@dataclass(frozen=True)
class FedACGSettings(StrategySettings):
    """FedACG's run-config keys (FedMeNF's Table 7 values by default)."""

    robust_rules = True
    momentum: float = setting(
        FEDACG_LAMBDA,
        "fedacg-lambda",
        "FedACG's server momentum lambda, in [0, 1)",
        within(0.0, 1.0, high_open=True),
    )
    beta: float = setting(
        FEDACG_BETA,
        "fedacg-beta",
        "FedACG's proximal weight beta around the lookahead, at most 1e6",
        within(0.0, MAX_LOSS_WEIGHT),
    )


class FedACG(Method):
    """FedACG's server half: sends x + lambda m, takes m and x from the round's mean.

    Args:
        momentum: lambda (FedMeNF's Table 7: 0.2).
        beta: the clients' proximal weight (Table 7: 0.1; Reptile 1e-4).

    Attributes:
        momentum: m as a state dict, carried across rounds ({} before round 1: zeros).
    """

    name = "fedacg"
    settings_class = FedACGSettings

    def __init__(self, *, momentum: float = FEDACG_LAMBDA, beta: float = FEDACG_BETA) -> None:
        for name, value in (("momentum", momentum), ("beta", beta)):
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be non-negative and finite, got {value}")
        self.momentum_weight, self.beta = float(momentum), float(beta)
        self.momentum: dict[str, Tensor] = {}

    def client_config(self) -> dict[str, int | float | str]:
        """beta as "proximal-mu": the clients' proximal term around the lookahead."""
        return {PROXIMAL_MU: self.beta}

    @classmethod
    def client_hooks(
        cls, config: Mapping[str, Any], received: Mapping[str, State], kept: Kept
    ) -> list[ClientHook]:
        """The proximal term (weight beta) around the lookahead received."""
        return proximal_hooks(config, received)

    def sent(self, global_state: State, server_round: int) -> dict[str, State]:
        """The lookahead x + lambda m instead of x (m = 0 in the first round)."""
        if self.momentum.keys() != global_state.keys():
            self.momentum = {k: torch.zeros_like(v) for k, v in global_state.items()}
        return {ARRAYS: fedacg_lookahead(global_state, self.momentum, self.momentum_weight)}

    def step_from_mean(self, context: RoundContext, mean: State) -> ServerStep:
        """m <- lambda m + (mean - x~), x <- x + m."""
        new_global, self.momentum = fedacg_update(
            context.global_state, self.momentum, mean, self.momentum_weight
        )
        return ServerStep(new_global)

    def state(self) -> dict[str, Any]:
        """The server momentum m."""
        return {"momentum": dict(self.momentum)}

    def restore(self, state: Mapping[str, Any]) -> None:
        """Take back m."""
        self.momentum = dict(state["momentum"])

    def describe(self) -> str:
        """The name, lambda and beta."""
        return f"fedacg (lambda {self.momentum_weight:g}, beta {self.beta:g})"
