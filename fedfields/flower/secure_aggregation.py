"""Client side of secure aggregation: hold replies back, answer Flower SecAgg+ stages.

`secure_aggregation_mod` wraps every ClientApp handler. For a message whose CONFIG asks for
secure aggregation it runs the handler, keeps the reply's ArrayRecords and scalar metrics in
`context.state` (multiplied by the "secure-weight" metric, as differences for "secure-delta"
records) and replies with their names only. SecAgg+ messages go to Flower's
`secaggplus_mod`, whose masked-vector stage is answered from what was held: exponent
one-hots ("bounds") or the scaled payload ("payload"); under compression 'quantise' the
payload goes as b-bit codes packed several to a masked integer (`fedfields.privacy.packed_sum`),
the update's residual kept in the node's state for its next round. The plaintext weight of
every SecAgg+ reply is 1 and its metrics are empty, so nothing but masked vectors identifies
the client.

Distributed DP: when CONFIG carries "dp-clip-norm", "dp-noise-multiplier" z and
"dp-min-holders" t, the held records (differences for "secure-delta" records, x - s g with
"secure-delta-scale" s) are clipped to C over all of them jointly and N(0, z^2 C^2 / t) is
added to every entry, from a secret-seeded generator, before anything is held: a secure sum
of t clients then carries std z C, and no unnoised update leaves this function. The client
answers a SecAgg+ setup only if its reconstruction threshold is at least t, so no sum of
fewer shares can be unmasked (`check_threshold`). The held metrics are not noised; under DP
the server asks for none of them (docs/PRIVACY.md). A node whose node-config sets
"dp-min-noise-multiplier" refuses (before training) every train or gradient message that
does not carry distributed DP with at least that z: a server cannot talk it into less noise.

Errors: Flower forwards a ClientApp exception's text to the server as the reply's error
reason. In secure mode (a SecAgg+ stage, a message whose CONFIG asks for secure aggregation,
or run-config `secure-aggregation` on) an exception raised below this mod reaches the server
as `SecureModeClientError` naming only the exception's type; the full message, which may hold
a loss, a norm or a shape of the client's data, is logged on the node only. A
`ValueFreeError` (a refusal that names settings and tensors, no values) goes through as is.
"""

from __future__ import annotations

import hashlib
import math
from logging import ERROR

import numpy as np
import torch
from flwr.app import (
    ArrayRecord,
    ConfigRecord,
    Context,
    Error,
    Message,
    MessageType,
    MetricRecord,
    RecordDict,
)
from flwr.client.mod import secaggplus_mod
from flwr.clientapp.typing import ClientAppCallable
from flwr.common.logger import log
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Stage
from flwr.common.secure_aggregation.secaggplus_constants import Key as SecAggKey
from torch import Tensor

from fedfields.flower.node import NodeState, user_key
from fedfields.flower.protocol import (
    ARRAYS,
    CONFIG,
    DP_CLIP_NORM,
    DP_COUNT_STDDEV,
    DP_GRADIENT_CLIP_NORM,
    DP_MIN_HOLDERS,
    DP_NOISE_MULTIPLIER,
    DP_UNCLIPPED,
    GRADIENT_QUERY,
    HELD,
    HELD_METRICS,
    HELD_RECORDS,
    METRICS,
    SECURE_AGGREGATION,
    SECURE_DELTA,
    SECURE_DELTA_SCALE,
    SECURE_SUM_CLIPPING,
    SECURE_SUM_LAYOUT,
    SECURE_SUM_MAX_EXPONENT,
    SECURE_SUM_PACKING,
    SECURE_SUM_SCALES,
    SECURE_SUM_STAGE,
    SECURE_WEIGHT,
    SERVER_ROUND,
    WEIGHT_KEY,
    arrays_to_state,
    fallback_key,
    state_to_arrays,
)
from fedfields.flower.upload_compression import RESIDUAL, requested_compression
from fedfields.privacy.adaptive_clipping import combined_noise_multiplier
from fedfields.privacy.dp import (
    clip_records,
    distributed_noise_std,
    noise_generator,
    noised_records,
    scaled_difference,
    share_std,
)
from fedfields.privacy.packed_sum import Packing, coded_entries, packed_vectors
from fedfields.privacy.secagg_plan import (
    CLIENT_WEIGHT,
    EXPONENT_MAX,
    ValueFreeError,
    bound_vectors,
    check_payload,
    decode_layout,
    scaled_vectors,
)

