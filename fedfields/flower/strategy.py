"""ProtocolStrategy: Flower's FedAvg sampling and evaluation with the fedfields train protocol.

A strategy is Flower glue and its paper's hooks (options, sampling, train config, messages;
`open_train_round`, `aggregate`, `check_update`); what a round does with its replies belongs to
the `Round` that `begin_round` opens (`fedfields.flower.round`: gate -> sum -> privacy ->
ledger -> `RoundOutcome`), and `start` runs the resumable loop over rounds (`RoundLoop`, last
in this file, as Flower keeps `Strategy.start` beside its strategy), which passes each round as
a value from `open_train_round` to `finish_round`; Flower's `configure_train` and
`aggregate_train` remain for any other loop."""

from __future__ import annotations

import functools
import inspect
import math
import random
import re
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from logging import ERROR, INFO, WARNING
from typing import Any, ClassVar, Protocol, Self, TypedDict, Unpack

import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.common.logger import log
from flwr.proto.node_pb2 import NodeInfo
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg as FlowerFedAvg
from flwr.serverapp.strategy import Result
from flwr.serverapp.strategy.strategy_utils import log_strategy_start_info
from flwr.supercore.run import Run
from torch import Tensor

from fedfields.compression import CompressionConfig
from fedfields.flower.compressed_downloads import DOWNLOAD_TYPES, DownloadSender
from fedfields.flower.protocol import (
    ARRAYS,
    CONFIG,
    DP_MIN_HOLDERS,
    GRADIENT,
    GRADIENT_COMPRESSED,
    GRADIENT_QUERY,
    LOCAL_STEPS,
    NON_FINITE_AGGREGATE,
    NUM_EXAMPLES,
    NUM_REPLIES,
    RESUME_POINTS,
    SERVER_ROUND,
    STRATEGY,
    USER_KEY_MESSAGE_TYPE,
    BadReply,
    arrays_to_state,
    check_metrics,
    content_bytes,
    fallback_key,
    reply_key,
    shapes_of,
    state_to_arrays,
)
from fedfields.flower.round import (
    CheckedReply,
    EmptyTally,
    PrivacyBudgetSpent,
    ReplyGate,
    Round,
    RoundLedger,
    RoundOutcome,
    RoundPrivacy,
    SumRules,
    round_counts,
)
from fedfields.flower.upload_compression import compression_entries
from fedfields.methods import FEDAVG_COST, CostModel
from fedfields.methods.base import (
    Method,
    RecordSpec,
    RoundContext,
    RoundSums,
    ServerStep,
    State,
    update_norm,
)
from fedfields.methods.robust import (
    AGGREGATION_RULES,
    DEFAULT_TRIM_FRACTION,
    RobustRule,
    check_trim_fraction,
    robust_aggregate,
)
from fedfields.methods.settings import StrategySettings, optional_cap
from fedfields.privacy.dp import DPConfig
from fedfields.privacy.secagg_plan import SecureAggregationConfig

# The options every fedfields strategy takes (`StrategyOptions`), their defaults and checks,
# and how a strategy's own train-config entries merge with the user's (`merged_train_config`).
#
# The reply caps bound what one client can do to a round: `max_num_examples` its weight,
# `max_update_norm` how far its update may move the model; 0 or None lifts a cap.


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
    compression: CompressionConfig | None


DEFAULT_MAX_NUM_EXAMPLES = 1e9
"""Cap on a reply's "num-examples": a thousand megapixel photos, far above any client here,
yet low enough that one client cannot outweigh the others a billion to one."""
DEFAULT_MAX_UPDATE_NORM = 1e3
"""Cap on ||g_k - g|| / max(||g||, 1): an honest round moves a model by far less than 1000x
its own norm; a scaled or exploded update does not."""


DEFAULT_MAX_EMPTY_ROUNDS = 3
"""Consecutive rounds without an aggregate that end a run: one empty round is a bad moment,
three in a row a federation that cannot train as configured."""


def check_max_empty_rounds(value: object) -> int:
    """`value` as max_empty_rounds: an integer >= 0 (0: no limit); ValueError otherwise."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"max_empty_rounds must be an integer, got {value!r}")
    if value < 0:
        raise ValueError(f"max_empty_rounds must be >= 0 (0: no limit), got {value}")
    return value


DEFAULT_LOCAL_STEPS = 1
""""local-steps" when neither the strategy nor the user's train config sets it."""


