"""FedAvg (McMahan et al. 2017) on the fedfields protocol: the example-weighted mean of states,
or optionally a robust rule (median, trimmed mean, Krum, Multi-Krum, Bulyan)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from logging import WARNING
from typing import Unpack

from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, RecordDict
from flwr.common.logger import log
from flwr.serverapp import Grid
from torch import Tensor

from fedfields.flower.protocol import ARRAYS, CONFIG, NUM_EXAMPLES, state_to_arrays
from fedfields.flower.round import Round, RoundOutcome
from fedfields.flower.strategy import ProtocolStrategy
from fedfields.flower.strategy_options import StrategyOptions
from fedfields.methods.robust import (
    AGGREGATION_RULES,
    DEFAULT_TRIM_FRACTION,
    RobustRule,
    check_trim_fraction,
    robust_aggregate,
)
from fedfields.methods.settings import StrategySettings


class FedAvgOptions(StrategyOptions, total=False):
    """`StrategyOptions` plus FedAvg's aggregation rule, for the strategies built on it."""

    aggregation_rule: str
    trim_fraction: float
    num_malicious: int
    krum_select: int


@dataclass(frozen=True)
class FedAvgSettings(StrategySettings):
    """FedAvg has no run-config key of its own; its mean may become a robust rule."""

    robust_rules = True


