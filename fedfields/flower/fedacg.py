"""FedACG (Kim et al. 2024) on the fedfields protocol: server momentum sent ahead to clients."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Unpack

import torch
from flwr.app import ArrayRecord, ConfigRecord, Message
from flwr.serverapp import Grid
from torch import Tensor

from fedfields.flower.fedavg import FedAvg, FedAvgOptions
from fedfields.flower.protocol import PROXIMAL_MU, arrays_to_state, state_to_arrays
from fedfields.flower.round import Round, RoundOutcome
from fedfields.methods.fedacg import FEDACG_BETA, FEDACG_LAMBDA, fedacg_lookahead, fedacg_update
from fedfields.methods.settings import NON_NEGATIVE, StrategySettings, setting


@dataclass(frozen=True)
class FedACGSettings(StrategySettings):
    """FedACG's run-config keys (FedMeNF's Table 7 values by default)."""

    robust_rules = True
    momentum: float = setting(
        FEDACG_LAMBDA, "fedacg-lambda", "FedACG's server momentum lambda", NON_NEGATIVE
    )
    beta: float = setting(
        FEDACG_BETA,
        "fedacg-beta",
        "FedACG's proximal weight beta around the lookahead",
        NON_NEGATIVE,
    )


class FedACG(FedAvg):
    """FedACG: clients start from x + lambda m and add beta/2 ||y - (x + lambda m)||^2 to
    their loss (sent as "proximal-mu"); the server averages the replies as FedAvg does (also
    through SecAgg+) and updates x and its momentum m (`fedfields.methods.fedacg`).

    Args:
        momentum: lambda (FedMeNF's Table 7: 0.2).
        beta: the clients' proximal weight (Table 7: 0.1; Reptile 1e-4).
        **options: as for `fedfields.flower.FedAvg` (a robust `aggregation_rule` replaces the
            mean that the momentum step starts from).
    """

    strategy_name = "fedacg"
    settings_class = FedACGSettings

    def __init__(
        self,
        *,
        momentum: float = FEDACG_LAMBDA,
        beta: float = FEDACG_BETA,
        **options: Unpack[FedAvgOptions],
    ) -> None:
        super().__init__(**options)
        for name, value in (("momentum", momentum), ("beta", beta)):
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be non-negative and finite, got {value}")
        self.momentum_weight, self.beta = float(momentum), float(beta)
        self.global_state: dict[str, Tensor] = {}
        self.momentum: dict[str, Tensor] = {}

    def protocol_config(self) -> dict[str, int | float | str]:
        """FedAvg's entries plus "proximal-mu" = beta."""
        return {**super().protocol_config(), PROXIMAL_MU: self.beta}

    def resumable_state(self) -> dict[str, Any]:
        """FedAvg's state plus the server momentum m."""
        return {**super().resumable_state(), "momentum": dict(self.momentum)}

    def restore_state(self, state: Mapping[str, Any]) -> None:
        """Take back FedAvg's state and m."""
        super().restore_state(state)
        self.momentum = dict(state["momentum"])

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Send the lookahead x + lambda m instead of x."""
        self.global_state = arrays_to_state(arrays)
        if self.momentum.keys() != self.global_state.keys():  # first round: m = 0
            self.momentum = {k: torch.zeros_like(v) for k, v in self.global_state.items()}
        lookahead = fedacg_lookahead(self.global_state, self.momentum, self.momentum_weight)
        return super().configure_train(server_round, state_to_arrays(lookahead), config, grid)

    def aggregate(self, train_round: Round, replies: Iterable[Message]) -> RoundOutcome:
        """FedAvg's mean of the replies, then m <- lambda m + (mean - x~), x <- x + m."""
        mean = self.mean(train_round, replies)
        if mean is None:
            return train_round.outcome(None)
        new_global, self.momentum = fedacg_update(
            self.global_state, self.momentum, arrays_to_state(mean), self.momentum_weight
        )
        return train_round.outcome(state_to_arrays(new_global))
