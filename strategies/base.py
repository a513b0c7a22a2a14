"""Mechanics shared by the fedfields strategies: sampling, protocol messages, reply checks.

Built on Flower 1.41's message-API FedAvg, whose node sampling and federated evaluation the
strategies keep; records and keys follow `fedfields.flower_io`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from logging import INFO, WARNING
from typing import ClassVar, TypedDict

from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.common.logger import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg as FlowerFedAvg
from flwr.serverapp.strategy.strategy_utils import sample_nodes

from fedfields.flower_io import (
    ARRAYS,
    BYTES_DOWN,
    BYTES_UP,
    CONFIG,
    LOCAL_STEPS,
    METRICS,
    NUM_EXAMPLES,
    NUM_FAILURES,
    NUM_REPLIES,
    SERVER_ROUND,
    STRATEGY,
    content_bytes,
    shapes_of,
)


class StrategyOptions(TypedDict, total=False):
    """Constructor arguments every fedfields strategy takes (see `ProtocolStrategy`)."""

    fraction_train: float
    fraction_evaluate: float
    min_train_nodes: int
    min_evaluate_nodes: int
    min_available_nodes: int
    local_steps: int | None


DEFAULT_LOCAL_STEPS = 1
""""local-steps" when neither the strategy nor the user's train config sets it."""


