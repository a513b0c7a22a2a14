"""The FedMeNF job end to end on an in-process Flower grid, and the FedMeNF strategy."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from flwr.app import Context, Message, MessageType, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from fedfields.config import FederatedConfig, meta_settings
from fedfields.data.objects import CollectionConfig, write_collection
from fedfields.flower import FedMeNF, m_of_n_sampling
from fedfields.flower.fedmenf import GAMMA
from fedfields.flower.protocol import (
    ARRAYS,
    CLIENT,
    CLIENT_INDEX,
    CONFIG,
    DOWNLOAD_VERSION,
    METRICS,
    NUM_EXAMPLES,
    NUM_FAILURES,
    NUM_REPLIES,
    STRATEGY,
    TRAIN_LOSS,
    arrays_to_state,
    state_to_arrays,
)
from fedfields.flower.upload_compression import RESIDUAL
from fedfields.methods.scaffold import CLIENT_CONTROL, CONTROL_DELTA
from fedfields.train.builders import (
    _object_task,
    client_meta_tasks,
    heldout_meta_tasks,
    meta_model,
    tto_schedule,
)
from simulations import meta_observer
from simulations.in_process_grid import InProcessGrid
from simulations.meta_job import run_meta_job
from simulations.meta_observer import meta_observers
from simulations.observers import Observer
from simulations.run import client_app
from strategies import parse_app_config

State = dict[str, torch.Tensor]
TINY_OBJECTS = CollectionConfig(count=2, views=4, resolution=8, mean_support=1, mean_query=1)


def tiny(run_dir: Path, task: str = "faces", **overrides: object) -> dict:
    """4 clients, 2 per round, 2 rounds of E=2, K=1 on a 2x16 SIREN, TTO up to 4 steps.

    A simulation: run-config `simulation-audit` is on (as the launchers set it), so the
    privacy audit is attached.
    """
    return {
        "task": task,
        "run-dir": str(run_dir),
        "simulation-audit": True,
        "num-server-rounds": 2,
        "num-clients": 4,
        "clients-per-round": 2,
        "outer-steps": 2,
        "inner-steps": 1,
        "field-width": 16,
        "field-depth": 2,
        "tto-steps": 4,
        **overrides,
    }


def run_in_process(
    config: dict, observers: list[Observer] | None = None
) -> tuple[Path, InProcessGrid]:
    num_clients = meta_settings(parse_app_config(config)).num_clients
    grid = InProcessGrid([client_app(config)] * num_clients, raise_errors=True)
    return run_meta_job(grid, parse_app_config(config), observers), grid


def simulation_root(collection: Path, num_clients: int, root: Path) -> Path:
    """A simulation's data root as `fedfields.flower.node` maps virtual nodes: root/object_NN
    links to the collection's object folders (which `write_collection` names object_NNN)."""
    root.mkdir()
    for client in range(num_clients):
        (root / f"object_{client:02d}").symlink_to(collection / f"object_{client:03d}")
    return root


class OpenRecorder:
    """Files opened by this process, tagged with who was running: "server" or "node".

    An audit hook cannot be removed, so one recorder is installed once and records only
    while `side` is set.
    """

    def __init__(self) -> None:
        self.side: str | None = None
        self.opened: list[tuple[str, Path]] = []

    def __call__(self, event: str, args: tuple[Any, ...]) -> None:
        if self.side is not None and event == "open" and isinstance(args[0], str | bytes):
            self.opened.append((self.side, Path(os.fsdecode(args[0]))))

    @contextmanager
    def server(self) -> Iterator[None]:
        """Record this block's opens as the server's."""
        self.side, self.opened = "server", []
        try:
            yield
        finally:
            self.side = None

    def node(self, app: ClientApp):
        """`app` as a node handler whose opens are recorded as the node's.

        The objects a node read stay in the node: the process-wide object cache is cleared,
        so the server cannot reach them without opening their files.
        """

        def handle(message: Message, context: Context) -> Message:
            self.side = "node"
            try:
                return app(message, context)
            finally:
                _object_task.cache_clear()
                self.side = "server"

        return handle

    def paths(self, side: str, under: Path) -> list[Path]:
        """The files `side` opened below `under`."""
        return [
            path
            for who, path in self.opened
            if who == side and path.resolve().is_relative_to(under.resolve())
        ]


