"""Mechanics shared by the fedfields strategies: sampling, protocol messages, reply checks.

Built on Flower 1.41's message-API FedAvg, whose node sampling and federated evaluation the
strategies keep; records and keys follow `fedfields.flower.protocol`.

Reply checks live here once (`ProtocolStrategy.checked_replies`): a plaintext reply with
NaN/Inf, wrong shapes, missing or extra keys, integer or bool arrays where the global's are
float (float16/32/64 arrays are cast to the global's dtype: `protocol.checked_dtype`), a
NaN/Inf metric, a non-positive or absurd "num-examples" (above `max_num_examples`) or an
update ||g_k - g|| above `max_update_norm` * max(||g||, 1) is dropped before it touches any
sum, logged at WARNING with node and check, and counted in the round's "num-failures",
"num-dropped" and "dropped-<check>" metrics; the round aggregates the rest, and with nothing
left the global model stays as it was. Under secure aggregation a reply that holds nothing
back is dropped ("held"), and a halted or unusable secure sum (a summed weight that is not
positive, a non-finite sum) is counted in "secure-sum-failures" and skips the round.
`max_empty_rounds` consecutive rounds without an aggregate, or a run whose every round was
empty, end `start` with one `EmptyRoundsError` naming the drop counts and the commonest
reason.
"""

from __future__ import annotations

import math
import random
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from logging import ERROR, INFO, WARNING
from typing import Any, ClassVar, Self, TypedDict, Unpack

import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.common.logger import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg as FlowerFedAvg
from flwr.serverapp.strategy import Result
from flwr.serverapp.strategy.strategy_utils import log_strategy_start_info
from torch import Tensor

from fedfields.aggregate import FEDAVG_COST, CostModel
from fedfields.aggregate.robust import update_norm
from fedfields.flower.protocol import (
    ARRAYS,
    BYTES_DOWN,
    BYTES_UP,
    CONFIG,
    DROPPED_PREFIX,
    HELD,
    HELD_METRICS,
    HELD_RECORDS,
    LOCAL_STEPS,
    METRICS,
    NUM_DROPPED,
    NUM_EXAMPLES,
    NUM_FAILURES,
    NUM_REPLIES,
    SECURE_AGGREGATION,
    SECURE_DELTA,
    SECURE_WEIGHT,
    SERVER_ROUND,
    STRATEGY,
    TRAIN_STEPS,
    WEIGHT_KEY,
    BadReply,
    Shapes,
    arrays_to_state,
    check_metrics,
    content_bytes,
    reply_metric,
    reply_state,
    shapes_of,
)
from fedfields.flower.secure_sum import SecureSum, SecureSumResult
from fedfields.flower.streaming import StreamingGrid
from fedfields.privacy.secure_sum import (
    SecureAggregationConfig,
    SecureAggregationError,
    payload_layout,
)

SECURE_SUMS = "secure-sums"
"""Train metric: secure sums completed this round (present when secure aggregation is on)."""
SECURE_FAILURES = "secure-sum-failures"
"""Train metric: secure sums that halted this round (the round's aggregate is then skipped)."""


class StrategyOptions(TypedDict, total=False):
    """Constructor arguments every fedfields strategy takes (see `ProtocolStrategy`)."""

    fraction_train: float
    fraction_evaluate: float
    min_train_nodes: int
    min_evaluate_nodes: int
    min_available_nodes: int
    local_steps: int | None
    secure_aggregation: SecureAggregationConfig | None
    node_timeout: float | None
    max_num_examples: float | None
    max_update_norm: float | None
    max_empty_rounds: int
    sampling_seed: int | None


DEFAULT_MAX_NUM_EXAMPLES = 1e9
"""Cap on a reply's "num-examples": a thousand megapixel photos, far above any client here,
yet low enough that one client cannot outweigh the others a billion to one."""
DEFAULT_MAX_UPDATE_NORM = 1e3
"""Cap on ||g_k - g|| / max(||g||, 1): an honest round moves a model by far less than 1000x
its own norm; a scaled or exploded update does not."""


