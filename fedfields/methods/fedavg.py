"""FedAvg (McMahan et al. 2017, Algorithm 1): the new global is the example-weighted mean of
the clients' states,

    g <- sum_k n_k g_k / sum_k n_k,

n_k the reply's "num-examples". The round forms the mean (plaintext, SecAgg+'s sum, or under
client-level DP the noised mean of clipped updates); a run-config `aggregation-rule` may
replace it by a robust rule (`fedfields.methods.robust`). Clients train with the one local
loop and no hook of their own.
"""

from __future__ import annotations

from dataclasses import dataclass

from fedfields.methods.base import Method
from fedfields.methods.settings import StrategySettings


@dataclass(frozen=True)
class FedAvgSettings(StrategySettings):
    """FedAvg has no run-config key of its own; its mean may become a robust rule."""

    robust_rules = True


class FedAvg(Method):
    """FedAvg's server step: the mean as it is (`Method.step_from_mean`)."""

    name = "fedavg"
    settings_class = FedAvgSettings