OPENS = OpenRecorder()
sys.addaudithook(OPENS)


def metric_lines(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def train_replies(grid: InProcessGrid, group: str) -> list[Message]:
    return [
        reply
        for reply in grid.received
        if reply.metadata.message_type == MessageType.TRAIN and reply.metadata.group_id == group
    ]


@pytest.fixture(scope="module")
def faces_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, InProcessGrid]:
    return run_in_process(tiny(tmp_path_factory.mktemp("meta") / "faces"))


def test_faces_run_writes_the_report(faces_run: tuple[Path, InProcessGrid]) -> None:
    run_dir, grid = faces_run
    names = {path.name for path in run_dir.iterdir()}
    expected = {"config.json", "metrics.jsonl", "checkpoint.pt", "summary.json"}
    assert expected | {"tto.png", "privacy.png", "renders.png"} <= names
    lines = metric_lines(run_dir)
    assert [line["round"] for line in lines] == [1, 2]
    for line in lines:
        assert 0 < line["psnr"] < 60 and 0 < line["psnr_p"] < 60
        assert line["delta"] == pytest.approx(line["psnr"] - line["psnr_p"])
        assert list(line["tto"]) == ["0", "1", "2", "4"]
        assert line["tto"]["4"] == line["psnr"] and len(line["clients"]) == 2
    train_messages = [m for m in grid.sent if m.metadata.message_type == MessageType.TRAIN]
    assert len(train_messages) == 4  # M = 2 of N = 4 clients, 2 rounds
    assert {m.content[CONFIG][STRATEGY] for m in train_messages} == {"fedmenf"}
    for reply in train_replies(grid, "1") + train_replies(grid, "2"):
        assert 0.0 <= reply.content[METRICS][GAMMA] <= 1.0
    saved = parse_app_config(json.loads((run_dir / "config.json").read_text()))
    assert saved.common.task == "faces" and saved.strategy_name == "fedmenf"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["final"] == lines[-1] and set(summary["initial"]) == {"0", "1", "2", "4"}
    assert summary["settings"]["outer_steps"] == 2 and summary["settings"]["inner_lr"] == 0.005


def test_aggregate_is_the_size_weighted_mean_of_the_uploads(
    faces_run: tuple[Path, InProcessGrid],
) -> None:
    run_dir, grid = faces_run
    round_two = [m for m in grid.sent if m.metadata.group_id == "2"][0]
    final = torch.load(run_dir / "checkpoint.pt", weights_only=True)["state_dict"]
    for group, aggregate in (("1", arrays_to_state(round_two.content[ARRAYS])), ("2", final)):
        replies = train_replies(grid, group)
        sizes = [float(reply.content[METRICS][NUM_EXAMPLES]) for reply in replies]
        states = [arrays_to_state(reply.content[ARRAYS]) for reply in replies]
        for key, value in aggregate.items():
            expected = sum(n * s[key].double() for n, s in zip(sizes, states, strict=True))
            torch.testing.assert_close(value.double(), expected / sum(sizes))


def test_privacy_audit_never_influences_training(
    faces_run: tuple[Path, InProcessGrid], tmp_path: Path
) -> None:
    audited, _ = faces_run
    blind, _ = run_in_process(tiny(tmp_path / "blind", **{"privacy-audit": False}))
    first, second = (
        torch.load(run_dir / "checkpoint.pt", weights_only=True)["state_dict"]
        for run_dir in (audited, blind)
    )
    assert all(torch.equal(first[key], second[key]) for key in first)
    for with_audit, without in zip(metric_lines(audited), metric_lines(blind), strict=True):
        assert "psnr_p" not in without and without["psnr"] == with_audit["psnr"]
    assert not (blind / "renders.png").exists()


