"""FedAdagrad (Reddi et al. 2021) on the fedfields protocol: an adaptive server step."""

from __future__ import annotations

from typing import Unpack

from fedfields.flower.fedavg import FedAvgOptions
from fedfields.flower.fedopt import TAU, AdaptiveOptimiser, AdaptiveSettings
from fedfields.methods.fedopt import adagrad_moment


class FedAdagrad(AdaptiveOptimiser):
    """FedAdagrad: FedAvg's mean (plaintext, SecAgg+ or a robust rule), then with
    delta = mean - x v <- v + delta^2 and no first-moment decay (beta_1 = 0)
    (`fedfields.methods.fedopt`); clients train as for FedAvg.

    Args:
        server_learning_rate: eta (Flower's default 1e-1).
        tau: the adaptivity floor (Flower's default 1e-3).
        **options: as for `fedfields.flower.FedAvg`.
    """

    strategy_name = "fedadagrad"
    settings_class = AdaptiveSettings
    second_moment = staticmethod(adagrad_moment)
    default_learning_rate = 1e-1

    def __init__(
        self,
        *,
        server_learning_rate: float | None = None,
        tau: float = TAU,
        **options: Unpack[FedAvgOptions],
    ) -> None:
        super().__init__(server_learning_rate=server_learning_rate, beta_1=0.0, tau=tau, **options)
