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
from fedfields.flower.fednova import refuse_secure_aggregation
from fedfields.flower.protocol import (
    ARRAYS,
    NUM_EXAMPLES,
    arrays_to_state,
    reply_metric,
    reply_state,
    state_to_arrays,
)
from fedfields.flower.strategy import StrategyOptions, reply_metrics

SERVER_STEP = "fedexp-server-step"
"""Train metric: the round's eta_g (1 is FedAvg's step)."""


class FedExP(FedAvg):
    """FedExP: x <- x - eta_g Delta with eta_g = max(1, mean ||Delta_i||^2 / 2(||Delta||^2 +
    eps)) (`fedfields.aggregate.fedexp`); eta_g is reported as "fedexp-server-step".

    Args:
        epsilon: eps of the step size (FedMeNF's Table 7: 0.001).
        **options: as for `fedfields.flower.FedAvg`; not with secure aggregation (the step
            needs each client's ||Delta_i||).
    """

    strategy_name = "fedexp"
    config_keys = {"fedexp-epsilon": "epsilon"}

    def __init__(
        self, *, epsilon: float = FEDEXP_EPSILON, **options: Unpack[StrategyOptions]
    ) -> None:
        refuse_secure_aggregation("fedexp", options)
        super().__init__(**options)
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
        """The extrapolated update, folding each reply in as it arrives."""
        train_round = self.round_state(server_round)
        sums, metrics, weights = FedExPSums(self.global_state, self.epsilon), [], []
        for reply in self.successful_replies(replies):
            weight = reply_metric(reply, NUM_EXAMPLES, positive=True)
            sums.add(reply_state(reply, ARRAYS, train_round.shapes), weight, checked=True)
            metrics.append(reply_metrics(reply))
            weights.append(weight)
        if sums.count == 0:
            return None, self.train_metrics(metrics)
        aggregated = self.train_metrics(metrics, weights)
        aggregated[SERVER_STEP] = sums.server_step()
        self.latest_train_metrics[SERVER_STEP] = aggregated[SERVER_STEP]
        return state_to_arrays(sums.update()), aggregated