@pytest.mark.parametrize("strategy", ["fedmenf", "scaffold"])
def test_secure_aggregation_gives_the_plaintext_aggregate(strategy: str, tmp_path: Path) -> None:
    one_round = {"num-server-rounds": 1, "strategy": strategy, "clients-per-round": 3}
    plain, _ = run_in_process(tiny(tmp_path / "plain", **one_round))
    secure, grid = run_in_process(  # SecAgg+ needs 3 clients per round
        tiny(tmp_path / "secure", **one_round, **{"secure-aggregation": True})
    )
    first, second = (
        torch.load(run_dir / "checkpoint.pt", weights_only=True)["state_dict"]
        for run_dir in (plain, secure)
    )
    difference = torch.cat([(first[k] - second[k]).flatten() for k in first]).norm()
    assert float(difference / torch.cat([v.flatten() for v in first.values()]).norm()) < 1e-5
    if strategy == "fedmenf":  # quantised by SecAgg+; Scaffold sums the small y_i - x, whose
        # quantisation error can fall below float32's resolution of x (3 clients: it does)
        assert not all(torch.equal(first[k], second[k]) for k in first)
    assert "psnr_p" not in metric_lines(secure)[0]  # no upload to audit: the server sees sums
    summary = json.loads((secure / "summary.json").read_text())
    assert summary["secure-aggregation"]["enabled"] is True
    held = [reply for reply in grid.received if "held" in reply.content]
    assert len(held) == 3 and all("client" not in reply.content for reply in held)


@pytest.mark.parametrize("strategy", ["fedprox", "scaffold", "fednova", "fedexp", "fedacg"])
def test_meta_learners_under_other_strategies(strategy: str, tmp_path: Path) -> None:
    config = tiny(
        tmp_path / strategy,
        strategy=strategy,
        **{"meta-learner": "fomaml", "num-server-rounds": 1},
        **({"proximal-mu": 0.1} if strategy == "fedprox" else {}),  # others refuse the key
        **{"state-dir": str(tmp_path / "state")},
    )
    run_dir, grid = run_in_process(config)
    replies = train_replies(grid, "1")
    assert len(replies) == 2 and "psnr_p" in metric_lines(run_dir)[0]
    assert all(GAMMA not in reply.content[METRICS] for reply in replies)  # not FedMeNF
    if strategy == "scaffold":  # c_i stays in each node's own state directory
        assert all(CONTROL_DELTA in reply.content for reply in replies)
        clients = [reply.content[CLIENT][CLIENT_INDEX] for reply in replies]
        for client in clients:
            assert (tmp_path / "state" / f"node_{client:02d}" / f"{CLIENT_CONTROL}.pt").is_file()
            assert CLIENT_CONTROL not in grid.contexts[101 + client].state


def test_video_photos_and_objects_run_in_process(tmp_path: Path) -> None:
    one_round = {"num-server-rounds": 1, "num-clients": 2, "outer-steps": 1, "tto-steps": 2}
    video, _ = run_in_process(tiny(tmp_path / "video", "video", **one_round))
    assert "psnr_p" in metric_lines(video)[0] and (video / "renders.png").is_file()
    photos, _ = run_in_process(tiny(tmp_path / "photos", "photos", **one_round))
    assert {"psnr_p", "psnr"} <= set(metric_lines(photos)[0])
    assert (photos / "renders.png").is_file()
    collection = tmp_path / "objects"
    write_collection(TINY_OBJECTS, collection, progress=False)
    data_dir = simulation_root(collection, 2, tmp_path / "simulation")
    objects, _ = run_in_process(
        tiny(tmp_path / "run", "objects", **one_round, **{"data-dir": str(data_dir)})
    )
    line = metric_lines(objects)[0]  # no eval-scene-dir: no server TTO, the audit still runs
    assert "psnr_p" in line and "psnr" not in line and line[NUM_REPLIES] == 2
    assert (objects / "renders.png").is_file() and not (objects / "tto.png").exists()


