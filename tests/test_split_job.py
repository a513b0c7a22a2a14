"""Split learning over Flower (run-config mode "split") on an in-process grid."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from flwr.app import Context, Message, RecordDict
from flwr.clientapp import ClientApp

from clients.split_client import client_views, scene_dir, split_defence
from fedfields.cli import main as fedfields_main
from fedfields.flower.node import NodeState
from fedfields.flower.protocol import GRADIENT, SAMPLES, arrays_to_state
from simulations.in_process_grid import InProcessGrid
from simulations.run import client_app, with_run_config
from simulations.split_job import run_split_job
from simulations.split_observer import split_observers
from strategies import parse_app_config

LEGO = Path(__file__).resolve().parents[1] / "data" / "lego"  # the bundled scene


def tiny(run_dir: Path, **overrides: object) -> dict:
    """A simulation's run-config: 40 steps of 64 rays x 24 samples on lego at 25x25 with a
    2^12 table; the client's state under <run-dir>.nodes, the split audit attached."""
    return {
        "mode": "split",
        "data-dir": str(LEGO),
        "state-dir": str(run_dir.with_name(run_dir.name + ".nodes")),
        "simulation-audit": True,
        "downscale": 8.0,
        "run-dir": str(run_dir),
        "split-steps": 40,
        "split-batch-rays": 64,
        "split-samples": 24,
        "split-record-every": 5,
        "split-attack": False,
        "hash-log2-size": 12,
        **overrides,
    }


@pytest.fixture(scope="module")
def split_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, InProcessGrid, dict]:
    config = tiny(tmp_path_factory.mktemp("split") / "run")
    grid = InProcessGrid([client_app(config)], raise_errors=True)
    return run_split_job(grid, parse_app_config(config)), grid, config


def test_split_run_writes_the_report_and_a_checkpoint_fedfields_eval_reads(
    split_run: tuple[Path, InProcessGrid, dict], capsys: pytest.CaptureFixture
) -> None:
    run_dir, _, config = split_run
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [25, 40]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["mode"] == "split" and "attack" not in summary
    held_out = summary["client"]["heldout-psnr"]
    assert 5 < held_out < 40 and len(list((run_dir / "renders").glob("*.png"))) == 10
    node_dir = Path(config["state-dir"]) / "node_00"  # the client wrote here; the audit copied
    assert (node_dir / "checkpoint.pt").read_bytes() == (run_dir / "checkpoint.pt").read_bytes()
    code = fedfields_main(
        ["eval", "--checkpoint", str(run_dir / "checkpoint.pt"), "--scene", str(LEGO)]
        + ["--downscale", "8", "--no-progress"]
    )
    assert code == 0
    json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_the_server_receives_rays_and_gradients_only(
    split_run: tuple[Path, InProcessGrid, dict],
) -> None:
    _, grid, config = split_run
    assert len(grid.received) == 40 + 2  # start, one reply per step, finish
    for reply in grid.received:
        assert set(reply.content.array_records) <= {SAMPLES, GRADIENT}
        for record in reply.content.array_records.values():
            for key, tensor in arrays_to_state(record).items():
                assert key in ("origins", "directions", "edges", "embeddings")
                if key == "embeddings":
                    assert tensor.shape == (64 * 24, 64)
    samples = [r for r in grid.received if SAMPLES in r.content]
    assert len(samples) == 40  # pipelined: each reply carries the next batch but the last
    state = NodeState(with_run_config(grid.contexts[101], config))
    assert state.directory == Path(config["state-dir"]) / "node_00"
    pending = state.tensors("split-pending")
    assert pending is not None and pending["colors"].shape == (64, 3)  # stayed on the client


def test_split_mode_settings_are_checked(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="'mode' 'split' trains a scene"):
        parse_app_config({"mode": "split", "task": "faces"})
    with pytest.raises(ValueError, match="split-noise-r"):
        parse_app_config({"mode": "split", "split-noise-r": 0.0})
    with pytest.raises(ValueError, match="'state-dir' is empty"):
        split_observers(parse_app_config(tiny(tmp_path / "audit", **{"state-dir": ""})))
    both = tiny(tmp_path / "both", **{"split-noise-c": 1.2, "split-label-noise": 0.5})
    with pytest.raises(ValueError, match="'split-noise-c' or 'split-label-noise', not both"):
        parse_app_config(both)  # refused before the run, not by the client at its first step


def test_the_clients_s2nerf_noise_differs_across_steps() -> None:
    """The client builds its defence anew for every step (`split_defence`): its noise must
    still change from step to step, else the server could average the steps' gradients and
    cancel one fixed pattern."""
    config = parse_app_config(
        {"mode": "split", "split-noise-c": 1.2, "split-noise-r": 1.0, "seed": 3}
    )
    gradient = torch.ones(256, 64)  # every row of norm 8: sigma = 1.2 * 8

    def noise(step: int) -> torch.Tensor:
        defence = split_defence(config)
        assert defence is not None
        return (defence.perturb_gradient(gradient, step) - gradient).double()

    sigma = 1.2 * 8.0
    assert not torch.allclose(noise(0), noise(1))
    assert torch.equal(noise(5), noise(5))  # the same (seed, step) reproduces
    steps = torch.stack([noise(step) for step in range(100)])
    assert steps[0].std().item() == pytest.approx(sigma, rel=0.05)
    # averaging 100 steps shrinks independent noise to sigma / 10; a fixed pattern stays sigma
    assert steps.mean(dim=0).std().item() < 0.2 * sigma


