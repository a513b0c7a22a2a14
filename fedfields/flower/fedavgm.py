"""FedAvgM (Hsu et al. 2019) on the fedfields protocol: FedAvg's mean, then server momentum."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Unpack

from torch import Tensor

from fedfields.flower.fedavg import FedAvgOptions
from fedfields.flower.fedopt import ServerOptimiser, ServerOptimiserSettings
from fedfields.methods.fedavgm import FEDAVGM_LEARNING_RATE, FEDAVGM_MOMENTUM, fedavgm_update
from fedfields.methods.settings import NON_NEGATIVE, setting
from fedfields.methods.states import check_scalar


@dataclass(frozen=True)
class FedAvgMSettings(ServerOptimiserSettings):
    """FedAvgM's run-config keys: server-learning-rate (0: Flower's 1) and server-momentum."""

    server_momentum: float = setting(
        FEDAVGM_MOMENTUM, "server-momentum", "FedAvgM's server momentum beta", NON_NEGATIVE
    )


class FedAvgM(ServerOptimiser):
    """FedAvgM: FedAvg's mean (plaintext, SecAgg+ or a robust rule), then
    v <- beta v + (x - mean), x <- x - eta v (`fedfields.methods.fedavgm`); clients train as
    for FedAvg.

    Args:
        server_learning_rate: eta (Flower's default 1.0).
        server_momentum: beta (Flower's default 0.0: no momentum, so FedAvg).
        **options: as for `fedfields.flower.FedAvg`.
    """

    strategy_name = "fedavgm"
    settings_class = FedAvgMSettings

    def __init__(
        self,
        *,
        server_learning_rate: float = FEDAVGM_LEARNING_RATE,
        server_momentum: float = FEDAVGM_MOMENTUM,
        **options: Unpack[FedAvgOptions],
    ) -> None:
        super().__init__(**options)
        self.server_learning_rate = check_scalar(server_learning_rate, "server_learning_rate")
        self.server_momentum = check_scalar(server_momentum, "server_momentum", positive=False)
        self.momentum: dict[str, Tensor] | None = None
        """v, None before the first aggregate and without momentum."""

    def server_step(
        self, server_round: int, global_state: dict[str, Tensor], mean: dict[str, Tensor]
    ) -> dict[str, Tensor]:
        """x - eta v with v <- beta v + (x - mean)."""
        new_global, self.momentum = fedavgm_update(
            global_state, mean, self.momentum, self.server_learning_rate, self.server_momentum
        )
        return new_global

    def resumable_state(self) -> dict[str, Any]:
        """FedAvg's state plus the momentum v."""
        return {**super().resumable_state(), "momentum": self.momentum}

    def restore_state(self, state: Mapping[str, Any]) -> None:
        """Take back FedAvg's state and v."""
        super().restore_state(state)
        self.momentum = state["momentum"]
