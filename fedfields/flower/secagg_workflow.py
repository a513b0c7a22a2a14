"""One secure sum of named tensors over chosen nodes with Flower's SecAggPlusWorkflow.

Flower's workflow drives a legacy (`flwr.server.strategy`) strategy inside a `LegacyContext`;
`_OneShotSum` is the smallest one it accepts: fixed nodes, one fit config, no evaluation, and
`aggregate_fit` keeping the unmasked result. Every client sends weight 1 (= max_weight), so the
workflow's weighted mean times the number of survivors is the exact sum; anything a client
wants weighted it multiplies into its masked vector itself. Clipping, quantisation and
scales come from `fedfields.privacy.secagg_plan`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from logging import INFO, WARNING

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict
from flwr.common import FitIns, Parameters, parameters_to_ndarrays
from flwr.common.logger import log
from flwr.server.client_manager import SimpleClientManager
from flwr.server.compat.legacy_context import LegacyContext
from flwr.server.strategy import Strategy as LegacyStrategy
from flwr.server.workflow import SecAggPlusWorkflow
from flwr.server.workflow.constant import MAIN_CONFIGS_RECORD, MAIN_PARAMS_RECORD
from flwr.server.workflow.constant import Key as WorkflowKey
from flwr.serverapp import Grid
from torch import Tensor

from fedfields.flower.protocol import (
    METRICS,
    SECURE_SUM_CLIPPING,
    SECURE_SUM_LAYOUT,
    SECURE_SUM_MAX_EXPONENT,
    SECURE_SUM_PACKING,
    SECURE_SUM_SCALES,
    SECURE_SUM_STAGE,
)
from fedfields.privacy.packed_sum import Packing, coded_entries, plan_packing, summed_values
from fedfields.privacy.secagg_plan import (
    CLIENT_WEIGHT,
    NUM_BUCKETS,
    LayoutEntry,
    SecureAggregationConfig,
    SecureAggregationError,
    encode_layout,
    plan_scales,
    unpack_sum,
)


@dataclass
class SecureSumResult:
    """Record -> key -> summed float64 tensor, the nodes in the sum and their masked bytes.

    `total_weight` is filled in by the strategy from the METRICS pseudo-record; `scales` are
    the per-tensor scales of the payload (its quantisation step is 2 * C * scale / Q);
    `resolution` bounds each sum's error: a sum within it of 0 may be 0 (n clients times
    one stochastic-rounding step each)."""

    sums: dict[str, dict[str, Tensor]]
    node_ids: list[int]
    bytes_up: int = 0
    total_weight: float = 0.0
    scales: list[float] | None = None
    resolution: dict[str, dict[str, float]] = field(default_factory=dict)


class _NodeProxy:
    """What the workflow reads of a legacy ClientProxy: its node id."""

    def __init__(self, node_id: int) -> None:
        self.node_id = node_id


class _OneShotSum(LegacyStrategy):
    """Legacy strategy for one SecAgg+ run: fixed nodes and fit config; keeps the results."""

    def __init__(self, node_ids: Sequence[int], fit_config: Mapping[str, object]) -> None:
        self.node_ids = list(node_ids)
        self.fit_config = dict(fit_config)
        self.results: list = []
        self.aggregated = False

    def configure_fit(self, server_round, parameters, client_manager):  # noqa: ANN001, ANN201
        """Every chosen node gets the (empty) parameters and the stage's fit config."""
        return [(_NodeProxy(n), FitIns(parameters, dict(self.fit_config))) for n in self.node_ids]

    def aggregate_fit(self, server_round, results, failures):  # noqa: ANN001, ANN201
        """Called once the workflow unmasked the sum; results hold the survivors."""
        self.results, self.aggregated = list(results), True
        return (results[0][1].parameters, {}) if results else (None, {})

    def initialize_parameters(self, client_manager):  # noqa: ANN001, ANN201
        """Unused: the message-API strategy owns the parameters."""
        return None

    def configure_evaluate(self, server_round, parameters, client_manager):  # noqa: ANN001, ANN201
        """No evaluation in a secure sum."""
        return []

    def aggregate_evaluate(self, server_round, results, failures):  # noqa: ANN001, ANN201
        """No evaluation in a secure sum."""
        return None, {}

    def evaluate(self, server_round, parameters):  # noqa: ANN001, ANN201
        """No evaluation in a secure sum."""
        return None