def test_the_node_finds_its_scene(tmp_path: Path) -> None:
    """Node-config `data-dir` first; in simulation run-config `data-dir` when it is itself a
    scene (the launcher's one virtual node), else its scene_NN folder below it."""

    def context(node_config: dict[str, Any], run_config: dict[str, Any]) -> Context:
        return Context(
            run_id=1, node_id=7, node_config=node_config, state=RecordDict(), run_config=run_config
        )

    root = tmp_path / "root"
    (root / "scene_00").mkdir(parents=True)
    simulated = {"partition-id": 0, "num-partitions": 1}
    assert scene_dir(context({"data-dir": str(LEGO)}, {"data-dir": str(root)})) == LEGO
    assert scene_dir(context(simulated, {"data-dir": str(LEGO)})) == LEGO
    assert scene_dir(context(simulated, {"data-dir": str(root)})) == root / "scene_00"
    with pytest.raises(ValueError, match="node 7: no data"):
        scene_dir(context(simulated, {}))


class ServerOpens:
    """Files opened while the server's code runs (the node's handler excluded).

    An audit hook cannot be removed: one is installed once and records only while `on`.
    """

    def __init__(self) -> None:
        self.on = False
        self.opened: list[Path] = []

    def __call__(self, event: str, args: tuple[Any, ...]) -> None:
        if self.on and event == "open" and isinstance(args[0], str | bytes):
            self.opened.append(Path(os.fsdecode(args[0])).resolve())

    def node(self, app: ClientApp):
        """`app` as a node handler whose own opens are not recorded.

        The scene the node read stays in the node: the process-wide scene cache is cleared
        after each message, so the server cannot reach it without opening its files.
        """

        def handle(message: Message, context: Context) -> Message:
            self.on = False
            try:
                return app(message, context)
            finally:
                client_views.cache_clear()
                self.on = True

        return handle


SERVER_OPENS = ServerOpens()
sys.addaudithook(SERVER_OPENS)


def test_the_server_starts_from_run_config_alone_and_opens_no_scene_file(
    tmp_path: Path,
) -> None:
    """A deployment: no data-dir, state-dir or audit in run-config; the node is given its
    scene and state directory in node-config. The server opens no file of the scene, the
    client keeps its joint field in its own state directory, and a second run with the same
    state directory starts afresh."""
    config = tiny(tmp_path / "run", **{"split-steps": 3})
    for key in ("data-dir", "state-dir", "simulation-audit"):
        del config[key]
    assert split_observers(parse_app_config(config)) == []
    node_dir = tmp_path / "node-state"

    def deployed(run_dir: Path, audit: bool) -> tuple[Path, dict]:
        app = client_app(config | {"run-dir": str(run_dir)})
        grid = InProcessGrid([SERVER_OPENS.node(app) if audit else app], raise_errors=True)
        grid.contexts[101].node_config.update({"data-dir": str(LEGO), "state-dir": str(node_dir)})
        client_views.cache_clear()
        SERVER_OPENS.opened, SERVER_OPENS.on = [], audit
        try:
            run_dir = run_split_job(grid, parse_app_config(config | {"run-dir": str(run_dir)}))
        finally:
            SERVER_OPENS.on = False
        return run_dir, json.loads((run_dir / "summary.json").read_text())

    run_dir, summary = deployed(tmp_path / "run", audit=True)
    assert SERVER_OPENS.opened  # the hook saw the server write its report
    assert [p for p in SERVER_OPENS.opened if p.is_relative_to(LEGO.resolve())] == []
    written = {p.name for p in run_dir.iterdir()}
    (events,) = [name for name in written if name.startswith("events.out.tfevents.")]
    assert written - {events} == {"config.json", "metrics.jsonl", "summary.json", "report.html"}
    assert {"checkpoint.pt", "client.json", "renders"} <= {p.name for p in node_dir.iterdir()}
    _, again = deployed(tmp_path / "again", audit=False)
    assert again["client"] == summary["client"]


def test_the_attack_audit_recovers_geometry_and_reports_it(tmp_path: Path) -> None:
    config = tiny(
        tmp_path / "attacked",
        **{
            "split-steps": 200,
            "split-batch-rays": 128,
            "split-record-every": 20,
            "split-attack": True,
        },
    )
    run_dir = run_split_job(
        InProcessGrid([client_app(config)], raise_errors=True),
        parse_app_config(config),
    )
    attack = json.loads((run_dir / "summary.json").read_text())["attack"]
    assert attack["transcript-steps"] == 10
    assert attack["attacked"]["ssim_depth"] > attack["untrained"]["ssim_depth"] + 0.3
    assert (run_dir / "attack.png").stat().st_size > 10_000
