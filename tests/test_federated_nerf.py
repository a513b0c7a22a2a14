"""The federated NeRF job end to end: in-process Flower grid, and once through Ray."""

from __future__ import annotations

import json
import shutil
import tomllib
from pathlib import Path

import imageio.v3 as iio
import pytest
import torch
from flwr.app import ArrayRecord

from clients.scene_client import PERSONAL
from fedfields.cli import main as fedfields_main
from fedfields.data.crowd import CrowdData
from fedfields.flower.protocol import arrays_to_state
from fedfields.methods import ALPHA_KEY
from fedfields.privacy.leakage import PERSONAL_FLOOR, UPLOAD_LEAK, score_crowd
from fedfields.render.orbit import ORBIT_FILE
from fedfields.report import REPORT_FILE
from simulations.federated_nerf import run_federated_nerf
from simulations.in_process_grid import InProcessGrid
from simulations.run import client_app, run_with_ray
from strategies import parse_app_config

ROOT = Path(__file__).resolve().parents[1]


def tiny(crowd_dir: Path, run_dir: Path, strategy: str, **overrides: object) -> dict:
    """A run-config small enough for a test: 2 rounds of 3 local steps on a field of 4 levels
    of 2^12 entries up to resolution 64 (its density is evaluated over the whole occupancy
    grid at every refresh, the bulk of a tiny run's time), no final orbit.

    The nodes keep their state in directories next to the run directory.
    """
    return {
        "data-dir": str(crowd_dir),
        "simulation-audit": True,
        "state-dir": str(run_dir.with_name(run_dir.name + ".nodes")),
        "run-dir": str(run_dir),
        "strategy": strategy,
        "num-server-rounds": 2,
        "local-steps": 3,
        "fraction-train": 1.0,
        "eval-views-per-round": 1,
        "target-samples": 4096,
        "hash-log2-size": 12,
        "hash-levels": 4,
        "hash-max-resolution": 64,
        "orbit-frames": 0,  # decentnerf_run and the tracking test look at an orbit
        **overrides,
    }


def _run_in_process(config: dict, users: int = 3) -> tuple[Path, InProcessGrid]:
    grid = InProcessGrid([client_app(config)] * users, raise_errors=True)
    return run_federated_nerf(grid, parse_app_config(config), observe=True), grid


@pytest.fixture(scope="module")
def decentnerf_run(
    crowd_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, InProcessGrid]:
    """One plaintext DecentNeRF run (`tiny`) that three tests read: its report, its replies
    and its summary next to a secure run's."""
    run_dir = tmp_path_factory.mktemp("decentnerf") / "run"
    return _run_in_process(tiny(crowd_dir, run_dir, "decentnerf", **{"orbit-frames": 4}))


def test_decentnerf_run_writes_the_report(
    decentnerf_run: tuple[Path, InProcessGrid], crowd_dir: Path, capsys
) -> None:
    run_dir, _ = decentnerf_run
    names = {p.name for p in run_dir.iterdir()}
    expected = {"config.json", "metrics.jsonl", "checkpoint.pt", "renders", "summary.json"}
    assert expected | {"alphas.jsonl", "alphas.png", "leakage.png", ORBIT_FILE} <= names
    orbit = iio.imread(run_dir / ORBIT_FILE, index=None)  # the server's field, orbiting
    assert (
        orbit.ndim == 4
        and len(orbit) == 4  # run-config orbit-frames
        and "data:image/gif" in (run_dir / REPORT_FILE).read_text()
    )
    rounds = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rounds] == [1, 2]
    assert all(r["server-flops"] > 0 and 0 < r["clean-psnr"] < 60 for r in rounds)
    assert all(r["num-replies"] == 3 and 0 < r["client-eval-psnr"] < 60 for r in rounds)
    # Without secure aggregation the server can divide alpha_k g_k by alpha_k: scored per upload.
    assert all(0 < r[UPLOAD_LEAK] < 60 for r in rounds)
    alphas = [json.loads(line) for line in (run_dir / "alphas.jsonl").read_text().splitlines()]
    assert sorted({(a["round"], a["user"]) for a in alphas}) == [
        (r, u) for r in (1, 2) for u in range(3)
    ]
    assert len(list((run_dir / "renders").glob("user_*.png"))) == 3
    saved = json.loads((run_dir / "config.json").read_text())
    assert parse_app_config(saved).common.strategy == "decentnerf"
    # The server's checkpoint is what `fedfields eval` reads.
    code = fedfields_main(
        [
            "eval",
            "--checkpoint",
            str(run_dir / "checkpoint.pt"),
            "--scene",
            str(crowd_dir / "heldout"),
        ]
        + ["--no-progress"]
    )
    assert code == 0
    reported = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    summary = json.loads((run_dir / "summary.json").read_text())["final"]
    assert reported["psnr"] == pytest.approx(summary["heldout-psnr"], abs=0.5)