class FedAvg(ProtocolStrategy):
    """FedAvg: g <- sum_k n_k g_k / sum_k n_k with n_k the reply's "num-examples".

    Train messages carry ARRAYS and CONFIG ("server-round", "strategy", "local-steps" and the
    user's train config); replies must carry ARRAYS with the global's keys and shapes and
    METRICS with a positive "num-examples". A bad reply (`fedfields.flower.reply_gate`) is
    dropped and counted and the round aggregates the rest; failed replies are dropped, as
    in Flower's FedAvg. With no reply left the global model stays as it was.

    Args:
        fraction_train: fraction of the connected nodes sampled for training (Flower's FedAvg).
        fraction_evaluate: fraction sampled for federated evaluation (0 skips it).
        min_train_nodes: at least this many nodes are sampled for training.
        min_evaluate_nodes: at least this many nodes are sampled for evaluation.
        min_available_nodes: sampling waits until this many nodes are connected.
        local_steps: local optimisation steps per round, sent as "local-steps"; None (default)
            takes "local-steps" from the train config given to `start`, else 1.
        secure_aggregation: SecAgg+ settings; set, the server only learns
            sum_k n_k g_k and sum_k n_k (clients put n_k inside the masked vector).
        node_timeout: seconds a round waits for nodes to connect (None: forever).
        sampling_seed: seeds the strategy's own node-sampling RNG (None: fresh entropy), so
            a run samples the same nodes with or without SecAgg+, whose workflow shuffles
            with Python's global `random`.
        max_num_examples: a reply whose "num-examples" exceeds it is dropped (0/None: no cap).
        max_update_norm: a reply with ||g_k - g|| > max_update_norm * max(||g||, 1) is dropped
            (g: the arrays sent; 0/None: no bound).
        aggregation_rule: "mean" (the weighted mean, folded in as replies arrive), or the
            coordinate-wise "median" or "trimmed-mean", or "krum", "multi-krum" or "bulyan"
            (`fedfields.methods.robust`, as Flower's Krum, MultiKrum and Bulyan); these hold
            every reply of the round in memory, and only Krum's and Multi-Krum's means weigh
            by "num-examples". Not with secure aggregation (the server never sees one
            client's state).
        trim_fraction: share of the replies cut from each end of each coordinate by
            "trimmed-mean", in [0, 0.5).
        num_malicious: f, the malicious clients Krum, Multi-Krum and Bulyan assume; a Bulyan
            round with fewer than 4f + 3 checked replies forms no aggregate.
        krum_select: m, the states Multi-Krum averages (0: n - f).
        differential_privacy: client-level DP (`fedfields.privacy.dp.DPConfig`): each
            update g_k - g clipped to C, uniform weights, N(0, (z C)^2) on the sum (by the
            server, or in shares by the clients under secure aggregation); epsilon is
            accounted per round (docs/PRIVACY.md). "mean" only.
    """

    strategy_name = "fedavg"
    weight_metric = NUM_EXAMPLES
    settings_class = FedAvgSettings
    shared_keys = {
        "aggregation-rule": "aggregation_rule",
        "trim-fraction": "trim_fraction",
        "num-malicious": "num_malicious",
        "krum-select": "krum_select",
    }

    def __init__(
        self,
        *,
        aggregation_rule: str = "mean",
        trim_fraction: float = DEFAULT_TRIM_FRACTION,
        num_malicious: int = 0,
        krum_select: int = 0,
        **options: Unpack[StrategyOptions],
    ) -> None:
        super().__init__(**options)
        if aggregation_rule not in AGGREGATION_RULES:
            raise ValueError(
                f"aggregation_rule must be one of {AGGREGATION_RULES}, got {aggregation_rule!r}"
            )
        if aggregation_rule != "mean" and self.dp is not None:
            raise ValueError(
                f"aggregation_rule {aggregation_rule!r} is not a sum of clipped updates, so "
                "client-level DP (dp-noise-multiplier > 0) does not bound it; use 'mean'"
            )
        if aggregation_rule != "mean" and self.secure_aggregation is not None:
            raise ValueError(
                f"aggregation_rule {aggregation_rule!r} needs each client's state, which secure "
                "aggregation hides; use 'mean' with secure aggregation"
            )
        self.aggregation_rule = aggregation_rule
        self.trim_fraction = check_trim_fraction(trim_fraction)
        self.robust_rule = (
            None
            if aggregation_rule == "mean"
            else RobustRule(aggregation_rule, trim_fraction, num_malicious, krum_select)
        )
        """The robust rule's settings; None for the mean."""

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Sample nodes and send them the global state and the train config."""
        self.begin_round(server_round, arrays, grid)
        content = RecordDict({ARRAYS: arrays, CONFIG: self.train_config(server_round, config)})
        return self.messages(content, MessageType.TRAIN)

    def aggregate(self, train_round: Round, replies: Iterable[Message]) -> RoundOutcome:
        """The round's outcome with `mean` as the new global."""
        return train_round.outcome(self.mean(train_round, replies))

    def mean(self, train_round: Round, replies: Iterable[Message]) -> ArrayRecord | None:
        """sum_k n_k x_k / sum_k n_k over the replies (the round's sum: checked and folded in
        as they arrive, or SecAgg+'s), or the robust rule over all of them; None: no aggregate."""
        if self.robust_rule is not None:
            return self.robust_mean(train_round, replies, self.robust_rule)
        summed = train_round.sum(replies, {ARRAYS: train_round.shapes})
        if summed is None:
            return None
        return state_to_arrays(train_round.in_global_dtypes(summed.mean(ARRAYS)))

    def robust_mean(
        self, train_round: Round, replies: Iterable[Message], rule: RobustRule
    ) -> ArrayRecord | None:
        """The coordinate-wise robust rule over every checked reply of the round's sum (it
        needs all at once); None below the rule's fewest states."""
        states: list[dict[str, Tensor]] = []
        shapes = {ARRAYS: train_round.shapes}
        summed = train_round.sum(replies, shapes, fold=lambda r: states.append(r.states[ARRAYS]))
        if summed is None:
            return None
        if len(states) < rule.least_states():
            log(WARNING, "round %d: %s with num-malicious = %d needs %d checked replies, got %d: "
                "no aggregate", train_round.ledger.server_round, rule.name, rule.num_malicious,
                rule.least_states(), len(states))  # fmt: skip
            return None
        return state_to_arrays(robust_aggregate(rule, states, summed.weights))
