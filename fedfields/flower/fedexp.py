"""FedExP (Jhunjhunwala et al. 2023) on the fedfields protocol: an extrapolating server step."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Unpack

from flwr.app import Message

from fedfields.flower.fedavg import FedAvg
from fedfields.flower.fednova import (
    refuse_differential_privacy,
    refuse_robust_rule,
    refuse_secure_aggregation,
)
from fedfields.flower.protocol import ARRAYS, state_to_arrays
from fedfields.flower.reply_gate import CheckedReply
from fedfields.flower.round import Round, RoundOutcome
from fedfields.flower.strategy_options import StrategyOptions
from fedfields.methods.fedexp import FEDEXP_EPSILON, FedExPSums
from fedfields.methods.settings import POSITIVE, StrategySettings, setting
from fedfields.methods.states import check_scalar

SERVER_STEP = "fedexp-server-step"
"""Train metric: the round's eta_g (1 is FedAvg's step)."""


@dataclass(frozen=True)
class FedExPSettings(StrategySettings):
    """FedExP's run-config key."""

    epsilon: float = setting(
        FEDEXP_EPSILON, "fedexp-epsilon", "FedExP's epsilon in its server step size", POSITIVE
    )


class FedExP(FedAvg):
    """FedExP: x <- x - eta_g Delta with eta_g = max(1, mean ||Delta_i||^2 / 2(||Delta||^2 +
    eps)) (`fedfields.methods.fedexp`); eta_g is reported as "fedexp-server-step".

    Args:
        epsilon: eps of the step size (FedMeNF's Table 7: 0.001).
        **options: as for `fedfields.flower.FedAvg`; not with secure aggregation (the step
            needs each client's ||Delta_i||) nor with a robust `aggregation_rule`.
    """

    strategy_name = "fedexp"
    settings_class = FedExPSettings

    def __init__(
        self, *, epsilon: float = FEDEXP_EPSILON, **options: Unpack[StrategyOptions]
    ) -> None:
        refuse_secure_aggregation("fedexp", options)
        refuse_differential_privacy("fedexp", options)
        super().__init__(**options)
        refuse_robust_rule(self)
        self.epsilon = check_scalar(epsilon, "epsilon")

    def aggregate(self, train_round: Round, replies: Iterable[Message]) -> RoundOutcome:
        """The extrapolated update from the round's sum, each checked reply folded in as it
        arrives; eta_g among the metrics."""
        sums = FedExPSums(train_round.reference, self.epsilon)

        def fold(reply: CheckedReply) -> None:
            sums.add(reply.states[ARRAYS], reply.weight, checked=True)

        if train_round.sum(replies, {ARRAYS: train_round.shapes}, fold=fold) is None:
            return train_round.outcome(None)
        step = {SERVER_STEP: sums.server_step()}
        return train_round.outcome(state_to_arrays(sums.update()), step)