def test_decentnerf_replies_carry_no_personal_content(
    decentnerf_run: tuple[Path, InProcessGrid],
) -> None:
    run_dir, grid = decentnerf_run
    personal = [  # what each node keeps in its state directory (`tiny`)
        tensor
        for node in sorted(run_dir.with_name(run_dir.name + ".nodes").glob("node_*"))
        for tensor in torch.load(node / f"{PERSONAL}.pt", weights_only=True).values()
    ]
    assert personal, "clients kept no personal field"
    global_keys = None
    replies = [reply for reply in grid.received if not reply.has_error()]
    rounds = [reply for reply in replies if reply.metadata.message_type != "query.user_key"]
    assert len(rounds) == 3 + 3 + 3  # round 1 train, round 2 gradient query and train
    for reply in replies:
        for name, record in reply.content.items():
            if not isinstance(record, ArrayRecord):
                assert "alpha" not in json.dumps(dict(record)), f"{name} carries alpha"
                continue
            state = arrays_to_state(record)
            keys = set(state) - {ALPHA_KEY}
            global_keys = global_keys or keys
            assert keys == global_keys, "a reply carries tensors beyond the global field"
            for sent in state.values():
                for kept in personal:
                    same = sent.shape == kept.shape and torch.allclose(sent, kept)
                    assert not same, f"reply record {name!r} contains a personal tensor"
    embedding_shape = (2, 8)  # 2 training images (1 held out) x 8 appearance dimensions
    assert any(t.shape == embedding_shape for t in personal)


def test_secure_decentnerf_run_sends_only_masked_vectors(
    decentnerf_run: tuple[Path, InProcessGrid], crowd_dir: Path, tmp_path: Path
) -> None:
    plain_dir, _ = decentnerf_run
    secure = {"secure-aggregation": True, "min-train-nodes": 3}  # SecAgg+ needs 3 per round
    config = tiny(crowd_dir, tmp_path / "secure", "decentnerf", **secure)
    run_dir, grid = _run_in_process(config)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["secure-aggregation"]["enabled"] is True
    assert summary["secure-aggregation"]["protocol"] == "Flower SecAgg+"
    plain = json.loads((plain_dir / "summary.json").read_text())
    assert plain["secure-aggregation"] == {"enabled": False}
    assert summary["final"]["clean-psnr"] == pytest.approx(plain["final"]["clean-psnr"], abs=0.2)
    replies = [
        r
        for r in grid.received
        if not r.has_error() and r.metadata.message_type != "query.user_key"
    ]
    assert not any(len(r) for reply in replies for r in reply.content.array_records.values())
    masked = [reply for reply in replies if "fitres.num_examples" in reply.content]
    assert len(masked) == 3 * 2 * 3  # 3 secure sums (round 1: 1, round 2: 2) x 2 runs x 3 users
    rounds = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert not any(UPLOAD_LEAK in r for r in rounds)  # nothing per user to read


