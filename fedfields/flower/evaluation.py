"""Flower FedAvg's federated evaluation among the connected nodes, replies checked first.

`FederatedEvaluation` is the base every fedfields strategy evaluates through: it samples
evaluation nodes with the strategy's seeded `NodeSampler` (so a seed gives one evaluation
too) and leaves out failed replies and replies with non-finite metrics before Flower's
weighted metric mean.
"""

from __future__ import annotations

from collections.abc import Iterable
from logging import WARNING

from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.common.logger import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg as FlowerFedAvg

from fedfields.flower.protocol import ARRAYS, CONFIG, SERVER_ROUND, BadReply, check_metrics
from fedfields.flower.sampling import NodeSampler


class FederatedEvaluation(FlowerFedAvg):
    """Flower FedAvg with evaluation sampled by `sampler` (set by the subclass's constructor)
    and its replies checked."""

    sampler: NodeSampler

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Flower FedAvg's federated evaluation, sampling among the connected nodes only."""
        if self.fraction_evaluate == 0.0:
            return []
        node_ids = self.sampler.sample(
            grid, grid.get_node_ids(), self.fraction_evaluate, self.min_evaluate_nodes
        )
        config[SERVER_ROUND] = server_round
        content = RecordDict({ARRAYS: arrays, CONFIG: config})
        return [
            Message(content, dst_node_id=node_id, message_type=MessageType.EVALUATE)
            for node_id in node_ids
        ]

    def aggregate_evaluate(
        self, server_round: int, replies: Iterable[Message]
    ) -> MetricRecord | None:
        """Flower FedAvg's weighted metric mean over the replies without errors or
        non-finite metrics (`check_metrics`)."""
        kept = []
        for reply in replies:
            if reply.has_error():
                log(WARNING, "evaluation reply failed and is left out: %s", reply.error.reason)
                continue
            try:
                check_metrics(reply)
            except BadReply as bad:
                log(WARNING, "evaluation reply left out (check %r): %s", bad.check, bad)
                continue
            kept.append(reply)
        return super().aggregate_evaluate(server_round, kept) if kept else None
