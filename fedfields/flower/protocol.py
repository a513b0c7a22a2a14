"""The fedfields message protocol on Flower 1.41 records, and state-dict <-> record conversion.

Strategies and client helpers (`fedfields.flower`) and this repository's ClientApp name records,
config keys and metric keys through these constants only.

Train message (server -> client), records by name:
  ARRAYS          global federated state g (what the method's `sent` returns)
  CONFIG          "server-round", "strategy", "local-steps", the method's own entries
                  (`Method.client_config`), "compression" and its strength,
                  with G the method's `query_config` entries, plus the user's train config
  ...             any other record the method sends (`Method.sent`)
  GRADIENT        a method with a gradient query, from round 2: G = sum_k G_k
                  (with "gradient-compressed" in CONFIG: G's compressed record)
Train reply (client -> server):
  ARRAYS          local state; a payload scaled by the client's weight s: s x plus s under
                  the scale's key (`fedfields.methods.base.ScaleSpec`)
  METRICS         "num-examples" (pixels; the mean's weight), "train-loss", "train-psnr"
  ...             the method's other reply records (`Method.reply_records`)
  With "compression" in CONFIG, ARRAYS holds the record of the compressed update (local
  state minus the ARRAYS received; `fedfields.compression`) instead of the state, and each
  other compressed reply record its own compressed record.
  With "download-version" in a train message's CONFIG, its ARRAYS is a compressed download
  (`fedfields.flower.compressed_downloads`) the node's mod rebuilds into the global before
  the handler.
Gradient query (`Method.gradient_query`, message type GRADIENT_QUERY): ARRAYS g^(m-1) and
CONFIG out, GRADIENT G_k = dL_k/dg at g^(m-1) back.

Secure aggregation (CONFIG "secure-aggregation" true): a train or gradient reply carries no
arrays and no per-client metrics, only HELD (the names of the records and metrics the client
holds back). The server then sums what the clients hold with Flower's SecAgg+ over "train"
messages whose legacy fit config carries the SECURE_SUM_* entries
(`fedfields.flower.secagg_workflow`, `fedfields.flower.secure_aggregation`): metrics travel
masked in the METRICS pseudo-record together with the client's weight under WEIGHT_KEY (its
"secure-weight" metric, or 1).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np
import torch
from flwr.app import (
    Array,
    ArrayRecord,
    ConfigRecord,
    Message,
    MessageType,
    MetricRecord,
    RecordDict,
)
from torch import Tensor

from fedfields.methods.base import (  # noqa: F401 (re-exported: the protocol's shared names)
    ARRAYS,
    CONFIG,
    GRADIENT,
    LOCAL_STEPS,
    METRICS,
    NUM_EXAMPLES,
    SERVER_ROUND,
    TRAIN_STEPS,
)

# ------------------------------------------------------------------ record names
# ARRAYS, CONFIG and METRICS (and the keys every method shares: "local-steps",
# "num-examples", "train-steps") and GRADIENT come from `fedfields.methods.base`; a method's
# own records and keys live in its module (a control variate's records in that method's module).

GRADIENT_QUERY = "query.gradient"
"""Message type of a method's gradient query before training (`Method.gradient_query`;
handler `@app.query("gradient")`)."""

# ------------------------------------------------------------------ train config keys
STRATEGY = "strategy"
RESUME_POINTS = "resume-points"
"""Train-config entry of a run continued from its checkpoint: the round each continuation
started after, comma-separated in order (absent before the first), so a node keeps only the
state versions the server's checkpoint kept (`fedfields.flower.node.RunAttempt`)."""

