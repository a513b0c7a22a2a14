"""FedProx (Li et al. 2020) on the fedfields protocol: FedAvg plus the client's proximal term."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Unpack

from fedfields.flower.fedavg import FedAvg, FedAvgOptions
from fedfields.flower.protocol import PROXIMAL_MU
from fedfields.methods.settings import NON_NEGATIVE, StrategySettings, setting


@dataclass(frozen=True)
class FedProxSettings(StrategySettings):
    """FedProx's run-config keys."""

    robust_rules = True
    proximal_mu: float = setting(
        0.01, "proximal-mu", "FedProx mu (scene and meta tasks)", NON_NEGATIVE
    )


class FedProx(FedAvg):
    """FedProx: FedAvg's aggregation; clients add mu/2 ||w - g||^2 (Eq. 2) to their loss.

    The server only sends mu as "proximal-mu" in the train config; clients compute the term
    with `fedfields.methods.proximal_term`. mu = 0 is FedAvg.

    Args:
        proximal_mu: weight mu >= 0 of the proximal term (default 0.0, as Flower's FedProx).
        **options: sampling, "local-steps", reply bounds and `aggregation_rule`, as for
            `fedfields.flower.FedAvg`.
    """

    strategy_name = "fedprox"
    settings_class = FedProxSettings

    def __init__(self, *, proximal_mu: float = 0.0, **options: Unpack[FedAvgOptions]) -> None:
        super().__init__(**options)
        if not (math.isfinite(proximal_mu) and proximal_mu >= 0):
            raise ValueError(f"proximal_mu must be non-negative and finite, got {proximal_mu}")
        self.proximal_mu = float(proximal_mu)

    def protocol_config(self) -> dict[str, int | float | str]:
        """FedAvg's entries plus "proximal-mu"."""
        return {**super().protocol_config(), PROXIMAL_MU: self.proximal_mu}