class SecureSum:
    """Sums tensors the clients hold back, securely: the server learns the sum only.

    With `config.clipping_range` 0 it first sums per-tensor exponent one-hots (one SecAgg+
    run) to pick power-of-two scales, capped at 2^`config.max_exponent` whatever a client
    declares (`fedfields.privacy.secagg_plan.plan_scales`), then sums the scaled payload (a
    second run); with a fixed clipping range it runs once and clients refuse values beyond it;
    with `dp_range` (distributed DP) it runs once with every record's scale set from C, z and
    t, reading nothing of the noised values. Every run takes `min_holders` t as its
    reconstruction threshold: fewer than t clients' vectors are never unmasked. With `bits`
    (compression 'quantise') the payload goes as b-bit codes packed several to a masked
    integer (`fedfields.privacy.packed_sum`), the weight, metrics and one-value tensors at
    full precision.
    """

    def __init__(self, config: SecureAggregationConfig, bits: int = 0) -> None:
        self.config = config
        self.bits = bits

    def __call__(
        self,
        grid: Grid,
        node_ids: Sequence[int],
        layout: Sequence[LayoutEntry],
        server_round: int,
        min_holders: int | None = None,
        dp_range: tuple[float, float] | None = None,
    ) -> SecureSumResult:
        """Secure sum of `layout`'s tensors over `node_ids`, unmasked from at least
        `min_holders` clients' vectors (default: the threshold of `node_ids`);
        SecureAggregationError if halted or refused. With `dp_range` (records, metrics) every
        record is scaled by the first, METRICS (the weights and noised bits) by the second.
        """
        node_ids = list(node_ids)
        if min_holders is None:
            min_holders = self.config.min_holders(len(node_ids))
        if len(node_ids) < min_holders:
            raise SecureAggregationError(
                f"round {server_round}: {len(node_ids)} clients hold a payload, fewer than the "
                f"{min_holders} a sum of this round may be unmasked from (the reconstruction "
                "threshold of its sample, from secagg-reconstruction-threshold and "
                f"secagg-num-shares = {self.config.num_shares:g}); nothing was unmasked"
            )
        bytes_up = 0
        common = {SECURE_SUM_LAYOUT: encode_layout(layout)}
        if dp_range is not None:
            record_range, metric_range = dp_range
            scales = [metric_range if r == METRICS else record_range for r, _, _ in layout]
            clipping = 1.0
        elif self.config.clipping_range > 0 and self.bits:
            scales, clipping = [self.config.clipping_range] * len(layout), 1.0
        elif self.config.clipping_range > 0:
            scales, clipping = [1.0] * len(layout), self.config.clipping_range
        else:
            bounds_config = {
                **common,
                SECURE_SUM_STAGE: "bounds",
                SECURE_SUM_MAX_EXPONENT: self.config.max_exponent,
            }
            bounds, node_ids = self._run(
                grid, node_ids, bounds_config, 1.0, server_round, min_holders
            )
            bytes_up += _masked_bytes(bounds, len(node_ids))
            if any(vector.size != NUM_BUCKETS for vector in bounds):
                raise SecureAggregationError("bounds stage returned vectors of the wrong length")
            plan = plan_scales(bounds, self.config.max_exponent, len(node_ids))
            _log_overruled(plan.capped, plan.malformed, layout, self.config.max_exponent)
            scales, clipping = plan.scales, 1.0
        payload_config = {
            **common,
            SECURE_SUM_STAGE: "payload",
            SECURE_SUM_SCALES: scales,
            SECURE_SUM_CLIPPING: clipping,
        }
        if self.bits:
            packing = plan_packing(self.bits, len(node_ids), self.config.modulus_range)
            payload_config[SECURE_SUM_PACKING] = packing.as_list()
            levels = packing.levels
        else:
            levels = self.config.quantization_range(len(node_ids))
        vectors, survivors = self._run(
            grid, node_ids, payload_config, clipping, server_round, min_holders, levels
        )
        bytes_up += _masked_bytes(vectors, len(survivors))
        if self.bits:
            sums, steps = _unpacked_sum(vectors, layout, scales, packing, len(survivors))
        else:
            sums = unpack_sum(vectors, layout, scales)
            steps = [2 * clipping / levels] * len(layout)
        resolution: dict[str, dict[str, float]] = {}
        for (record, key, _), scale, step in zip(layout, scales, steps, strict=True):
            resolution.setdefault(record, {})[key] = len(node_ids) * step * scale
        return SecureSumResult(
            sums, survivors, bytes_up, scales=list(scales), resolution=resolution
        )

    def _run(
        self,
        grid: Grid,
        node_ids: list[int],
        fit_config: Mapping[str, object],
        clipping_range: float,
        server_round: int,
        min_holders: int,
        levels: int | None = None,
    ) -> tuple[list[np.ndarray], list[int]]:
        """One SecAggPlusWorkflow over `node_ids` with reconstruction threshold `min_holders`
        (a count) and `levels` quantisation levels (default: the most without overflow): the
        summed vectors and the survivors."""
        stage = fit_config[SECURE_SUM_STAGE]
        if len(node_ids) < max(min_holders, 2):
            raise SecureAggregationError(
                f"round {server_round}: a secure sum of this round needs at least "
                f"{max(min_holders, 2)} clients, {len(node_ids)} reached the {stage} stage; "
                "nothing was unmasked"
            )
        shim = _OneShotSum(node_ids, fit_config)
        workflow = SecAggPlusWorkflow(
            num_shares=self.config.flower_num_shares,
            reconstruction_threshold=min_holders,
            max_weight=CLIENT_WEIGHT,
            clipping_range=clipping_range,
            quantization_range=levels or self.config.quantization_range(len(node_ids)),
            modulus_range=self.config.modulus_range,
            timeout=self.config.timeout or None,
        )
        context = LegacyContext(
            Context(run_id=0, node_id=0, node_config={}, state=RecordDict(), run_config={}),
            strategy=shim,
            client_manager=SimpleClientManager(),
        )
        context.state[MAIN_CONFIGS_RECORD] = ConfigRecord({WorkflowKey.CURRENT_ROUND: server_round})
        context.state[MAIN_PARAMS_RECORD] = ArrayRecord()
        recorder = _ErrorRecorder(grid)
        workflow(recorder, context)  # type: ignore[arg-type]  # it only sends and receives
        if not shim.aggregated or not shim.results:
            shares = self.config.shares_and_threshold(len(node_ids))[0]
            reasons = "; ".join(recorder.errors[:3]) or "none reported (timeouts?)"
            raise SecureAggregationError(
                f"round {server_round}: SecAgg+ {stage} stage over {len(node_ids)} clients halted: "
                f"too few clients or key shares survived (each client needs {min_holders} of its "
                f"{min(shares, len(node_ids))} neighbours' shares); nothing was unmasked. "
                f"Client errors: {reasons}"
            )
        survivors = sorted(proxy.node_id for proxy, _ in shim.results)
        mean = parameters_to_ndarrays(_parameters(shim.results))
        log(INFO, "secure sum (%s): %d of %d clients", stage, len(survivors), len(node_ids))
        return [array * len(survivors) for array in mean], survivors


