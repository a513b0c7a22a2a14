"""FedAvgM (Hsu et al. 2019): server momentum on the clients' mean, as Flower 1.41's FedAvgM.

With the pseudo-gradient d = x - mean (the global minus the clients' mean),
    v <- beta v + d (v = d in the first round),   x <- x - eta v;
beta = 0 drops the momentum (x <- x - eta d), and eta = 1 with beta = 0 is FedAvg's mean.
Floating-point tensors only: a non-float one (a counter) takes the mean. The mean is the
round's (plaintext, SecAgg+'s, noised under DP, or a robust rule's); clients train as for
FedAvg.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

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
from fedfields.methods.settings import (
    MAX_STEP_SCALE,
    StrategySettings,
    setting,
    within,
)

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


@dataclass(frozen=True)
class ServerOptimiserSettings(StrategySettings):
    """The server step size every server optimiser reads; 0 takes the method's own default
    (Flower's), since they differ and a run-config key has one default."""

    robust_rules = True
    server_learning_rate: float = setting(
        0.0,
        "server-learning-rate",
        "eta of the server optimiser (0: Flower's default: fedavgm 1, fedadam 0.1, fedyogi "
        "0.01, fedadagrad 0.1); at most 1000",
        within(0.0, MAX_STEP_SCALE),
    )

    def arguments(self) -> dict[str, Any]:
        """The constructor arguments, without a server-learning-rate of 0 (the default)."""
        arguments = super().arguments()
        if arguments["server_learning_rate"] == 0.0:
            del arguments["server_learning_rate"]
        return arguments


@dataclass(frozen=True)
class FedAvgMSettings(ServerOptimiserSettings):
    """FedAvgM's run-config keys: server-learning-rate (0: Flower's 1) and server-momentum."""

    server_momentum: float = setting(
        FEDAVGM_MOMENTUM,
        "server-momentum",
        "FedAvgM's server momentum beta, in [0, 1) (1 or more grows every step without bound)",
        (lambda value: 0.0 <= value < 1.0, "in [0, 1)"),
    )


class FedAvgM(Method):
    """FedAvgM's server step: v <- beta v + (x - mean), x <- x - eta v.

    Args:
        server_learning_rate: eta (Flower's default 1.0).
        server_momentum: beta (Flower's default 0.0: no momentum, so FedAvg).
    """

    name = "fedavgm"
    settings_class = FedAvgMSettings

    def __init__(
        self,
        *,
        server_learning_rate: float = FEDAVGM_LEARNING_RATE,
        server_momentum: float = FEDAVGM_MOMENTUM,
    ) -> None:
        self.server_learning_rate = check_scalar(server_learning_rate, "server_learning_rate")
        self.server_momentum = check_scalar(server_momentum, "server_momentum", positive=False)
        if not 0.0 <= self.server_momentum < 1.0:
            raise ValueError(f"server_momentum must be in [0, 1), got {server_momentum!r}")
        self.momentum: dict[str, Tensor] | None = None
        """v, None before the first aggregate and without momentum."""

    def step_from_mean(self, context: RoundContext, mean: State) -> ServerStep:
        """x - eta v with v <- beta v + (x - mean)."""
        new_global, self.momentum = fedavgm_update(
            context.global_state, mean, self.momentum, self.server_learning_rate,
            self.server_momentum,
        )  # fmt: skip
        return ServerStep(new_global)

    def state(self) -> dict[str, Any]:
        """The momentum v."""
        return {"momentum": self.momentum}

    def restore(self, state: Mapping[str, Any]) -> None:
        """Take back v."""
        self.momentum = state["momentum"]
