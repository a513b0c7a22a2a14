"""Flower 1.41's `Strategy.start` loop over rounds as values, resumable, and the rule that stops
a run that cannot train.

`RoundLoop(strategy, num_rounds, first_round)` refuses, when it is built and so before anything
is sent or written, a DP plan that cannot meet dp-target-epsilon. `run` then runs rounds
`first_round`..`num_rounds` as Flower does (train, federated evaluation, the server's
`evaluate_fn`) over a `StreamingGrid`, so replies reach the round's sum as they arrive and the
running sums hold one model, not one per node. Each round ends in the strategy's
`RoundOutcome` (`fedfields.flower.round`), which `round_end_fn` receives last in the round with
the global arrays: where a job writes its report line and a resumable run its checkpoint.
`max_empty_rounds` consecutive rounds without an aggregate, or a run whose every round was
empty, raise one `EmptyRoundsError` naming the drop counts and the commonest reason. Under DP
the run ends cleanly before a round whose charge would exceed the target
(`PrivacyBudgetSpent`, logged)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from logging import INFO, WARNING
from typing import Protocol

from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.common.logger import log
from flwr.proto.node_pb2 import NodeInfo
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result
from flwr.serverapp.strategy.strategy_utils import log_strategy_start_info
from flwr.supercore.run import Run

from fedfields.flower.protocol import NON_FINITE_AGGREGATE, NUM_REPLIES
from fedfields.flower.round import EmptyTally, PrivacyBudgetSpent, Round, RoundOutcome, round_counts
from fedfields.privacy.secagg_plan import SecureAggregationConfig

EvaluateFn = Callable[[int, ArrayRecord], MetricRecord | None]
RoundEndFn = Callable[[RoundOutcome, ArrayRecord], None]
"""Called last in each round with its outcome and the global arrays after it."""


class LoopStrategy(Protocol):
    """What the loop needs of a strategy: Flower's train and evaluate pairs, each round's
    outcome, and the settings the loop enforces."""

    max_empty_rounds: int
    rounds_aggregated: int
    secure_aggregation: SecureAggregationConfig | None

    def summary(self) -> None: ...

    def check_privacy_plan(self, first_round: int, num_rounds: int) -> float: ...

    def open_train_round(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> tuple[Round, list[Message]]: ...

    def finish_round(self, train_round: Round, replies: Iterable[Message]) -> RoundOutcome: ...

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]: ...

    def aggregate_evaluate(
        self, server_round: int, replies: Iterable[Message]
    ) -> MetricRecord | None: ...

    def drop_reason(self, check: str) -> str: ...


class EmptyRoundsError(RuntimeError):
    """Rounds ended without an aggregate: `max_empty_rounds` in a row, or every round of a
    run (its global model never changed). The message names the drop counts and the
    commonest reason in the user's words."""