COMPRESSION = "compression"
"""The scheme replies compress their ARRAYS update with ("lowrank", "quantise", "topk";
absent: sent whole), with its strength under COMPRESSION_RANK, _BITS or _FRACTION
(`fedfields.flower.upload_compression`)."""
COMPRESSION_RANK = "compression-rank"
COMPRESSION_BITS = "compression-bits"
COMPRESSION_FRACTION = "compression-fraction"
COMPRESSION_DELTA_SCALE = "compression-delta-scale"
"""Train-config entry: the ARRAYS key s of a method whose payload is s x (`ScaleSpec`): the
compressed update is then s x - s g, and s is sent within it, whole in effect."""
DOWNLOAD_VERSION = "download-version"
"""Train-config entry of a compressed download (`fedfields.flower.compressed_downloads`): the
version t of the reference ARRAYS stands for."""
DOWNLOAD_BASE = "download-base"
"""Train-config entry: the version b the download's chain starts from (0: ARRAYS is R_t whole)."""
GRADIENT_COMPRESSED = "gradient-compressed"
"""Train-config entry under compressed downloads: GRADIENT holds the record of the query's G
compressed with the run's scheme, which the node's mod decompresses before the handler."""

SECURE_AGGREGATION = "secure-aggregation"
"""True: replies are held back and summed with SecAgg+ (see the module docstring)."""
SECURE_WEIGHT = "secure-weight"
"""Metric the client multiplies its held payload by (e.g. "num-examples"); absent: 1."""
SECURE_DELTA = "secure-delta"
"""Records (list) the client holds as reply minus the message's record of the same name."""
SECURE_DELTA_SCALE = "secure-delta-scale"
"""Key inside a "secure-delta" record whose value s scales the reference: held as x - s g
(a scaled payload's s x - s g under DP: `ScaleSpec`); absent: x - g."""
DP_CLIP_NORM = "dp-clip-norm"
"""Secure DP: the client clips all its held records jointly to this L2 norm C."""
DP_NOISE_MULTIPLIER = "dp-noise-multiplier"
"""Secure DP: z; the client adds N(0, z^2 C^2 / t) to its clipped records before masking."""
DP_COUNT_STDDEV = "dp-clipped-count-stddev"
"""Secure DP with adaptive clipping: sigma_b; the client also holds its bit 1[||Delta|| <= C]
plus N(0, sigma_b^2 / t) under DP_UNCLIPPED (`fedfields.privacy.adaptive_clipping`)."""
DP_GRADIENT_CLIP_NORM = "dp-gradient-clip-norm"
"""Secure DP: the clip norm of a gradient query's G_k (absent: dp-clip-norm)."""
DP_UNCLIPPED = "dp-unclipped"
"""Held metric under adaptive clipping: the client's noised unclipped bit, summed securely."""
DP_MIN_HOLDERS = "dp-min-holders"
"""Secure DP: t, the fewest clients a sum of this round is unmasked from (the SecAgg+
reconstruction threshold of every stage): t noise shares sum to std z C."""

# ------------------------------------------------------------------ metric keys
TRAIN_LOSS = "train-loss"
TRAIN_PSNR = "train-psnr"
CLIENT_SECONDS = "client-seconds"
"""Train metric: wall seconds of the client's train handler (compute, for overhead accounting)."""

# Server-side entries the strategies add to each round's aggregated train MetricRecord.
NUM_REPLIES = "num-replies"
NUM_FAILURES = "num-failures"
"""Replies of the round left out: error replies, unexpected replies and dropped ones."""
NUM_MISSING = "num-missing"
"""Sampled nodes that sent no reply within the round's timeout (present only when some did):
their updates are missing from the round, so a run's figure under load can differ."""
NUM_DROPPED = "num-dropped"
"""Replies that arrived but failed a check (`BadReply`) and were dropped unaggregated."""
DROPPED_PREFIX = "dropped-"
"""Prefix of the per-check drop counts, e.g. "dropped-non-finite" (present when non-zero)."""
BYTES_UP = "bytes-up"
BYTES_DOWN = "bytes-down"
NON_FINITE_AGGREGATE = "non-finite-aggregate"
"""1 when the round's aggregate held NaN or infinite values in the global's dtypes and was
refused (the global model stays as it was)."""

RESERVED_METRICS = frozenset(
    {
        NUM_REPLIES,
        NUM_FAILURES,
        NUM_MISSING,
        NUM_DROPPED,
        BYTES_UP,
        BYTES_DOWN,
        NON_FINITE_AGGREGATE,
    }
    | {"round", "seconds"}
)
"""Round metrics only the server writes: a reply's metric of that name is refused."""
RESERVED_METRIC_PREFIXES = ("dp-", "dropped-", "secure-", "users-", "upload-", "fedexp-")
"""Prefixes of the server's privacy, drop, secure-sum, sampling, leakage and FedExP metrics,
some written only in some runs (no "dp-epsilon" without DP): a reply's metric under one of
them would pass for the server's and is refused."""

