"""`fedfields audit` on real tiny runs of each pipeline: the table, audit.json against numbers
computed another way, audit.png, --help, and a clear error for each bad input."""

from __future__ import annotations

import contextlib
import io
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from fedfields.cli import main as fedfields_main
from fedfields.config import meta_settings
from fedfields.data.crowd import CrowdData
from fedfields.metrics import psnr
from fedfields.privacy.leakage import UPLOAD_LEAK
from fedfields.privacy.split import TRANSCRIPT_FILE, load_transcript
from fedfields.train.builders import (
    client_meta_tasks,
    heldout_meta_tasks,
    meta_model,
    tto_qualities,
    tto_schedule,
)
from fedfields.train.evaluation import FieldRenderer
from fedfields.train.meta import privacy_metrics
from simulations.federated_nerf import run_federated_nerf
from simulations.in_process_grid import InProcessGrid
from simulations.meta_job import run_meta_job
from simulations.run import client_app
from simulations.split_job import run_split_job
from strategies import parse_app_config

LEGO = Path(__file__).resolve().parents[1] / "data" / "lego"
SMALL_GRID = {"hash-log2-size": 12, "hash-levels": 4, "hash-max-resolution": 64}  # a fast field


def scene_run(root: Path, crowd: Path) -> Path:
    """FedAvg (FedNeRF) on the shared 3-user crowd (conftest) at 25x25, one round of 3 steps
    (as test_federated_nerf); the observer records each plaintext upload's personal PSNR."""
    run_dir = root / "scene"
    config = {
        "data-dir": str(crowd),
        "simulation-audit": True,
        "state-dir": str(root / "scene.nodes"),
        "run-dir": str(run_dir),
        "strategy": "fedavg",
        "num-server-rounds": 1,
        "local-steps": 3,
        "fraction-train": 1.0,
        "eval-views-per-round": 1,
        "client-eval-views": 0,  # nodes train on every view; the audit scores them all
        "target-samples": 4096,
        "orbit-frames": 0,
        **SMALL_GRID,
    }
    return run_federated_nerf(
        InProcessGrid([client_app(config)] * 3, raise_errors=True),
        parse_app_config(config),
    )


def meta_run(root: Path) -> Path:
    """FedMeNF on faces: 4 clients, 2 per round, one round on a 2x16 SIREN (test_meta_job)."""
    config = {
        "task": "faces",
        "run-dir": str(root / "meta"),
        "simulation-audit": True,
        "num-server-rounds": 1,
        "num-clients": 4,
        "clients-per-round": 2,
        "outer-steps": 2,
        "inner-steps": 1,
        "field-width": 16,
        "field-depth": 2,
        "tto-steps": 4,
    }
    return run_meta_job(
        InProcessGrid([client_app(config)] * 4, raise_errors=True),
        parse_app_config(config),
    )


def first_views(scene: Path, count: int, out: Path) -> Path:
    """`scene` cut to its first `count` views (images linked, not copied)."""
    out.mkdir()
    meta = json.loads((scene / "transforms_train.json").read_text())
    meta["frames"] = meta["frames"][:count]
    (out / "transforms_train.json").write_text(json.dumps(meta))
    (out / "train").symlink_to(scene / "train", target_is_directory=True)
    return out


def split_run(root: Path) -> Path:
    """SplitNeRF at 25x25 on lego's first 16 views (every 8th held out: 2, which the run and
    the audit score every attack on), 20 steps of 32 rays x 16 samples, every 10th exchange
    recorded (test_split_job)."""
    run_dir = root / "split"
    config = {
        "mode": "split",
        "data-dir": str(first_views(LEGO, 16, root / "lego16")),
        "state-dir": str(root / "split.nodes"),
        "simulation-audit": True,
        "downscale": 8.0,
        "run-dir": str(run_dir),
        "split-steps": 20,
        "split-batch-rays": 32,
        "split-samples": 16,
        "split-record-every": 10,
        "split-attack": True,
        **SMALL_GRID,
    }
    return run_split_job(
        InProcessGrid([client_app(config)], raise_errors=True),
        parse_app_config(config),
    )


def run_cli(*args: str) -> tuple[int, str, str]:
    """`fedfields ARGS` in process: (exit status, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = fedfields_main(list(args))
        except SystemExit as exit_:  # argparse: --help and usage errors
            code = int(exit_.code or 0)
    return code, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def runs(crowd_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("audit")
    return {"scene": scene_run(root, crowd_dir), "meta": meta_run(root), "split": split_run(root)}


@pytest.fixture(scope="module")
def audited(runs: dict[str, Path]) -> tuple[str, dict[str, dict]]:
    """One `fedfields audit` over the three runs: its table and each run's audit.json."""
    code, out, err = run_cli("audit", *(str(p) for p in runs.values()), "--no-progress")
    assert code == 0, err
    return out, {name: json.loads((p / "audit.json").read_text()) for name, p in runs.items()}