class RoundLoop:
    """Rounds `first_round`..`num_rounds` of `strategy`; building it checks the DP plan
    (`check_privacy_plan`: ValueError naming dp-target-epsilon beyond it)."""

    def __init__(self, strategy: LoopStrategy, num_rounds: int, first_round: int = 1) -> None:
        if not 1 <= first_round <= num_rounds + 1:
            raise ValueError(f"first_round must lie in [1, {num_rounds + 1}], got {first_round}")
        self.strategy = strategy
        self.num_rounds = num_rounds
        self.first_round = first_round
        strategy.check_privacy_plan(first_round, num_rounds)

    def run(
        self,
        grid: Grid,
        initial_arrays: ArrayRecord,
        timeout: float = 3600,
        train_config: ConfigRecord | None = None,
        evaluate_config: ConfigRecord | None = None,
        evaluate_fn: EvaluateFn | None = None,
        round_end_fn: RoundEndFn | None = None,
    ) -> Result:
        """The rounds from `initial_arrays`; `evaluate_fn(0, ...)` only when starting at round
        1, `round_end_fn(outcome, arrays)` last in each round."""
        strategy, first_round, num_rounds = self.strategy, self.first_round, self.num_rounds
        train_config = ConfigRecord() if train_config is None else train_config
        evaluate_config = ConfigRecord() if evaluate_config is None else evaluate_config
        if not isinstance(grid, StreamingGrid):
            grid = StreamingGrid(grid)
        name = type(strategy).__name__
        log(INFO, "Starting %s strategy (rounds %d-%d):", name, first_round, num_rounds)
        log_strategy_start_info(num_rounds, initial_arrays, train_config, evaluate_config)
        strategy.summary()
        result = Result(arrays=initial_arrays)
        if evaluate_fn and first_round == 1:
            if (initial := evaluate_fn(0, initial_arrays)) is not None:
                result.evaluate_metrics_serverapp[0] = initial
        arrays, empty = initial_arrays, EmptyTally()
        for server_round in range(first_round, num_rounds + 1):
            log(INFO, "[ROUND %s/%s]", server_round, num_rounds)
            try:
                train_round, messages = strategy.open_train_round(
                    server_round, arrays, train_config, grid
                )
            except PrivacyBudgetSpent as spent:
                log(WARNING, "differential privacy: %s (dp-target-epsilon reached)", spent)
                break
            replies = grid.send_and_receive(messages=messages, timeout=timeout)
            outcome = strategy.finish_round(train_round, replies)
            log(INFO, round_counts(outcome.metrics, outcome.arrays is not None))
            if outcome.arrays is not None:
                arrays = result.arrays = outcome.arrays
                empty = EmptyTally()
            else:
                kept = int(outcome.metrics.get(NUM_REPLIES, 0))
                refused = NON_FINITE_AGGREGATE in outcome.metrics
                empty.add(outcome.ledger, kept, non_finite=refused)
            result.train_metrics_clientapp[server_round] = MetricRecord(outcome.metrics)
            messages = strategy.configure_evaluate(server_round, arrays, evaluate_config, grid)
            replies = grid.send_and_receive(messages=messages, timeout=timeout)
            if (evaluated := strategy.aggregate_evaluate(server_round, replies)) is not None:
                result.evaluate_metrics_clientapp[server_round] = evaluated
            if evaluate_fn and (scored := evaluate_fn(server_round, arrays)) is not None:
                result.evaluate_metrics_serverapp[server_round] = scored
            if round_end_fn is not None:
                round_end_fn(outcome, arrays)
            if strategy.max_empty_rounds and len(empty.rounds) >= strategy.max_empty_rounds:
                raise EmptyRoundsError(empty_rounds_message(strategy, empty, consecutive=True))
        if empty.rounds and strategy.rounds_aggregated == 0:
            raise EmptyRoundsError(empty_rounds_message(strategy, empty, consecutive=False))
        return result


def empty_rounds_message(strategy: LoopStrategy, empty: EmptyTally, *, consecutive: bool) -> str:
    """One line: which rounds formed no aggregate, the drop counts, the commonest reason."""
    first, last = empty.rounds[0], empty.rounds[-1]
    span = f"{first}-{last}" if last != first else f"{first}"
    if consecutive:
        head = (
            f"{len(empty.rounds)} consecutive rounds ({span}) formed no aggregate "
            f"(max-empty-rounds = {strategy.max_empty_rounds}): the run stops"
        )
    else:
        head = (
            f"no round of this run formed an aggregate (rounds {span}): the global model "
            "never changed, so the run did not complete"
        )
    secure = strategy.secure_aggregation is not None
    counts = empty.counts(secure)
    return f"{head}; {counts}; commonest reason: {empty_reason(strategy, empty, secure)}"


def empty_reason(strategy: LoopStrategy, empty: EmptyTally, secure: bool) -> str:
    """The commonest cause of the empty rounds, in a user's words."""
    cause = empty.commonest_cause()
    if cause is None:
        return "no node replied with a usable update (check the nodes' logs)"
    if cause == "failed":
        return "the nodes' replies were errors (their ClientApps raised or they left)"
    if cause == NON_FINITE_AGGREGATE:
        return "the aggregates held NaN or infinite values in the global model's dtypes"
    if cause == "failed-sum":
        sums = "secure sums" if secure else "sums"
        return f"the {sums} failed ({empty.sum_error or 'see the errors above'})"
    return strategy.drop_reason(cause)