# ------------------------------------------------------------------ split learning
SPLIT_STAGE = "split-stage"
"""CONFIG entry of a split-learning "train" message: "start", "step" or "finish"."""
SPLIT_STEP = "split-step"
SAMPLES = "samples"
"""Client -> server: the next batch's rays ("origins", "directions") and bin "edges"."""
EMBEDDINGS = "embeddings"
"""Server -> client: the cut-layer embeddings of the pending batch ("embeddings")."""
SERVER_PART = "server-part"
"""Server -> client at "finish": the server part's state, to assemble the joint field."""

# ------------------------------------------------------------------ secure sums
CLIENT = "client"
"""Meta-learning reply ConfigRecord naming the client: CLIENT_INDEX, its index among the N."""
CLIENT_INDEX = "index"
HELD = "held"
"""ConfigRecord of a secure-mode reply: "records" and "metrics" the client holds back."""
HELD_RECORDS = "records"
HELD_METRICS = "metrics"
WEIGHT_KEY = "__weight__"
"""Key of the client's weight in the METRICS pseudo-record of a secure sum."""
PROTOCOL_HELD_METRICS = frozenset({WEIGHT_KEY, DP_UNCLIPPED})
"""Held metrics `secure_aggregation_mod` itself writes (not the ClientApp's)."""
SECURE_SUM_STAGE = "secure-sum-stage"
"""Fit-config entry of a SecAgg+ stage: "bounds" (exponent one-hots) or "payload"."""
SECURE_SUM_LAYOUT = "secure-sum-layout"
SECURE_SUM_SCALES = "secure-sum-scales"
SECURE_SUM_CLIPPING = "secure-sum-clipping"
SECURE_SUM_MAX_EXPONENT = "secure-sum-max-exponent"
"""Fit-config entry of the bounds stage: the cap e (secagg-max-exponent) of a declared 2^e."""
SECURE_SUM_PACKING = "secure-sum-packing"
"""Payload-stage config: the `fedfields.privacy.packed_sum.Packing` of quantised codes."""

Shapes = Mapping[str, tuple[int, ...]]


@dataclass(frozen=True)
class ReplyParts:
    """A client's reply before it is sent: its records and its METRICS (None: no METRICS),
    so that an app adds its own entries (timings, names) in one place, then sends one Message."""

    records: Mapping[str, ArrayRecord | ConfigRecord]
    metrics: Mapping[str, float] | None = None

    def message(self, msg: Message) -> Message:
        """The reply to `msg`: the records, then METRICS."""
        content = RecordDict(dict(self.records))
        if self.metrics is not None:
            content[METRICS] = MetricRecord(dict(self.metrics))
        return Message(content, reply_to=msg)


def state_to_arrays(state: Mapping[str, Tensor]) -> ArrayRecord:
    """ArrayRecord holding `state`'s tensors (detached, on CPU) under the same keys, in order."""
    record = ArrayRecord()
    for key, tensor in state.items():
        if tensor.dtype == torch.bfloat16:
            raise ValueError(f"key {key!r}: Flower records cannot carry bfloat16; cast it first")
        record[key] = Array(tensor.detach().cpu().numpy())
    return record


def arrays_to_state(record: ArrayRecord, *, copy: bool = True) -> dict[str, Tensor]:
    """CPU tensors from an ArrayRecord, keyed and ordered as the record.

    `copy=False` gives read-only views of the record's bytes (no decode copy): what a
    server that only reads a reply (checks and sums it) needs; never write into them.
    """
    state = {}
    for key, array in record.items():
        try:
            state[key] = _decoded(array) if copy else _read_only_view(array)
        except (TypeError, ValueError) as error:
            raise ValueError(f"key {key!r}: cannot decode the array ({error})") from None
    return state


