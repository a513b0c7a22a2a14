"""FedAdam (Reddi et al. 2021) on the fedfields protocol: an adaptive server step."""

from __future__ import annotations

from typing import Unpack

from fedfields.aggregate.fedopt import adam_moment
from fedfields.flower.fedavg import FedAvgOptions
from fedfields.flower.fedopt import BETA_1, BETA_2, TAU, AdaptiveOptimiser, MomentSettings


class FedAdam(AdaptiveOptimiser):
    """FedAdam: FedAvg's mean (plaintext, SecAgg+ or a robust rule), then with delta = mean - x
    v <- beta_2 v + (1 - beta_2) delta^2 and Adam's bias-corrected eta
    (`fedfields.aggregate.fedopt`); clients train as for FedAvg.

    Args:
        server_learning_rate: eta (Flower's default 1e-1).
        beta_1, beta_2: the moments' decays (Flower's defaults 0.9, 0.99).
        tau: the adaptivity floor (Flower's default 1e-3).
        **options: as for `fedfields.flower.FedAvg`.
    """

    strategy_name = "fedadam"
    settings_class = MomentSettings
    second_moment = staticmethod(adam_moment)
    bias_corrected = True

    def __init__(
        self,
        *,
        server_learning_rate: float = 1e-1,
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