def copy_run(run_dir: Path, to: Path) -> Path:
    """A fresh copy of a run directory, without the audit's files."""
    copy = shutil.copytree(run_dir, to)
    for name in ("audit.json", "audit.png"):
        (copy / name).unlink(missing_ok=True)
    return copy


def test_help_documents_the_audit() -> None:
    code, out, _ = run_cli("audit", "--help")
    assert code == 0
    for words in ("RUN_DIR", "audit.json", "audit.png", "scene", "meta", "split", "floor"):
        assert words in out


def test_the_table_has_one_row_per_run_and_every_run_gets_its_files(
    runs: dict[str, Path], audited: tuple[str, dict[str, dict]]
) -> None:
    table, reports = audited
    lines = table.splitlines()
    assert lines[0].startswith("run") and "utility" in lines[0] and "leakage" in lines[0]
    for name, run_dir in runs.items():
        (row,) = [line for line in lines[2:] if line.startswith(run_dir.name)]
        assert f"{name} (" in row
        headline = reports[name]["headline"]
        value = reports[name]["leakage"][headline["leakage"]]
        assert f"{headline['leakage']} {value:.3f}" in row
        assert sorted(reports[name]["compared-with"]) == sorted(str(p) for p in runs.values())
        with Image.open(run_dir / "audit.png") as image:
            image.verify()
            assert image.format == "PNG"
        assert "Audit" in (run_dir / "report.html").read_text()
        assert not list(run_dir.glob("*.partial"))


def test_every_file_of_fresh_runs_is_whole_and_loads_as_weights_only(
    runs: dict[str, Path], audited: tuple[str, dict[str, dict]]
) -> None:
    """The runs' and their nodes' torch files (checkpoint.pt, resume.pt, transcript.pt, node
    state) hold only tensors and plain containers: `weights_only=True` reads each; the JSON
    files parse whole, and no temporary file of an atomic write is left anywhere."""
    root = runs["scene"].parent
    files = [path for path in root.rglob("*") if path.is_file()]
    torch_files = [path for path in files if path.suffix == ".pt"]
    kinds = {path.name for path in torch_files}
    assert {"checkpoint.pt", "resume.pt", TRANSCRIPT_FILE} <= kinds and len(kinds) > 3
    for path in torch_files:
        torch.load(path, map_location="cpu", weights_only=True)
    for path in files:
        if path.suffix == ".json":
            json.loads(path.read_text())
        elif path.suffix == ".jsonl":
            assert all(json.loads(line) for line in path.read_text().splitlines())
    assert [path for path in files if path.name.endswith(".partial")] == []


def test_scene_leakage_is_the_personal_psnr_of_the_servers_field(
    runs: dict[str, Path], audited: tuple[str, dict[str, dict]]
) -> None:
    report, run_dir = audited[1]["scene"], runs["scene"]
    config = parse_app_config(json.loads((run_dir / "config.json").read_text()))
    renderer = FieldRenderer.from_checkpoint(config, run_dir / "checkpoint.pt")
    users = CrowdData.load(config.deployment.data_dir, config.common.downscale).users
    personal, floor, clean = [], [], []
    for user in users:
        for view in range(len(user.scene)):
            photo, mask = user.scene.images[view], user.personal_masks[view]
            personal.append(psnr(renderer(user.scene, view), photo, mask))
            floor.append(psnr(user.clean_images[view], photo, mask))  # renders no person
            clean.append(psnr(renderer(user.scene, view), user.clean_images[view]))
    assert report["leakage"]["personal-psnr"] == pytest.approx(np.mean(personal), abs=1e-4)
    assert report["reference"]["personal-psnr-floor"] == pytest.approx(np.mean(floor), abs=1e-6)
    assert report["utility"]["clean-psnr"] == pytest.approx(np.mean(clean), abs=1e-4)
    last = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])
    assert report["recorded-during-the-run"] == {UPLOAD_LEAK: last[UPLOAD_LEAK]}