def optional_cap(value: float | None, name: str) -> float | None:
    """A positive finite cap, or None for 0/None (no cap); ValueError otherwise."""
    if value is None or (not isinstance(value, bool) and value == 0):
        return None
    if isinstance(value, bool) or not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be > 0 and finite (0 or None: no cap), got {value!r}")
    return float(value)


DEFAULT_MAX_EMPTY_ROUNDS = 3
"""Consecutive rounds without an aggregate that end a run: one empty round is a bad moment,
three in a row a federation that cannot train as configured."""


class InsufficientNodesError(RuntimeError):
    """Too few nodes stayed connected to run a round."""


class EmptyRoundsError(RuntimeError):
    """Rounds ended without an aggregate: `max_empty_rounds` in a row, or every round of a
    run (its global model never changed). The message names the drop counts and the
    commonest reason in the user's words."""


NODE_POLL_SECONDS = 1.0


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
    dtypes: dict[str, str]
    grid: Grid
    bytes_down: int = 0
    bytes_up: int = 0
    num_failures: int = 0
    dropped: dict[str, int] = field(default_factory=dict)
    """Replies dropped by a check, per check ("non-finite", "shape", ...)."""
    secure_sums: int = 0
    secure_failures: int = 0
    secure_error: str = ""
    """Why the round's last secure sum failed (value-free), for `EmptyRoundsError`."""
    secure_metrics: dict[str, float] | None = None
    reference: dict[str, Tensor] = field(default_factory=dict)
    """The arrays sent (read-only views), for the update-norm check; {} when it is off."""
    reference_norm: float = 0.0


@dataclass
class EmptyTally:
    """What went wrong in consecutive rounds that formed no aggregate."""

    rounds: list[int] = field(default_factory=list)
    sampled: int = 0
    kept: int = 0
    failures: int = 0
    dropped: Counter[str] = field(default_factory=Counter)
    secure_failures: int = 0
    secure_error: str = ""

    def add(self, train_round: TrainRound, kept: int) -> None:
        """Count one empty round; `kept` replies passed the checks (yet nothing came of it)."""
        self.rounds.append(train_round.server_round)
        self.sampled += len(train_round.node_ids)
        self.kept += kept
        self.dropped.update(train_round.dropped)
        self.failures += train_round.num_failures - sum(train_round.dropped.values())
        self.secure_failures += train_round.secure_failures
        self.secure_error = train_round.secure_error or self.secure_error


@dataclass
class CheckedReply:
    """A plaintext reply that passed every check: its records as read-only tensors (views of
    the message's bytes; never write into them), its weight, the scalars asked for and a
    copy of its METRICS. It holds no reference to the message itself."""

    node_id: int
    states: dict[str, dict[str, Tensor]]
    weight: float = 1.0
    scalars: dict[str, float] = field(default_factory=dict)
    metrics: dict[str, Any] = field(default_factory=dict)