def test_photos_clients_hold_two_crops_each_and_none_is_held_out() -> None:
    """Task photos: 20 clients x 2 colour crops, 10 held-out crops no client holds; an RGB
    SIREN (x, y) -> (r, g, b)."""
    config = parse_app_config({"task": "photos"})
    settings = meta_settings(config)
    held = {task.name for task in heldout_meta_tasks(config, settings)}
    owned = [
        [task.name for task in client_meta_tasks(config, settings, client)]
        for client in range(settings.num_clients)
    ]
    assert len(held) == settings.heldout_tasks == 10 and all(len(own) == 2 for own in owned)
    names = [name for own in owned for name in own]
    assert len(set(names)) == 40 and not held & set(names)
    model = meta_model(config, settings)
    assert model(torch.zeros(5, 2)).shape == (5, 3)


def test_photo_crop_and_size_give_a_thousand_clients_their_own_crops() -> None:
    """photo-crop 24 cuts 2,975 disjoint crops: 1,000 clients hold two each of
    photo-size x photo-size, none held out; a size above its crop or 0 is refused by name."""
    config = parse_app_config(
        {"task": "photos", "num-clients": 1000, "photo-crop": 24, "photo-size": 16}
    )
    settings = meta_settings(config)
    held = {task.name for task in heldout_meta_tasks(config, settings)}
    names = [
        task.name
        for client in (0, 1, 500, 999)
        for task in client_meta_tasks(config, settings, client)
    ]
    assert len(set(names)) == 8 and not held & set(names)
    assert client_meta_tasks(config, settings, 999)[0].num_examples == 16 * 16
    for bad in ({"photo-size": 32, "photo-crop": 24}, {"photo-size": 0}, {"photo-crop": 5000}):
        with pytest.raises(ValueError, match="photo-"):
            parse_app_config({"task": "photos", **bad})
    default = parse_app_config({"task": "photos", "num-clients": 1000})
    with pytest.raises(ValueError, match="2010 crops of 128 px"):
        client_meta_tasks(default, meta_settings(default), 0)


def test_a_failing_node_is_counted_and_the_round_goes_on(tmp_path: Path) -> None:
    config = tiny(tmp_path / "run", **{"num-server-rounds": 1, "clients-per-round": 4})

    def broken(message: Message, context: Context) -> Message:
        raise RuntimeError("node lost its data")

    grid = InProcessGrid([broken] + [client_app(config)] * 3)
    run_dir = run_meta_job(grid, parse_app_config(config))
    (line,) = metric_lines(run_dir)
    assert line[NUM_FAILURES] == 1 and line[NUM_REPLIES] == 3
    assert line["clients"] == [1, 2, 3] and 0 < line["psnr_p"] < 60


@pytest.mark.parametrize("hostile", ["shape", "non-finite", "client-index"])
def test_a_reply_the_gate_drops_never_reaches_the_privacy_audit(
    tmp_path: Path, hostile: str
) -> None:
    """Node 0 replies with an upload the audit could not render (another shape, NaN) or that
    names a client that does not exist: the gate drops the first two, and the audit (a
    simulation observer tapping every reply) scores only the replies the gate let in, so the
    round goes on and its "clients" and PSNR_p are the honest three's."""
    config = tiny(tmp_path / "run", **{"num-server-rounds": 1, "clients-per-round": 4})
    honest = client_app(config)

    def poisoned(message: Message, context: Context) -> Message:
        reply = honest(message, context)
        if message.metadata.message_type != MessageType.TRAIN or ARRAYS not in reply.content:
            return reply
        state = arrays_to_state(reply.content[ARRAYS])
        if hostile == "shape":
            state = {key: value[..., :1] for key, value in state.items()}
        elif hostile == "non-finite":
            state = {key: torch.full_like(value, float("nan")) for key, value in state.items()}
        else:
            reply.content[CLIENT][CLIENT_INDEX] = 999
        reply.content[ARRAYS] = state_to_arrays(state)
        return reply

    grid = InProcessGrid([poisoned] + [honest] * 3)
    run_dir = run_meta_job(grid, parse_app_config(config))
    (line,) = metric_lines(run_dir)
    assert line["clients"] == [1, 2, 3] and 0 < line["psnr_p"] < 60
    assert line[NUM_REPLIES] == (4 if hostile == "client-index" else 3)


