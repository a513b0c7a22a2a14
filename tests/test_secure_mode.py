"""Secure mode holds (issue 18, item 3): a capped exponent for the automatic SecAgg+ bounds,
error reasons without client values, and nothing per client the server side can read.

The leak tests run a secure DecentNeRF job and a secure FedMeNF job in process, record what
each client computed (its held replies, its node state, its data) and search every message
the server received and every file under the server's run directory for those values; the
same search over a plaintext run finds them, so the search can fail.
"""

from __future__ import annotations

import base64
import io
import json
import math
import re
from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Error, Message, MetricRecord, RecordDict
from flwr.client.mod import secaggplus_mod
from flwr.clientapp import ClientApp
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS
from PIL import Image, ImageSequence
from tensorboard.backend.event_processing.event_accumulator import (
    IMAGES,
    SCALARS,
    EventAccumulator,
)
from test_federated_nerf import tiny
from test_meta_job import tiny as tiny_meta
from test_secure_aggregation import numbers_received as numbers_in_records

from clients.scene_client import PERSONAL
from fedfields.config import meta_settings
from fedfields.data.crowd import CrowdData
from fedfields.flower import EmptyRoundsError, secure_aggregation
from fedfields.flower.node import answer_user_key
from fedfields.flower.protocol import (
    CONFIG,
    SECURE_AGGREGATION,
    SECURE_SUM_SCALES,
    SECURE_SUM_STAGE,
    USER_KEY,
    USER_KEY_ACTION,
    USER_KEY_MESSAGE_TYPE,
    USER_RECORD,
    arrays_to_state,
    state_to_arrays,
)
from fedfields.flower.secagg_workflow import SecureSum
from fedfields.flower.secure_aggregation import (
    HELD_PREFIX,
    SecureModeClientError,
    secure_aggregation_mod,
)
from fedfields.methods.decentnerf import ALPHA_STATE, PREVIOUS_GLOBAL
from fedfields.privacy.secagg_plan import (
    DEFAULT_MAX_EXPONENT,
    EXPONENT_MAX,
    EXPONENT_MIN,
    NUM_BUCKETS,
    SecureAggregationConfig,
    ValueFreeError,
    bound_vectors,
    decode_layout,
    exponent_one_hot_of,
    plan_scales,
)
from fedfields.report import CURVE_ORDER, REPORT_FILE
from fedfields.train.builders import client_meta_tasks
from simulations.federated_nerf import run_federated_nerf
from simulations.in_process_grid import InProcessGrid
from simulations.meta_job import run_meta_job
from simulations.run import client_app
from simulations.scene_observer import audit_dir
from strategies import parse_app_config

# ------------------------------------------------------------------ the exponent cap


def test_the_cap_is_a_validated_run_config_key() -> None:
    assert SecureAggregationConfig().max_exponent == DEFAULT_MAX_EXPONENT
    config = parse_app_config(
        {"secure-aggregation": True, "secagg-max-exponent": 12, "min-train-nodes": 3}
    )
    secure = config.secure.secure_aggregation_config()
    assert secure is not None and secure.max_exponent == 12
    for bad in (EXPONENT_MAX + 1, EXPONENT_MIN - 1, 2.5):
        with pytest.raises(ValueError, match="secagg-max-exponent must be an integer"):
            SecureAggregationConfig(max_exponent=bad)  # type: ignore[arg-type]


def test_an_honest_client_beyond_the_cap_refuses_without_naming_a_value() -> None:
    secret = 12345.678
    payload = {"arrays": {"w": torch.tensor([0.5, secret])}}
    layout = [("arrays", "w", (2,))]
    assert bound_vectors(payload, layout, 14)[0].argmax() == 14 - EXPONENT_MIN
    with pytest.raises(ValueFreeError, match=r"arrays/w exceeds 2\^8.*secagg-max-exponent") as info:
        bound_vectors(payload, layout, 8)
    assert "12345" not in str(info.value) and "1.23" not in str(info.value)


