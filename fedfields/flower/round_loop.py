"""Flower 1.41's `Strategy.start` loop, resumable, and the rule that stops a run that cannot train.

Rounds `first_round`..`num_rounds` run as in Flower (train, federated evaluation, the
server's `evaluate_fn`) over a `StreamingGrid`, so replies reach `aggregate_train` as they
arrive and the running sums hold one model, not one per node. `round_end_fn` is where a
resumable run writes its checkpoint. `max_empty_rounds` consecutive rounds without an
aggregate, or a run whose every round was empty, raise one `EmptyRoundsError` naming the drop
counts and the commonest reason. An aggregate that is not finite in the global's dtypes is
refused (the round counts as empty, "non-finite-aggregate" 1). Under DP a plan that cannot
meet dp-target-epsilon is refused before round `first_round`, and the run ends cleanly before
a round whose charge would exceed it (`PrivacyBudgetSpent`, logged).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from logging import ERROR, INFO, WARNING
from typing import Protocol

from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.common.logger import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result
from flwr.serverapp.strategy.strategy_utils import log_strategy_start_info

from fedfields.flower.protocol import NON_FINITE_AGGREGATE, NUM_REPLIES, finite_arrays
from fedfields.flower.reply_gate import ReplyGate
from fedfields.flower.round_ledger import EmptyTally, TrainRound
from fedfields.flower.round_privacy import PrivacyBudgetSpent
from fedfields.flower.streaming import StreamingGrid
from fedfields.privacy.dp import DPConfig
from fedfields.privacy.secure_sum import SecureAggregationConfig

EvaluateFn = Callable[[int, ArrayRecord], MetricRecord | None]


class LoopStrategy(Protocol):
    """What the loop needs of a strategy: Flower's train and evaluate pairs, and the
    settings and counts the loop enforces."""

    fraction_train: float
    max_empty_rounds: int
    rounds_aggregated: int
    secure_aggregation: SecureAggregationConfig | None

    @property
    def dp(self) -> DPConfig | None: ...

    @property
    def gate(self) -> ReplyGate: ...

    def summary(self) -> None: ...

    def check_privacy_plan(self, first_round: int, num_rounds: int) -> float: ...

    def round_state(self, server_round: int) -> TrainRound: ...

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]: ...

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]: ...

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]: ...

    def aggregate_evaluate(
        self, server_round: int, replies: Iterable[Message]
    ) -> MetricRecord | None: ...


class EmptyRoundsError(RuntimeError):
    """Rounds ended without an aggregate: `max_empty_rounds` in a row, or every round of a
    run (its global model never changed). The message names the drop counts and the
    commonest reason in the user's words."""


def run_rounds(
    strategy: LoopStrategy,
    grid: Grid,
    initial_arrays: ArrayRecord,
    num_rounds: int,
    timeout: float,
    train_config: ConfigRecord,
    evaluate_config: ConfigRecord,
    evaluate_fn: EvaluateFn | None,
    first_round: int,
    round_end_fn: Callable[[int, ArrayRecord], None] | None,
) -> Result:
    """`strategy`'s rounds `first_round`..`num_rounds`; `evaluate_fn(0, ...)` only when
    starting at round 1, `round_end_fn(round, arrays)` last in each round."""
    if not 1 <= first_round <= num_rounds + 1:
        raise ValueError(f"first_round must lie in [1, {num_rounds + 1}], got {first_round}")
    if not isinstance(grid, StreamingGrid):
        grid = StreamingGrid(grid)
    name = type(strategy).__name__
    log(INFO, "Starting %s strategy (rounds %d-%d):", name, first_round, num_rounds)
    log_strategy_start_info(num_rounds, initial_arrays, train_config, evaluate_config)
    strategy.summary()
    if strategy.dp is not None:
        planned = strategy.check_privacy_plan(first_round, num_rounds)
        plan = f"q = fraction-train {strategy.fraction_train:g}, no dropouts"
        log(INFO, "differential privacy: the plan (%s) spends epsilon %.4g at delta %g", plan,
            planned, strategy.dp.delta)  # fmt: skip
    result = Result(arrays=initial_arrays)
    if evaluate_fn and first_round == 1:
        if (initial := evaluate_fn(0, initial_arrays)) is not None:
            result.evaluate_metrics_serverapp[0] = initial
    arrays, empty = initial_arrays, EmptyTally()
    for server_round in range(first_round, num_rounds + 1):
        log(INFO, "[ROUND %s/%s]", server_round, num_rounds)
        try:
            messages = strategy.configure_train(server_round, arrays, train_config, grid)
        except PrivacyBudgetSpent as spent:
            log(WARNING, "differential privacy: %s (dp-target-epsilon reached)", spent)
            break
        replies = grid.send_and_receive(messages=messages, timeout=timeout)
        new_arrays, train_metrics = strategy.aggregate_train(server_round, replies)
        refused = new_arrays is not None and not finite_arrays(new_arrays)
        if refused:
            log(ERROR, "round %d: the aggregate holds NaN or infinite values in the global's "
                "dtypes and is refused; the global model stays", server_round)  # fmt: skip
            train_metrics = MetricRecord({**(train_metrics or {}), NON_FINITE_AGGREGATE: 1})
        if new_arrays is not None and not refused:
            arrays = result.arrays = new_arrays
            strategy.rounds_aggregated += 1
            empty = EmptyTally()
        else:
            kept = int((train_metrics or {}).get(NUM_REPLIES, 0))
            empty.add(strategy.round_state(server_round), kept, non_finite=refused)
        if train_metrics is not None:
            result.train_metrics_clientapp[server_round] = train_metrics
        messages = strategy.configure_evaluate(server_round, arrays, evaluate_config, grid)
        replies = grid.send_and_receive(messages=messages, timeout=timeout)
        if (evaluated := strategy.aggregate_evaluate(server_round, replies)) is not None:
            result.evaluate_metrics_clientapp[server_round] = evaluated
        if evaluate_fn and (scored := evaluate_fn(server_round, arrays)) is not None:
            result.evaluate_metrics_serverapp[server_round] = scored
        if round_end_fn is not None:
            round_end_fn(server_round, arrays)
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
    counts = empty.counts(secure=strategy.secure_aggregation is not None)
    return f"{head}; {counts}; commonest reason: {empty_reason(strategy, empty)}"


def empty_reason(strategy: LoopStrategy, empty: EmptyTally) -> str:
    """The commonest cause of the empty rounds, in a user's words."""
    cause = empty.commonest_cause()
    if cause is None:
        return "no node replied with a usable update (check the nodes' logs)"
    if cause == "failed":
        return "the nodes' replies were errors (their ClientApps raised or they left)"
    if cause == NON_FINITE_AGGREGATE:
        return "the aggregates held NaN or infinite values in the global model's dtypes"
    if cause == "secure-sum":
        return f"the secure sums failed ({empty.secure_error or 'see the errors above'})"
    return strategy.gate.drop_reason(cause, type(strategy).__name__)