HELD_PREFIX = "secure-held/"
"""context.state keys of the held records: HELD_PREFIX + record name."""
ROUNDING_STATE = "secure-rounding"
"""context.state key: the seed of the held payload's quantised codes, and under compression
'quantise' the weight and keys its error feedback divides out and keeps."""
CALIBRATED_STATE = "secure-dp-calibration"
"""context.state key: the "dp-min-holders" t the held noise share was calibrated to."""
SECURE_RUN_CONFIG = "secure-aggregation"
"""Run-config key that, when true, puts every message of the run in secure mode."""


class SecureModeClientError(RuntimeError):
    """What the server learns of a ClientApp failure in secure mode: the exception's type."""


NOISE_FLOOR_KEY = "dp-min-noise-multiplier"
"""Node-config: the least noise multiplier z this node adds its share of (0 or absent: none)."""


def check_noise_floor(msg: Message, context: Context) -> None:
    """ValueError if this node's node-config sets a `NOISE_FLOOR_KEY` and `msg` (a train or
    gradient-query message) asks for less distributed DP than the floor: a plaintext message,
    a secure one below the floor's z, or one without what the node needs to clip and noise its
    share (a positive, finite "dp-clip-norm", "dp-min-holders" >= 2) or that weights the held
    payload by a metric (the weight's sum is released unnoised)."""
    floor = noise_floor(context)
    config = msg.content.config_records.get(CONFIG)
    updating = msg.metadata.message_type in (MessageType.TRAIN, GRADIENT_QUERY)
    if floor <= 0 or config is None or not updating:
        return
    if RECORD_KEY_CONFIGS in msg.content.config_records:  # a SecAgg+ stage of a checked one
        return
    refusal = floor_refusal(config, floor)
    if refusal:
        raise ValueError(
            f"node-config {NOISE_FLOOR_KEY} = {floor:g}: this node adds its noise share only "
            f"under secure aggregation with dp-noise-multiplier >= {floor:g}; {refusal}"
        )


def noise_floor(context: Context) -> float:
    """This node's node-config `NOISE_FLOOR_KEY` (0: none); ValueError if not a finite number
    >= 0, so a mistyped floor never silently means none."""
    value = context.node_config.get(NOISE_FLOOR_KEY, 0.0)
    try:
        floor = float(value)
    except (TypeError, ValueError):
        floor = math.nan
    if isinstance(value, bool) or not (math.isfinite(floor) and floor >= 0):
        raise ValueError(f"node-config {NOISE_FLOOR_KEY} must be a number >= 0, got {value!r}")
    return floor


def floor_refusal(config: ConfigRecord, floor: float) -> str:
    """Why a train config falls short of a node's noise floor ("" when it does not)."""
    if not bool(config.get(SECURE_AGGREGATION, False)):
        return "the server asked for a plaintext reply"
    z = requested_multiplier(config)
    if not z >= floor:
        return f"the server asked for z = {z:g}"
    norms = [DP_CLIP_NORM] + ([DP_GRADIENT_CLIP_NORM] if DP_GRADIENT_CLIP_NORM in config else [])
    for key in norms:
        norm = _number(config.get(key))
        if not (math.isfinite(norm) and norm > 0):
            return f"the message's {key!r} is {config.get(key)!r}, not a positive finite norm"
    holders = _number(config.get(DP_MIN_HOLDERS))
    if not (math.isfinite(holders) and holders >= 2 and holders == int(holders)):
        return f"the message's {DP_MIN_HOLDERS!r} is {config.get(DP_MIN_HOLDERS)!r}, not >= 2"
    if config.get(SECURE_WEIGHT, ""):
        return f"the message weights the held payload by {config[SECURE_WEIGHT]!r}, unnoised"
    return ""


