"""FedAdam (Reddi et al. 2021) on the fedfields protocol: an adaptive server step."""

from __future__ import annotations

from fedfields.flower.fedopt import AdaptiveOptimiser, MomentSettings
from fedfields.methods.fedopt import adam_moment


class FedAdam(AdaptiveOptimiser):
    """FedAdam: FedAvg's mean (plaintext, SecAgg+ or a robust rule), then with delta = mean - x
    v <- beta_2 v + (1 - beta_2) delta^2 and Adam's bias-corrected eta
    (`fedfields.methods.fedopt`); clients train as for FedAvg.

    Args:
        server_learning_rate: eta (Flower's default 1e-1).
        beta_1, beta_2: the moments' decays (Flower's defaults 0.9, 0.99).
        tau: the adaptivity floor (Flower's default 1e-3).
        **options: as for `fedfields.flower.FedAvg`.
    """

    strategy_name = "fedadam"
    settings_class = MomentSettings
    default_learning_rate = 1e-1
    second_moment = staticmethod(adam_moment)
    bias_corrected = True