def check_local_steps(value: object, name: str) -> None:
    """Raise ValueError unless `value` is a positive int (bools excluded)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def merged_train_config(
    config: Mapping[str, Any], own: Mapping[str, Any], server_round: int
) -> dict[str, Any]:
    """The user's train `config` with the strategy's `own` entries and "server-round"; an own
    entry the user set to another value raises (set it through the strategy's constructor).

    "local-steps" comes from `own` if set, else from `config`, else `DEFAULT_LOCAL_STEPS`.
    """
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
    check_local_steps(merged[LOCAL_STEPS], f"train config {LOCAL_STEPS!r}")
    return merged


def checked_compression(
    config: CompressionConfig | None,
    secure_aggregation: SecureAggregationConfig | None,
    privacy: DPConfig | None = None,
) -> CompressionConfig | None:
    """`config` if a strategy can take it (None for "none"); ValueError saying why not.

    SecAgg+ sums masked vectors entry by entry: quantised codes on the scale every client
    shares add up (`fedfields.privacy.packed_sum`), low-rank factors and top-k index sets of
    different clients do not, so they cannot be masked. Under distributed DP the noised shares
    are not coarsened to b bits (the accountant charges the noised sum itself).
    """
    if config is None or not config.enabled:
        return None
    if secure_aggregation is not None and config.scheme in ("lowrank", "topk"):
        raise ValueError(
            f"compression {config.scheme!r} cannot compose with secure aggregation: SecAgg+ "
            "sums masked vectors entry by entry, and clients' low-rank factors or top-k "
            "indices do not add up to those of the sum"
        )
    if secure_aggregation is not None and privacy is not None:
        raise ValueError(
            "compression 'quantise' with secure aggregation and differential privacy is "
            "refused: b-bit codes of each client's noise share are not the noised sum the "
            "accountant charges; use one or the other"
        )
    return config


class RunConfigured:
    """How a strategy is built from run-config: typed `settings` (the App's registry) or a
    Flower run-config's keys (your own app)."""

    settings_class: ClassVar[type[StrategySettings]] = StrategySettings
    """The strategy's own run-config keys, typed (`fedfields.methods.settings`)."""
    shared_keys: ClassVar[dict[str, str]] = {
        "max-num-examples": "max_num_examples",
        "max-update-norm": "max_update_norm",
        "max-empty-rounds": "max_empty_rounds",
    }
    """Run-config keys every strategy of this family takes (the App's schema keeps them in
    its sections) -> constructor arguments; `from_config` reads those of the bases too."""

    @classmethod
    def from_settings(cls, settings: StrategySettings, **options: Unpack[StrategyOptions]) -> Self:
        """The strategy with its typed run-config `settings` (an instance of
        `settings_class`) and the shared `options`: what the App's registry builds."""
        if not isinstance(settings, cls.settings_class):
            raise TypeError(
                f"{cls.__name__} takes {cls.settings_class.__name__}, got {type(settings).__name__}"
            )
        return cls(**settings.arguments(), **options)

    @classmethod
    def from_config(cls, run_config: Mapping[str, Any], **options: Unpack[StrategyOptions]) -> Self:
        """The strategy with its own settings from a Flower run-config (`settings_class`'s
        keys and `shared_keys`; absent keys keep the constructor's defaults) and the shared
        `options`; ValueError naming a key that misspells one of them, or a bad value."""
        cls.settings_class.refuse_misspelt(run_config)
        return cls(**cls.settings_class.given(run_config), **cls.shared_config(run_config),
                   **options)  # fmt: skip

    @classmethod
    def shared_config(cls, run_config: Mapping[str, Any]) -> dict[str, Any]:
        """Constructor arguments from the run-config keys in `shared_keys` of this class and
        its bases (absent keys are left out, so they keep the defaults)."""
        keys: dict[str, str] = {}
        for klass in reversed(cls.__mro__):
            keys.update(vars(klass).get("shared_keys", {}))
        return {arg: run_config[key] for key, arg in keys.items() if key in run_config}


# Flower FedAvg's federated evaluation among the connected nodes, replies checked first.
#
# `FederatedEvaluation` is the base every fedfields strategy evaluates through: it samples
# evaluation nodes with the strategy's seeded `NodeSampler` (so a seed gives one evaluation
# too) and leaves out failed replies and replies with non-finite metrics before Flower's
# weighted metric mean.


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


class ProtocolStrategy(RunConfigured, FederatedEvaluation):
    """Flower FedAvg's sampling and evaluation with the fedfields train protocol.

    Subclasses set `strategy_name`, extend `protocol_config` and implement `open_train_round`
    (`begin_round`, `train_config`, `messages`) and `aggregate` (through the `Round`'s one
    sum); constructor arguments (`StrategyOptions`) are documented on `fedfields.flower.FedAvg`.
    Nodes come and go: a round samples among those connected now (`NodeSampler`), and an error
    reply (a node that died, a ClientApp that raised) is logged and counted, never raised.
    """

    strategy_name: ClassVar[str]
    weight_metric: ClassVar[str] = ""
    """Metric a client's records are weighted by in the sum ("": 1): read by the server from
    plaintext replies, applied by the clients to their held payloads under SecAgg+."""
    delta_records: ClassVar[tuple[str, ...]] = ()
    """Records summed as differences from what the clients received, in both modes."""
    dp_delta_scale: ClassVar[str] = ""
    """Under DP, the key s of the ARRAYS record whose update is x - s g (a client's own weight
    alpha_k: alpha_k g_k - alpha_k g); "": x - g."""
    cost_model: ClassVar[CostModel] = FEDAVG_COST
    """Server FLOPs and traffic per round (`fedfields.methods.accounting`)."""

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
        sample_by_user: bool = False,
        differential_privacy: DPConfig | None = None,
        compression: CompressionConfig | None = None,
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
            check_local_steps(local_steps, "local_steps")
        self.local_steps = local_steps
        self.secure_aggregation = secure_aggregation
        self.compression = checked_compression(
            compression, secure_aggregation, differential_privacy
        )
        """The scheme replies compress their ARRAYS update with (None: sent whole)."""
        self.downloads = DownloadSender.of(self.compression, sampling_seed)
        """Compressed downloads' reference chain (`fedfields.flower.compressed_downloads`);
        None: sent whole."""
        self.node_timeout = node_timeout
        self.max_num_examples = optional_cap(max_num_examples, "max_num_examples")
        self.max_update_norm = optional_cap(max_update_norm, "max_update_norm")
        self.max_empty_rounds = check_max_empty_rounds(max_empty_rounds)
        self.sampling_rng = random.Random(sampling_seed)
        """Draws each round's nodes. The strategy's own, not Python's global `random`: Flower's
        SecAgg+ workflow shuffles with the global one, and a secure run must sample the same
        nodes as its plaintext twin."""
        user_keys = UserKeys(node_timeout) if sample_by_user else None
        self.sampler = NodeSampler(self.sampling_rng, user_keys, node_timeout)
        """With `sample_by_user`, nodes sampled, sent to and summed in user-key order
        (`UserKeys`), so one seed gives one run; without it (the default:
        a stock ClientApp has no handler for the query, and Flower logs an ERROR for each
        node asked) in node-id order, which Flower draws at random in simulation."""
        self.flower_round: Round | None = None
        """The round Flower's `configure_train` opened (for a loop other than `start`'s, whose
        `aggregate_train` takes only replies); `start`'s own loop passes rounds as values."""
        self.rounds_started = 0
        self.rounds_aggregated = 0
        """Rounds that formed an aggregate, over the whole run (resumed runs included)."""
        self.resume_points: list[int] = []
        """The round each continuation of this run started after (`continue_after`), sent as
        "resume-points" so nodes read only the state versions the checkpoints kept."""
        checks = (self.weight_metric, self.min_train_nodes)
        self.privacy = RoundPrivacy.of_strategy(
            differential_privacy, secure_aggregation, self.dp_sums_per_round, self.dp_delta_scale,
            checks,
        )  # fmt: skip
        """Client-level DP's state (`fedfields.flower.round`): its settings, the run's
        accountant and why it stopped early; None without DP."""

    @property
    def dp(self) -> DPConfig | None:
        """The DP settings; None without DP."""
        return None if self.privacy is None else self.privacy.config

    def summary(self) -> None:
        """Log the protocol settings, then Flower FedAvg's sampling summary."""
        log(INFO, "\t├──> fedfields %s: %s", self.strategy_name, self.protocol_config())
        super().summary()

    def protocol_config(self) -> dict[str, int | float | str]:
        """Train-config entries this strategy owns, besides "server-round"."""
        own: dict[str, int | float | str] = {STRATEGY: self.strategy_name}
        if self.compression is not None:
            own |= compression_entries(self.compression, self.dp_delta_scale)
        if self.local_steps is not None:
            own[LOCAL_STEPS] = self.local_steps
        if self.secure_aggregation is not None:
            own |= self.sum_rules().secure_config(self.privacy)
        if self.resume_points:
            own[RESUME_POINTS] = ",".join(str(point) for point in self.resume_points)
        return own

    def continue_after(self, server_round: int) -> None:
        """This run continues from its checkpoint of `server_round` (after `restore_state`)."""
        self.resume_points.append(server_round)

    def sum_rules(self) -> SumRules:
        """How this strategy's replies are summed (`weight_metric`, `delta_records`, ...)."""
        bits = 0
        if self.secure_aggregation is not None and self.compression is not None:
            bits = self.compression.bits  # only 'quantise' composes with SecAgg+
        return SumRules(self.weight_metric, self.delta_records, self.dp_delta_scale, bits)

    def train_config(self, train_round: Round, config: ConfigRecord) -> ConfigRecord:
        """A copy of the user's `config` with the protocol entries (`merged_train_config`:
        clashing values raise) and, for DP under SecAgg+, the round's "dp-min-holders"."""
        merged = merged_train_config(config, self.protocol_config(), train_round.server_round)
        if self.dp is not None and self.secure_aggregation is not None:
            merged[DP_MIN_HOLDERS] = train_round.ledger.min_holders
        return ConfigRecord(merged)

    def begin_round(self, server_round: int, arrays: ArrayRecord, grid: Grid) -> Round:
        """Sample the round's nodes among those connected (`NodeSampler`: the first round waits
        for `min_available_nodes`, the others for `min_train_nodes`) and open its `Round`."""
        first = self.rounds_started == 0
        wanted = max(self.min_available_nodes if first else 0, self.min_train_nodes)
        node_ids, connected = self.sampler.round_nodes(
            grid, self.fraction_train, self.min_train_nodes, wanted
        )
        if node_ids and self.privacy is not None:
            num_params = sum(math.prod(array.shape) for array in arrays.values())
            self.privacy.before_round(server_round, len(node_ids), connected, num_params, first)
        self.rounds_started += 1
        if self.downloads is not None:  # replies are read against `arrays`, kept exact
            self.downloads.advance(server_round, arrays)
        ledger = RoundLedger(server_round, node_ids, connected, shapes_of(arrays), {}, grid)
        ledger.users = self.sampler.users_of(node_ids)
        gate = ReplyGate(
            self.max_num_examples, self.max_update_norm, self.compression, self.dp_delta_scale,
            self.compressed_records(),
        )  # fmt: skip
        rules, secure = self.sum_rules(), self.secure_aggregation
        return Round.open(ledger, arrays, gate, self.check_update, rules, secure, self.privacy)

    def compressed_records(self) -> frozenset[str]:
        """Reply records that travel compressed under compressed uploads: ARRAYS and the
        gradient query's GRADIENT; a strategy with records of its own says which."""
        return frozenset({ARRAYS, GRADIENT})

    def dp_sums_per_round(self, server_round: int) -> int:
        """Noised sums a round makes over its sampled clients (a strategy with a query
        phase adds its query sums); the DP accountant's hook."""
        return 1

    def check_privacy_plan(self, first_round: int, num_rounds: int) -> float:
        """The epsilon a run of rounds `first_round`..`num_rounds` would spend at sampling rate
        `fraction_train` (`RoundPrivacy.check_plan`: ValueError naming dp-target-epsilon
        beyond it). 0 without DP."""
        if self.privacy is None:
            return 0.0
        return self.privacy.check_plan(first_round, num_rounds, self.fraction_train)

    def round_of(self, server_round: int) -> Round:
        """The `Round` Flower's `configure_train` opened for `server_round`; RuntimeError
        without it."""
        if self.flower_round is None or self.flower_round.server_round != server_round:
            raise RuntimeError(
                f"aggregate_train for round {server_round} without configure_train of that round"
            )
        return self.flower_round

    def messages(self, train_round: Round, content: RecordDict, message_type: str) -> list[Message]:
        """`train_round`'s messages carrying `content` (under compressed downloads a train or
        gradient-query message's ARRAYS is each node's own: `DownloadSender.contents`)."""
        users = train_round.ledger.users
        if self.downloads is None or message_type not in DOWNLOAD_TYPES:
            sent = content_bytes(content) * len(users)
            return train_round.messages([content] * len(users), sent, message_type)
        return train_round.messages(*self.downloads.contents(content, users), message_type)

    def open_train_round(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> tuple[Round, list[Message]]:
        """Sample round `server_round`'s nodes (`begin_round`) and build its train messages:
        the `Round` comes back as a value, for `finish_round`."""
        raise NotImplementedError

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Flower's hook, for a loop other than `start`'s: `open_train_round`, the round kept
        for `aggregate_train` (`round_of`)."""
        self.flower_round, messages = self.open_train_round(server_round, arrays, config, grid)
        return messages

    def aggregate(self, train_round: Round, replies: Iterable[Message]) -> RoundOutcome:
        """The paper's server step over the round's replies, ending in `train_round.outcome`."""
        raise NotImplementedError

    def finish_round(self, train_round: Round, replies: Iterable[Message]) -> RoundOutcome:
        """The outcome of `train_round` (`aggregate`), counted if it aggregated."""
        outcome = self.aggregate(train_round, replies)
        self.rounds_aggregated += outcome.arrays is not None
        if self.downloads is not None:
            self.downloads.round_ended(outcome.ledger.users, outcome.ledger.summed_users)
        return outcome

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Flower's hook: the outcome of the round `configure_train` opened (`finish_round`)
        as Flower's pair."""
        outcome = self.finish_round(self.round_of(server_round), replies)
        return outcome.arrays, MetricRecord(outcome.metrics)

    def check_update(self, train_round: Round, reply: CheckedReply) -> None:
        """Raise `BadReply` ("update-norm") if the reply's ARRAYS moved further than
        `max_update_norm` * max(||g||, 1) from the arrays sent (g); strategies add theirs."""
        if ARRAYS in reply.states:
            train_round.check_update_norm(reply.node_id, reply.states[ARRAYS])

    def drop_reason(self, check: str) -> str:
        """What a reply dropped by `check` lacked, in a user's words (`ReplyGate.drop_reason`)."""
        gate = ReplyGate(self.max_num_examples, self.max_update_norm)
        return gate.drop_reason(check, type(self).__name__)

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
        round_end_fn: RoundEndFn | None = None,
    ) -> Result:
        """Flower's `Strategy.start` loop, resumable (`RoundLoop`):
        rounds `first_round`..`num_rounds`; `round_end_fn(outcome, arrays)` last in each round,
        where a resumable run writes its `fedfields.flower.resume.RoundCheckpoint`."""
        loop = RoundLoop(self, num_rounds, first_round)
        return loop.run(
            grid, initial_arrays, timeout, train_config, evaluate_config, evaluate_fn, round_end_fn
        )

    def resumable_state(self) -> dict[str, Any]:
        """The strategy's own state a resumed run needs (subclasses add theirs); under DP the
        accountant's charges, so a resumed run continues its epsilon."""
        state: dict[str, Any] = {
            "rounds-started": self.rounds_started,
            "rounds-aggregated": self.rounds_aggregated,
            "resume-points": list(self.resume_points),
        }
        if self.privacy is not None:
            state |= self.privacy.resumable_state()
        if self.downloads is not None:
            state["downloads"] = self.downloads.state()
        return state

    def restore_state(self, state: Mapping[str, Any]) -> None:
        """Take back what `resumable_state` returned (a checkpoint from before
        "rounds-aggregated" was kept counts as having aggregated); a DP run needs its
        accountant's state (ValueError without it: its epsilon would restart at 0)."""
        self.rounds_started = int(state["rounds-started"])
        self.rounds_aggregated = int(state.get("rounds-aggregated", 1))
        self.resume_points = [int(point) for point in state.get("resume-points", [])]
        if self.privacy is not None:
            self.privacy.restore(state)
        if self.downloads is not None:
            self.downloads.restore(state["downloads"])


# Which nodes a round asks: those connected, once enough are, sampled in user-key order.
#
# `wait_for_nodes` is the one wait for nodes the server jobs share (a strategy's rounds, the
# split job's one client): it polls the grid until enough nodes are connected or the timeout
# has passed. `NodeSampler` draws a round's nodes as Flower's FedAvg does,
# max(int(connected * fraction), least) but never more than are connected, with the strategy's
# own seeded RNG over the nodes in user-key order, so one seed gives one run; the sample keeps
# that order, the order its messages are sent and its replies summed.
#
# Flower 1.41 gives simulated SuperNodes random node ids (from os.urandom) and lists them as a
# set, so a seeded sample over them would pick other users in every run. Each node knows which
# user it is (`fedfields.flower.node.user_key`): its partition-id in simulation; when deployed,
# its node-config `user`, else its data folder's name, else its partition-id. `UserKeys` asks
# each node once with a "query.user_key" message (nodes that join later are asked when first
# seen) and orders the nodes by that key, digit runs compared as numbers. A node that does not
# answer, such as Flower's stock quickstart ClientApp, keeps "node-<id>" with one warning: its
# place then depends on Flower's random ids. A strategy asks only with `sample_by_user=True`
# (this App's strategies do): Flower's ClientApp raises for a message type it has no handler
# for and logs an ERROR with a traceback, so by default a library strategy asks nothing and
# orders nodes by id. A library user's ClientApp answers with
# `app.query(USER_KEY_ACTION)(answer_user_key)`.


NODE_POLL_SECONDS = 0.5
"""How often a wait asks the grid for its nodes: a node that connects is seen within half a
second, and the SuperLink is asked twice a second at most."""


DIGITS = re.compile(r"([0-9]+)")
"""A run of ASCII digits (a Unicode digit such as '²' is text)."""


def natural_order(key: str) -> tuple[tuple[int, int, str], ...]:
    """Sort key of a user key: runs of ASCII digits compare as numbers (their length first,
    then the digits, so no run is ever converted), so "user_10" follows "user_9"."""
    return tuple(
        (0, len(part.lstrip("0")), part.lstrip("0")) if DIGITS.fullmatch(part) else (1, 0, part)
        for part in DIGITS.split(key)
        if part
    )


class UserKeys:
    """The server's map from node id to user key, learnt once per node."""

    def __init__(self, timeout: float | None = None) -> None:
        self.timeout = timeout
        """Seconds to wait for the nodes' answers (None: until all answered)."""
        self.keys: dict[int, str] = {}

    def learn(self, grid: Grid, node_ids: Iterable[int]) -> None:
        """Ask the nodes among `node_ids` not asked before which user they are; a node that
        does not answer keeps "node-<id>" (one warning per call naming them)."""
        unknown = sorted(set(node_ids) - set(self.keys))
        if not unknown:
            return
        messages = [
            Message(RecordDict(), dst_node_id=node_id, message_type=USER_KEY_MESSAGE_TYPE)
            for node_id in unknown
        ]
        for reply in grid.send_and_receive(messages, timeout=self.timeout):
            key = reply_key(reply)
            if key is not None and reply.metadata.src_node_id in unknown:
                self.keys[reply.metadata.src_node_id] = key
        silent = [node_id for node_id in unknown if node_id not in self.keys]
        for node_id in silent:
            self.keys[node_id] = fallback_key(node_id)
        if silent:
            log(
                WARNING,
                "%d node(s) did not say which user they are (no '%s' handler in their "
                "ClientApp?): they are ordered by Flower's node ids, which change every run",
                len(silent),
                USER_KEY_MESSAGE_TYPE,
            )
        self._warn_shared(unknown)

    def _warn_shared(self, node_ids: list[int]) -> None:
        """Warn when new nodes share a user key with another node (their order is then by id)."""
        seen: dict[str, int] = {}
        for node_id, key in self.keys.items():
            if key in seen and (node_id in node_ids or seen[key] in node_ids):
                log(WARNING, "nodes %d and %d are both user %r", seen[key], node_id, key)
            seen.setdefault(key, node_id)

    def ordered(self, node_ids: Iterable[int]) -> list[int]:
        """`node_ids` by user key (ties by node id); every node must have been learnt."""
        return sorted(node_ids, key=lambda node_id: (natural_order(self.keys[node_id]), node_id))

    def of(self, node_ids: Iterable[int]) -> list[str]:
        """The user keys of `node_ids`, in their order ("node-<id>" for one never learnt)."""
        return [self.keys.get(node_id, fallback_key(node_id)) for node_id in node_ids]


class InsufficientNodesError(RuntimeError):
    """Too few nodes stayed connected to run a round."""


def wait_for_nodes(grid: Grid, wanted: int, timeout: float | None) -> list[int]:
    """The connected nodes once `wanted` are, or those connected when `timeout` seconds have
    passed (None: wait for ever), fewer then; logs each poll that finds too few."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while len(nodes := list(grid.get_node_ids())) < wanted:
        now = time.monotonic()
        if deadline is not None and now >= deadline:
            break
        log(INFO, "waiting for nodes: %d connected, %d wanted", len(nodes), wanted)
        time.sleep(
            NODE_POLL_SECONDS if deadline is None else min(NODE_POLL_SECONDS, deadline - now)
        )
    return nodes


@dataclass
class NodeSampler:
    """A strategy's node sampling: its seeded `rng`, the nodes' `user_keys` (None: node-id
    order) and how long a round waits for nodes (`node_timeout`, None: for ever)."""

    rng: random.Random
    user_keys: UserKeys | None
    node_timeout: float | None

    def connected(self, grid: Grid, wanted: int, least: int) -> list[int]:
        """The connected nodes once `wanted` are, or after `node_timeout` with at least
        `least` (min-train-nodes, logged); InsufficientNodesError with fewer."""
        nodes = wait_for_nodes(grid, wanted, self.node_timeout)
        if len(nodes) < least:
            raise InsufficientNodesError(
                f"{len(nodes)} nodes connected after {self.node_timeout} s, fewer than "
                f"min-train-nodes = {least}: the federation has too few nodes"
            )
        if len(nodes) < wanted:
            log(
                WARNING, "%d of %d nodes connected; the round goes on with them", len(nodes), wanted
            )
        return nodes

    def round_nodes(
        self, grid: Grid, fraction: float, least: int, wanted: int
    ) -> tuple[list[int], int]:
        """A train round's sample and how many nodes were connected: once `wanted` are
        connected (or after `node_timeout`, with at least `least`), `fraction` of them, at
        least `least`; none for fraction 0."""
        if fraction == 0.0:
            return [], len(list(grid.get_node_ids()))
        connected = self.connected(grid, wanted, least)
        node_ids = self.sample(grid, connected, fraction, least)
        log(INFO, "configure_train: sampled %d of %d nodes", len(node_ids), len(connected))
        return node_ids, len(connected)

    def sample(
        self, grid: Grid, connected: Iterable[int], fraction: float, least: int
    ) -> list[int]:
        """max(int(len(connected) * fraction), least) of the `connected` nodes, at most all of
        them, drawn in user-key order and kept in it."""
        ordered = self.ordered(grid, connected)
        size = min(max(int(len(ordered) * fraction), least), len(ordered))
        return self.ordered(grid, self.rng.sample(ordered, size))

    def ordered(self, grid: Grid, node_ids: Iterable[int]) -> list[int]:
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


# Any fedfields method (`fedfields.methods`) as a Flower strategy: the one thin adapter.
#
# `MethodStrategy` runs a round the same way whatever the method: from round 2 a method with a
# gradient query first sums its sampled nodes' G_k (`Method.gradient_query`), then it sends
# what the method's `sent` returns with the train config (the method's `client_config` entries
# merged in) and G with the method's `query_config` entries, then
# reads the replies through the round's one sum (`fedfields.flower.round.Round.sum`: gate,
# plaintext or SecAgg+, DP, ledger). A method whose step starts from the mean gets the
# replies' weighted mean (or a robust rule's aggregate) in the global's dtypes; any other gets
# the sums of its declared reply records (or folds each checked reply itself) and takes its
# step from them. The records' caps and scales declared in `RecordSpec`s are checked here, so
# the generic round never names a method. `method_strategy(MethodClass)` makes the
# Flower-facing class a user imports (`fedfields.flower.FedAvg`, ...), whose keyword arguments
# are the method's own and the shared `MethodOptions`.


RefineGlobal = Callable[[State, int], tuple[State, dict[str, float]]]
"""A field's structure step over a round's new global before it goes out (a splat field's
relocation of dead Gaussians), given the round; returns the global and round metrics. It reads
only the aggregate: post-processing under DP, nothing SecAgg+ hides."""


class MethodOptions(StrategyOptions, total=False):
    """`StrategyOptions` plus the robust rule that may replace a method's mean."""

    aggregation_rule: str
    trim_fraction: float
    num_malicious: int
    krum_select: int
    query_timeout: float | None
    refine_global: RefineGlobal | None


class MethodStrategy(ProtocolStrategy):
    """A `fedfields.methods.base.Method` run through Flower 1.41's message API.

    Train messages carry ARRAYS (the method's `sent`: the global or a lookahead), any other
    record the method sends (a control variate) and CONFIG ("server-round",
    "strategy", "local-steps", the method's `client_config` and the user's train config);
    replies carry the method's `reply_records` and METRICS (a positive "num-examples" when
    the method weighs by it). A bad reply (`fedfields.flower.round`, or a record above
    its declared cap) is dropped and counted and the round aggregates the rest; failed
    replies are dropped, as in Flower's FedAvg. With no reply left the global stays.

    Args:
        method: the method's server half; None builds `method_class` from the method's own
            keyword arguments among `**options`.
        fraction_train: fraction of the connected nodes sampled for training (Flower's FedAvg).
        fraction_evaluate: fraction sampled for federated evaluation (0 skips it).
        min_train_nodes: at least this many nodes are sampled for training.
        min_evaluate_nodes: at least this many nodes are sampled for evaluation.
        min_available_nodes: sampling waits until this many nodes are connected.
        local_steps: local optimisation steps per round, sent as "local-steps"; None (default)
            takes "local-steps" from the train config given to `start`, else 1.
        secure_aggregation: SecAgg+ settings; set, the server only learns the sums of what
            the clients hold back (clients put their weight inside the masked vector).
            Refused for a method whose step reads each client's own values.
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
            by "num-examples". Only for methods whose step starts from the mean; not with
            secure aggregation (the server never sees one client's state) nor DP.
        trim_fraction: share of the replies cut from each end of each coordinate by
            "trimmed-mean", in [0, 0.5).
        num_malicious: f, the malicious clients Krum, Multi-Krum and Bulyan assume; a Bulyan
            round with fewer than 4f + 3 checked replies forms no aggregate.
        krum_select: m, the states Multi-Krum averages (0: n - f).
        query_timeout: seconds to wait for a gradient query's replies; None takes
            `node_timeout` (None there too waits for all).
        refine_global: a structure step over each new global (`RefineGlobal`), same shapes
            out as in; None: the method's step is the round's global.
        differential_privacy: client-level DP (`fedfields.privacy.dp.DPConfig`): each
            update clipped to C, uniform weights, N(0, (z C)^2) on the sum (by the server, or
            in shares by the clients under secure aggregation); epsilon is accounted per
            round (docs/PRIVACY.md). "mean" only.
        compression: the scheme replies compress their updates with (None: sent whole).
    """

    method_class: ClassVar[type[Method]]
    shared_keys = {
        "aggregation-rule": "aggregation_rule",
        "trim-fraction": "trim_fraction",
        "num-malicious": "num_malicious",
        "krum-select": "krum_select",
    }

    def __init__(
        self,
        *,
        method: Method | None = None,
        aggregation_rule: str = "mean",
        trim_fraction: float = DEFAULT_TRIM_FRACTION,
        num_malicious: int = 0,
        krum_select: int = 0,
        query_timeout: float | None = None,
        refine_global: RefineGlobal | None = None,
        **options: Any,
    ) -> None:
        own = method_arguments(self.method_class, options)
        if method is None:
            method = self.method_class(**own)
        elif own:
            raise TypeError(f"pass {sorted(own)} to the method, not beside `method`")
        self.method = method
        self.weight_metric = method.weight_metric
        self.delta_records = tuple(spec.name for spec in method.reply_records() if spec.delta)
        scale = method.reply_records()[0].scale
        self.dp_delta_scale = "" if scale is None else scale.key
        refuse_unsupported(self.strategy_name, method, options)
        super().__init__(**options)
        self.query_timeout = self.node_timeout if query_timeout is None else query_timeout
        self.refine_global = refine_global
        self.aggregation_rule = checked_rule(
            self.strategy_name, method, aggregation_rule, self.dp is not None,
            self.secure_aggregation is not None,
        )  # fmt: skip
        self.trim_fraction = check_trim_fraction(trim_fraction)
        self.robust_rule = (
            None
            if aggregation_rule == "mean"
            else RobustRule(aggregation_rule, trim_fraction, num_malicious, krum_select)
        )
        """The robust rule's settings; None for the mean."""

    def summary(self) -> None:
        """Log the method and its settings, then the shared summary."""
        log(INFO, "\t├──> method: %s", self.method.describe())
        super().summary()

    def protocol_config(self) -> dict[str, int | float | str]:
        """The shared entries plus the method's `client_config`."""
        return {**super().protocol_config(), **self.method.client_config()}

    def dp_sums_per_round(self, server_round: int) -> int:
        """Under DP a round with a gradient query (from round 2) noises two sums of its
        sampled users: the query's G and the payload's (charged as one multiplier z / sqrt(2))."""
        return 2 if server_round >= 2 and self.method.gradient_query() is not None else 1

    def open_train_round(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> tuple[Round, list[Message]]:
        """Sample nodes; from round 2 the method's gradient query, summed; the round and its
        messages: what the method's `sent` returns with the train config, and G."""
        global_state = arrays_to_state(arrays)
        records = self.method.sent(global_state, server_round)
        sent = arrays if records[ARRAYS] is global_state else state_to_arrays(records[ARRAYS])
        train_round = self.begin_round(server_round, sent, grid)
        train_config = self.train_config(train_round, config)
        train_round.context = RoundContext(
            server_round, global_state, dict(train_config), train_round.ledger.num_nodes_total
        )
        content: dict[str, ArrayRecord | ConfigRecord] = {
            ARRAYS: sent,
            **{name: state_to_arrays(s) for name, s in records.items() if name != ARRAYS},
            CONFIG: train_config,
        }
        query = self.method.gradient_query()
        if query is not None and server_round >= 2 and train_round.ledger.node_ids:
            gradient = self.gradient_sum(train_round, sent, train_config, grid)
            if gradient is not None:
                if self.privacy is not None:  # G leaves before the round is charged
                    self.privacy.write_ahead(train_round.ledger)
                content[GRADIENT] = self.gradient_record(server_round, gradient, train_config)
                for key, value in self.method.query_config().items():
                    train_config[key] = value
        return train_round, self.messages(train_round, RecordDict(content), MessageType.TRAIN)

    def gradient_sum(
        self, train_round: Round, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> dict[str, Tensor] | None:
        """G = sum_k dL_k/dg at the global `arrays` over the round's sampled nodes, in the
        global's dtypes (None: nothing summed, or G is not finite there and is not sent)."""
        content = RecordDict({ARRAYS: arrays, CONFIG: config})
        queries = self.messages(train_round, content, GRADIENT_QUERY)
        replies = grid.send_and_receive(queries, timeout=self.query_timeout)
        summed = train_round.sum(replies, {GRADIENT: train_round.shapes})
        if summed is None:
            return None
        if self.downloads is not None:  # they rebuilt this round's global for the query
            self.downloads.hold(train_round.ledger.summed_users)
        gradient = train_round.in_global_dtypes(summed.sums[GRADIENT])
        if not all(bool(torch.isfinite(value).all()) for value in gradient.values()):
            log(ERROR, "round %d: the summed gradient G holds NaN or infinite values in the "
                "global's dtypes and is not sent", train_round.ledger.server_round)  # fmt: skip
            return None
        return gradient

    def gradient_record(
        self, server_round: int, gradient: dict[str, Tensor], config: ConfigRecord
    ) -> ArrayRecord:
        """G as the train message carries it: whole, or under compressed downloads compressed
        on its way down as the global is (`DownloadSender.gradient`; `config` then says so)."""
        if self.downloads is None:
            return state_to_arrays(gradient)
        config[GRADIENT_COMPRESSED] = True
        return self.downloads.gradient(server_round, gradient)

    def aggregate(self, train_round: Round, replies: Iterable[Message]) -> RoundOutcome:
        """The method's server step over the round's mean or sums, as the round's outcome."""
        context, method = train_round.context, self.method
        assert context is not None, "configure_train opens the round's context"
        if method.from_mean:
            mean = self.mean(train_round, replies)
            step = None if mean is None else method.step_from_mean(context, mean)
        else:
            step = self.step_from_sums(train_round, replies, context)
        if step is None or step.new_global is None:
            if step is not None and step.failure:
                train_round.fail_sum(step.failure)
            if step is not None and step.warning:
                log(WARNING, "round %d: %s", context.server_round, step.warning)
            return train_round.outcome(None, None if step is None else step.metrics)
        new_global, metrics = step.new_global, step.metrics
        if self.refine_global is not None:
            new_global, refined = self.refine_global(new_global, context.server_round)
            metrics = {**metrics, **refined}
        return train_round.outcome(state_to_arrays(new_global), metrics)

    def step_from_sums(
        self, train_round: Round, replies: Iterable[Message], context: RoundContext
    ) -> ServerStep | None:
        """The method's step from the sums of its reply records (or its own fold of each
        checked reply); None when nothing was summed."""
        method, shapes = self.method, train_round.shapes
        fold = method.fold(context)
        summed = train_round.sum(
            replies,
            {spec.name: record_shapes(spec, shapes) for spec in method.reply_records()},
            scalars=method.reply_scalars(context) or None,
            fold=None if fold is None else lambda r: fold(r.states, r.weight, r.scalars),
        )
        if summed is None:
            return None
        noise_std = None if self.privacy is None else self.privacy.payload_noise_std
        sums = RoundSums(
            summed.sums, summed.weight, len(summed.node_ids), summed.resolution, noise_std
        )
        return method.step_from_sums(context, sums)

    def mean(self, train_round: Round, replies: Iterable[Message]) -> State | None:
        """sum_k n_k x_k / sum_k n_k of the replies' ARRAYS in the global's dtypes (the
        round's sum: checked and folded in as they arrive, or SecAgg+'s), or the robust rule
        over all of them; None: no aggregate."""
        if self.robust_rule is not None:
            return self.robust_mean(train_round, replies, self.robust_rule)
        summed = train_round.sum(replies, {ARRAYS: train_round.shapes})
        if summed is None:
            return None
        return train_round.in_global_dtypes(summed.mean(ARRAYS))

    def robust_mean(
        self, train_round: Round, replies: Iterable[Message], rule: RobustRule
    ) -> State | None:
        """The coordinate-wise robust rule over every checked reply of the round's sum (it
        needs all at once); None below the rule's fewest states, counted as a failed sum whose
        reason names the rule and its setting (what a run of such rounds ends with)."""
        states: list[State] = []
        shapes = {ARRAYS: train_round.shapes}
        summed = train_round.sum(replies, shapes, fold=lambda r: states.append(r.states[ARRAYS]))
        if summed is None:
            return None
        if shortfall := rule.shortfall(len(states)):
            train_round.fail_sum(f"{shortfall}: no aggregate")
            return None
        return robust_aggregate(rule, states, summed.weights)

    def record_specs(self) -> tuple[RecordSpec, ...]:
        """The method's reply records and its gradient query's record."""
        query = self.method.gradient_query()
        return (*self.method.reply_records(), *(() if query is None else (query,)))

    def compressed_records(self) -> frozenset[str]:
        """The method's reply records (and gradient query's) declared `compressed`."""
        return frozenset(spec.name for spec in self.record_specs() if spec.compressed)

    def check_update(self, train_round: Round, reply: CheckedReply) -> None:
        """The update-norm bound on ARRAYS (a scaled payload's scale in its range first,
        then divided out), then each record's declared norm cap."""
        payload = reply.states.get(ARRAYS)
        scale = self.method.reply_records()[0].scale
        if payload is not None and scale is not None:
            weight = float(payload[scale.key].double().reshape(()))
            if not scale.low <= weight <= scale.high:
                raise BadReply(
                    scale.check,
                    f"reply from node {reply.node_id}, record {ARRAYS!r}: {scale.key!r} is "
                    f"outside [{scale.low:g}, {scale.high:g}] ({scale.check})",
                )
            train_round.check_update_norm(reply.node_id, payload, scale=weight)
        else:
            super().check_update(train_round, reply)
        for spec in self.record_specs():
            record = reply.states.get(spec.name)
            if spec.norm_cap is None or record is None:
                continue
            if not update_norm(record) <= spec.norm_cap:
                raise BadReply(
                    spec.norm_check,
                    f"reply from node {reply.node_id}, record {spec.name!r}: its norm exceeds "
                    f"the cap {spec.norm_cap:g} ({spec.norm_check})",
                )

    def drop_reason(self, check: str) -> str:
        """A declared record check's reason, else the gate's."""
        for spec in self.record_specs():
            if spec.norm_check == check and spec.drop_reason:
                return spec.drop_reason
            if spec.scale is not None and spec.scale.check == check:
                return spec.scale.drop_reason
        return super().drop_reason(check)

    def resumable_state(self) -> dict[str, Any]:
        """The shared state plus the method's (`Method.state`)."""
        return {**super().resumable_state(), **self.method.state()}

    def restore_state(self, state: Mapping[str, Any]) -> None:
        """Take back the shared state and the method's."""
        super().restore_state(state)
        self.method.restore(state)


def record_shapes(spec: RecordSpec, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, Any]:
    """The shapes a reply record is summed with: the global's, plus a scale's one entry."""
    if spec.scale is None:
        return dict(shapes)
    return {**shapes, spec.scale.key: (1,)}


def method_arguments(method_class: type[Method], options: dict[str, Any]) -> dict[str, Any]:
    """Pop the method's own keyword arguments (its constructor's) out of `options`."""
    parameters = inspect.signature(method_class.__init__).parameters
    names = [name for name, p in parameters.items() if p.kind is p.KEYWORD_ONLY]
    return {name: options.pop(name) for name in names if name in options}


def refuse_unsupported(name: str, method: Method, options: Mapping[str, Any]) -> None:
    """ValueError when SecAgg+ or DP is asked of a method whose step reads each client's own
    values (its update, norm or step count), which a secure or clipped sum hides."""
    if not method.secure_aggregation and options.get("secure_aggregation") is not None:
        raise ValueError(
            f"{name} needs each client's update (and its norm or step count), which secure "
            "aggregation hides; use a method whose server step reads only sums"
        )
    if not method.differential_privacy and options.get("differential_privacy") is not None:
        raise ValueError(
            f"{name} does not support client-level DP (dp-noise-multiplier > 0): its server step "
            "reads each client's own values, whose sensitivity a clipped sum does not bound"
        )


def checked_rule(name: str, method: Method, rule: str, dp: bool, secure: bool) -> str:
    """`rule` if the method and the round can take it; ValueError saying why not."""
    if rule not in AGGREGATION_RULES:
        raise ValueError(f"aggregation_rule must be one of {AGGREGATION_RULES}, got {rule!r}")
    if rule == "mean":
        return rule
    if not (method.from_mean and method.settings_class.robust_rules):
        raise ValueError(
            f"{name} aggregates with its own server step; aggregation_rule {rule!r} is for "
            "methods whose step starts from the replies' mean"
        )
    if dp:
        raise ValueError(
            f"aggregation_rule {rule!r} is not a sum of clipped updates, so client-level DP "
            "(dp-noise-multiplier > 0) does not bound it; use 'mean'"
        )
    if secure:
        raise ValueError(
            f"aggregation_rule {rule!r} needs each client's state, which secure aggregation "
            "hides; use 'mean' with secure aggregation"
        )
    return rule


@functools.cache
def method_strategy(method_class: type[Method]) -> type[MethodStrategy]:
    """The Flower strategy class of `method_class` (one per method: the same class on every
    call): named after it, its `strategy_name` the method's `name`, built from the method's
    settings (`from_settings`, `from_config`)."""
    namespace = {
        "__doc__": f"{method_class.__doc__}\n\n    As a Flower strategy: `MethodStrategy`.",
        "__module__": __name__,
        "method_class": method_class,
        "strategy_name": method_class.name,
        "settings_class": method_class.settings_class,
        "weight_metric": method_class.weight_metric,
        "cost_model": method_class.cost_model,
    }
    return type(method_class.__name__, (MethodStrategy,), namespace)


# The loop over rounds: Flower 1.41's `Strategy.start`, resumable, over rounds as values.
#
# `RoundLoop(strategy, num_rounds, first_round)` refuses, when it is built and so before
# anything is sent or written, a DP plan that cannot meet dp-target-epsilon. `run` then runs
# rounds `first_round`..`num_rounds` as Flower does (train, federated evaluation, the server's
# `evaluate_fn`) over a `StreamingGrid`, so replies reach the round's sum as they arrive and the
# running sums hold one model, not one per node. Each round ends in the strategy's
# `RoundOutcome` (`fedfields.flower.round`), which `round_end_fn` receives last in the round
# with the global arrays: where a job writes its report line and a resumable run its
# checkpoint. `max_empty_rounds` consecutive rounds without an aggregate, or a run whose every
# round was empty, raise one `EmptyRoundsError` naming the drop counts and the commonest
# reason. Under DP the run ends cleanly before a round whose charge would exceed the target
# (`PrivacyBudgetSpent`, logged).

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
# order, `UserKeys`) makes a float sum independent of which client finished
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
