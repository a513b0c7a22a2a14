"""Split learning over Flower (run-config mode "split") on an in-process grid."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from flower_harness import InProcessGrid

from fedfields.cli import main as fedfields_main
from fedfields.flower_io import GRADIENT, SAMPLES, arrays_to_state
from fedfields.train.run_config import FederatedConfig
from simulations.run import client_app
from simulations.split_job import run_split_job

LEGO = Path(__file__).resolve().parents[2] / "shared" / "data" / "lego"


def tiny(run_dir: Path, **overrides: object) -> dict:
    """40 steps of 64 rays x 24 samples on lego at 25x25 with a 2^12 table."""
    return {
        "mode": "split",
        "data-dir": str(LEGO),
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
    return run_split_job(grid, config), grid, config


def test_split_run_writes_the_report_and_a_checkpoint_fedfields_eval_reads(
    split_run: tuple[Path, InProcessGrid, dict], capsys: pytest.CaptureFixture
) -> None:
    run_dir, _, _ = split_run
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [25, 40]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["mode"] == "split" and summary["transcript-steps"] == 8
    held_out = summary["client"]["heldout-psnr"]
    assert 5 < held_out < 40 and len(list((run_dir / "renders").glob("*.png"))) == 10
    code = fedfields_main(
        ["eval", "--checkpoint", str(run_dir / "checkpoint.pt"), "--scene", str(LEGO)]
        + ["--downscale", "8", "--no-progress"]
    )
    assert code == 0
    json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_the_server_receives_rays_and_gradients_only(
    split_run: tuple[Path, InProcessGrid, dict],
) -> None:
    _, grid, _ = split_run
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
    pending = arrays_to_state(grid.contexts[101].state["split-pending"])
    assert pending["colors"].shape == (64, 3)  # the colours stayed on the client


def test_split_mode_settings_are_checked(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="'mode' 'split' trains a scene"):
        FederatedConfig.from_run_config({"mode": "split", "task": "faces"})
    with pytest.raises(ValueError, match="split-noise-r"):
        FederatedConfig.from_run_config({"mode": "split", "split-noise-r": 0.0})
    config = tiny(tmp_path / "both", **{"split-noise-c": 1.2, "split-label-noise": 0.5})
    grid = InProcessGrid([client_app(config)])
    with pytest.raises(RuntimeError, match="split-noise-c or split-label-noise, not both"):
        run_split_job(grid, config)


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
    run_dir = run_split_job(InProcessGrid([client_app(config)], raise_errors=True), config)
    attack = json.loads((run_dir / "summary.json").read_text())["attack"]
    assert attack["attacked"]["ssim_depth"] > attack["untrained"]["ssim_depth"] + 0.3
    assert (run_dir / "attack.png").stat().st_size > 10_000