def _check_local_steps(value: object, name: str) -> None:
    """Raise ValueError unless `value` is a positive int (bools excluded)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


@dataclass
class TrainRound:
    """What `configure_train` fixed for one round, read back by `aggregate_train`."""

    server_round: int
    node_ids: list[int]
    num_nodes_total: int
    shapes: dict[str, tuple[int, ...]]
    bytes_down: int = 0
    bytes_up: int = 0
    num_failures: int = 0


class ProtocolStrategy(FlowerFedAvg):
    """Flower FedAvg's sampling and evaluation with the fedfields train protocol.

    Subclasses set `strategy_name`, extend `protocol_config` and implement
    `configure_train`/`aggregate_train` with `begin_round`, `messages`,
    `successful_replies` and `train_metrics`. Constructor arguments (`StrategyOptions`) are
    documented on `strategies.FedAvg`.
    """

    strategy_name: ClassVar[str]

    def __init__(
        self,
        *,
        fraction_train: float = 1.0,
        fraction_evaluate: float = 1.0,
        min_train_nodes: int = 2,
        min_evaluate_nodes: int = 2,
        min_available_nodes: int = 2,
        local_steps: int | None = None,
    ) -> None:
        super().__init__(
            fraction_train=fraction_train,
            fraction_evaluate=fraction_evaluate,
            min_train_nodes=min_train_nodes,
            min_evaluate_nodes=min_evaluate_nodes,
            min_available_nodes=min_available_nodes,
            weighted_by_key=NUM_EXAMPLES,
            arrayrecord_key=ARRAYS,
            configrecord_key=CONFIG,
        )
        if local_steps is not None:
            _check_local_steps(local_steps, "local_steps")
        self.local_steps = local_steps
        self.current_round: TrainRound | None = None

    def summary(self) -> None:
        """Log the protocol settings, then Flower FedAvg's sampling summary."""
        log(INFO, "\t├──> fedfields %s: %s", self.strategy_name, self.protocol_config())
        super().summary()

    def protocol_config(self) -> dict[str, int | float | str]:
        """Train-config entries this strategy owns, besides "server-round"."""
        own: dict[str, int | float | str] = {STRATEGY: self.strategy_name}
        if self.local_steps is not None:
            own[LOCAL_STEPS] = self.local_steps
        return own

    def train_config(self, server_round: int, config: ConfigRecord) -> ConfigRecord:
        """A copy of the user's `config` with the protocol entries; clashing values raise.

        "local-steps" comes from the strategy if set, else from `config`, else 1.
        """
        own = self.protocol_config()
        clashes = [
            f"{key!r}={config[key]!r} (strategy: {value!r})"
            for key, value in own.items()
            if key in config and config[key] != value
        ]
        if clashes:
            raise ValueError(
                "train_config sets entries the strategy owns; set them through the strategy's "
                f"constructor instead: {', '.join(clashes)}"
            )
        merged = {LOCAL_STEPS: DEFAULT_LOCAL_STEPS, **config, **own, SERVER_ROUND: server_round}
        _check_local_steps(merged[LOCAL_STEPS], f"train config {LOCAL_STEPS!r}")
        return ConfigRecord(merged)

    def begin_round(self, server_round: int, arrays: ArrayRecord, grid: Grid) -> TrainRound:
        """Sample the round's nodes as Flower's FedAvg does and remember them with the shapes."""
        node_ids: list[int] = []
        num_nodes_total = len(list(grid.get_node_ids()))
        if self.fraction_train != 0.0:
            sample_size = max(int(num_nodes_total * self.fraction_train), self.min_train_nodes)
            node_ids, all_nodes = sample_nodes(grid, self.min_available_nodes, sample_size)
            num_nodes_total = len(all_nodes)
            log(INFO, "configure_train: sampled %d of %d nodes", len(node_ids), num_nodes_total)
        self.current_round = TrainRound(server_round, node_ids, num_nodes_total, shapes_of(arrays))
        return self.current_round

    @property
    def active_round(self) -> TrainRound:
        """The round `begin_round` opened last."""
        if self.current_round is None:
            raise RuntimeError("no round configured yet: configure_train opens a round")
        return self.current_round

    def round_state(self, server_round: int) -> TrainRound:
        """The `TrainRound` of `server_round`; aggregate_train needs configure_train first."""
        if self.active_round.server_round != server_round:
            raise RuntimeError(
                f"aggregate_train for round {server_round} without configure_train of that round"
            )
        return self.active_round

    def messages(self, content: RecordDict, message_type: str) -> list[Message]:
        """One message per sampled node, all carrying `content`; counts the bytes sent."""
        train_round = self.active_round
        train_round.bytes_down += content_bytes(content) * len(train_round.node_ids)
        return [
            Message(
                content=content,
                dst_node_id=node_id,
                message_type=message_type,
                group_id=str(train_round.server_round),
            )
            for node_id in train_round.node_ids
        ]

    def successful_replies(self, replies: Iterable[Message]) -> list[Message]:
        """Replies of sampled nodes without errors; failed ones are logged and dropped.

        A reply from a node that was not sampled, or a second reply of one node, raises.
        """
        train_round = self.active_round
        successful, seen = [], set()
        for reply in replies:
            node_id = reply.metadata.src_node_id
            if node_id not in train_round.node_ids or node_id in seen:
                raise ValueError(
                    f"unexpected reply from node {node_id} in round {train_round.server_round} "
                    "(not sampled, or a second reply)"
                )
            seen.add(node_id)
            if reply.has_error():
                train_round.num_failures += 1
                log(WARNING, "node %d failed and is left out: %s", node_id, reply.error.reason)
                continue
            train_round.bytes_up += content_bytes(reply.content)
            successful.append(reply)
        return successful

    def train_metrics(
        self, replies: Sequence[Message], weights: Sequence[float] | None = None
    ) -> MetricRecord:
        """Mean of the clients' scalar METRICS (weighted by `weights` if given) plus traffic.

        Adds "num-replies", "num-failures", "bytes-up" and "bytes-down" (ArrayRecord bytes of
        the round, gradient queries included); "num-examples" itself is not averaged.
        """
        weights = [1.0] * len(replies) if weights is None else weights
        totals: dict[str, float] = {}
        norms: dict[str, float] = {}
        for reply, weight in zip(replies, weights, strict=True):
            for key, value in reply.content.metric_records.get(METRICS, {}).items():
                if key == NUM_EXAMPLES or isinstance(value, list):
                    continue
                totals[key] = totals.get(key, 0.0) + weight * value
                norms[key] = norms.get(key, 0.0) + weight
        train_round = self.active_round
        return MetricRecord(
            {
                **{key: total / norms[key] for key, total in totals.items()},
                NUM_REPLIES: len(replies),
                NUM_FAILURES: train_round.num_failures,
                BYTES_UP: train_round.bytes_up,
                BYTES_DOWN: train_round.bytes_down,
            }
        )
