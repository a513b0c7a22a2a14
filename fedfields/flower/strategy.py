"""ProtocolStrategy: Flower's FedAvg sampling and evaluation with the fedfields train protocol.

A strategy is put together from small parts, each its own module:
- `reply_gate`: every check a reply passes before any of it reaches a sum (drops counted);
- `round_ledger`: the round's nodes, traffic, drops and secure sums, and its train metrics;
- `sum_replies`: one sum of the replies' records, in plaintext or through Flower SecAgg+;
- `round_loop`: Flower's round loop, resumable, stopping a run that cannot train
  (`EmptyRoundsError`) or whose next round would exceed its privacy budget.
Client-level DP (`differential_privacy`, `fedfields.privacy.dp`): plaintext sums clip each
reply's update and the server adds N(0, (z C)^2) (central DP); under secure aggregation the
clients clip and add their share of that noise before masking (distributed DP). Weights are
uniform; a `DPAccountant` is charged each round with the q and z it used ("dp-epsilon").
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
    DP_CLIP_NORM,
    DP_NOISE_MULTIPLIER,
    DP_NUM_SAMPLED,
    LOCAL_STEPS,
    NUM_EXAMPLES,
    SECURE_AGGREGATION,
    SECURE_DELTA,
    SECURE_DELTA_SCALE,
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
from fedfields.flower.round_loop import (
    EmptyRoundsError,
    EvaluateFn,
    PrivacyBudgetSpent,
    run_rounds,
)
from fedfields.flower.sum_replies import CentralPrivacy, RoundSum, plain_sum, secure_sum
from fedfields.privacy.dp import (
    CLIP_NORM_KEY,
    EPSILON_METRIC,
    DPAccountant,
    DPConfig,
    RoundCharge,
    central_noise_std,
    check_plan,
    combined_noise_multiplier,
    distributed_noise_std,
    effective_noise_multiplier,
    noise_generator,
)
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


DP_EPSILON = EPSILON_METRIC
"""Train metric: epsilon at dp-delta spent by the run so far (DP runs only)."""
DP_ROUND_MULTIPLIER = "dp-round-noise-multiplier"
"""Train metric: the noise multiplier the accountant charged this round (DP runs only)."""
NOISE_TAIL = 8.0
"""A fixed SecAgg+ clipping range must hold a clipped value plus this many noise-share
stds: |N(0, 1)| > 8 has probability 1.2e-15 per entry."""


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
        self.current_round: TrainRound | None = None
        self.rounds_started = 0
        self.rounds_aggregated = 0
        """Rounds that formed an aggregate, over the whole run (resumed runs included)."""
        self.latest_train_metrics: dict[str, float] = {}
        """The last round's aggregated train metrics (client means, failures, traffic)."""
        self.dp = (
            differential_privacy if differential_privacy and differential_privacy.enabled else None
        )
        self.dp_noise: torch.Generator | None = None
        """The central DP noise's generator, secret-seeded at first use (`noise_generator`);
        tests may set a seeded one. Never seeded from run-config: the server could subtract."""
        self.accountant = None if self.dp is None else DPAccountant(self.dp.delta)
        self.privacy_stop = ""
        """Why the run stopped before its last round to stay within dp-target-epsilon."""
        if self.dp is not None:
            self.check_dp_settings()

    def check_dp_settings(self) -> None:
        """Log the uniform weights DP needs; refuse a fixed SecAgg+ clipping range without
        room for the noise shares."""
        assert self.dp is not None
        if self.secure_weight:
            reason = "the sum's sensitivity to one client is then the clip norm C"
            log(
                INFO,
                "differential privacy: replies weigh 1 each, not %r: %s",
                self.secure_weight,
                reason,
            )
        secure = self.secure_aggregation
        if secure is not None and secure.clipping_range > 0:
            share = distributed_noise_std(
                self.dp.noise_multiplier, self.dp.clip_norm, max(self.min_train_nodes, 2)
            )
            needed = self.dp.clip_norm + NOISE_TAIL * share
            if secure.clipping_range < needed:
                raise ValueError(
                    f"secagg-clipping-range = {secure.clipping_range:g} leaves no room for the DP "
                    f"noise: a clipped value ({CLIP_NORM_KEY} = {self.dp.clip_norm:g}) plus "
                    f"{NOISE_TAIL:g} noise-share stds needs >= {needed:.4g}; raise it, or set it "
                    "to 0 (automatic bounds, which see the noised values)"
                )

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
            if self.dp is not None:
                own[DP_CLIP_NORM] = self.dp.clip_norm
                own[DP_NOISE_MULTIPLIER] = self.dp.noise_multiplier
                if self.dp_delta_scale:
                    own[SECURE_DELTA_SCALE] = self.dp_delta_scale
        return own

    dp_delta_scale: ClassVar[str] = ""
    """Under DP, the key s of the ARRAYS record whose update is x - s g (DecentNeRF's alpha_k:
    alpha_k g_k - alpha_k g); "": x - g."""

    @property
    def dp_deltas(self) -> tuple[str, ...]:
        """Records summed as differences from what was sent: `secure_delta`, and under DP
        ARRAYS too (what DP clips is the update, not the model)."""
        if self.dp is None or ARRAYS in self.secure_delta:
            return self.secure_delta
        return (*self.secure_delta, ARRAYS)

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
            merged[DP_NUM_SAMPLED] = len(self.active_round.node_ids)
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
        if node_ids:
            self.check_privacy_budget(server_round, len(node_ids), len(connected))
        self.rounds_started += 1
        dtypes = {key: str(array.dtype) for key, array in arrays.items()}
        self.current_round = TrainRound(
            server_round, node_ids, len(connected), shapes_of(arrays), dtypes, grid
        )
        if self.secure_aggregation is None or self.dp is not None:  # read-only views: the
            # norm check's and the DP updates' reference
            reference = arrays_to_state(arrays, copy=False)
            self.current_round.reference = reference
            if self.max_update_norm is not None:
                self.current_round.reference_norm = update_norm(reference)
        return self.current_round

    # Differential privacy: the accountant, its budget and the round's charge.

    def dp_sums_per_round(self, server_round: int) -> int:
        """Noised sums a round makes over its sampled clients (DecentNeRF adds the gradient
        query's from round 2)."""
        return 1

    def planned_multiplier(self, server_round: int, num_sampled: int | None = None) -> float:
        """The noise multiplier a round is charged: z per sum, combined over its sums; with
        `num_sampled` under secure aggregation, the worst case (only the reconstruction
        threshold's clients survive each sum, `effective_noise_multiplier`)."""
        assert self.dp is not None
        z = self.dp.noise_multiplier
        if num_sampled is not None and self.secure_aggregation is not None and num_sampled > 1:
            threshold = self.secure_aggregation.shares_and_threshold(num_sampled)[1]
            z = effective_noise_multiplier(z, num_sampled, max(2, min(threshold, num_sampled)))
        return combined_noise_multiplier([z] * self.dp_sums_per_round(server_round))

    def check_privacy_plan(self, first_round: int, num_rounds: int) -> float:
        """The epsilon a run of rounds `first_round`..`num_rounds` would spend at sampling rate
        `fraction_train` (on top of what the accountant holds); ValueError naming
        dp-target-epsilon when it exceeds the target. 0 without DP."""
        if self.dp is None or self.accountant is None:
            return 0.0
        planned = [
            RoundCharge(min(self.fraction_train, 1.0), self.planned_multiplier(server_round))
            for server_round in range(first_round, num_rounds + 1)
        ]
        return check_plan(self.dp, [*self.accountant.charges, *planned])

    def check_privacy_budget(self, server_round: int, num_sampled: int, connected: int) -> None:
        """Raise PrivacyBudgetSpent when this round's worst-case charge would take epsilon
        above dp-target-epsilon (before anything of the round is sent)."""
        if self.dp is None or self.accountant is None or self.dp.target_epsilon == 0:
            return
        sampling_rate = num_sampled / connected
        z = self.planned_multiplier(server_round, num_sampled)
        after = self.accountant.epsilon_after(sampling_rate, z)
        if after > self.dp.target_epsilon:
            self.privacy_stop = (
                f"round {server_round} not run: its charge (q = {sampling_rate:.4g}, z = {z:.4g}) "
                f"would take epsilon from {self.accountant.epsilon():.4g} to {after:.4g}, above "
                f"dp-target-epsilon = {self.dp.target_epsilon:g}; the run stops after round "
                f"{server_round - 1}"
            )
            raise PrivacyBudgetSpent(self.privacy_stop)

    def charge_round(self, train_round: TrainRound) -> dict[str, float]:
        """Charge the round's noised sums once (q = sampled / connected, z combined over its
        sums); the DP train metrics. A round that released no sum is not charged."""
        if self.dp is None or self.accountant is None:
            return {}
        metrics: dict[str, float] = {}
        if not train_round.dp_charged and train_round.dp_multipliers:
            train_round.dp_charged = True
            z = combined_noise_multiplier(train_round.dp_multipliers)
            self.accountant.charge(len(train_round.node_ids) / train_round.num_nodes_total, z)
            metrics[DP_ROUND_MULTIPLIER] = z
        return {**metrics, DP_EPSILON: self.accountant.epsilon()}

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
        if self.accountant is not None:
            state["dp-accountant"] = self.accountant.state_dict()
        return state

    def restore_state(self, state: Mapping[str, Any]) -> None:
        """Take back what `resumable_state` returned (a checkpoint from before
        "rounds-aggregated" was kept counts as having aggregated); a DP run needs its
        accountant's state (ValueError without it: its epsilon would restart at 0)."""
        self.rounds_started = int(state["rounds-started"])
        self.rounds_aggregated = int(state.get("rounds-aggregated", 1))
        if self.dp is not None:
            if "dp-accountant" not in state:
                raise ValueError("the checkpoint holds no DP accountant: epsilon would restart")
            self.accountant = DPAccountant.from_state_dict(state["dp-accountant"])

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
        scalars: Sequence[str] = (),
    ) -> Iterator[CheckedReply]:
        """The plaintext replies that pass every check, the strategy's `check_update` last
        (`ReplyGate.checked`); a bad one is dropped before it reaches any sum."""
        return self.gate.checked(
            self.active_round,
            replies,
            records,
            self.check_update,
            weighted=weighted,
            scalars=scalars,
        )

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
        deltas = tuple(name for name in self.dp_deltas if name in records)
        if self.secure_aggregation is None:
            summed = plain_sum(
                self.gate,
                train_round,
                replies,
                records,
                self.check_update,
                weighted=bool(self.secure_weight) and self.dp is None,
                deltas=deltas,
                privacy=self.central_privacy(),
            )
        else:
            held = list(self.gate.successful(train_round, replies))  # metrics: payloads held
            if not held:
                return None
            summed = secure_sum(self.gate, train_round, self.secure_aggregation, held, records)
        if summed is None or self.dp is None:
            return summed
        z = self.dp.noise_multiplier
        if self.secure_aggregation is not None:
            z = effective_noise_multiplier(z, len(train_round.node_ids), len(summed.node_ids))
        train_round.dp_multipliers.append(z)
        return self.restored_records(summed, deltas)

    def central_privacy(self) -> CentralPrivacy | None:
        """The plaintext sum's clip and noise (std z C on the sum); None without DP."""
        if self.dp is None:
            return None
        if self.dp_noise is None:
            self.dp_noise = noise_generator()
        std = central_noise_std(self.dp.noise_multiplier, self.dp.clip_norm)
        return CentralPrivacy(self.dp.clip_norm, std, self.dp_noise, self.dp_delta_scale)

    def restored_records(self, summed: RoundSum, deltas: Sequence[str]) -> RoundSum:
        """A DP sum's ARRAYS back in the form the strategy sums (`secure_delta` stays as
        differences): sum_k (x_k - s_k g) + (sum_k s_k) g, with the summed s (DecentNeRF's
        noised alpha sum) or the number summed."""
        for name in deltas:
            if name in self.secure_delta:
                continue
            total = summed.sums[name]
            scale = summed.weight
            if self.dp_delta_scale:
                scale = float(total[self.dp_delta_scale].double().sum())
            reference = self.active_round.reference
            for key, value in reference.items():
                total[key] = total[key] + scale * value.double()
        return summed

    def train_metrics(
        self, metrics: Sequence[Mapping[str, Any]], weights: Sequence[float] | None = None
    ) -> MetricRecord:
        """The round's train metrics (`round_ledger.round_metrics`), kept as the latest."""
        secure = self.secure_aggregation is not None
        record = round_metrics(self.active_round, metrics, weights, secure)
        record |= self.charge_round(self.active_round)
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