def test_deployed_faces_server_runs_from_run_config_alone(tmp_path: Path) -> None:
    config = tiny(tmp_path / "run", **{"num-server-rounds": 1, "simulation-audit": False})
    deployed = parse_app_config(config)
    assert meta_observers(deployed) == []  # a deployment: no simulation audit
    run_dir, _ = run_in_process(config)
    (line,) = metric_lines(run_dir)
    assert line[NUM_REPLIES] == 2 and line[NUM_FAILURES] == 0  # figures from the clients
    assert line[TRAIN_LOSS] > 0 and 0.0 <= line[GAMMA] <= 1.0
    assert 0 < line["psnr"] < 60 and "psnr_p" not in line  # public held-out faces only
    names = {path.name for path in run_dir.iterdir()}
    assert {"metrics.jsonl", "checkpoint.pt", "summary.json", "tto.png"} <= names
    assert not {"privacy.png", "renders.png"} & names
    assert json.loads((run_dir / "summary.json").read_text())["final"] == line


def test_deployed_objects_server_opens_no_client_data(tmp_path: Path) -> None:
    clients, public = tmp_path / "clients", tmp_path / "public"
    write_collection(TINY_OBJECTS, clients, progress=False)
    write_collection(replace(TINY_OBJECTS, count=1, seed=7), public, progress=False)
    config = tiny(
        tmp_path / "run",
        "objects",
        **{"num-server-rounds": 1, "num-clients": 2, "outer-steps": 1, "tto-steps": 2},
        **{"simulation-audit": False, "eval-scene-dir": str(public)},
    )
    grid = InProcessGrid([OPENS.node(client_app(config))] * 2, raise_errors=True)
    for node_id, context in grid.contexts.items():  # each node holds only its own object
        context.node_config["data-dir"] = str(clients / f"object_{node_id - 101:03d}")
    with OPENS.server():
        run_dir = run_meta_job(grid, parse_app_config(config))
    assert OPENS.paths("node", clients)  # the hook sees the nodes read their objects
    assert OPENS.paths("server", public)  # and the server its public held-out object
    assert OPENS.paths("server", clients) == []
    line = metric_lines(run_dir)[0]
    assert 0 < line["psnr"] < 60 and "psnr_p" not in line and line[NUM_REPLIES] == 2


def test_bad_run_config_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="'decentnerf' is for task 'scene' only"):
        parse_app_config({"task": "faces", "strategy": "decentnerf"})
    with pytest.raises(ValueError, match="'fedmenf' is for the meta tasks"):
        parse_app_config({"strategy": "fedmenf"})
    with pytest.raises(ValueError, match="'meta-learner' must be one of"):
        parse_app_config({"task": "faces", "meta-learner": "protonet"})
    with pytest.raises(ValueError, match="'task' must be one of"):
        parse_app_config({"task": "audio"})
    with pytest.raises(ValueError, match="unknown run-config key 'meta-lerner'; did you mean"):
        parse_app_config({"meta-lerner": "maml"})
    too_many = parse_app_config({"task": "faces", "clients-per-round": 30})
    with pytest.raises(ValueError, match="'clients-per-round' \\(30\\) exceeds the 20 clients"):
        meta_settings(too_many)
    with pytest.raises(ValueError, match="no data: a simulation's launcher names .*'data-dir'"):
        run_in_process(tiny(tmp_path / "objects", "objects", **{"simulation-audit": False}))
    with pytest.raises(ValueError, match="'data-dir' is empty: the objects privacy audit"):
        run_in_process(tiny(tmp_path / "audit", "objects"))
    with pytest.raises(ValueError, match="'eval-scene-dir' .*: no object_\\* folders"):
        no_public_objects = {"eval-scene-dir": str(tmp_path), "simulation-audit": False}
        run_in_process(tiny(tmp_path / "eval", "objects", **no_public_objects))


