"""FedExP (Jhunjhunwala et al. 2023) on the fedfields protocol: an extrapolating server step."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Unpack

from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid
from torch import Tensor

from fedfields.aggregate.fedexp import FEDEXP_EPSILON, FedExPSums
from fedfields.aggregate.states import check_scalar
from fedfields.flower.fedavg import FedAvg
from fedfields.flower.fednova import (
    refuse_differential_privacy,
    refuse_robust_rule,
    refuse_secure_aggregation,
)
from fedfields.flower.protocol import ARRAYS, arrays_to_state, state_to_arrays
from fedfields.flower.strategy import StrategyOptions

SERVER_STEP = "fedexp-server-step"
"""Train metric: the round's eta_g (1 is FedAvg's step)."""


class FedExP(FedAvg):
    """FedExP: x <- x - eta_g Delta with eta_g = max(1, mean ||Delta_i||^2 / 2(||Delta||^2 +
    eps)) (`fedfields.aggregate.fedexp`); eta_g is reported as "fedexp-server-step".

    Args:
        epsilon: eps of the step size (FedMeNF's Table 7: 0.001).
        **options: as for `fedfields.flower.FedAvg`; not with secure aggregation (the step
            needs each client's ||Delta_i||) nor with a robust `aggregation_rule`.
    """

    strategy_name = "fedexp"
    config_keys = {"fedexp-epsilon": "epsilon"}

    def __init__(
        self, *, epsilon: float = FEDEXP_EPSILON, **options: Unpack[StrategyOptions]
    ) -> None:
        refuse_secure_aggregation("fedexp", options)
        refuse_differential_privacy("fedexp", options)
        super().__init__(**options)
        refuse_robust_rule(self)
        self.epsilon = check_scalar(epsilon, "epsilon")
        self.global_state: dict[str, Tensor] = {}

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """FedAvg's messages; x is kept for the extrapolated update."""
        self.global_state = arrays_to_state(arrays)
        return super().configure_train(server_round, arrays, config, grid)

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """The extrapolated update, folding each checked reply in as it arrives."""
        train_round = self.round_state(server_round)
        sums, metrics, weights = FedExPSums(self.global_state, self.epsilon), [], []
        checked = self.checked_replies(replies, {ARRAYS: train_round.shapes}, weighted=True)
        for reply in checked:
            sums.add(reply.states[ARRAYS], reply.weight, checked=True)
            metrics.append(reply.metrics)
            weights.append(reply.weight)
        if sums.count == 0:
            return None, self.train_metrics(metrics)
        aggregated = self.train_metrics(metrics, weights)
        aggregated[SERVER_STEP] = sums.server_step()
        self.latest_train_metrics[SERVER_STEP] = aggregated[SERVER_STEP]
        return state_to_arrays(sums.update()), aggregated
