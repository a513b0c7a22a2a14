"""FedYogi (Reddi et al. 2021) on the fedfields protocol: an adaptive server step."""

from __future__ import annotations

from typing import Unpack

from fedfields.aggregate.fedopt import yogi_moment
from fedfields.flower.fedavg import FedAvgOptions
from fedfields.flower.fedopt import BETA_1, BETA_2, TAU, AdaptiveOptimiser, MomentSettings


class FedYogi(AdaptiveOptimiser):
    """FedYogi: FedAvg's mean (plaintext, SecAgg+ or a robust rule), then with delta = mean - x
    v <- v - (1 - beta_2) delta^2 sign(v - delta^2) (`fedfields.aggregate.fedopt`); clients
    train as for FedAvg.

    Args:
        server_learning_rate: eta (Flower's default 1e-2).
        beta_1, beta_2: the moments' decays (Flower's defaults 0.9, 0.99).
        tau: the adaptivity floor (Flower's default 1e-3).
        **options: as for `fedfields.flower.FedAvg`.
    """

    strategy_name = "fedyogi"
    settings_class = MomentSettings
    second_moment = staticmethod(yogi_moment)

    def __init__(
        self,
        *,
        server_learning_rate: float = 1e-2,
        beta_1: float = BETA_1,
        beta_2: float = BETA_2,
        tau: float = TAU,
        **options: Unpack[FedAvgOptions],
    ) -> None:
        super().__init__(
            server_learning_rate=server_learning_rate,
            beta_1=beta_1,
            beta_2=beta_2,
            tau=tau,
            **options,
        )