def test_presets_fill_only_the_keys_left_at_zero() -> None:
    faces = meta_settings(parse_app_config({"task": "faces", "outer-lr": 0.02}))
    assert (faces.outer_steps, faces.inner_steps, faces.outer_optimizer) == (32, 1, "sgd")
    assert faces.outer_lr == 0.02
    objects = meta_settings(parse_app_config({"task": "objects"}))
    assert (objects.outer_steps, objects.inner_steps, objects.outer_optimizer) == (8, 8, "adamw")
    assert FederatedConfig().strategy_name == "decentnerf"
    assert parse_app_config({"task": "video"}).strategy_name == "fedmenf"
    assert tto_schedule(32) == (0, 1, 2, 4, 8, 16, 32) and tto_schedule(5) == (0, 1, 2, 4, 5)


def fake_client(state: State, size: int):
    """A node that uploads `state` with "num-examples" = `size`."""

    def handle(message: Message, context: Context) -> Message:
        metrics = MetricRecord({NUM_EXAMPLES: size})
        content = RecordDict({ARRAYS: state_to_arrays(state), METRICS: metrics})
        return Message(content, reply_to=message)

    return handle


def test_fedmenf_samples_m_of_n_and_weights_by_dataset_size() -> None:
    generator = torch.Generator().manual_seed(0)
    states = [{"w": torch.randn(3, 2, generator=generator)} for _ in range(7)]
    sizes = [1, 5, 2, 9, 3, 4, 6]
    grid = InProcessGrid([fake_client(s, n) for s, n in zip(states, sizes, strict=True)])
    strategy = FedMeNF(clients_per_round=3, num_clients=7, fraction_evaluate=0.0)
    result = strategy.start(grid, state_to_arrays({"w": torch.zeros(3, 2)}), num_rounds=2)
    for group in ("1", "2"):
        assert len([m for m in grid.sent if m.metadata.group_id == group]) == 3
    last = [reply.metadata.src_node_id - 101 for reply in train_replies(grid, "2")]
    expected = sum(sizes[i] * states[i]["w"].double() for i in last) / sum(sizes[i] for i in last)
    torch.testing.assert_close(arrays_to_state(result.arrays)["w"].double(), expected)
    with pytest.raises(ValueError, match="exceeds num_clients"):
        m_of_n_sampling(8, 7)
    with pytest.raises(ValueError, match="sets \\['min_train_nodes'\\]"):
        FedMeNF(clients_per_round=3, num_clients=7, min_train_nodes=2)


def test_the_audit_attacks_every_clients_last_upload(tmp_path: Path) -> None:
    config = tiny(tmp_path / "run", **{"num-clients": 6, "clients-per-round": 6})
    config["num-server-rounds"] = 1
    run_dir, _ = run_in_process(config)
    final = json.loads((run_dir / "summary.json").read_text())["final"]
    assert final["attack-clients"] == 6
    assert final["mia-chance"] == 0.5  # balanced pairs: own upload vs another client's
    assert 0.0 <= final["mia-accuracy"] <= 1.0 and 0.0 <= final["mia-auc"] <= 1.0
    for similarity in ("mse", "correlation"):  # threshold attacks on the same pairs
        assert 0.0 <= final[f"mia-{similarity}-accuracy"] <= 1.0
        assert 0.0 <= final[f"mia-{similarity}-auc"] <= 1.0
    assert "pia-accuracy" not in final  # faces carry no property to infer
    assert final["attack-folds"] == 3  # 6 clients: 3 folds of 2 targets, each a target once