def _decoded(array: Array) -> Tensor:
    """A tensor holding a copy of a Flower Array's values, in native byte order."""
    values = array.numpy()
    if not values.dtype.isnative:
        values = values.astype(values.dtype.newbyteorder("="))
    return torch.from_numpy(values)


def _read_only_view(array: Array) -> Tensor:
    """A tensor over a Flower Array's .npy bytes without copying them.

    The .npy header is parsed only far enough to find where the data starts; dtype and shape
    come from the Array's metadata and must account for exactly the bytes that follow.
    Anything unusual (Fortran order, big-endian data, another serialisation) is decoded
    the slow way, by numpy.
    """
    data = array.data
    if array.stype != "numpy.ndarray" or data[:6] != b"\x93NUMPY" or data[6] not in (1, 2):
        return _decoded(array)
    width = 2 if data[6] == 1 else 4
    start = 8 + width + int.from_bytes(data[8 : 8 + width], "little")
    header = data[8 + width : start]
    dtype = np.dtype(array.dtype)
    count = math.prod(array.shape)
    native = dtype.byteorder in ("=", "|") or dtype.itemsize == 1
    if b"'fortran_order': False" not in header or dtype.hasobject or not native:
        return _decoded(array)
    if len(data) - start != count * dtype.itemsize:
        raise ValueError(
            f"{len(data) - start} data bytes do not hold shape {array.shape} of {array.dtype}"
        )
    flat = np.frombuffer(data, dtype=dtype, count=count, offset=start)
    with warnings.catch_warnings():  # read-only by design: the caller never writes into it
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(flat.reshape(array.shape))


def shapes_of(record: ArrayRecord) -> dict[str, tuple[int, ...]]:
    """Key -> shape of each array in `record` (from its metadata, without decoding)."""
    return {key: tuple(array.shape) for key, array in record.items()}


def content_bytes(content: RecordDict) -> int:
    """Bytes of the ArrayRecords in a message's content (keys and array data)."""
    return sum(record.count_bytes() for record in content.array_records.values())


class BadReply(ValueError):
    """A reply that fails a check. `check` names the check ("missing-key", "shape",
    "non-finite", "num-examples", ...); the message names node, record and key, never a
    value the client sent. Strategies drop such a reply and count it as "dropped-<check>"."""

    def __init__(self, check: str, message: str) -> None:
        super().__init__(message)
        self.check = check


def reply_state(
    message: Message,
    record_name: str,
    expected_shapes: Shapes,
    expected_dtypes: Mapping[str, str] | None = None,
) -> dict[str, Tensor]:
    """The ArrayRecord `record_name` of a reply as read-only tensors (views of the message's
    bytes), or one `BadReply` naming the problem.

    Missing or unexpected keys, shapes other than `expected_shapes`, dtypes that break the
    dtype rule (`checked_dtype`) and non-finite floating values are all reported together
    with the sender's node id and the record name.
    """
    where = f"reply from node {message.metadata.src_node_id}, record {record_name!r}"
    if message.has_error():
        raise BadReply("error", f"{where}: the node reported an error: {message.error.reason}")
    record = message.content.get(record_name)
    if not isinstance(record, ArrayRecord):
        found = "nothing" if record is None else type(record).__name__
        raise BadReply("missing-record", f"{where}: expected an ArrayRecord, found {found}")
    return checked_state(record, expected_shapes, where, expected_dtypes)


