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
Floating-point tensors only: a non-float one (a counter) takes the mean. The mean is the
round's (plaintext, SecAgg+'s, noised under DP, or a robust rule's); clients train as for
FedAvg. Three methods in one module: one paper, one rule with three second moments.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor

from fedfields.methods.base import (
    Method,
    RoundContext,
    ServerStep,
    State,
    check_scalar,
    check_states,
    like,
)
from fedfields.methods.fedavgm import ServerOptimiserSettings
from fedfields.methods.settings import Rule, setting

BETA_1, BETA_2, TAU = 0.9, 0.99, 1e-3
"""Flower 1.41's FedAdam and FedYogi defaults (FedAdagrad: beta_1 = 0, tau 1e-3 too)."""
MIN_TAU = 1e-9
"""Least tau a run-config may set: a step where a second moment is 0 is eta |m| / tau, which
tau 1e-300 turns into 1e298 times the update."""
DECAY: Rule = (lambda value: 0.0 <= value < 1.0, "in [0, 1)")
"""A moment's decay: 1 would freeze the moment at 0."""

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


@dataclass(frozen=True)
class AdaptiveSettings(ServerOptimiserSettings):
    """FedAdagrad's run-config keys: server-learning-rate and tau."""

    tau: float = setting(
        TAU,
        "tau",
        f"FedAdam, FedYogi, FedAdagrad: adaptivity tau, >= {MIN_TAU:g} (it bounds each step by "
        "eta |m| / tau where a second moment is 0)",
        (lambda value: math.isfinite(value) and value >= MIN_TAU, f"finite and >= {MIN_TAU:g}"),
    )


@dataclass(frozen=True)
class MomentSettings(AdaptiveSettings):
    """FedAdam's and FedYogi's run-config keys: besides eta and tau, beta-1 and beta-2."""

    beta_1: float = setting(BETA_1, "beta-1", "FedAdam, FedYogi: first-moment decay beta_1", DECAY)
    beta_2: float = setting(BETA_2, "beta-2", "FedAdam, FedYogi: second-moment decay beta_2", DECAY)


class AdaptiveOptimiser(Method):
    """FedOpt's server step x <- x + eta' m / (sqrt(v) + tau) on delta = mean - x; subclasses
    set the second moment's rule.

    Args:
        server_learning_rate: eta (None: the subclass's `default_learning_rate`, Flower's).
        beta_1, beta_2: the moments' decays.
        tau: the adaptivity floor.
    """

    second_moment: ClassVar[SecondMoment]
    bias_corrected: ClassVar[bool] = False
    default_learning_rate: ClassVar[float]

    def __init__(
        self,
        *,
        server_learning_rate: float | None = None,
        beta_1: float = BETA_1,
        beta_2: float = BETA_2,
        tau: float = TAU,
    ) -> None:
        for name, value in (("beta_1", beta_1), ("beta_2", beta_2)):
            if not 0.0 <= value < 1.0:
                raise ValueError(f"{name} must be in [0, 1), got {value!r}")
        if not check_scalar(tau, "tau") >= MIN_TAU:
            raise ValueError(f"tau must be >= {MIN_TAU:g}, got {tau!r}")
        if server_learning_rate is None:
            server_learning_rate = self.default_learning_rate
        self.rule = AdaptiveStep(
            check_scalar(server_learning_rate, "server_learning_rate"),
            beta_1,
            beta_2,
            check_scalar(tau, "tau"),
            type(self).second_moment,
            self.bias_corrected,
        )
        self.moments: tuple[dict[str, Tensor], dict[str, Tensor]] | None = None
        """(m, v), None before the first aggregate."""

    def step_from_mean(self, context: RoundContext, mean: State) -> ServerStep:
        """x + eta' m / (sqrt(v) + tau), m and v updated with mean - x."""
        new_global, self.moments = adaptive_update(
            self.rule, context.server_round, context.global_state, mean, self.moments
        )
        return ServerStep(new_global)

    def state(self) -> dict[str, Any]:
        """The moments m and v."""
        return {"moments": self.moments}

    def restore(self, state: Mapping[str, Any]) -> None:
        """Take back the moments."""
        self.moments = state["moments"]


class FedAdam(AdaptiveOptimiser):
    """FedAdam: v <- beta_2 v + (1 - beta_2) delta^2 and Adam's bias-corrected eta (Flower's
    defaults: eta 1e-1, beta_1 0.9, beta_2 0.99, tau 1e-3)."""

    name = "fedadam"
    settings_class = MomentSettings
    default_learning_rate = 1e-1
    second_moment = staticmethod(adam_moment)
    bias_corrected = True


class FedYogi(AdaptiveOptimiser):
    """FedYogi: v <- v - (1 - beta_2) delta^2 sign(v - delta^2) (Flower's defaults: eta 1e-2,
    beta_1 0.9, beta_2 0.99, tau 1e-3)."""

    name = "fedyogi"
    settings_class = MomentSettings
    default_learning_rate = 1e-2
    second_moment = staticmethod(yogi_moment)


class FedAdagrad(AdaptiveOptimiser):
    """FedAdagrad: v <- v + delta^2 and no first-moment decay (beta_1 = 0; Flower's defaults:
    eta 1e-1, tau 1e-3)."""

    name = "fedadagrad"
    settings_class = AdaptiveSettings
    default_learning_rate = 1e-1
    second_moment = staticmethod(adagrad_moment)

    def __init__(self, *, server_learning_rate: float | None = None, tau: float = TAU) -> None:
        super().__init__(server_learning_rate=server_learning_rate, beta_1=0.0, tau=tau)