# A Grid that forwards every call to a wrapped Grid: the base of grids that change one call.
#
# Flower 1.41's `Grid` is abstract in seven members; a wrapper that streams replies or shows
# them to an observer overrides one or two and inherits the rest from here.


class ForwardingGrid(Grid):
    """`grid` itself, call for call; subclasses override what they change."""

    def __init__(self, grid: Grid) -> None:
        self.grid = grid

    def set_run(self, run: Run) -> None:
        """Set the run of the wrapped grid."""
        self.grid.set_run(run)

    @property
    def run(self) -> Run:
        """The wrapped grid's run."""
        return self.grid.run

    def create_message(
        self,
        content: RecordDict,
        message_type: str,
        dst_node_id: int,
        group_id: str,
        ttl: float | None = None,
    ) -> Message:
        """A message built by the wrapped grid."""
        return self.grid.create_message(content, message_type, dst_node_id, group_id, ttl)

    def get_node_ids(self) -> Iterable[int]:
        """The wrapped grid's connected nodes."""
        return self.grid.get_node_ids()

    def get_nodes(self) -> Iterable[NodeInfo]:
        """The wrapped grid's connected nodes with their details."""
        return self.grid.get_nodes()

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        """Push through the wrapped grid."""
        return self.grid.push_messages(messages)

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        """Pull through the wrapped grid."""
        return self.grid.pull_messages(message_ids)

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> Iterable[Message]:
        """Send and receive through the wrapped grid."""
        return self.grid.send_and_receive(messages, timeout=timeout)


# A Grid whose replies arrive as a stream, so a strategy can aggregate them one at a time.
#
# Flower 1.41's `send_and_receive` returns a list only once every reply is in, so the server
# holds all sampled clients' models at once. `StreamingGrid` pushes the same messages and
# yields each reply in the order its message was pushed, as soon as it and the replies before
# it are in; a strategy that folds each reply into a running sum
# (`fedfields.methods.RunningSum`) and drops it keeps O(model) memory while replies come in
# order, and holds only those that overtake a slower one. Summing in push order (user-key
# order, `fedfields.flower.user_keys`) makes a float sum independent of which client finished
# first. Everything else is forwarded to the wrapped grid.


DEFAULT_PULL_INTERVAL = 0.1
"""Seconds between pulls when the wrapped grid names none (Flower's in-memory grid: 0.1)."""


class StreamingGrid(ForwardingGrid):
    """`grid` with a lazy `send_and_receive`: messages are pushed at once, replies yielded
    in the order their messages were pushed, each as soon as it and those before it are in,
    until all arrived or `timeout` passed (Flower's semantics)."""

    def __init__(self, grid: Grid) -> None:
        super().__init__(grid)
        self.pull_interval = float(getattr(grid, "pull_interval", DEFAULT_PULL_INTERVAL))

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> Iterator[Message]:
        """Push `messages` now; the returned iterator yields each reply once pulled."""
        message_ids = list(self.grid.push_messages(messages))
        deadline = None if timeout is None else time.time() + timeout
        return self._replies(message_ids, deadline)

    def _replies(self, message_ids: list[str], deadline: float | None) -> Iterator[Message]:
        """Pull until every message has its reply or the deadline passed, yielding replies in
        `message_ids`' order: a reply that comes early waits for those before it, so a sum
        folded over them never depends on arrival order (the strategies push in user-key
        order). At the deadline the replies still waiting are yielded in that order."""
        waiting = set(message_ids)
        early: dict[str, Message] = {}
        position = 0
        while waiting and (deadline is None or time.time() < deadline):
            pending = [message_id for message_id in message_ids if message_id in waiting]
            for reply in self.grid.pull_messages(pending):
                waiting.discard(reply.metadata.reply_to_message_id)
                early[reply.metadata.reply_to_message_id] = reply
            while position < len(message_ids) and message_ids[position] in early:
                yield early.pop(message_ids[position])  # keeps no reference once handed over
                position += 1
            if waiting:
                time.sleep(self.pull_interval)
        for message_id in message_ids[position:]:
            if message_id in early:
                yield early.pop(message_id)
