"""FedAvg (McMahan et al. 2017) on the fedfields protocol: the example-weighted mean of states."""

from __future__ import annotations

from collections.abc import Iterable

from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid

from fedfields.aggregate import RunningSum
from fedfields.flower.protocol import (
    ARRAYS,
    CONFIG,
    NUM_EXAMPLES,
    reply_metric,
    reply_state,
    state_to_arrays,
)
from fedfields.flower.strategy import ProtocolStrategy, reply_metrics


class FedAvg(ProtocolStrategy):
    """FedAvg: g <- sum_k n_k g_k / sum_k n_k with n_k the reply's "num-examples".

    Train messages carry ARRAYS and CONFIG ("server-round", "strategy", "local-steps" and the
    user's train config); replies must carry ARRAYS with the global's keys and shapes and
    METRICS with a positive "num-examples". A bad reply raises one ValueError and nothing
    is aggregated; failed replies are dropped, as in Flower's FedAvg.

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
    """

    strategy_name = "fedavg"
    secure_weight = NUM_EXAMPLES

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
        """Weighted mean of the replies' states, folded in as they arrive (`RunningSum`: the
        same as `fedfields.aggregate.weighted_mean`, in O(model) memory)."""
        train_round = self.round_state(server_round)
        successful = self.successful_replies(replies)
        if self.secure_aggregation is not None:
            held = list(successful)  # metrics only: the payloads are held for SecAgg+
            metrics = [reply_metrics(reply) for reply in held]
            if not held:
                return None, self.train_metrics(metrics)
            result = self.secure_sums(held, {ARRAYS: train_round.shapes})
            if result is None:
                return None, self.train_metrics([])
            mean = {key: value / result.total_weight for key, value in result.sums[ARRAYS].items()}
            return state_to_arrays(self.like_global(mean)), self.train_metrics(metrics)
        total, metrics, weights = RunningSum(), [], []
        for reply in successful:  # each reply is folded in and dropped as it arrives
            weight = reply_metric(reply, NUM_EXAMPLES, positive=True)
            total.add(reply_state(reply, ARRAYS, train_round.shapes), weight, checked=True)
            metrics.append(reply_metrics(reply))
            weights.append(weight)
        if total.count == 0:
            return None, self.train_metrics(metrics)
        return state_to_arrays(total.mean()), self.train_metrics(metrics, weights)