def test_the_audit_attacks_a_seeded_sample_above_its_client_cap(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The attacks' cost grows with the square of the clients: above MAX_ATTACK_CLIENTS
    uploads (4 here, of 6) a seeded sample is attacked, the same in two runs."""
    monkeypatch.setattr(meta_observer, "MAX_ATTACK_CLIENTS", 4)
    finals = []
    for name in ("first", "second"):
        config = tiny(tmp_path / name, **{"num-clients": 6, "clients-per-round": 6})
        config["num-server-rounds"] = 1
        run_dir, _ = run_in_process(config)
        final = json.loads((run_dir / "summary.json").read_text())["final"]
        finals.append({key: value for key, value in final.items() if key.startswith("mia")})
        assert final["attack-clients"] == 4 and final["attack-folds"] == 2
    assert finals[0] == finals[1]


@pytest.mark.parametrize("download", [False, True], ids=["uploads", "downloads-too"])
def test_a_compressed_run_goes_through_the_app_with_its_residuals_in_the_nodes_state(
    tmp_path: Path, download: bool
) -> None:
    """Run-config compression through the App's ClientApp and job: every train reply's ARRAYS
    is a top-k record, none is dropped, each node keeps its residual in its state directory;
    with compression-download every train message is a download the nodes rebuild, and the
    audit's attacks still read the uploads."""
    config = tiny(
        tmp_path / "run",
        strategy="fedavg",
        compression="topk",
        **{"meta-learner": "fomaml", "compression-fraction": 0.25},
        **{"state-dir": str(tmp_path / "state"), "compression-download": download},
    )
    run_dir, grid = run_in_process(config)
    lines = metric_lines(run_dir)
    assert len(lines) == 2 and all(line[NUM_REPLIES] == 2 for line in lines)
    assert all("num-dropped" not in line or line["num-dropped"] == 0 for line in lines)
    for server_round in ("1", "2"):
        for reply in train_replies(grid, server_round):
            names = list(reply.content[ARRAYS])
            assert names and all(name.endswith((":indices", ":values")) for name in names)
            client = reply.content[CLIENT][CLIENT_INDEX]
            assert (tmp_path / "state" / f"node_{client:02d}" / f"{RESIDUAL}.pt").is_file()
    train = [m for m in grid.sent if m.metadata.message_type == MessageType.TRAIN]
    assert all((DOWNLOAD_VERSION in m.content[CONFIG]) == download for m in train)
    assert all(len(line["clients"]) == 2 and line["psnr_p"] > 0 for line in lines)  # the audit


def test_the_largest_seed_the_parser_accepts_runs_two_rounds_of_each_job(
    crowd_dir: Path, tmp_path: Path
) -> None:
    """run-config seed 2^31 - 1 (the parser's largest) through 2 rounds of the meta job and
    the scene job in process: every generator derived from it (torch's, numpy's task split,
    the client and download seeds) takes it, and both runs finish."""
    from test_method_digests import SMALL_SCENE

    import strategies
    from fedfields.config.schema import MAX_SEED
    from simulations.federated_nerf import run_federated_nerf

    meta_dir, _ = run_in_process(tiny(tmp_path / "meta", seed=MAX_SEED))
    assert len((meta_dir / "metrics.jsonl").read_text().splitlines()) == 2
    config = {
        **SMALL_SCENE,
        "data-dir": str(crowd_dir),
        "state-dir": str(tmp_path / "nodes"),
        "run-dir": str(tmp_path / "scene"),
        "seed": MAX_SEED,
        "num-server-rounds": 2,
        "strategy": "fedavg",
        "compression": "quantise",
        "compression-download": True,
    }
    grid = InProcessGrid([client_app(config)] * 3, raise_errors=True)
    scene_dir = run_federated_nerf(grid, strategies.parse_app_config(config))
    assert len((scene_dir / "metrics.jsonl").read_text().splitlines()) == 2