def _number(value: object) -> float:
    """`value` as a float, NaN for anything that is not a number."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return math.nan
    return float(value)


def check_floor_stage(layout: list[tuple[str, str, tuple[int, ...]]], context: Context) -> None:
    """ValueFreeError if this node has a noise floor and a SecAgg+ stage asks it to sum a held
    metric other than the weight and the noised clipping bit: the rest carry no noise."""
    if noise_floor(context) <= 0:
        return
    unnoised = sorted(
        key for record, key, _ in layout if record == METRICS and key not in NOISED_METRICS
    )
    if unnoised:
        raise ValueFreeError(
            f"node-config {NOISE_FLOOR_KEY}: the SecAgg+ stage asks for held metrics that "
            f"carry no noise ({', '.join(unnoised)}); this node sums only {NOISED_METRICS}"
        )


NOISED_METRICS = (WEIGHT_KEY, DP_UNCLIPPED)
"""Held metrics a node with a noise floor takes part in summing: the weight (1 per client
under DP, which the fixed-size sample makes public) and the noised clipping bit."""


def requested_multiplier(config: ConfigRecord) -> float:
    """The z a DP train config asks for: "dp-noise-multiplier", or under adaptive clipping
    what it composes to with the count's "dp-clipped-count-stddev" (`combined_noise_multiplier`).
    """
    z = float(config.get(DP_NOISE_MULTIPLIER, 0.0))
    return combined_noise_multiplier(z, float(config.get(DP_COUNT_STDDEV, 0.0)))


def secure_aggregation_mod(msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
    """Route SecAgg+ stages to Flower's mod; hold back replies of secure-mode messages.

    In secure mode (`in_secure_mode`) a failure below reaches the server as the exception's
    type only (module docstring); the full error is logged on this node.
    """
    check_noise_floor(msg, context)
    if not in_secure_mode(msg, context):
        return _route(msg, context, call_next)
    try:
        reply = _route(msg, context, call_next)
    except ValueFreeError:
        raise
    except Exception as error:
        kind = type(error).__name__
        log(ERROR, "secure mode: the ClientApp raised %s (the server learns the type only)", kind)
        log(ERROR, "%s: %s", kind, error, exc_info=error)
        raise SecureModeClientError(
            f"{kind} in the ClientApp (secure mode: the message stays in the node's log)"
        ) from None
    if reply.has_error():  # a handler's own Error reply: its reason may hold values too
        log(ERROR, "secure mode: the handler replied with an error: %s", reply.error.reason)
        reason = "the handler replied with an error (secure mode: the reason stays on the node)"
        return Message(Error(code=reply.error.code, reason=reason), reply_to=msg)
    return reply


def in_secure_mode(msg: Message, context: Context) -> bool:
    """A SecAgg+ stage, a message whose CONFIG asks for secure aggregation, or a run whose
    run-config turns `secure-aggregation` on."""
    if RECORD_KEY_CONFIGS in msg.content.config_records:
        return True
    config = msg.content.config_records.get(CONFIG)
    if config is not None and bool(config.get(SECURE_AGGREGATION, False)):
        return True
    return context.run_config.get(SECURE_RUN_CONFIG, False) is True


def _route(msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
    """SecAgg+ stages to Flower's mod, secure messages held back, others straight through."""
    if RECORD_KEY_CONFIGS in msg.content.config_records:
        if msg.metadata.message_type != MessageType.TRAIN:
            raise ValueError("SecAgg+ stages must arrive as 'train' messages")
        check_threshold(msg, context)
        return _seeded_secaggplus(msg, context)
    config = msg.content.config_records.get(CONFIG)
    if config is None or not bool(config.get(SECURE_AGGREGATION, False)):
        return call_next(msg, context)
    reply = call_next(msg, context)
    if reply.has_error():
        return reply
    held = hold(msg, reply, context)
    return Message(RecordDict({HELD: held}), reply_to=msg)


