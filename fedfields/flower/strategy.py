"""ProtocolStrategy: Flower's FedAvg sampling and evaluation with the fedfields train protocol.

A strategy is Flower glue and its paper's hooks (options, sampling, train config, messages;
`open_train_round`, `aggregate`, `check_update`); what a round does with its replies belongs to
the `Round` that `begin_round` opens (`fedfields.flower.round`: gate -> sum -> privacy ->
ledger -> `RoundOutcome`), and `start` runs the resumable loop over rounds (`round_loop`),
which passes each round as a value from `open_train_round` to `finish_round`; Flower's
`configure_train` and `aggregate_train` remain for any other loop.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable, Mapping
from logging import INFO
from typing import Any, ClassVar

from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.common.logger import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result

from fedfields.compression import CompressionConfig
from fedfields.flower.compressed_downloads import DownloadSender, node_contents
from fedfields.flower.evaluation import FederatedEvaluation
from fedfields.flower.protocol import (
    ARRAYS,
    CONFIG,
    DP_MIN_HOLDERS,
    GRADIENT,
    LOCAL_STEPS,
    NUM_EXAMPLES,
    STRATEGY,
    shapes_of,
)
from fedfields.flower.reply_gate import CheckedReply, ReplyGate
from fedfields.flower.round import Round, RoundOutcome, SumRules
from fedfields.flower.round_ledger import RoundLedger
from fedfields.flower.round_loop import EvaluateFn, RoundEndFn, RoundLoop
from fedfields.flower.round_privacy import RoundPrivacy
from fedfields.flower.sampling import NodeSampler
from fedfields.flower.strategy_options import (
    DEFAULT_MAX_EMPTY_ROUNDS,
    DEFAULT_MAX_NUM_EXAMPLES,
    DEFAULT_MAX_UPDATE_NORM,
    RunConfigured,
    check_local_steps,
    check_max_empty_rounds,
    checked_compression,
    merged_train_config,
)
from fedfields.flower.upload_compression import compression_entries
from fedfields.flower.user_keys import UserKeys
from fedfields.methods import FEDAVG_COST, CostModel
from fedfields.methods.settings import optional_cap
from fedfields.privacy.dp import DPConfig
from fedfields.privacy.secagg_plan import SecureAggregationConfig


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
    """Under DP, the key s of the ARRAYS record whose update is x - s g (DecentNeRF's alpha_k:
    alpha_k g_k - alpha_k g); "": x - g."""
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
        (`fedfields.flower.user_keys`), so one seed gives one run; without it (the default:
        a stock ClientApp has no handler for the query, and Flower logs an ERROR for each
        node asked) in node-id order, which Flower draws at random in simulation."""
        self.flower_round: Round | None = None
        """The round Flower's `configure_train` opened (for a loop other than `start`'s, whose
        `aggregate_train` takes only replies); `start`'s own loop passes rounds as values."""
        self.rounds_started = 0
        self.rounds_aggregated = 0
        """Rounds that formed an aggregate, over the whole run (resumed runs included)."""
        checks = (self.weight_metric, self.min_train_nodes)
        self.privacy = RoundPrivacy.of_strategy(
            differential_privacy, secure_aggregation, self.dp_sums_per_round, self.dp_delta_scale,
            checks,
        )  # fmt: skip
        """Client-level DP's state (`fedfields.flower.round_privacy`): its settings, the run's
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
        own |= compression_entries(self.compression, self.dp_delta_scale)
        if self.local_steps is not None:
            own[LOCAL_STEPS] = self.local_steps
        if self.secure_aggregation is not None:
            own |= self.sum_rules().secure_config(self.privacy)
        return own

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
        """Noised sums a round makes over its sampled clients (DecentNeRF adds the gradient
        query's from round 2); the DP accountant's hook."""
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
        gradient-query message's ARRAYS is each node's own: `node_contents`)."""
        users = train_round.ledger.users
        contents, sent = node_contents(self.downloads, content, message_type, users)
        return train_round.messages(contents, sent, message_type)

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
        """Flower's `Strategy.start` loop, resumable (`fedfields.flower.round_loop.RoundLoop`):
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
        if self.privacy is not None:
            self.privacy.restore(state)
        if self.downloads is not None:
            self.downloads.restore(state["downloads"])