def test_meta_audit_scores_theta_as_the_meta_jobs_evaluation(
    runs: dict[str, Path], audited: tuple[str, dict[str, dict]]
) -> None:
    report, run_dir = audited[1]["meta"], runs["meta"]
    config = parse_app_config(json.loads((run_dir / "config.json").read_text()))
    settings = meta_settings(config)
    model = meta_model(config, settings)
    theta = torch.load(run_dir / "checkpoint.pt", weights_only=True)["state_dict"]
    last = tto_schedule(settings.tto_steps)[-1]
    tto = [
        tto_qualities(model, theta, task, config, settings)[last]["psnr"]
        for task in heldout_meta_tasks(config, settings)
    ]
    assert report["utility"]["tto-psnr"] == pytest.approx(np.mean(tto), abs=1e-4)
    leaks = [
        privacy_metrics(model, theta, task, with_lpips=False)["psnr_p"]
        for client in range(settings.num_clients)
        for task in client_meta_tasks(config, settings, client)
    ]
    assert report["leakage"]["psnr_p"] == pytest.approx(np.mean(leaks), abs=1e-4)
    assert report["leakage"]["psnr_p_oracle"] >= report["leakage"]["psnr_p"] - 1e-6
    assert 0.0 <= report["leakage"]["theta-mia-accuracy"] <= 1.0
    assert report["leakage"]["theta-mia-chance"] == 0.5
    summary = json.loads((run_dir / "summary.json").read_text())
    assert report["recorded-during-the-run"]["psnr_p"] == summary["final"]["psnr_p"]


def test_split_audit_runs_every_attack_on_the_recorded_transcript(
    runs: dict[str, Path], audited: tuple[str, dict[str, dict]]
) -> None:
    report, run_dir = audited[1]["split"], runs["split"]
    client = json.loads((run_dir / "client.json").read_text())
    assert report["utility"]["heldout-psnr"] == pytest.approx(client["heldout-psnr"], abs=1e-4)
    assert len(load_transcript(run_dir / TRANSCRIPT_FILE)) == 2  # steps 0 and 10
    for attack in ("surrogate-offline", "surrogate-online", "sdar", "sdar-naive"):
        for score in ("ssim_depth", "ssim_grey"):
            assert -1.0 <= report["leakage"][f"{attack}-{score}"] <= 1.0
    assert -1.0 <= report["reference"]["untrained-ssim_depth"] <= 1.0
    assert report["skipped"] == {} and report["settings"]["transcript-steps"] == 2
    assert report["settings"]["heldout-views"] == 2  # views 0 and 8 of the 16
    # The offline attack is the one the run's observer ran, same seed and transcript.
    recorded = report["recorded-during-the-run"]["surrogate-ssim_depth"]
    assert report["leakage"]["surrogate-offline-ssim_depth"] == pytest.approx(recorded, abs=1e-6)


def test_a_split_run_without_transcript_says_what_was_skipped(
    runs: dict[str, Path], tmp_path: Path
) -> None:
    copy = copy_run(runs["split"], tmp_path / "no-transcript")
    (copy / TRANSCRIPT_FILE).unlink()
    code, out, err = run_cli("audit", str(copy), "--no-progress")
    assert code == 0, err
    report = json.loads((copy / "audit.json").read_text())
    assert set(report["skipped"]) == {"surrogate-offline", "surrogate-online", "sdar", "sdar-naive"}
    assert report["leakage"] == {} and "split-attack" in out and "skipped" in out


@pytest.mark.parametrize("fault", ["file", "no-config", "no-checkpoint", "no-data-dir"])
def test_bad_input_is_one_clear_error_and_nothing_is_written(
    fault: str, runs: dict[str, Path], tmp_path: Path
) -> None:
    good = copy_run(runs["scene"], tmp_path / "good")
    bad = tmp_path / "bad"
    expected = {
        "file": "not a directory",
        "no-config": "not a fedfields run",
        "no-checkpoint": "no checkpoint.pt",
        "no-data-dir": "'data-dir'",
    }[fault]
    if fault == "file":
        bad.write_text("")
    else:
        copy_run(runs["scene"], bad)
    if fault == "no-config":
        (bad / "config.json").unlink()
    if fault == "no-checkpoint":
        (bad / "checkpoint.pt").unlink()
    if fault == "no-data-dir":
        config = json.loads((bad / "config.json").read_text())
        config["data-dir"] = str(tmp_path / "gone")
        (bad / "config.json").write_text(json.dumps(config))
    code, out, err = run_cli("audit", str(good), str(bad), "--no-progress")
    assert code == 2 and out == ""
    assert err.startswith("fedfields audit: error: ") and str(bad) in err and expected in err
    assert len(err.strip().splitlines()) == 1
    assert not (good / "audit.json").exists() and not (good / "audit.png").exists()