def _seeded_secaggplus(msg: Message, context: Context) -> Message:
    """Flower's `secaggplus_mod` over `_answer_stage`, numpy's global generator seeded for the
    call from the held rounding seed and the stage's group and restored after: Flower's
    quantiser rounds each float at random with `np.random` (its masks draw from their own
    secret-seeded generators), so one seed gives one secure run; rounding needs no secrecy."""
    rounding = context.state.get(ROUNDING_STATE, ConfigRecord())
    text = f"{rounding.get('seed', 0)}/{msg.metadata.group_id}"
    seed = int.from_bytes(hashlib.sha256(text.encode()).digest()[:4], "little")
    saved = np.random.get_state()
    np.random.seed(seed)
    try:
        return secaggplus_mod(msg, context, _answer_stage)
    finally:
        np.random.set_state(saved)


def hold(msg: Message, reply: Message, context: Context) -> ConfigRecord:
    """Keep `reply`'s arrays and scalar metrics in `context.state`; return their names.

    Everything is multiplied by the weight w (the CONFIG "secure-weight" metric, else 1);
    w itself goes under WEIGHT_KEY of the METRICS pseudo-record. Under compression 'quantise'
    the held update carries the node's residual (error feedback) and the rounding seed is kept.
    """
    config = msg.content[CONFIG]
    metrics = dict(reply.content.metric_records.get(METRICS, MetricRecord()))
    weight_name = str(config.get(SECURE_WEIGHT, ""))
    weight = 1.0
    if weight_name:
        if weight_name not in metrics:
            raise ValueError(f"reply lacks the metric {weight_name!r} that weights its payload")
        weight = float(metrics.pop(weight_name))
    delta_records = set(config.get(SECURE_DELTA, []))
    scale_key = str(config.get(SECURE_DELTA_SCALE, ""))
    _clear_held(context)
    feedback = _quantised_update(config, delta_records)
    rounding: dict[str, int | float | list[str]] = {"seed": rounding_seed(msg, context)}
    held: dict[str, dict[str, Tensor]] = {}
    for name, record in reply.content.array_records.items():
        state = arrays_to_state(record)
        if name in delta_records:
            reference = arrays_to_state(msg.content[name])
            state = scaled_difference(state, reference, scale_key)
            if feedback and name == ARRAYS:
                state = _with_residual(state, NodeState(context).tensors(RESIDUAL) or {})
                rounding |= {"weight": weight, "keys": sorted(reference)}
        held[name] = {key: value.double() * weight for key, value in state.items()}
    context.state[ROUNDING_STATE] = ConfigRecord(rounding)
    bit = None
    if DP_CLIP_NORM in config and held:
        query = msg.metadata.message_type == GRADIENT_QUERY
        held, bit = private_records(held, config, gradient_query=query)
        calibrated = {DP_MIN_HOLDERS: int(config[DP_MIN_HOLDERS])}
        context.state[CALIBRATED_STATE] = ConfigRecord(calibrated)
    records = []
    for name, state in held.items():
        context.state[HELD_PREFIX + name] = state_to_arrays(state)
        records.append(name)
    scalars = {
        key: torch.tensor([float(value) * weight], dtype=torch.float64)
        for key, value in metrics.items()
        if not isinstance(value, list)
    }
    scalars[WEIGHT_KEY] = torch.tensor([weight], dtype=torch.float64)
    if bit is not None:
        scalars[DP_UNCLIPPED] = torch.tensor([bit], dtype=torch.float64)
    context.state[HELD_PREFIX + METRICS] = state_to_arrays(scalars)
    return ConfigRecord({HELD_RECORDS: records, HELD_METRICS: sorted(scalars)})


def _quantised_update(config: ConfigRecord, delta_records: set[str]) -> bool:
    """Whether the held ARRAYS go as quantised codes with error feedback (compression
    'quantise' under SecAgg+, the update held as a difference)."""
    compression = requested_compression(config)
    quantised = compression is not None and compression.scheme == "quantise"
    return quantised and ARRAYS in delta_records


