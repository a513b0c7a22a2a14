"""ProtocolStrategy: Flower's FedAvg sampling and evaluation with the fedfields train protocol.

A strategy is put together from small parts, each its own module:
- `reply_gate`: every check a reply passes before any of it reaches a sum (drops counted);
- `round_ledger`: the round's nodes, traffic, drops and secure sums, and its train metrics;
- `sum_replies`: one sum of the replies' records, in plaintext or through Flower SecAgg+;
- `round_loop`: Flower's round loop, resumable, stopping a run that cannot train
  (`EmptyRoundsError`) or whose next round would exceed its privacy budget;
- `round_privacy`: client-level DP (`differential_privacy`): central or distributed noise on
  each sum, and the accountant charged once a round ("dp-epsilon").
This module keeps what ties them: the constructor's options, the train config, node sampling
among the connected nodes, and the hooks each strategy module fills in with its paper's
equations (`configure_train`, `aggregate_train`, `check_update`).
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from logging import INFO, WARNING
from typing import Any, ClassVar, Self, TypedDict, Unpack

import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.common.logger import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg as FlowerFedAvg
from flwr.serverapp.strategy import Result
from torch import Tensor

from fedfields.aggregate import FEDAVG_COST, CostModel
from fedfields.aggregate.robust import update_norm
from fedfields.flower.protocol import (
    ARRAYS,
    CONFIG,
    DP_MIN_HOLDERS,
    LOCAL_STEPS,
    NUM_EXAMPLES,
    SECURE_AGGREGATION,
    SECURE_DELTA,
    SECURE_WEIGHT,
    SERVER_ROUND,
    STRATEGY,
    BadReply,
    Shapes,
    arrays_to_state,
    check_metrics,
    content_bytes,
    shapes_of,
)
from fedfields.flower.reply_gate import CheckedReply, ReplyGate, reply_metrics
from fedfields.flower.round_ledger import (
    SECURE_FAILURES,
    SECURE_SUMS,
    EmptyTally,
    TrainRound,
    round_metrics,
)
from fedfields.flower.round_loop import EmptyRoundsError, EvaluateFn, run_rounds
from fedfields.flower.round_privacy import PrivacyBudgetSpent, RoundPrivacy
from fedfields.flower.sum_replies import RoundSum, plain_sum, secure_sum
from fedfields.flower.user_keys import UserKeys, fallback_key
from fedfields.privacy.dp import DPAccountant, DPConfig
from fedfields.privacy.secure_sum import SecureAggregationConfig

__all__ = [  # the parts' names a strategy module or a user's app imports from here
    "SECURE_FAILURES",
    "SECURE_SUMS",
    "CheckedReply",
    "EmptyRoundsError",
    "EmptyTally",
    "InsufficientNodesError",
    "PrivacyBudgetSpent",
    "ProtocolStrategy",
    "RoundSum",
    "StrategyOptions",
    "TrainRound",
    "reply_metrics",
]


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
    sample_by_user: bool
    differential_privacy: DPConfig | None


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


NODE_POLL_SECONDS = 1.0


DEFAULT_LOCAL_STEPS = 1
""""local-steps" when neither the strategy nor the user's train config sets it."""