class ProtocolStrategy(FlowerFedAvg):
    """Flower FedAvg's sampling and evaluation with the fedfields train protocol.

    Subclasses set `strategy_name`, extend `protocol_config` and implement
    `configure_train`/`aggregate_train` with `begin_round`, `messages`,
    `successful_replies` and `train_metrics`. Constructor arguments (`StrategyOptions`) are
    documented on `fedfields.flower.FedAvg`. With `secure_aggregation` set, replies are held back
    by the clients and aggregated through `secure_sums` (Flower SecAgg+) only; otherwise
    `checked_replies` checks each reply and drops a bad one (see the module docstring).

    Nodes come and go: a round samples among the nodes connected now (the first round waits
    up to `node_timeout` for `min_available_nodes`, every round for `min_train_nodes`, and
    raises `InsufficientNodesError` only when fewer stay connected); an error reply (a node
    that died, a ClientApp that raised) is logged and counted, never raised.
    """

    strategy_name: ClassVar[str]
    secure_weight: ClassVar[str] = ""
    """Metric the clients weight their held payload by under secure aggregation ("": 1)."""
    secure_delta: ClassVar[tuple[str, ...]] = ()
    """Records the clients hold as differences from what they received."""
    cost_model: ClassVar[CostModel] = FEDAVG_COST
    """Server FLOPs and traffic per round (`fedfields.aggregate.accounting`)."""
    config_keys: ClassVar[dict[str, str]] = {
        "max-num-examples": "max_num_examples",
        "max-update-norm": "max_update_norm",
        "max-empty-rounds": "max_empty_rounds",
    }
    """Flower run-config keys `from_config` reads, mapped to constructor arguments; the keys
    of the base classes are read too (`own_config`)."""

    def __init__(
        self,
        *,
        fraction_train: float = 1.0,
        fraction_evaluate: float = 1.0,
        min_train_nodes: int = 2,
        min_evaluate_nodes: int = 2,
        min_available_nodes: int = 2,
        local_steps: int | None = None,
        secure_aggregation: SecureAggregationConfig | None = None,
        node_timeout: float | None = None,
        max_num_examples: float | None = DEFAULT_MAX_NUM_EXAMPLES,
        max_update_norm: float | None = DEFAULT_MAX_UPDATE_NORM,
        max_empty_rounds: int = DEFAULT_MAX_EMPTY_ROUNDS,
        sampling_seed: int | None = None,
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
        self.secure_aggregation = secure_aggregation
        self.node_timeout = node_timeout
        self.max_num_examples = optional_cap(max_num_examples, "max_num_examples")
        self.max_update_norm = optional_cap(max_update_norm, "max_update_norm")
        if isinstance(max_empty_rounds, bool) or not isinstance(max_empty_rounds, int):
            raise ValueError(f"max_empty_rounds must be an integer, got {max_empty_rounds!r}")
        if max_empty_rounds < 0:
            raise ValueError(f"max_empty_rounds must be >= 0 (0: no limit), got {max_empty_rounds}")
        self.max_empty_rounds = max_empty_rounds
        self.sampling_rng = random.Random(sampling_seed)
        """Draws each round's nodes. The strategy's own, not Python's global `random`: Flower's
        SecAgg+ workflow shuffles with the global one, and a secure run must sample the same
        nodes as its plaintext twin."""
        self.current_round: TrainRound | None = None
        self.rounds_started = 0
        self.rounds_aggregated = 0
        """Rounds that formed an aggregate, over the whole run (resumed runs included)."""
        self.latest_train_metrics: dict[str, float] = {}
        """The last round's aggregated train metrics (client means, failures, traffic)."""

    @classmethod
    def from_config(cls, run_config: Mapping[str, Any], **options: Unpack[StrategyOptions]) -> Self:
        """The strategy with its own settings from a Flower run-config (`config_keys`, e.g.
        "proximal-mu" for FedProx; absent keys keep the defaults) and the shared `options`."""
        return cls(**cls.own_config(run_config), **options)

    @classmethod
    def own_config(cls, run_config: Mapping[str, Any]) -> dict[str, Any]:
        """Constructor arguments from the run-config keys in `config_keys` of this class and
        its bases (absent keys are left out, so they keep the defaults)."""
        keys: dict[str, str] = {}
        for klass in reversed(cls.__mro__):
            keys.update(vars(klass).get("config_keys", {}))
        return {arg: run_config[key] for key, arg in keys.items() if key in run_config}

    def summary(self) -> None:
        """Log the protocol settings, then Flower FedAvg's sampling summary."""
        log(INFO, "\t├──> fedfields %s: %s", self.strategy_name, self.protocol_config())
        super().summary()

    def protocol_config(self) -> dict[str, int | float | str]:
        """Train-config entries this strategy owns, besides "server-round"."""
        own: dict[str, int | float | str] = {STRATEGY: self.strategy_name}
        if self.local_steps is not None:
            own[LOCAL_STEPS] = self.local_steps
        if self.secure_aggregation is not None:
            own[SECURE_AGGREGATION] = True
            if self.secure_weight:
                own[SECURE_WEIGHT] = self.secure_weight
            if self.secure_delta:
                own[SECURE_DELTA] = list(self.secure_delta)
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
        """Sample the round's nodes among those connected and remember them with the shapes.

        Samples max(int(connected * fraction_train), min_train_nodes) nodes, as Flower's
        FedAvg does, but never more than are connected (see `connected_nodes`).
        """
        node_ids: list[int] = []
        connected = list(grid.get_node_ids())
        if self.fraction_train != 0.0:
            connected = self.connected_nodes(grid)
            sample_size = max(int(len(connected) * self.fraction_train), self.min_train_nodes)
            node_ids = self.sampling_rng.sample(connected, min(sample_size, len(connected)))
            log(INFO, "configure_train: sampled %d of %d nodes", len(node_ids), len(connected))
        self.rounds_started += 1
        dtypes = {key: str(array.dtype) for key, array in arrays.items()}
        self.current_round = TrainRound(
            server_round, node_ids, len(connected), shapes_of(arrays), dtypes, grid
        )
        if self.max_update_norm is not None and self.secure_aggregation is None:
            reference = arrays_to_state(arrays, copy=False)
            self.current_round.reference = reference
            self.current_round.reference_norm = update_norm(reference)
        return self.current_round

    def connected_nodes(self, grid: Grid) -> list[int]:
        """The connected nodes, once enough are: waits up to `node_timeout` seconds.

        The first round waits for `min_available_nodes` (the federation assembling), later
        rounds for `min_train_nodes`; when the wait ends with at least `min_train_nodes`
        connected the round goes on with them, with fewer it raises InsufficientNodesError.
        """
        wanted = self.min_train_nodes
        if self.rounds_started == 0:
            wanted = max(self.min_available_nodes, self.min_train_nodes)
        deadline = None if self.node_timeout is None else time.monotonic() + self.node_timeout
        while len(nodes := list(grid.get_node_ids())) < wanted:
            if deadline is not None and time.monotonic() >= deadline:
                break
            log(INFO, "waiting for nodes: %d connected, %d wanted", len(nodes), wanted)
            time.sleep(NODE_POLL_SECONDS)
        if len(nodes) < self.min_train_nodes:
            raise InsufficientNodesError(
                f"{len(nodes)} nodes connected after {self.node_timeout} s, fewer than "
                f"min-train-nodes = {self.min_train_nodes}: the federation has too few nodes"
            )
        if len(nodes) < wanted:
            log(
                WARNING, "%d of %d nodes connected; the round goes on with them", len(nodes), wanted
            )
        return nodes

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Flower FedAvg's federated evaluation, sampling among the connected nodes only."""
        if self.fraction_evaluate == 0.0:
            return []
        connected = list(grid.get_node_ids())
        sample_size = max(int(len(connected) * self.fraction_evaluate), self.min_evaluate_nodes)
        node_ids = self.sampling_rng.sample(connected, min(sample_size, len(connected)))
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

    def start(
        self,
        grid: Grid,
        initial_arrays: ArrayRecord,
        num_rounds: int = 3,
        timeout: float = 3600,
        train_config: ConfigRecord | None = None,
        evaluate_config: ConfigRecord | None = None,
        evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None = None,
        *,
        first_round: int = 1,
        round_end_fn: Callable[[int, ArrayRecord], None] | None = None,
    ) -> Result:
        """Flower's `Strategy.start` loop, resumable, over a `StreamingGrid` (replies reach
        `aggregate_train` as they arrive: the running sums hold one model, not one per node).

        Rounds `first_round`..`num_rounds` run as in Flower 1.41 (train, federated evaluation,
        `evaluate_fn`); `evaluate_fn(0, ...)` runs only when starting at round 1.
        `round_end_fn(round, arrays)` is called last in each round: where a resumable run
        writes its `fedfields.flower.resume.RoundCheckpoint`, RNG states included.
        """
        if not 1 <= first_round <= num_rounds + 1:
            raise ValueError(f"first_round must lie in [1, {num_rounds + 1}], got {first_round}")
        if not isinstance(grid, StreamingGrid):
            grid = StreamingGrid(grid)
        name = type(self).__name__
        log(INFO, "Starting %s strategy (rounds %d-%d):", name, first_round, num_rounds)
        log_strategy_start_info(num_rounds, initial_arrays, train_config, evaluate_config)
        self.summary()
        train_config = ConfigRecord() if train_config is None else train_config
        evaluate_config = ConfigRecord() if evaluate_config is None else evaluate_config
        result = Result(arrays=initial_arrays)
        if evaluate_fn and first_round == 1:
            if (initial := evaluate_fn(0, initial_arrays)) is not None:
                result.evaluate_metrics_serverapp[0] = initial
        arrays, empty = initial_arrays, EmptyTally()
        for server_round in range(first_round, num_rounds + 1):
            log(INFO, "[ROUND %s/%s]", server_round, num_rounds)
            messages = self.configure_train(server_round, arrays, train_config, grid)
            replies = grid.send_and_receive(messages=messages, timeout=timeout)
            new_arrays, train_metrics = self.aggregate_train(server_round, replies)
            if new_arrays is not None:
                arrays = result.arrays = new_arrays
                self.rounds_aggregated += 1
                empty = EmptyTally()
            else:
                kept = int((train_metrics or {}).get(NUM_REPLIES, 0))
                empty.add(self.round_state(server_round), kept)
            if train_metrics is not None:
                result.train_metrics_clientapp[server_round] = train_metrics
            messages = self.configure_evaluate(server_round, arrays, evaluate_config, grid)
            replies = grid.send_and_receive(messages=messages, timeout=timeout)
            if (evaluated := self.aggregate_evaluate(server_round, replies)) is not None:
                result.evaluate_metrics_clientapp[server_round] = evaluated
            if evaluate_fn and (scored := evaluate_fn(server_round, arrays)) is not None:
                result.evaluate_metrics_serverapp[server_round] = scored
            if round_end_fn is not None:
                round_end_fn(server_round, arrays)
            if self.max_empty_rounds and len(empty.rounds) >= self.max_empty_rounds:
                raise EmptyRoundsError(self.empty_rounds_message(empty, consecutive=True))
        if empty.rounds and self.rounds_aggregated == 0:
            raise EmptyRoundsError(self.empty_rounds_message(empty, consecutive=False))
        return result

    def empty_rounds_message(self, empty: EmptyTally, *, consecutive: bool) -> str:
        """One line: which rounds formed no aggregate, the drop counts, the commonest reason."""
        first, last = empty.rounds[0], empty.rounds[-1]
        span = f"{first}-{last}" if last != first else f"{first}"
        if consecutive:
            head = (
                f"{len(empty.rounds)} consecutive rounds ({span}) formed no aggregate "
                f"(max-empty-rounds = {self.max_empty_rounds}): the run stops"
            )
        else:
            head = (
                f"no round of this run formed an aggregate (rounds {span}): the global model "
                "never changed, so the run did not complete"
            )
        drops = ", ".join(
            f"{DROPPED_PREFIX}{check} {n}" for check, n in empty.dropped.most_common()
        )
        counts = (
            f"{empty.sampled} replies asked, {empty.kept} kept, {sum(empty.dropped.values())} "
            f"dropped{f' ({drops})' if drops else ''}, {empty.failures} failed"
        )
        if self.secure_aggregation is not None:
            counts += f", {empty.secure_failures} secure sums failed"
        return f"{head}; {counts}; commonest reason: {self.empty_reason(empty)}"

    def empty_reason(self, empty: EmptyTally) -> str:
        """The commonest cause of the empty rounds, in a user's words."""
        causes = Counter(empty.dropped)
        if empty.failures:
            causes["failed"] = empty.failures
        if empty.secure_failures:
            causes["secure-sum"] = empty.secure_failures
        if not causes:
            return "no node replied with a usable update (check the nodes' logs)"
        check = causes.most_common(1)[0][0]
        if check == "failed":
            return "the nodes' replies were errors (their ClientApps raised or they left)"
        if check == "secure-sum":
            return f"the secure sums failed ({empty.secure_error or 'see the errors above'})"
        return self.drop_reason(check)

    def drop_reason(self, check: str) -> str:
        """What a reply dropped by `check` lacked, in a user's words."""
        mismatch = "the replies' arrays did not match the global model's keys and shapes"
        reasons = {
            NUM_EXAMPLES: (
                f"the clients must report a positive, finite {NUM_EXAMPLES!r} metric (at most "
                f"max-num-examples = {self.max_num_examples or math.inf:g})"
            ),
            TRAIN_STEPS: (
                f"the clients must report {TRAIN_STEPS!r} (the local steps each took, > 0) in "
                f"their {METRICS!r} record: {type(self).__name__} normalises by it"
            ),
            "update-norm": (
                f"updates exceeded max-update-norm = {self.max_update_norm or math.inf:g} "
                "times max(||global||, 1)"
            ),
            "non-finite": "the replies' arrays held NaN or infinite values",
            "non-finite-metric": "the replies' metrics held NaN or infinite values",
            "dtype": "the replies' arrays were integer or bool where the global model's are float",
            "held": "secure-mode replies held nothing back (is secure_aggregation_mod installed?)",
            "missing-record": f"the replies lacked their {ARRAYS!r} record",
            "shape": mismatch,
            "missing-key": mismatch,
            "extra-key": mismatch,
            "decode": "the replies' arrays could not be decoded",
            "alpha": "DecentNeRF replies carried an alpha_k outside (0, alpha-max]",
            "gradient-norm": "gradient replies' ||G_k|| exceeded max-gradient-norm",
        }
        return reasons.get(check, f"the replies failed the {check!r} check")

    def resumable_state(self) -> dict[str, Any]:
        """The strategy's own state a resumed run needs (subclasses add theirs)."""
        return {"rounds-started": self.rounds_started, "rounds-aggregated": self.rounds_aggregated}

    def restore_state(self, state: Mapping[str, Any]) -> None:
        """Take back what `resumable_state` returned (a checkpoint from before
        "rounds-aggregated" was kept counts as having aggregated)."""
        self.rounds_started = int(state["rounds-started"])
        self.rounds_aggregated = int(state.get("rounds-aggregated", 1))

    def successful_replies(self, replies: Iterable[Message]) -> Iterator[Message]:
        """Replies of sampled nodes without errors, yielded as they come; every other reply
        is logged and dropped.

        An error reply (a ClientApp that raised, or the SuperLink answering for a node that
        went away, which names the SuperLink as its source) counts in "num-failures"; so
        does a reply from a node that was not sampled or a second reply of one node. A reply
        with a NaN or infinite metric is dropped ("non-finite-metric", `check_metrics`).
        """
        train_round = self.active_round
        seen: set[int] = set()
        for reply in replies:
            node_id = reply.metadata.src_node_id
            if reply.has_error():
                train_round.num_failures += 1
                log(
                    WARNING,
                    "round %d: reply from node %d failed and is left out: %s",
                    train_round.server_round,
                    node_id,
                    reply.error.reason,
                )
                continue
            if node_id not in train_round.node_ids or node_id in seen:
                train_round.num_failures += 1
                log(
                    WARNING,
                    "round %d: unexpected reply from node %d (not sampled, or a second reply) "
                    "is left out",
                    train_round.server_round,
                    node_id,
                )
                continue
            seen.add(node_id)
            train_round.bytes_up += content_bytes(reply.content)
            try:
                check_metrics(reply)
            except BadReply as bad:
                self.drop(reply, bad)
                continue
            yield reply
        if missing := sorted(set(train_round.node_ids) - seen):
            log(
                INFO,
                "round %d: no successful reply from nodes %s",
                train_round.server_round,
                missing,
            )

    def checked_replies(
        self,
        replies: Iterable[Message],
        records: Mapping[str, Shapes],
        *,
        weighted: bool = False,
        scalars: Sequence[str] = (),
    ) -> Iterator[CheckedReply]:
        """The successful plaintext replies that pass every check, yielded as they come; a
        bad one is dropped (`drop`) before anything of it reaches the caller's sums.

        Checks, in order: finite metrics (`successful_replies`); each of `records` present
        with exactly the expected keys, shapes and dtypes (the global's, floats cast) and
        finite values (`reply_state`); if `weighted`, a "num-examples" in
        (0, `max_num_examples`] (the reply's `weight`, else 1); each metric in `scalars`
        positive and finite; then `check_update` (the update-norm bound).
        """
        dtypes = self.active_round.dtypes
        for reply in self.successful_replies(replies):
            try:
                states = {
                    name: reply_state(reply, name, shapes, dtypes)
                    for name, shapes in records.items()
                }
                checked = CheckedReply(reply.metadata.src_node_id, states)
                if weighted:
                    checked.weight = reply_metric(
                        reply, NUM_EXAMPLES, positive=True, at_most=self.max_num_examples
                    )
                checked.scalars = {key: reply_metric(reply, key, positive=True) for key in scalars}
                self.check_update(checked)
            except BadReply as bad:
                self.drop(reply, bad)
                continue
            checked.metrics = reply_metrics(reply)
            yield checked

    def check_update(self, reply: CheckedReply) -> None:
        """Raise `BadReply` ("update-norm") if the reply's ARRAYS moved further than
        `max_update_norm` * max(||g||, 1) from the arrays sent (g); no-op when off."""
        if ARRAYS in reply.states:
            self.check_update_norm(reply.node_id, reply.states[ARRAYS])

    def check_update_norm(
        self, node_id: int, state: Mapping[str, Tensor], scale: float = 1.0
    ) -> None:
        """The update-norm check of `state` / `scale` (DecentNeRF divides out alpha_k)."""
        train_round = self.active_round
        if self.max_update_norm is None or not train_round.reference:
            return
        bound = self.max_update_norm * max(train_round.reference_norm, 1.0)
        if not update_norm(state, train_round.reference, scale) <= bound:
            raise BadReply(
                "update-norm",
                f"reply from node {node_id}, record {ARRAYS!r}: the update's norm exceeds "
                f"max-update-norm = {self.max_update_norm:g} times max(||global||, 1)",
            )

    def drop(self, reply: Message, bad: BadReply) -> None:
        """Leave `reply` out of the round: count it and log node and check at WARNING."""
        train_round = self.active_round
        train_round.num_failures += 1
        train_round.dropped[bad.check] = train_round.dropped.get(bad.check, 0) + 1
        log(
            WARNING,
            "round %d: reply from node %d dropped (check %r): %s",
            train_round.server_round,
            reply.metadata.src_node_id,
            bad.check,
            bad,
        )

    def train_metrics(
        self, metrics: Sequence[Mapping[str, Any]], weights: Sequence[float] | None = None
    ) -> MetricRecord:
        """Mean of the clients' scalar METRICS (`reply_metrics` of each successful reply,
        weighted by `weights` if given) plus traffic.

        Adds "num-replies", "num-failures" (error, unexpected and dropped replies),
        "num-dropped" with a "dropped-<check>" count per check that dropped one, "bytes-up" and
        "bytes-down" (ArrayRecord bytes of the round, gradient queries included);
        "num-examples" itself is not averaged.
        """
        weights = [1.0] * len(metrics) if weights is None else weights
        train_round = self.active_round
        totals: dict[str, float] = dict(train_round.secure_metrics or {})
        norms: dict[str, float] = dict.fromkeys(totals, 1.0)
        for values, weight in zip(metrics, weights, strict=True):
            for key, value in values.items():
                if key == NUM_EXAMPLES or isinstance(value, list):
                    continue
                totals[key] = totals.get(key, 0.0) + weight * value
                norms[key] = norms.get(key, 0.0) + weight
        secure = {}
        if self.secure_aggregation is not None:
            secure = {
                SECURE_SUMS: train_round.secure_sums,
                SECURE_FAILURES: train_round.secure_failures,
            }
        metrics = {
            **{key: total / norms[key] for key, total in totals.items()},
            NUM_REPLIES: len(metrics),
            NUM_FAILURES: train_round.num_failures,
            NUM_DROPPED: sum(train_round.dropped.values()),
            **{DROPPED_PREFIX + check: count for check, count in train_round.dropped.items()},
            BYTES_UP: train_round.bytes_up,
            BYTES_DOWN: train_round.bytes_down,
            **secure,
        }
        self.latest_train_metrics = dict(metrics)
        return MetricRecord(metrics)

    def secure_sums(
        self, replies: Sequence[Message], records: Mapping[str, Shapes]
    ) -> SecureSumResult | None:
        """Secure sum of the `records` the replying clients hold, plus their metrics.

        Sets the round's train metrics to the held metrics' weighted means and counts the
        masked upload in "bytes-up". A reply that does not hold every record is dropped
        ("held"). A halted SecAgg+ run, a summed weight that is not positive or a non-finite
        sum is logged as an ERROR, counted in "secure-sum-failures" and returns None (the
        caller then leaves the global unchanged); nothing raises.
        """
        if self.secure_aggregation is None:
            raise RuntimeError("secure_sums needs the strategy's secure_aggregation config")
        train_round = self.active_round
        holding = self.holding_replies(replies, records)
        if not holding:
            return None
        metric_keys = _held_metric_keys(holding)
        layout = payload_layout({**records, METRICS: dict.fromkeys(metric_keys, (1,))})
        node_ids = [reply.metadata.src_node_id for reply in holding]
        try:
            result = SecureSum(self.secure_aggregation)(
                train_round.grid, node_ids, layout, train_round.server_round
            )
        except SecureAggregationError as error:
            return self.secure_failure(f"SecAgg+ halted: {error}")
        train_round.bytes_up += result.bytes_up
        held_metrics = result.sums.pop(METRICS)
        weight = float(held_metrics.pop(WEIGHT_KEY))
        if not (math.isfinite(weight) and weight > result.resolution[METRICS][WEIGHT_KEY]):
            return self.secure_failure(
                "the summed weight is not positive (not above the secure sum's resolution)"
            )
        if not all(bool(torch.isfinite(v).all()) for s in result.sums.values() for v in s.values()):
            return self.secure_failure("a summed record holds NaN or infinite values")
        metric_means = {key: float(v) / weight for key, v in held_metrics.items()}
        if not all(math.isfinite(value) for value in metric_means.values()):
            return self.secure_failure("a summed metric is NaN or infinite")
        train_round.secure_sums += 1
        train_round.secure_metrics = metric_means
        result.total_weight = weight
        return result

    def secure_failure(self, reason: str) -> None:
        """Count a secure sum that cannot be used ("secure-sum-failures"), log it; None."""
        train_round = self.active_round
        train_round.secure_failures += 1
        train_round.secure_error = reason
        where = f"round {train_round.server_round}"
        log(ERROR, "%s: secure aggregation failed, nothing of it is used: %s", where, reason)

    def holding_replies(
        self, replies: Sequence[Message], records: Mapping[str, Shapes]
    ) -> list[Message]:
        """The secure-mode replies that hold every one of `records` back; others dropped."""
        holding = []
        for reply in replies:
            held = reply.content.config_records.get(HELD)
            where = f"reply from node {reply.metadata.src_node_id}, record {HELD!r}"
            missing = sorted(set(records) - set((held or {}).get(HELD_RECORDS, [])))
            if held is None or missing:
                self.drop(reply, BadReply("held", f"{where}: does not hold the records {missing}"))
            else:
                holding.append(reply)
        return holding

    def like_global(self, state: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """`state` with the global arrays' dtypes (secure sums are float64); others as they are."""
        dtypes = self.active_round.dtypes
        return {
            key: value.to(getattr(torch, dtypes[key])) if key in dtypes else value
            for key, value in state.items()
        }


def reply_metrics(reply: Message) -> dict[str, Any]:
    """A copy of a reply's METRICS record: all `train_metrics` needs once the reply is gone."""
    return dict(reply.content.metric_records.get(METRICS, {}))


def _held_metric_keys(replies: Sequence[Message]) -> list[str]:
    """Metrics held by every reply (`holding_replies`), the weight included."""
    common: set[str] | None = None
    for reply in replies:
        keys = set(reply.content.config_records[HELD].get(HELD_METRICS, []))
        common = keys if common is None else common & keys
    return sorted((common or set()) | {WEIGHT_KEY})
