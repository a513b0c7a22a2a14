"""Adaptive federated optimisation (Reddi et al. 2021): FedAdam, FedYogi and FedAdagrad, as
Flower 1.41's FedOpt family computes them.

With delta = mean - x (the clients' mean minus the global) each round,
    m <- beta_1 m + (1 - beta_1) delta                   (m = 0 before the first round)
    v <- beta_2 v + (1 - beta_2) delta^2                 FedAdam
    v <- v - (1 - beta_2) delta^2 sign(v - delta^2)      FedYogi
    v <- v + delta^2                                     FedAdagrad (beta_1 = 0)
    x <- x + eta' m / (sqrt(v) + tau)
where eta' = eta for FedYogi and FedAdagrad, and FedAdam's bias-corrected
eta sqrt(1 - beta_2^(t+1)) / (1 - beta_1^(t+1)) in round t (v = 0 before the first round).
Floating-point tensors only: a non-float one (a counter) takes the mean.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from fedfields.methods.states import State, check_states, like

SecondMoment = Callable[[Tensor, Tensor, float], Tensor]
"""v, delta^2 and beta_2 -> the new v (float64)."""


def adam_moment(v: Tensor, squared: Tensor, beta_2: float) -> Tensor:
    """FedAdam's v: the exponential mean of delta^2."""
    return beta_2 * v + (1.0 - beta_2) * squared


def yogi_moment(v: Tensor, squared: Tensor, beta_2: float) -> Tensor:
    """FedYogi's v: moves towards delta^2 by (1 - beta_2) delta^2 at most."""
    return v - (1.0 - beta_2) * squared * torch.sign(v - squared)


def adagrad_moment(v: Tensor, squared: Tensor, beta_2: float) -> Tensor:
    """FedAdagrad's v: the running sum of delta^2 (beta_2 unused)."""
    return v + squared


@dataclass(frozen=True)
class AdaptiveStep:
    """One adaptive rule's settings: eta, beta_1, beta_2, tau, the second moment's update
    and whether eta carries Adam's bias correction."""

    learning_rate: float
    beta_1: float
    beta_2: float
    tau: float
    second_moment: SecondMoment
    bias_corrected: bool = False

    def rate(self, server_round: int) -> float:
        """eta', the step of round `server_round`."""
        if not self.bias_corrected:
            return self.learning_rate
        correction = math.sqrt(1.0 - self.beta_2 ** (server_round + 1.0))
        return self.learning_rate * correction / (1.0 - self.beta_1 ** (server_round + 1.0))


def adaptive_update(
    rule: AdaptiveStep,
    server_round: int,
    global_state: State,
    client_mean: State,
    moments: tuple[State, State] | None,
) -> tuple[dict[str, Tensor], tuple[dict[str, Tensor], dict[str, Tensor]]]:
    """(new x, (m, v)) from the global x, the clients' mean and the moments (None before the
    first round), in x's dtypes; m and v stay float64."""
    check_states([global_state, client_mean], ["global_state", "mean"])
    delta = {
        key: client_mean[key].double() - x.double()
        for key, x in global_state.items()
        if x.is_floating_point()
    }
    old_m, old_v = moments or ({}, {})
    zero = {key: torch.zeros_like(d) for key, d in delta.items()}
    m = {
        key: rule.beta_1 * old_m.get(key, zero[key]) + (1.0 - rule.beta_1) * d
        for key, d in delta.items()
    }
    v = {
        key: rule.second_moment(old_v.get(key, zero[key]), d * d, rule.beta_2)
        for key, d in delta.items()
    }
    rate = rule.rate(server_round)
    new_global = {
        key: like(x.double() + rate * m[key] / (v[key].sqrt() + rule.tau), x)
        if key in delta
        else client_mean[key]
        for key, x in global_state.items()
    }
    return new_global, (m, v)