def _with_residual(update: dict[str, Tensor], residual: dict[str, Tensor]) -> dict[str, Tensor]:
    """`update` plus the residual the node kept from its last quantised upload; ValueFreeError
    when a kept residual has another shape (the node's state is from another model)."""
    corrected = dict(update)
    for key, value in residual.items():
        if key not in corrected or tuple(value.shape) != tuple(corrected[key].shape):
            raise ValueFreeError(
                f"the kept compression residual of {key!r} does not fit the model's update"
            )
        corrected[key] = corrected[key] + value.double()
    return corrected


def rounding_seed(msg: Message, context: Context) -> int:
    """The seed of this node's quantised codes for `msg`'s round: a hash of the run's seed, the
    node's user and the round, so one seed gives one run (rounding needs no secrecy: the
    masks hide the codes)."""
    try:
        user = user_key(context)
    except ValueError:
        user = fallback_key(context.node_id)
    server_round = msg.content[CONFIG].get(SERVER_ROUND, 0)
    text = f"{context.run_config.get('seed', 0)}/{user}/{server_round}/{msg.metadata.message_type}"
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little")


def private_records(
    records: dict[str, dict[str, Tensor]],
    config: ConfigRecord,
    generator: torch.Generator | None = None,
    *,
    gradient_query: bool = False,
) -> tuple[dict[str, dict[str, Tensor]], float | None]:
    """The records clipped to "dp-clip-norm" jointly plus this client's share of the noise,
    N(0, z^2 C^2 / (t - 1)) per entry (`distributed_noise_std`, t = "dp-min-holders", so one
    holder fewer than t still carries z C); under adaptive clipping ("dp-clipped-count-stddev"
    sigma_b) also the bit 1[norm <= C] plus N(0, sigma_b^2 / (t - 1)), else None. A
    `gradient_query` reply is clipped to "dp-gradient-clip-norm" (when sent) with the z the pair
    composes to, and has no bit. The generator is secret-seeded unless a test passes one."""
    holders = int(config[DP_MIN_HOLDERS])
    if holders < 2:
        raise ValueFreeError(f"{DP_MIN_HOLDERS} must be >= 2, got {holders}")
    clip_norm = float(config[DP_CLIP_NORM])
    z = float(config[DP_NOISE_MULTIPLIER])
    count_std = float(config.get(DP_COUNT_STDDEV, 0.0))
    if gradient_query:
        clip_norm = float(config.get(DP_GRADIENT_CLIP_NORM, clip_norm))
        z, count_std = requested_multiplier(config), 0.0
    generator = noise_generator() if generator is None else generator
    clipped, norm = clip_records(records, clip_norm)
    noised = noised_records(clipped, distributed_noise_std(z, clip_norm, holders), generator)
    if not count_std:
        return noised, None
    share = share_std(count_std, holders)
    noise = float(torch.randn((), generator=generator, dtype=torch.float64))
    return noised, float(norm <= clip_norm) + share * noise


def _clear_held(context: Context) -> None:
    """Forget what an earlier message held back (a new reply replaces it)."""
    for key in [key for key in context.state if key.startswith(HELD_PREFIX)]:
        del context.state[key]
    for key in (CALIBRATED_STATE, ROUNDING_STATE):
        if key in context.state:
            del context.state[key]


def check_threshold(msg: Message, context: Context) -> None:
    """ValueFreeError if `msg` is a SecAgg+ setup whose reconstruction threshold lies below
    the t this client's held noise share was calibrated to: a sum of fewer shares would carry
    less than z C, so this client drops out of it rather than take part. A node with a noise
    floor also refuses a setup when what it holds was never calibrated (held without noise)."""
    stage = msg.content.config_records[RECORD_KEY_CONFIGS]
    if stage.get(SecAggKey.STAGE) != Stage.SETUP:
        return
    if CALIBRATED_STATE not in context.state:
        if noise_floor(context) > 0 and _held_payload(context):
            raise ValueFreeError(
                f"node-config {NOISE_FLOOR_KEY}: this node holds a payload without its noise "
                "share and takes part in no sum of it"
            )
        return
    calibrated = int(context.state[CALIBRATED_STATE][DP_MIN_HOLDERS])
    threshold = int(stage.get(SecAggKey.THRESHOLD, 0))
    if threshold < calibrated:
        raise ValueFreeError(
            f"SecAgg+ setup asks for a reconstruction threshold of {threshold}, below the "
            f"{DP_MIN_HOLDERS} = {calibrated} this client's noise share was calibrated to"
        )