def checked_state(
    record: ArrayRecord,
    expected_shapes: Shapes,
    where: str,
    expected_dtypes: Mapping[str, str] | None = None,
) -> dict[str, Tensor]:
    """`record` as read-only tensors after checking keys, shapes, dtypes (`checked_dtype`,
    against `expected_dtypes`, e.g. the global's; a float cast makes a copy) and finiteness
    after the cast (the values as they will be summed);
    one `BadReply` starting with `where` lists every problem (its `check` is the first's)."""
    problems: list[tuple[str, str]] = []
    missing = [key for key in expected_shapes if key not in record]
    extra = [key for key in record if key not in expected_shapes]
    if missing:
        problems.append(("missing-key", f"missing keys {missing}"))
    if extra:
        problems.append(("extra-key", f"unexpected keys {extra}"))
    try:
        state = arrays_to_state(record, copy=False)
    except ValueError as error:
        raise BadReply("decode", f"{where}: {error}") from None
    for key, tensor in state.items():
        if key not in expected_shapes:
            continue
        expected = tuple(expected_shapes[key])
        dtype = checked_dtype(tensor.dtype, (expected_dtypes or {}).get(key))
        if tuple(tensor.shape) != expected:
            problems.append(
                ("shape", f"key {key!r} has shape {tuple(tensor.shape)}, expected {expected}")
            )
        elif dtype is None:
            wanted = (expected_dtypes or {}).get(key, "a float dtype")
            problems.append(("dtype", f"key {key!r} has dtype {tensor.dtype}, expected {wanted}"))
        else:
            # checked as it will be summed: a float64 1e39 is finite, but inf in float32
            cast = tensor.to(dtype) if dtype != tensor.dtype else tensor
            if cast.is_floating_point() and not _finite(cast):
                problems.append(("non-finite", f"key {key!r} has non-finite values in {dtype}"))
            state[key] = cast
    if problems:
        raise BadReply(problems[0][0], f"{where}: " + "; ".join(text for _, text in problems))
    return state


def checked_dtype(dtype: torch.dtype, expected: str | None) -> torch.dtype | None:
    """The dtype a reply's array is used in, or None if the dtype rule drops it.

    The rule: a floating array (float16, float32, float64) is cast to the expected floating
    dtype (the global's); an integer, bool or complex array where a float is expected is
    dropped, as is any array whose expected dtype is not floating and differs. With no
    expected dtype (a scaled payload's weight entry) any floating dtype is taken as it is.
    """
    if expected is None:
        return dtype if dtype.is_floating_point else None
    wanted = getattr(torch, str(expected), None)
    if not isinstance(wanted, torch.dtype):
        return None
    if wanted.is_floating_point:
        return wanted if dtype.is_floating_point else None
    return dtype if dtype == wanted else None


def _finite(tensor: Tensor) -> bool:
    """Whether every value is finite, in one pass: NaN and inf reach the sum, and a finite
    sum past the dtype's range (only possible with values near it) is checked element-wise."""
    total = float(tensor.sum())
    return math.isfinite(total) or bool(torch.isfinite(tensor).all())


def reserved_metric(name: str) -> bool:
    """Whether `name` is the server's to write (`RESERVED_METRICS`, `RESERVED_METRIC_PREFIXES`)."""
    return name in RESERVED_METRICS or name.startswith(RESERVED_METRIC_PREFIXES)


def check_metric_names(names: Iterable[str], where: str) -> None:
    """Raise `BadReply` ("reserved-metric") if a client metric takes a server metric's name:
    a client's "dp-epsilon" would be recorded as the run's privacy loss."""
    if reserved := sorted(name for name in names if reserved_metric(str(name))):
        raise BadReply(
            "reserved-metric", f"{where}: metrics {reserved} are names the server writes"
        )


def finite_arrays(arrays: ArrayRecord) -> bool:
    """Whether every floating array of `arrays` is finite: the check on each sum's result
    before it becomes the global model (an extrapolating step can leave the dtype's range)."""
    return all(
        _finite(tensor)
        for tensor in arrays_to_state(arrays, copy=False).values()
        if tensor.is_floating_point()
    )


def check_metrics(message: Message) -> None:
    """Raise `BadReply` ("reserved-metric") if a metric of the reply's METRICS record takes a
    server metric's name, or ("non-finite-metric") if a value, a scalar or an entry of a
    list, is NaN or infinite (it would poison the round's means)."""
    record = message.content.metric_records.get(METRICS)
    where = f"reply from node {message.metadata.src_node_id}, record {METRICS!r}"
    check_metric_names(record or {}, where)
    for key, value in (record or {}).items():
        values = value if isinstance(value, list) else [value]
        if not all(math.isfinite(entry) for entry in values):
            raise BadReply(
                "non-finite-metric",
                f"reply from node {message.metadata.src_node_id}, record {METRICS!r}: metric "
                f"{key!r} is not finite",
            )