class _ErrorRecorder:
    """The grid as SecAggPlusWorkflow uses it, keeping the reasons of clients' error replies."""

    def __init__(self, grid: Grid) -> None:
        self.grid = grid
        self.errors: list[str] = []

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> list[Message]:
        """Forward to the grid; record 'node N: reason' for each error reply."""
        replies = list(self.grid.send_and_receive(messages, timeout=timeout))
        self.errors += [
            f"node {reply.metadata.src_node_id}: {reply.error.reason}"
            for reply in replies
            if reply.has_error()
        ]
        return replies


def _log_overruled(
    capped: Sequence[int], malformed: Sequence[int], layout: Sequence[LayoutEntry], cap: int
) -> None:
    """Warn about tensors whose bounds a client declared beyond the cap or sent malformed
    (a liar or a misconfigured client; the secure sum cannot tell which one)."""
    names = [f"{layout[i][0]}/{layout[i][1]}" for i in capped]
    if names:
        log(
            WARNING,
            "secure sum: a client declared bounds above 2^%d (secagg-max-exponent) for %s; "
            "their scale is capped at 2^%d",
            cap,
            names,
            cap,
        )
    names = [f"{layout[i][0]}/{layout[i][1]}" for i in malformed]
    if names:
        log(
            WARNING,
            "secure sum: the bounds of %s are no sum of one-hots (a client sent a malformed "
            "bounds vector); their scale falls back to the cap 2^%d",
            names,
            cap,
        )


def _unpacked_sum(
    vectors: Sequence[np.ndarray],
    layout: Sequence[LayoutEntry],
    scales: Sequence[float],
    packing: Packing,
    num_clients: int,
) -> tuple[dict[str, dict[str, Tensor]], list[float]]:
    """Summed packed vectors back to record -> key -> float64 tensor (`packed_sum`), and each
    entry's quantisation step in units of its scale (2 / (2^b - 1) for codes, 2 / Q else)."""
    if len(vectors) != len(layout):
        raise SecureAggregationError(f"secure sum returned {len(vectors)} arrays for {len(layout)}")
    coded = coded_entries(list(layout), METRICS)
    counts = [math.prod(shape) for _, _, shape in layout]
    values = summed_values(list(vectors), counts, coded, packing, num_clients)
    sums: dict[str, dict[str, Tensor]] = {}
    for (record, key, shape), value, scale in zip(layout, values, scales, strict=True):
        sums.setdefault(record, {})[key] = value.reshape(shape) * scale
    steps = [2 / (2**packing.bits - 1) if c else 2 / packing.levels for c in coded]
    return sums, steps


def _masked_bytes(vectors: Sequence[np.ndarray], num_clients: int) -> int:
    """Bytes of the clients' masked uploads: 8-byte integers, plus the weight factor."""
    return num_clients * 8 * (1 + sum(vector.size for vector in vectors))


def _parameters(results: list) -> Parameters:
    """The unmasked mean the workflow wrote into every FitRes (all the same object)."""
    return results[0][1].parameters