def test_the_server_caps_declared_bounds_and_distrusts_malformed_histograms() -> None:
    honest = [exponent_one_hot_of(e) for e in (0, 1, -3)]
    liar = exponent_one_hot_of(EXPONENT_MAX)
    plan = plan_scales([sum(honest) + liar, sum(honest)], max_exponent=6, num_clients=4)
    assert plan.scales[0] == 2.0**6 and plan.capped == [0]  # the liar gets the cap, no more
    # without the liar the second tensor has 3 clients, not 4: no sum of 4 one-hots gives it
    assert plan.scales[1] == 2.0**6 and plan.malformed == [1]
    shifted = sum(honest) - exponent_one_hot_of(2) + 2 * exponent_one_hot_of(-5)
    assert plan_scales([shifted], 6, 4).malformed == [0]  # a negative count is no histogram
    fractional = sum(honest) + 0.5 * exponent_one_hot_of(3) + 0.5 * exponent_one_hot_of(2)
    assert plan_scales([fractional], 6, 4).malformed == [0]
    assert plan_scales([sum(honest)], 6, 3).scales == [2.0]  # honest: the largest bound


def _fit_reply(msg: Message, vectors: list[np.ndarray]) -> Message:
    """A SecAgg+ masked-vector stage reply in Flower's legacy FitRes layout."""
    return Message(
        RecordDict(
            {
                "fitres.parameters": ArrayRecord(vectors),
                "fitres.num_examples": MetricRecord({"num_examples": 1.0}),
                "fitres.metrics": ConfigRecord(),
                "fitres.status": ConfigRecord({"code": 0, "message": "Success"}),
            }
        ),
        reply_to=msg,
    )


def lying_node(values: torch.Tensor) -> Callable[[Message, Context], Message]:
    """A client running the SecAgg+ protocol code that declares 2^EXPONENT_MAX for every
    tensor in the bounds stage, then sends its true (small) `values` scaled as agreed."""

    def answer(msg: Message, context: Context) -> Message:
        fit_config = msg.content["fitins.config"]
        layout = decode_layout(str(fit_config["secure-sum-layout"]))
        if fit_config[SECURE_SUM_STAGE] == "bounds":
            return _fit_reply(msg, [exponent_one_hot_of(EXPONENT_MAX) for _ in layout])
        (scale,) = [float(s) for s in fit_config[SECURE_SUM_SCALES]]
        return _fit_reply(msg, [values.double().numpy() / scale])

    def node(msg: Message, context: Context) -> Message:
        assert RECORD_KEY_CONFIGS in msg.content.config_records
        return secaggplus_mod(msg, context, answer)

    return node


def honest_node(msg: Message, context: Context) -> Message:
    """A client whose payload is already held; it answers SecAgg+ stages only."""
    return secure_aggregation_mod(msg, context, lambda m, c: pytest.fail("not a SecAgg+ stage"))