def reply_metric(
    message: Message,
    key: str,
    *,
    positive: bool = False,
    at_most: float | None = None,
    at_least: float | None = None,
) -> float:
    """Scalar `key` of a reply's METRICS record, or a `BadReply` (check `key`) naming node
    and key but not the value.

    The value must be finite, > 0 if `positive` (e.g. "num-examples" as a weight), at most
    `at_most` if given (an absurd example count would outweigh every other client) and at
    least `at_least` if given (a step count a server step divides by).
    """
    where = f"reply from node {message.metadata.src_node_id}, record {METRICS!r}"
    record = message.content.metric_records.get(METRICS)
    if record is None or key not in record:
        raise BadReply(key, f"{where}: missing metric {key!r}")
    value = record[key]
    if isinstance(value, list) or not math.isfinite(value) or (positive and value <= 0):
        requirement = "a positive finite scalar" if positive else "a finite scalar"
        raise BadReply(key, f"{where}: metric {key!r} is not {requirement}")
    if at_most is not None and value > at_most:
        raise BadReply(key, f"{where}: metric {key!r} is above its cap {at_most:g}")
    if at_least is not None and value < at_least:
        raise BadReply(key, f"{where}: metric {key!r} is below its floor {at_least:g}")
    return float(value)


def checked_samples(reply: Message, max_rays: int, samples: int) -> dict[str, Tensor]:
    """The SAMPLES record as float32 tensors, or `BadReply`: "origins" and "directions"
    [R, 3], "edges" [R, samples + 1], 1 <= R <= max_rays, finite (`reply_state`)."""
    record = reply.content.get(SAMPLES)
    origins = record.get("origins") if isinstance(record, ArrayRecord) else None
    count = origins.shape[0] if origins is not None and len(origins.shape) == 2 else 1
    if not 1 <= count <= max_rays:
        raise BadReply(
            "batch-size",
            f"reply from node {reply.metadata.src_node_id}, record {SAMPLES!r}: {count} rays, "
            f"outside [1, split-batch-rays = {max_rays}]",
        )
    shapes = {"origins": (count, 3), "directions": (count, 3), "edges": (count, samples + 1)}
    return reply_state(reply, SAMPLES, shapes, dict.fromkeys(shapes, "float32"))


# ------------------------------------------------------------------ user keys
# Which user a node is: the query a server sends each node once, and the check of its answer.
# A strategy samples, sends to and sums nodes in the order of these stable keys, never by
# Flower's random node ids (`fedfields.flower.strategy.UserKeys`); a node answers with
# `fedfields.flower.node.answer_user_key`.

USER_KEY_ACTION = "user_key"
"""The query's action (an identifier, as Flower requires): message type "query.user_key"."""
USER_KEY_MESSAGE_TYPE = f"{MessageType.QUERY}.{USER_KEY_ACTION}"
USER_RECORD = "user"
"""The reply's ConfigRecord, holding the key under `USER_KEY`."""
USER_KEY = "user-key"
FALLBACK_PREFIX = "node-"
"""Key of a node that did not say which user it is: "node-<node id>"."""
MAX_KEY_LENGTH = 128
"""Longest user key a server takes: a key is written into every round's metrics line."""


def fallback_key(node_id: int) -> str:
    """The key of a node that did not say which user it is: "node-<node id>"."""
    return f"{FALLBACK_PREFIX}{node_id}"


def valid_key(key: object) -> bool:
    """Whether a node's answer is a key the server takes: a non-empty printable string of at
    most `MAX_KEY_LENGTH` characters."""
    return isinstance(key, str) and 0 < len(key) <= MAX_KEY_LENGTH and key.isprintable()


def reply_key(reply: Message) -> str | None:
    """The user key a reply to the query carries; None for an error or a malformed reply (not
    a string, empty, unprintable or longer than `MAX_KEY_LENGTH`)."""
    if reply.has_error() or USER_RECORD not in reply.content.config_records:
        return None
    key = reply.content.config_records[USER_RECORD].get(USER_KEY)
    return key if valid_key(key) else None