def _held_payload(context: Context) -> dict[str, dict[str, Tensor]]:
    """Record name -> held state."""
    return {
        key.removeprefix(HELD_PREFIX): arrays_to_state(context.state[key])
        for key in context.state
        if key.startswith(HELD_PREFIX)
    }


def _packed_payload(
    context: Context,
    payload: dict[str, dict[str, Tensor]],
    layout: list[tuple[str, str, tuple[int, ...]]],
    fit_config: ConfigRecord,
) -> list[np.ndarray]:
    """The payload as packed b-bit codes (`fedfields.privacy.packed_sum`), rounded with the
    held seed; under compression 'quantise' what the codes lost of the update is kept in the
    node's state (divided by the weight) for its next round."""
    try:
        packing = Packing.from_list(list(fit_config[SECURE_SUM_PACKING]))
        scales = [float(s) for s in fit_config[SECURE_SUM_SCALES]]
        values = [payload[record][key] for record, key, _ in layout]
        rounding = context.state.get(ROUNDING_STATE, ConfigRecord())
        generator = torch.Generator().manual_seed(int(rounding.get("seed", 0)))
        coded = coded_entries(layout, METRICS)
        vectors, decoded = packed_vectors(values, scales, coded, packing, generator)
    except ValueError as error:
        raise ValueFreeError(f"the packed secure-sum payload was refused: {error}") from None
    weight, keys = float(rounding.get("weight", 0.0)), set(rounding.get("keys", []))
    if keys and weight > 0:
        residual = {
            key: ((value - sent) / weight).float()
            for (record, key, _), value, sent in zip(layout, values, decoded, strict=True)
            if record == ARRAYS and key in keys
        }
        NodeState(context).put_tensors(RESIDUAL, residual)
    return vectors


def _answer_stage(msg: Message, context: Context) -> Message:
    """SecAgg+ masked-vector stage: this client's vectors, in Flower's legacy FitRes layout."""
    fit_config = msg.content["fitins.config"]
    layout = decode_layout(str(fit_config[SECURE_SUM_LAYOUT]))
    check_floor_stage(layout, context)
    held = _held_payload(context)
    payload = {record: held.get(record, {}) for record, _, _ in layout}
    wanted_metrics = {key for record, key, _ in layout if record == METRICS}
    payload[METRICS] = {k: v for k, v in payload.get(METRICS, {}).items() if k in wanted_metrics}
    check_payload(payload, layout)
    stage = fit_config[SECURE_SUM_STAGE]
    if stage == "bounds":
        cap = int(fit_config.get(SECURE_SUM_MAX_EXPONENT, EXPONENT_MAX))
        vectors = bound_vectors(payload, layout, cap)
    elif stage == "payload" and SECURE_SUM_PACKING in fit_config:
        vectors = _packed_payload(context, payload, layout, fit_config)
        _clear_held(context)
    elif stage == "payload":
        scales = [float(s) for s in fit_config[SECURE_SUM_SCALES]]
        vectors = scaled_vectors(payload, layout, scales, float(fit_config[SECURE_SUM_CLIPPING]))
        _clear_held(context)
    else:
        raise ValueError(f"unknown {SECURE_SUM_STAGE!r}: {stage!r}")
    return Message(
        RecordDict(
            {
                "fitres.parameters": ArrayRecord(vectors),
                "fitres.num_examples": MetricRecord({"num_examples": CLIENT_WEIGHT}),
                "fitres.metrics": ConfigRecord(),
                "fitres.status": ConfigRecord({"code": 0, "message": "Success"}),
            }
        ),
        reply_to=msg,
    )