@pytest.mark.parametrize("strategy", ["fedavg", "scaffold"])
def test_baselines_run_in_process(crowd_dir: Path, tmp_path: Path, strategy: str) -> None:
    """A method without a personal field, server-side (FedAvg) or with client hooks (Scaffold),
    through the App with the audit on: every round's uploads scored, no personal field kept.
    (Every registered method runs through the same job in tests/test_method_digests.py.)"""
    run_dir, _ = _run_in_process(tiny(crowd_dir, tmp_path / strategy, strategy))
    assert (run_dir / "checkpoint.pt").is_file() and not (run_dir / "alphas.jsonl").exists()
    assert not (run_dir / ORBIT_FILE).exists()  # orbit-frames 0: a sweep's runs skip it
    nodes = tmp_path / f"{strategy}.nodes"
    assert not list(nodes.glob(f"node_*/{PERSONAL}.pt"))  # FedNeRF and others share everything
    final = json.loads((run_dir / "summary.json").read_text())["final"]
    assert 0 < final["clean-psnr"] < 60
    rounds = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert all(0 < r[UPLOAD_LEAK] < 60 for r in rounds)  # plaintext uploads, scored per user


def test_one_round_through_flowers_ray_simulation_engine(crowd_dir: Path, tmp_path: Path) -> None:
    config = tiny(crowd_dir, tmp_path / "ray", "fedavg", **{"num-server-rounds": 1})
    run_dir = run_with_ray(config, num_supernodes=3)
    assert (run_dir / "checkpoint.pt").is_file()
    assert len((run_dir / "metrics.jsonl").read_text().splitlines()) == 1


def test_run_config_in_pyproject_matches_the_job_settings() -> None:
    with (ROOT / "pyproject.toml").open("rb") as file:
        declared = tomllib.load(file)["tool"]["flwr"]["app"]["config"]
    assert parse_app_config(declared) == parse_app_config({})
    assert declared == parse_app_config({}).to_run_config()


def test_bad_run_config_names_the_key(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown run-config key 'local-stepz'"):
        parse_app_config({"local-stepz": 3})
    with pytest.raises(ValueError, match="'strategy' 'fedsgd' is unknown; known: fedavg, fedprox"):
        run_federated_nerf(
            InProcessGrid([]),
            parse_app_config({"strategy": "fedsgd", "run-dir": str(tmp_path)}),
        )
    with pytest.raises(ValueError, match="'local-steps' must be int"):
        parse_app_config({"local-steps": 2.5})
    with pytest.raises(FileNotFoundError, match="no user_NN folders"):
        run_federated_nerf(
            InProcessGrid([]),
            parse_app_config({"data-dir": str(tmp_path)}),
            observe=True,
        )
    assert not list(tmp_path.iterdir()), "a refused run wrote something"


def test_rejects_a_used_run_directory(crowd_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "old.txt").write_text("x")
    with pytest.raises(FileExistsError, match="not empty"):
        run_federated_nerf(
            InProcessGrid([]),
            parse_app_config(tiny(crowd_dir, tmp_path / "used", "fedavg")),
        )
    shutil.rmtree(tmp_path / "used")


def test_leakage_metric_on_renders_with_known_content(crowd_dir: Path) -> None:
    users = CrowdData.load(str(crowd_dir), 1.0).users

    def blend(weight: float):  # weight 1: renders the photo (the person), 0: the clean view
        return lambda scene, view: next(
            weight * u.scene.images[view] + (1 - weight) * u.clean_images[view]
            for u in users
            if u.scene is scene
        )

    none, most = score_crowd(blend(0.0), users), score_crowd(blend(0.9), users)
    assert none["personal-psnr"] == pytest.approx(none[PERSONAL_FLOOR])  # no person: the floor
    # 90% of the person: the error inside the masks is 0.1x the floor's, i.e. +20 dB per view
    assert most["personal-psnr"] == pytest.approx(most[PERSONAL_FLOOR] + 20.0, abs=1e-3)
    assert most[PERSONAL_FLOOR] == none[PERSONAL_FLOOR]  # the floor ignores the render
    assert none[PERSONAL_FLOOR] < 40.0  # persons change the masked pixels
