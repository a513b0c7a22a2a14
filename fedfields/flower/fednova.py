"""FedNova (Wang et al. 2020) on the fedfields protocol: normalised averaging by local steps."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Unpack

from flwr.app import ConfigRecord, Message

from fedfields.flower.fedavg import FedAvg
from fedfields.flower.protocol import ARRAYS, LOCAL_STEPS, TRAIN_STEPS, state_to_arrays
from fedfields.flower.round import Round, RoundOutcome
from fedfields.flower.strategy_options import StrategyOptions
from fedfields.methods.fednova import FedNovaSums
from fedfields.methods.settings import StrategySettings


def refuse_secure_aggregation(name: str, options: StrategyOptions) -> None:
    """ValueError: this rule needs each client's own update, which SecAgg+ hides."""
    if options.get("secure_aggregation") is not None:
        raise ValueError(
            f"{name} needs each client's update (and its norm or step count), which secure "
            "aggregation hides; use fedavg, fedprox, scaffold, fedacg or decentnerf with it"
        )


def refuse_differential_privacy(name: str, options: StrategyOptions) -> None:
    """ValueError: this rule's server step reads per-client values (tau_i, ||Delta_i||^2)
    that a clipped, noised sum does not bound (docs/PRIVACY.md)."""
    if options.get("differential_privacy") is not None:
        raise ValueError(
            f"{name} does not support client-level DP (dp-noise-multiplier > 0): its server step "
            "reads each client's own values, whose sensitivity a clipped sum does not bound; "
            "use fedavg, fedprox, fedacg, fedmenf, scaffold or decentnerf with DP"
        )


def refuse_robust_rule(strategy: FedAvg) -> None:
    """ValueError: this rule has its own server step, built on the weighted mean only."""
    if strategy.aggregation_rule != "mean":
        raise ValueError(
            f"{strategy.strategy_name} aggregates with its own server step; aggregation_rule "
            f"{strategy.aggregation_rule!r} is for fedavg, fedprox, fedmenf and fedacg"
        )


class FedNova(FedAvg):
    """FedNova: x <- x - tau_eff sum_i p_i (x - y_i) / tau_i (`fedfields.methods.fednova`).

    Messages as FedAvg's; replies also carry "train-steps" (tau_i, the local steps the client
    took). Clients that trained longer do not pull x further; equal steps give FedAvg.
    Not available with secure aggregation (the server needs each client's tau_i and y_i),
    nor with a robust `aggregation_rule`. A reply whose "train-steps" lies outside
    [1, "local-steps" sent] (tau_i scales the step, so an inflated count would move the
    global arbitrarily far; docs/BENCHMARKS.md), or failing FedAvg's checks, is dropped.
    """

    strategy_name = "fednova"
    settings_class = StrategySettings  # no key of its own, no robust rule

    def __init__(self, **options: Unpack[StrategyOptions]) -> None:
        refuse_secure_aggregation("fednova", options)
        refuse_differential_privacy("fednova", options)
        super().__init__(**options)
        refuse_robust_rule(self)
        self.sent_steps = 1
        """The round's "local-steps": the most "train-steps" a reply may report."""

    def train_config(self, server_round: int, config: ConfigRecord) -> ConfigRecord:
        """FedAvg's train config; its "local-steps" bounds the replies' "train-steps"."""
        train_config = super().train_config(server_round, config)
        self.sent_steps = int(train_config[LOCAL_STEPS])
        return train_config

    def aggregate(self, train_round: Round, replies: Iterable[Message]) -> RoundOutcome:
        """The normalised update from the round's sum, each checked reply folded in as it
        arrives with its tau_i."""
        sums = FedNovaSums(train_round.reference)
        summed = train_round.sum(
            replies,
            {ARRAYS: train_round.shapes},
            scalars={TRAIN_STEPS: (1.0, float(self.sent_steps))},
            fold=lambda reply: sums.add(
                reply.states[ARRAYS], reply.weight, reply.scalars[TRAIN_STEPS], checked=True
            ),
        )
        return train_round.outcome(None if summed is None else state_to_arrays(sums.update()))
