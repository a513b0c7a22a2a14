"""Server optimisers on FedAvg's mean (FedAvgM, FedAdam, FedYogi, FedAdagrad): the shared glue.

The clients train as for FedAvg and the round forms FedAvg's mean (plaintext, SecAgg+'s
summed mean, or a robust rule); the server then treats mean - x as a pseudo-gradient and takes
its optimiser's step from the global x it sent. The step reads only the mean, so it composes
with secure aggregation and client-level DP. The maths is `fedfields.methods.fedavgm` and
`fedfields.methods.fedopt`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Unpack

from flwr.app import ArrayRecord, ConfigRecord, Message
from flwr.serverapp import Grid
from torch import Tensor

from fedfields.flower.fedavg import FedAvg, FedAvgOptions
from fedfields.flower.protocol import arrays_to_state, state_to_arrays
from fedfields.flower.round import Round, RoundOutcome
from fedfields.methods.fedopt import AdaptiveStep, SecondMoment, adaptive_update
from fedfields.methods.settings import (
    NON_NEGATIVE,
    POSITIVE,
    Rule,
    StrategySettings,
    setting,
)
from fedfields.methods.states import check_scalar

BETA_1, BETA_2, TAU = 0.9, 0.99, 1e-3
"""Flower 1.41's FedAdam and FedYogi defaults (FedAdagrad: beta_1 = 0, tau 1e-3 too)."""
DECAY: Rule = (lambda value: 0.0 <= value < 1.0, "in [0, 1)")
"""A moment's decay: 1 would freeze the moment at 0."""


@dataclass(frozen=True)
class ServerOptimiserSettings(StrategySettings):
    """The server step size every server optimiser reads; 0 takes the strategy's own
    default (Flower's), since the four differ and a run-config key has one default."""

    robust_rules = True
    server_learning_rate: float = setting(
        0.0,
        "server-learning-rate",
        "eta of the server optimiser (0: Flower's default: fedavgm 1, fedadam 0.1, fedyogi "
        "0.01, fedadagrad 0.1)",
        NON_NEGATIVE,
    )

    def arguments(self) -> dict[str, Any]:
        """The constructor arguments, without a server-learning-rate of 0 (the default)."""
        arguments = super().arguments()
        if arguments["server_learning_rate"] == 0.0:
            del arguments["server_learning_rate"]
        return arguments


@dataclass(frozen=True)
class AdaptiveSettings(ServerOptimiserSettings):
    """FedAdagrad's run-config keys: server-learning-rate and tau."""

    tau: float = setting(TAU, "tau", "FedAdam, FedYogi, FedAdagrad: adaptivity tau", POSITIVE)


@dataclass(frozen=True)
class MomentSettings(AdaptiveSettings):
    """FedAdam's and FedYogi's run-config keys: besides eta and tau, beta-1 and beta-2."""

    beta_1: float = setting(BETA_1, "beta-1", "FedAdam, FedYogi: first-moment decay beta_1", DECAY)
    beta_2: float = setting(BETA_2, "beta-2", "FedAdam, FedYogi: second-moment decay beta_2", DECAY)


class ServerOptimiser(FedAvg):
    """FedAvg whose mean becomes the new global through `server_step` from the global sent
    (kept here: under secure aggregation the round holds no copy of it)."""

    def __init__(self, **options: Unpack[FedAvgOptions]) -> None:
        super().__init__(**options)
        self.global_state: dict[str, Tensor] = {}

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """FedAvg's train messages, remembering the global x they carry."""
        self.global_state = arrays_to_state(arrays)
        return super().configure_train(server_round, arrays, config, grid)

    def aggregate(self, train_round: Round, replies: Iterable[Message]) -> RoundOutcome:
        """FedAvg's mean, then the server's step from x."""
        mean = self.mean(train_round, replies)
        if mean is None:
            return train_round.outcome(None)
        server_round = train_round.ledger.server_round
        new_global = self.server_step(server_round, self.global_state, arrays_to_state(mean))
        return train_round.outcome(state_to_arrays(new_global))

    def server_step(
        self, server_round: int, global_state: dict[str, Tensor], mean: dict[str, Tensor]
    ) -> dict[str, Tensor]:
        """The new global from x and the clients' mean; updates the optimiser's state."""
        raise NotImplementedError


class AdaptiveOptimiser(ServerOptimiser):
    """FedOpt (Reddi et al. 2021): x <- x + eta' m / (sqrt(v) + tau) on delta = mean - x;
    subclasses set the second moment's rule (`fedfields.methods.fedopt`).

    Args:
        server_learning_rate: eta (None: the subclass's `default_learning_rate`, Flower's).
        beta_1, beta_2: the moments' decays.
        tau: the adaptivity floor.
        **options: as for `fedfields.flower.FedAvg`.
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
        **options: Unpack[FedAvgOptions],
    ) -> None:
        super().__init__(**options)
        for name, value in (("beta_1", beta_1), ("beta_2", beta_2)):
            if not 0.0 <= value < 1.0:
                raise ValueError(f"{name} must be in [0, 1), got {value!r}")
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

    def server_step(
        self, server_round: int, global_state: dict[str, Tensor], mean: dict[str, Tensor]
    ) -> dict[str, Tensor]:
        """x + eta' m / (sqrt(v) + tau), m and v updated with mean - x."""
        new_global, self.moments = adaptive_update(
            self.rule, server_round, global_state, mean, self.moments
        )
        return new_global

    def resumable_state(self) -> dict[str, Any]:
        """FedAvg's state plus the moments m and v."""
        return {**super().resumable_state(), "moments": self.moments}

    def restore_state(self, state: Mapping[str, Any]) -> None:
        """Take back FedAvg's state and the moments."""
        super().restore_state(state)
        self.moments = state["moments"]