def _check_local_steps(value: object, name: str) -> None:
    """Raise ValueError unless `value` is a positive int (bools excluded)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


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
    """Metric a client's records are weighted by in `sum_replies` ("": 1): plaintext replies
    by the server, held payloads by the clients under secure aggregation."""
    secure_delta: ClassVar[tuple[str, ...]] = ()
    """Records summed as differences from what the clients received (`sum_replies`)."""
    dp_delta_scale: ClassVar[str] = ""
    """Under DP, the key s of the ARRAYS record whose update is x - s g (DecentNeRF's alpha_k:
    alpha_k g_k - alpha_k g); "": x - g."""
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
        sample_by_user: bool = True,
        differential_privacy: DPConfig | None = None,
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
        self.user_keys: UserKeys | None = UserKeys(node_timeout) if sample_by_user else None
        """Each node's user (`fedfields.flower.user_keys`): nodes are sampled, sent to and summed
        in user-key order, so one seed gives one run; None: in node-id order."""
        self.current_round: TrainRound | None = None
        self.rounds_started = 0
        self.rounds_aggregated = 0
        """Rounds that formed an aggregate, over the whole run (resumed runs included)."""
        self.latest_train_metrics: dict[str, float] = {}
        """The last round's aggregated train metrics (client means, failures, traffic)."""
        self.privacy: RoundPrivacy | None = None
        """Client-level DP's state (`fedfields.flower.round_privacy`); None without DP."""
        if differential_privacy is not None and differential_privacy.enabled:
            self.privacy = RoundPrivacy(
                differential_privacy,
                secure_aggregation,
                self.dp_sums_per_round,
                self.dp_delta_scale,
            )
            self.privacy.check_settings(self.secure_weight, self.min_train_nodes)

    @property
    def dp(self) -> DPConfig | None:
        """The DP settings; None without DP."""
        return None if self.privacy is None else self.privacy.config

    @property
    def accountant(self) -> DPAccountant | None:
        """The run's DP accountant; None without DP."""
        return None if self.privacy is None else self.privacy.accountant

    @property
    def privacy_stop(self) -> str:
        """Why the run stopped before its last round to stay within dp-target-epsilon."""
        return "" if self.privacy is None else self.privacy.stop

    @property
    def gate(self) -> ReplyGate:
        """The reply gate with this strategy's current caps."""
        return ReplyGate(self.max_num_examples, self.max_update_norm)

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
            if self.secure_weight and self.dp is None:
                own[SECURE_WEIGHT] = self.secure_weight
            if self.dp_deltas:
                own[SECURE_DELTA] = list(self.dp_deltas)
            if self.privacy is not None:
                own |= self.privacy.client_config()
        return own

    @property
    def dp_deltas(self) -> tuple[str, ...]:
        """Records summed as differences from what was sent: `secure_delta`, and under DP
        ARRAYS too (what DP clips is the update, not the model)."""
        if self.privacy is None:
            return self.secure_delta
        return self.privacy.deltas(self.secure_delta)

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
        if self.dp is not None and self.secure_aggregation is not None:
            merged[DP_MIN_HOLDERS] = self.active_round.min_holders
        _check_local_steps(merged[LOCAL_STEPS], f"train config {LOCAL_STEPS!r}")
        return ConfigRecord(merged)

    def begin_round(self, server_round: int, arrays: ArrayRecord, grid: Grid) -> TrainRound:
        """Sample the round's nodes among those connected and remember them with the shapes.

        Samples max(int(connected * fraction_train), min_train_nodes) nodes, as Flower's
        FedAvg does, but never more than are connected (see `connected_nodes`), with the
        seeded `sampling_rng` over the nodes in user-key order; the sample is kept in that
        order, which is the order its messages are sent and its replies summed.
        """
        node_ids: list[int] = []
        connected = list(grid.get_node_ids())
        if self.fraction_train != 0.0:
            connected = self.ordered_nodes(grid, self.connected_nodes(grid))
            sample_size = max(int(len(connected) * self.fraction_train), self.min_train_nodes)
            sample = self.sampling_rng.sample(connected, min(sample_size, len(connected)))
            node_ids = self.ordered_nodes(grid, sample)
            log(INFO, "configure_train: sampled %d of %d nodes", len(node_ids), len(connected))
        if node_ids and self.privacy is not None:
            if self.rounds_started == 0:  # before anything is sent: the pre-flight check
                num_params = sum(math.prod(array.shape) for array in arrays.values())
                self.privacy.start(len(node_ids))
                self.privacy.check_noise(len(node_ids), num_params)
            self.privacy.check_budget(server_round, len(node_ids), len(connected))
        self.rounds_started += 1
        dtypes = {key: str(array.dtype) for key, array in arrays.items()}
        self.current_round = TrainRound(
            server_round, node_ids, len(connected), shapes_of(arrays), dtypes, grid
        )
        self.current_round.users = self.users_of(node_ids)
        if self.secure_aggregation is not None:
            self.current_round.min_holders = self.secure_aggregation.min_holders(len(node_ids))
        if self.secure_aggregation is None or self.dp is not None:  # read-only views: the
            # norm check's and the DP updates' reference
            reference = arrays_to_state(arrays, copy=False)
            self.current_round.reference = reference
            if self.max_update_norm is not None:
                self.current_round.reference_norm = update_norm(reference)
        return self.current_round

    def ordered_nodes(self, grid: Grid, node_ids: Iterable[int]) -> list[int]:
        """`node_ids` in user-key order (asking nodes not seen before which user they are),
        or by node id without `user_keys`."""
        if self.user_keys is None:
            return sorted(node_ids)
        node_ids = list(node_ids)
        self.user_keys.learn(grid, node_ids)
        return self.user_keys.ordered(node_ids)

    def users_of(self, node_ids: Iterable[int]) -> list[str]:
        """The user keys of `node_ids` ("node-<id>" without `user_keys`), in their order."""
        if self.user_keys is None:
            return [fallback_key(node_id) for node_id in node_ids]
        return self.user_keys.of(node_ids)

    # Differential privacy's hooks (`fedfields.flower.round_privacy`).

    def dp_sums_per_round(self, server_round: int) -> int:
        """Noised sums a round makes over its sampled clients (DecentNeRF adds the gradient
        query's from round 2)."""
        return 1

    def check_privacy_plan(self, first_round: int, num_rounds: int) -> float:
        """The epsilon a run of rounds `first_round`..`num_rounds` would spend at sampling rate
        `fraction_train` (`RoundPrivacy.check_plan`: ValueError naming dp-target-epsilon
        beyond it). 0 without DP."""
        if self.privacy is None:
            return 0.0
        return self.privacy.check_plan(first_round, num_rounds, self.fraction_train)

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
        connected = self.ordered_nodes(grid, grid.get_node_ids())
        sample_size = max(int(len(connected) * self.fraction_evaluate), self.min_evaluate_nodes)
        sample = self.sampling_rng.sample(connected, min(sample_size, len(connected)))
        node_ids = self.ordered_nodes(grid, sample)
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
        evaluate_fn: EvaluateFn | None = None,
        *,
        first_round: int = 1,
        round_end_fn: Callable[[int, ArrayRecord], None] | None = None,
    ) -> Result:
        """Flower's `Strategy.start` loop, resumable (`fedfields.flower.round_loop`): rounds
        `first_round`..`num_rounds`; `round_end_fn(round, arrays)` last in each round, where a
        resumable run writes its `fedfields.flower.resume.RoundCheckpoint`."""
        return run_rounds(
            self,
            grid,
            initial_arrays,
            num_rounds,
            timeout,
            ConfigRecord() if train_config is None else train_config,
            ConfigRecord() if evaluate_config is None else evaluate_config,
            evaluate_fn,
            first_round,
            round_end_fn,
        )

    def resumable_state(self) -> dict[str, Any]:
        """The strategy's own state a resumed run needs (subclasses add theirs); under DP the
        accountant's charges, so a resumed run continues its epsilon."""
        state: dict[str, Any] = {
            "rounds-started": self.rounds_started,
            "rounds-aggregated": self.rounds_aggregated,
        }
        if self.privacy is not None:
            state |= self.privacy.resumable_state()
        return state

    def restore_state(self, state: Mapping[str, Any]) -> None:
        """Take back what `resumable_state` returned (a checkpoint from before
        "rounds-aggregated" was kept counts as having aggregated); a DP run needs its
        accountant's state (ValueError without it: its epsilon would restart at 0)."""
        self.rounds_started = int(state["rounds-started"])
        self.rounds_aggregated = int(state.get("rounds-aggregated", 1))
        if self.privacy is not None:
            self.privacy.restore(state)

    # The reply gate (`fedfields.flower.reply_gate`) on this round.

    def successful_replies(self, replies: Iterable[Message]) -> Iterator[Message]:
        """The round's replies without errors or non-finite metrics (`ReplyGate.successful`)."""
        return self.gate.successful(self.active_round, replies)

    def checked_replies(
        self,
        replies: Iterable[Message],
        records: Mapping[str, Shapes],
        *,
        weighted: bool = False,
        scalars: Mapping[str, tuple[float, float]] | None = None,
    ) -> Iterator[CheckedReply]:
        """The plaintext replies that pass every check, the strategy's `check_update` last
        (`ReplyGate.checked`); a bad one is dropped before it reaches any sum. The rules that
        aggregate them outside `sum_replies` (FedNova, FedExP, the robust rules) use them all,
        so each is recorded as summed."""
        train_round = self.active_round
        train_round.summed_nodes = []
        for reply in self.gate.checked(
            train_round, replies, records, self.check_update, weighted=weighted, scalars=scalars
        ):
            train_round.summed_nodes.append(reply.node_id)
            yield reply

    def check_update(self, reply: CheckedReply) -> None:
        """Raise `BadReply` ("update-norm") if the reply's ARRAYS moved further than
        `max_update_norm` * max(||g||, 1) from the arrays sent (g); strategies add theirs."""
        if ARRAYS in reply.states:
            self.check_update_norm(reply.node_id, reply.states[ARRAYS])

    def check_update_norm(
        self, node_id: int, state: Mapping[str, Tensor], scale: float = 1.0
    ) -> None:
        """The update-norm check of `state` / `scale` (DecentNeRF divides out alpha_k)."""
        self.gate.check_update_norm(self.active_round, node_id, state, scale)

    def drop(self, reply: Message, bad: BadReply) -> None:
        """Leave `reply` out of the round: count it and log node and check at WARNING."""
        self.gate.drop(self.active_round, reply, bad)

    # One sum for plaintext and SecAgg+ (`fedfields.flower.sum_replies`).

    def sum_replies(
        self, replies: Iterable[Message], records: Mapping[str, Shapes]
    ) -> RoundSum | None:
        """sum_k w_k x_k of each of `records` over the round's replies, and sum_k w_k.

        Plaintext: each reply is checked in full, then folded in as it arrives. With
        `secure_aggregation`: Flower SecAgg+'s sum of what the clients hold back, so the server
        never sees one client's record. w_k is the reply's `secure_weight` metric (else 1);
        `secure_delta` records are differences from the arrays sent, in both modes. None when
        nothing was summed (the round's ledger counts why).
        """
        train_round = self.active_round
        train_round.summed_nodes = []
        deltas = tuple(name for name in self.dp_deltas if name in records)
        payload = ARRAYS in records  # not DecentNeRF's gradient query
        if self.secure_aggregation is None:
            summed = plain_sum(
                self.gate,
                train_round,
                replies,
                records,
                self.check_update,
                weighted=bool(self.secure_weight) and self.privacy is None,
                deltas=deltas,
                privacy=None if self.privacy is None else self.privacy.central(payload),
            )
        else:
            held = list(self.gate.successful(train_round, replies))  # metrics: payloads held
            if not held:
                return None
            privacy = None
            if self.privacy is not None:
                privacy = self.privacy.distributed(train_round, payload)
            summed = secure_sum(
                self.gate, train_round, self.secure_aggregation, held, records, privacy
            )
        if summed is not None:
            train_round.summed_nodes = list(summed.node_ids)
        if summed is None or self.privacy is None:
            return summed
        return self.privacy.released(summed, train_round, deltas, self.secure_delta)

    def train_metrics(
        self, metrics: Sequence[Mapping[str, Any]], weights: Sequence[float] | None = None
    ) -> MetricRecord:
        """The round's train metrics (`round_ledger.round_metrics`), kept as the latest."""
        secure = self.secure_aggregation is not None
        record = round_metrics(self.active_round, metrics, weights, secure)
        if self.privacy is not None:
            record |= self.privacy.charge(self.active_round)
        self.latest_train_metrics = dict(record)
        return MetricRecord(record)

    def summed_metrics(self, summed: RoundSum | None) -> MetricRecord:
        """The train metrics of the replies in `summed` (none when nothing was summed)."""
        if summed is None:
            return self.train_metrics([])
        return self.train_metrics(summed.metrics, summed.weights)

    def like_global(self, state: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """`state` with the global arrays' dtypes (sums are float64); other keys as they are."""
        dtypes = self.active_round.dtypes
        return {
            key: value.to(getattr(torch, dtypes[key])) if key in dtypes else value
            for key, value in state.items()
        }
