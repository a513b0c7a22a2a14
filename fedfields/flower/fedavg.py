"""FedAvg (McMahan et al. 2017) on the fedfields protocol: the example-weighted mean of states,
or optionally a coordinate-wise robust rule (median, trimmed mean)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Unpack

from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid
from torch import Tensor

from fedfields.aggregate import RunningSum
from fedfields.aggregate.robust import (
    AGGREGATION_RULES,
    DEFAULT_TRIM_FRACTION,
    check_trim_fraction,
    robust_aggregate,
)
from fedfields.flower.protocol import ARRAYS, CONFIG, NUM_EXAMPLES, state_to_arrays
from fedfields.flower.strategy import ProtocolStrategy, StrategyOptions, reply_metrics


class FedAvgOptions(StrategyOptions, total=False):
    """`StrategyOptions` plus FedAvg's aggregation rule, for the strategies built on it."""

    aggregation_rule: str
    trim_fraction: float


class FedAvg(ProtocolStrategy):
    """FedAvg: g <- sum_k n_k g_k / sum_k n_k with n_k the reply's "num-examples".

    Train messages carry ARRAYS and CONFIG ("server-round", "strategy", "local-steps" and the
    user's train config); replies must carry ARRAYS with the global's keys and shapes and
    METRICS with a positive "num-examples". A bad reply (`ProtocolStrategy.checked_replies`)
    is dropped and counted and the round aggregates the rest; failed replies are dropped, as
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
            coordinate-wise "median" or "trimmed-mean" (`fedfields.aggregate.robust`), which
            ignore "num-examples" and hold every reply of the round in memory. Not with
            secure aggregation (the server never sees one client's state).
        trim_fraction: share of the replies cut from each end of each coordinate by
            "trimmed-mean", in [0, 0.5).
    """

    strategy_name = "fedavg"
    secure_weight = NUM_EXAMPLES
    config_keys = {"aggregation-rule": "aggregation_rule", "trim-fraction": "trim_fraction"}

    def __init__(
        self,
        *,
        aggregation_rule: str = "mean",
        trim_fraction: float = DEFAULT_TRIM_FRACTION,
        **options: Unpack[StrategyOptions],
    ) -> None:
        super().__init__(**options)
        if aggregation_rule not in AGGREGATION_RULES:
            raise ValueError(
                f"aggregation_rule must be one of {AGGREGATION_RULES}, got {aggregation_rule!r}"
            )
        if aggregation_rule != "mean" and self.secure_aggregation is not None:
            raise ValueError(
                f"aggregation_rule {aggregation_rule!r} needs each client's state, which secure "
                "aggregation hides; use 'mean' with secure aggregation"
            )
        self.aggregation_rule = aggregation_rule
        self.trim_fraction = check_trim_fraction(trim_fraction)

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Sample nodes and send them the global state and the train config."""
        self.begin_round(server_round, arrays, grid)
        content = RecordDict({ARRAYS: arrays, CONFIG: self.train_config(server_round, config)})
        return self.messages(content, MessageType.TRAIN)

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Weighted mean of the checked replies' states, folded in as they arrive
        (`RunningSum`: the same as `fedfields.aggregate.weighted_mean`, in O(model) memory),
        or the robust rule over all of them."""
        train_round = self.round_state(server_round)
        if self.secure_aggregation is not None:
            held = list(self.successful_replies(replies))  # metrics only: payloads are held
            if not held:
                return None, self.train_metrics([])
            result = self.secure_sums(held, {ARRAYS: train_round.shapes})
            if result is None:
                return None, self.train_metrics([])
            metrics = [reply_metrics(r) for r in held if r.metadata.src_node_id in result.node_ids]
            mean = {key: value / result.total_weight for key, value in result.sums[ARRAYS].items()}
            return state_to_arrays(self.like_global(mean)), self.train_metrics(metrics)
        total, kept, metrics, weights = RunningSum(), [], [], []
        checked = self.checked_replies(replies, {ARRAYS: train_round.shapes}, weighted=True)
        for reply in checked:  # a reply is checked in full before it touches the sum
            if self.aggregation_rule == "mean":  # folded in and dropped as it arrives
                total.add(reply.states[ARRAYS], reply.weight, checked=True)
            else:  # the robust rules need every state at once
                kept.append(reply.states[ARRAYS])
            metrics.append(reply.metrics)
            weights.append(reply.weight)
        if not metrics:
            return None, self.train_metrics(metrics)
        aggregate: dict[str, Tensor] = (
            total.mean()
            if self.aggregation_rule == "mean"
            else robust_aggregate(self.aggregation_rule, kept, self.trim_fraction)
        )
        return state_to_arrays(aggregate), self.train_metrics(metrics, weights)