@pytest.mark.parametrize("max_exponent", [4, DEFAULT_MAX_EXPONENT])
def test_a_lying_client_cannot_move_the_honest_sum_beyond_the_quantisation_error(
    max_exponent: int, caplog: pytest.LogCaptureFixture
) -> None:
    generator = torch.Generator().manual_seed(0)
    honest = [torch.rand(50, generator=generator, dtype=torch.float64) * 3 - 1.5 for _ in range(4)]
    liar_values = torch.full((50,), 0.75, dtype=torch.float64)
    grid = InProcessGrid([honest_node] * 4 + [lying_node(liar_values)], raise_errors=True)
    node_ids = list(grid.get_node_ids())
    for node_id, values in zip(node_ids, honest, strict=False):
        grid.contexts[node_id].state[HELD_PREFIX + "arrays"] = state_to_arrays({"w": values})
    layout = [("arrays", "w", (50,))]

    def secure_sum(cap: int) -> tuple[torch.Tensor, float, float]:
        """The sum less the liar's own values, the agreed scale and the tolerance."""
        config = SecureAggregationConfig(max_exponent=cap)
        for node_id in node_ids[:4]:  # the payload stage clears what was held: hold again
            state = state_to_arrays({"w": honest[node_ids.index(node_id)]})
            grid.contexts[node_id].state[HELD_PREFIX + "arrays"] = state
        result = SecureSum(config)(grid, node_ids, layout, server_round=1)
        assert result.node_ids == node_ids and result.scales is not None
        (scale,) = result.scales
        # Each client's value is stochastically rounded to a level of width 2 C scale / Q
        # (C = 1): the error of a sum of n clients is below n levels.
        levels = config.quantization_range(len(node_ids))
        tolerance = len(node_ids) * 2.0 * scale / levels
        return result.sums["arrays"]["w"] - liar_values, scale, tolerance

    honest_sum = torch.stack(honest).sum(0)
    without_liar_bound = 2.0**1  # the honest values lie within 2^1
    received, scale, tolerance = secure_sum(max_exponent)
    assert scale == max(2.0**max_exponent, without_liar_bound)
    assert float((received - honest_sum).abs().max()) <= tolerance
    assert tolerance <= len(node_ids) * 2.0 ** (max_exponent + 1) / (2**32 // 5)
    assert "declared bounds above 2^" in caplog.text
    # The oracle: without the cap (2^EXPONENT_MAX) the same lie drowns the honest values.
    drowned, scale, tolerance = secure_sum(EXPONENT_MAX)
    assert scale == 2.0**EXPONENT_MAX
    assert float((drowned - honest_sum).abs().max()) > 1e6


# ------------------------------------------------------------------ error reasons

SECRET = 0.7316028493


def failing_app(raise_it: Callable[[], Message]) -> ClientApp:
    """A ClientApp like the repo's (secure_aggregation_mod app-wide) whose train handler
    fails with `raise_it`."""
    app = ClientApp(mods=[secure_aggregation_mod])
    app.query(USER_KEY_ACTION)(answer_user_key)

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        return raise_it()

    return app


def train_reply(app: ClientApp, secure: bool, run_config: dict | None = None) -> Message:
    grid = InProcessGrid([app], run_config=run_config)
    config = ConfigRecord({SECURE_AGGREGATION: True} if secure else {})
    (node_id,) = grid.get_node_ids()
    message = Message(RecordDict({CONFIG: config}), dst_node_id=node_id, message_type="train")
    (reply,) = grid.send_and_receive([message])
    assert reply.has_error()
    return reply


def diverge() -> Message:
    raise ValueError(f"train loss {SECRET} diverged at norm {SECRET * 2:.6f}, shape (3, 17)")


def test_secure_error_reasons_name_the_type_and_keep_the_values_on_the_node(
    caplog: pytest.LogCaptureFixture,
) -> None:
    plain = train_reply(failing_app(diverge), secure=False)
    assert str(SECRET) in plain.error.reason  # what Flower forwards by default
    for secure, run_config in ((True, None), (False, {"secure-aggregation": True})):
        caplog.clear()
        reason = train_reply(failing_app(diverge), secure, run_config).error.reason
        assert SecureModeClientError.__name__ in reason and "ValueError" in reason
        assert not any(ch.isdigit() for ch in reason.replace("Error", "")), reason
        assert str(SECRET) in caplog.text  # logged on the node, for its operator


def test_value_free_refusals_and_error_replies_in_secure_mode() -> None:
    def refuse() -> Message:
        raise ValueFreeError("arrays/w exceeds 2^8 (secagg-max-exponent)")

    reason = train_reply(failing_app(refuse), secure=True).error.reason
    assert "arrays/w exceeds 2^8 (secagg-max-exponent)" in reason

    app = ClientApp(mods=[secure_aggregation_mod])
    app.query(USER_KEY_ACTION)(answer_user_key)

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        return Message(Error(code=0, reason=f"loss {SECRET}"), reply_to=msg)

    assert str(SECRET) not in train_reply(app, secure=True).error.reason


def test_the_repo_client_app_forwards_no_values_in_secure_mode(
    crowd_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import clients.scene_client as nerf_client

    def exploding(*args: object, **kwargs: object) -> None:
        raise FloatingPointError(f"loss became {SECRET} after 3 steps")

    monkeypatch.setattr(nerf_client, "local_train", exploding)
    config = tiny(
        crowd_dir, tmp_path / "run", "fedavg", **{"secure-aggregation": True, "min-train-nodes": 3}
    ) | {"num-server-rounds": 1}
    grid = InProcessGrid([client_app(config)] * 3)
    with pytest.raises(EmptyRoundsError, match="replies were errors") as raised:
        run_federated_nerf(
            grid, parse_app_config(config), observe=False
        )  # the only round failed: no model
    errors = [reply.error.reason for reply in grid.received if reply.has_error()]
    assert errors and all("FloatingPointError" in reason for reason in errors)
    assert not any(str(SECRET) in reason for reason in [*errors, str(raised.value)])


# ------------------------------------------------------------------ nothing per client


class HeldRecorder:
    """`secure_aggregation.hold` that also records what the client holds back: its reply's
    arrays and metrics as computed, and the weighted tensors it will mask."""

    def __init__(self) -> None:
        self.scalars: list[float] = []
        self.tensors: list[tuple[str, torch.Tensor]] = []  # (key, tensor) of every client
        self.original = secure_aggregation.hold

    def __call__(self, msg: Message, reply: Message, context: Context) -> ConfigRecord:
        for record in reply.content.array_records.values():
            self.tensors += [(key, t.double()) for key, t in arrays_to_state(record).items()]
        for record in reply.content.metric_records.values():
            self.scalars += [float(v) for v in record.values() if not isinstance(v, list)]
        held = self.original(msg, reply, context)
        for name in held["records"]:
            state = arrays_to_state(context.state[HELD_PREFIX + name])
            self.tensors += [(key, tensor) for key, tensor in state.items()]
        metrics = arrays_to_state(context.state[HELD_PREFIX + "metrics"])
        self.scalars += [float(v) for v in metrics.values()]
        return held


def matches(secrets: np.ndarray, pool: np.ndarray, rtol: float = 1e-9) -> np.ndarray:
    """Which secrets equal (relative `rtol`) some number of `pool`; vectorised."""
    pool = np.sort(pool[np.isfinite(pool)])
    if pool.size == 0 or secrets.size == 0:
        return np.zeros(secrets.shape, dtype=bool)
    index = np.searchsorted(pool, secrets)
    above = pool[np.minimum(index, pool.size - 1)]
    below = pool[np.maximum(index - 1, 0)]
    nearest = np.minimum(np.abs(above - secrets), np.abs(below - secrets))
    return nearest <= rtol * np.abs(secrets)


def private(values: Iterable[float] | np.ndarray, public: np.ndarray) -> np.ndarray:
    """The values that identify a client: not ~0, not integers or short binary fractions
    (counts, steps, sizes, constants such as 0.5 that a field is initialised with), and not
    numbers the server knows (what it sent, its run-config)."""
    array = np.asarray(list(values) if not isinstance(values, np.ndarray) else values)
    scaled = array * 2.0**12
    array = array[np.isfinite(array) & (np.abs(array) > 1e-6) & (scaled != np.round(scaled))]
    return np.unique(array[~matches(array, public)])


EMBEDDED_IMAGE = re.compile(r"data:image/(?:png|gif);base64,([A-Za-z0-9+/=]*)")
NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:e[-+]?\d+)?")


def file_numbers(
    run_dir: Path,
) -> tuple[np.ndarray, dict[str, list[torch.Tensor]], list[Path | bytes]]:
    """Every number in the run directory's JSON/JSONL files, report.html and TensorBoard event
    files, the tensors of its torch files by key, and its images (report.html embeds these and
    one plot of its own; the event files hold them again, as encoded bytes)."""
    numbers: list[float] = []
    tensors: dict[str, list[torch.Tensor]] = {}
    images: list[Path | bytes] = []
    tracked: list[bytes] = []  # the event files' images
    embedded: list[bytes] = []  # report.html's images

    def walk(value: object, key: str = "") -> None:
        if isinstance(value, bool) or value is None or isinstance(value, str):
            return
        if isinstance(value, int | float):
            numbers.append(float(value))
        elif isinstance(value, torch.Tensor):
            tensors.setdefault(key, []).append(value.detach().double().flatten())
        elif isinstance(value, dict):
            for k, v in value.items():
                walk(v, str(k))
        elif isinstance(value, list | tuple):
            for v in value:
                walk(v, key)

    for path in sorted(p for p in run_dir.rglob("*") if p.is_file()):
        if path.suffix == ".json":
            walk(json.loads(path.read_text()))
        elif path.suffix == ".jsonl":
            for line in path.read_text().splitlines():
                walk(json.loads(line))
        elif path.suffix in (".pt", ".partial"):
            walk(torch.load(path, map_location="cpu", weights_only=True))
        elif path.suffix in (".png", ".gif"):  # renders, plots, the server's orbit
            images.append(path)
        elif path.name == REPORT_FILE:  # the page the run ends with
            text = path.read_text()
            embedded = [base64.b64decode(data) for data in EMBEDDED_IMAGE.findall(text)]
            numbers += [float(number) for number in NUMBER.findall(EMBEDDED_IMAGE.sub("", text))]
        elif path.name.startswith("events.out.tfevents."):  # fedfields.tracking's
            events = EventAccumulator(str(path), size_guidance={IMAGES: 0, SCALARS: 0}).Reload()
            for tag in events.Tags()["scalars"]:
                numbers += [event.value for event in events.Scalars(tag)]
            for tag in events.Tags()["images"]:
                tracked += [event.encoded_image_string for event in events.Images(tag)]
        else:
            raise AssertionError(f"unexpected file in the run directory: {path}")
    # Besides the images searched here, the report embeds only its plots of metrics.jsonl.
    files = {image.read_bytes() for image in images if isinstance(image, Path)}
    plots = [image for image in embedded if image not in files]
    assert len(plots) <= len(CURVE_ORDER), "report.html embeds more"
    return np.asarray(numbers), tensors, images + tracked


def copied_coordinates(
    written: dict[str, list[torch.Tensor]],
    clients: list[tuple[str, torch.Tensor]],
    sent: dict[str, list[torch.Tensor]],
) -> float:
    """Largest fraction of one client tensor's coordinates that a written tensor of the same
    key repeats exactly (in float32), counting only coordinates that differ from zero, from
    every other recorded tensor of that key (a value every client holds alike, e.g. a weight
    no client's update moved, is no one's private value: the aggregate rightly equals it) and,
    clearly, from every version the server sent: a copy of a client's tensor scores 1, an
    aggregate ~0 (a coordinate one float32 step from the global could round either way)."""
    worst = 0.0
    for index, (key, tensor) in enumerate(clients):
        mine = tensor.flatten().float()
        moved = mine.abs() > 1e-12
        for other, (other_key, values) in enumerate(clients):
            if other != index and other_key == key and values.numel() == mine.numel():
                moved &= mine != values.flatten().float()
        for version in sent.get(key, []):  # moved well beyond float32 rounding of it
            if version.numel() == mine.numel():
                reference = version.flatten().float()
                moved &= (mine - reference).abs() > 1e-5 * reference.abs().clamp_min(1e-3)
        if int(moved.sum()) < 32:
            continue
        for candidate in written.get(key, []):
            if candidate.numel() == mine.numel():
                same = (mine == candidate.float()) & moved
                worst = max(worst, float(same.sum()) / float(moved.sum()))
    return worst


def packed_rgb(rgb: np.ndarray) -> np.ndarray:
    """[H, W, 3] uint8 -> [H, W] int32, one number per colour: a pixel compares in one op."""
    wide = rgb.astype(np.int32)
    return (wide[..., 0] << 16) | (wide[..., 1] << 8) | wide[..., 2]


def holds_image(image: Path | bytes, photo: np.ndarray) -> bool:
    """Whether the image in the file at `image`, or encoded in `image` (any frame of a GIF),
    contains `photo` ([H, W, 3] uint8) at 90% of its pixels."""
    source = io.BytesIO(image) if isinstance(image, bytes) else image
    frames = ImageSequence.Iterator(Image.open(source))
    return any(frame_holds_image(np.asarray(f.convert("RGB")), photo) for f in frames)


def frame_holds_image(frame: np.ndarray, photo: np.ndarray) -> bool:
    """Whether `frame` contains `photo` (both [H, W, 3] uint8) at 90% of its pixels."""
    image = packed_rgb(frame)
    pixels = packed_rgb(photo)
    height, width = pixels.shape
    rows, columns = image.shape[0] - height + 1, image.shape[1] - width + 1
    if rows < 1 or columns < 1:
        return False
    # matching pixels of every window at once, one photo pixel (offset) at a time
    matches = np.zeros((rows, columns), dtype=np.int32)
    for top in range(height):
        for left in range(width):
            matches += image[top : top + rows, left : left + columns] == pixels[top, left]
    return bool(matches.max() > 0.9 * height * width)


def numbers_received(messages: Iterable[Message]) -> np.ndarray:
    """`test_secure_aggregation.numbers_received`, leaving out Flower's empty legacy
    parameters ("_empty", no numbers) that SecAgg+ stage messages carry."""
    kept = []
    for message in messages:
        content = RecordDict(
            {
                name: record
                for name, record in message.content.items()
                if not (isinstance(record, ArrayRecord) and "_empty" in record)
            }
        )
        kept.append(Message(content, dst_node_id=0, message_type="train"))
    return numbers_in_records(kept)


def sent_state(grid: InProcessGrid) -> tuple[np.ndarray, dict[str, list[torch.Tensor]]]:
    """Every number the server sent (public), and every tensor it sent, by key."""
    sent: dict[str, list[torch.Tensor]] = {}
    for message in grid.sent:
        for record in message.content.array_records.values():
            if "_empty" in record:  # SecAgg+ stages carry Flower's empty legacy parameters
                continue
            for key, value in arrays_to_state(record).items():
                sent.setdefault(key, []).append(value.double())
    return numbers_received(grid.sent), sent


def exposure(
    grid: InProcessGrid,
    run_dir: Path,
    scalars: Iterable[float],
    tensors: list[tuple[str, torch.Tensor]],
    photos: list[np.ndarray],
) -> dict[str, int | float]:
    """What of the clients' values the server side can read, by where it was found."""
    public, sent = sent_state(grid)
    run_config = json.loads((run_dir / "config.json").read_text())
    numbers = [float(v) for v in run_config.values() if isinstance(v, int | float)]
    public = np.concatenate([public, np.asarray(numbers)])
    received = numbers_received(grid.received)
    scalar_secrets = private(scalars, public)
    tensor_secrets = private(np.concatenate([t.flatten().numpy() for _, t in tensors]), public)
    in_files, written, images = file_numbers(run_dir)
    written_numbers = torch.cat([t for ts in written.values() for t in ts]).numpy()
    return {
        "scalars": len(scalar_secrets),
        "tensor values": len(tensor_secrets),
        "scalars received": int(matches(scalar_secrets, received).sum()),
        "tensor values received": int(matches(tensor_secrets, received).sum()),
        "scalars in files": int(matches(scalar_secrets, in_files).sum())
        + int(matches(scalar_secrets, written_numbers).sum()),
        "tensor values in json files": int(matches(tensor_secrets, in_files).sum()),
        "tensor copied in files": copied_coordinates(written, tensors, sent),
        "photos in files": sum(holds_image(p, photo) for p in images for photo in photos),
    }


def masked_only(grid: InProcessGrid) -> None:
    """Every received reply: no error, no array, SecAgg+ replies with weight 1 and no metrics,
    held replies naming records only; user-key replies hold the node's partition id only."""
    for reply in grid.received:
        assert not reply.has_error()
        assert not any(len(record) for record in reply.content.array_records.values())
        if reply.metadata.message_type == USER_KEY_MESSAGE_TYPE:
            partition = grid.contexts[reply.metadata.src_node_id].node_config["partition-id"]
            assert reply.content.config_records[USER_RECORD] == {USER_KEY: str(partition)}
            assert set(reply.content.keys()) == {USER_RECORD}
        elif "fitres.num_examples" in reply.content:
            assert reply.content["fitres.num_examples"]["num_examples"] == 1.0
            assert len(reply.content["fitres.metrics"]) == 0
        else:
            assert set(reply.content.keys()) <= {"held", RECORD_KEY_CONFIGS}, reply.content.keys()


def assert_nothing_exposed(found: dict[str, int | float]) -> None:
    """No secret number received or written, no client tensor copied (a copy repeats all of
    its moved coordinates; an aggregate only a few, by float32 coincidence), no user's photo
    in the run directory."""
    counts = {k: v for k, v in found.items() if k not in ("scalars", "tensor values")}
    copied = counts.pop("tensor copied in files")
    assert not any(counts.values()) and copied < 0.1, found


def decentnerf_run(
    crowd: Path, run_dir: Path, secure: bool, monkeypatch: pytest.MonkeyPatch
) -> dict[str, int | float]:
    """A 2-round DecentNeRF run over 3 users; what of theirs the server side can read."""
    recorder = HeldRecorder()
    monkeypatch.setattr(secure_aggregation, "hold", recorder)
    config = tiny(
        crowd, run_dir, "decentnerf", **{"secure-aggregation": secure, "min-train-nodes": 3}
    )
    grid = InProcessGrid([client_app(config)] * 3, raise_errors=True)
    run_federated_nerf(grid, parse_app_config(config), observe=True)
    scalars = list(recorder.scalars)
    tensors = list(recorder.tensors)
    nodes = Path(config["state-dir"])
    for node in sorted(nodes.glob("node_*")):
        scalars += [a for _, a in json.loads((node / f"{ALPHA_STATE}.json").read_text())["history"]]
        for name in (PREVIOUS_GLOBAL, PERSONAL):
            state = torch.load(node / f"{name}.pt", weights_only=True)
            tensors += [(key, value.double()) for key, value in state.items()]
    if not secure:  # plaintext replies are not held: take the clients' values from them
        for reply in grid.received:
            for record in reply.content.array_records.values():
                tensors += [(k, v.double()) for k, v in arrays_to_state(record).items()]
            for record in reply.content.metric_records.values():
                scalars += [float(v) for v in record.values() if not isinstance(v, list)]
    else:
        masked_only(grid)
    downscale = parse_app_config(config).common.downscale
    photos = [  # the users' photos as the observer's renders/ would show them
        (view.numpy() * 255 + 0.5).astype(np.uint8)
        for user in CrowdData.load(str(crowd), downscale).users
        for view in user.scene.images
    ]
    assert len(photos) == 9
    return exposure(grid, run_dir, scalars, tensors, photos)


def test_a_secure_decentnerf_run_shows_the_server_nothing_per_client(
    crowd_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    secure = decentnerf_run(crowd_dir, tmp_path / "secure", True, monkeypatch)
    assert secure["scalars"] >= 12 and secure["tensor values"] > 10_000  # alphas, metrics, g, G
    assert_nothing_exposed(secure)
    # The per-user audit went beside the run directory, and says so in its name.
    assert (audit_dir(tmp_path / "secure") / "alphas.jsonl").is_file()
    assert (audit_dir(tmp_path / "secure") / "renders").is_dir()
    # The oracle: the same search over a plaintext run finds the clients' values in the
    # replies, alpha_k in alphas.jsonl and the users' photos in renders/.
    plain = decentnerf_run(crowd_dir, tmp_path / "plain", False, monkeypatch)
    assert plain["scalars received"] > 0 and plain["tensor values received"] > 10_000
    assert plain["scalars in files"] >= 3 and plain["photos in files"] >= 3


def meta_run(run_dir: Path, secure: bool, monkeypatch: pytest.MonkeyPatch) -> dict:
    """2 rounds of FedMeNF on faces, 3 of 4 clients per round; what of theirs the server
    side can read."""
    recorder = HeldRecorder()
    monkeypatch.setattr(secure_aggregation, "hold", recorder)
    config = tiny_meta(
        run_dir,
        **{
            "secure-aggregation": secure,
            "clients-per-round": 3,
            "min-train-nodes": 3,
            "privacy-audit": False,
        },
    )
    parsed = parse_app_config(config)
    settings = meta_settings(parsed)
    grid = InProcessGrid([client_app(config)] * settings.num_clients, raise_errors=True)
    run_meta_job(grid, parse_app_config(config))
    scalars, tensors = list(recorder.scalars), list(recorder.tensors)
    if secure:
        masked_only(grid)
    else:
        for reply in grid.received:
            for record in reply.content.array_records.values():
                tensors += [(k, v.double()) for k, v in arrays_to_state(record).items()]
            for record in reply.content.metric_records.values():
                scalars += [float(v) for v in record.values() if not isinstance(v, list)]
    for client in range(settings.num_clients):  # the clients' data: their query pixels
        for task in client_meta_tasks(parsed, settings, client, None):
            tensors.append(("data", task.query_targets.double()))
    return exposure(grid, run_dir, scalars, tensors, photos=[])


def test_a_secure_fedmenf_run_shows_the_server_nothing_per_client(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    secure = meta_run(tmp_path / "secure", True, monkeypatch)
    assert secure["scalars"] >= 6 and secure["tensor values"] > 1000
    assert_nothing_exposed(secure)
    plain = meta_run(tmp_path / "plain", False, monkeypatch)
    assert plain["scalars received"] > 0 and plain["tensor values received"] > 1000


def test_a_copied_client_tensor_or_value_in_a_file_is_found(tmp_path: Path) -> None:
    """The file search itself: a client's tensor or metric written into the run directory."""
    client = torch.linspace(0.1, 0.9, 40, dtype=torch.float64)
    torch.save({"w": client.float()}, tmp_path / "state.pt")
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"train-loss": 0.123456789}) + "\n")
    numbers, written, _ = file_numbers(tmp_path)
    assert copied_coordinates(written, [("w", client)], {}) == 1.0
    assert matches(np.array([0.123456789]), numbers).all()
    assert math.isclose(copied_coordinates(written, [("w", client + 1.0)], {}), 0.0)
    assert NUM_BUCKETS == EXPONENT_MAX - EXPONENT_MIN + 1
