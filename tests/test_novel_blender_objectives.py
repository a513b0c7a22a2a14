"""The objectives bench (issue 58, point 6 on a CPU): FedNeRF's and DecentNeRF's objectives and
the clean ceiling trained centrally on a reproduce crowd, scored as the App scores a run, kept
per seed and objective so a rerun skips finished ones."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from fedfields.data.crowd import CrowdData
from simulations import reproduce
from simulations.bench import novel_blender_objectives as bench
from simulations.bench.federated_lego import all_photos

SEED = 6


@pytest.fixture(scope="module")
def crowd(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("objectives")
    argv = ["decentnerf-table1", "--scale", "toy", "--seeds", str(SEED), "--out", str(out)]
    assert reproduce.main([*argv, "--crowds-only"]) == 0
    return out / "crowds" / f"seed-{SEED}"


def test_each_objective_is_trained_scored_and_kept(crowd: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    argv = ["--crowds", str(crowd), "--scale", "toy", "--steps", "3", "--eval-every", "2",
            "--device", "cpu", "--out", str(out)]  # fmt: skip
    assert bench.main(argv) == 0
    results = bench.load_results(out)
    assert sorted(results) == sorted(bench.OBJECTIVES)
    for objective, by_seed in results.items():
        result = by_seed[SEED]
        assert [r["step"] for r in result["history"]] == [2, 3]  # a short last chunk
        last = result["history"][-1]
        assert all(math.isfinite(last[metric]) for metric in bench.METRICS), objective
        assert result["persons-kept-psnr"] > last["personal-psnr-floor"]
        assert result["diverged"] is None and result["steps"] == 3
        progress = out / f"seed-{SEED}" / f"{objective}.progress.jsonl"
        lines = [json.loads(line) for line in progress.read_text().splitlines()]
        assert lines == result["history"]  # each score as it came
    scores = {
        o: [{k: v for k, v in r.items() if k != "seconds"} for r in results[o][SEED]["history"]]
        for o in bench.OBJECTIVES
    }  # three objectives, three trainings: no score shared
    assert scores["photos"] != scores["nerfw"] and scores["photos"] != scores["clean"]
    assert scores["nerfw"] != scores["clean"]
    text = (out / "table.md").read_text()
    assert "| nerfw − photos |" in text and "NeRF-W 27.09" in text
    assert (out / "curves.png").stat().st_size > 0
    written = (out / f"seed-{SEED}" / "photos.json").stat().st_mtime_ns
    assert bench.main(argv) == 0  # finished: skipped, the table rewritten
    assert (out / f"seed-{SEED}" / "photos.json").stat().st_mtime_ns == written


def test_the_ceiling_trains_on_the_photos_poses_with_clean_images(crowd: Path) -> None:
    data = CrowdData.load(crowd, 1.0)
    photos, clean = all_photos(data), bench.clean_views(data)
    assert torch.equal(clean.cameras.camera_to_world, photos.cameras.camera_to_world)
    assert torch.equal(clean.images, torch.cat([u.clean_images for u in data.users]))
    persons = torch.cat([u.personal_masks for u in data.users])
    assert not torch.equal(clean.images[persons], photos.images[persons])


def test_persons_kept_is_the_photos_psnr_against_the_clean_views(crowd: Path) -> None:
    data = CrowdData.load(crowd, 1.0)
    by_hand = [
        10 * np.log10(1 / np.mean((u.scene.images[0].numpy() - u.clean_images[0].numpy()) ** 2))
        for u in data.users
    ]
    assert bench.persons_kept_psnr(data) == pytest.approx(float(np.mean(by_hand)), abs=1e-4)


def test_bad_crowds_and_budgets_are_refused_by_name(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"crowd\.json: not found"):
        bench.crowd_seed(tmp_path)
    (tmp_path / "crowd.json").write_text(json.dumps({"format": "x"}))
    with pytest.raises(ValueError, match=r"crowd\.json: no source\.config\.seed"):
        bench.crowd_seed(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--crowds", str(tmp_path), "--steps", "0"])
    assert exit_info.value.code == 2


def test_scales_are_the_reproduce_command_s_or_the_app_s_defaults() -> None:
    cpu = bench.bench_config("cpu", "target-samples=65536", 2)
    assert (cpu.scene.scene_field, cpu.common.field_width, cpu.common.seed) == ("mlp", 64, 2)
    assert cpu.scene.target_samples == 65536
    app = bench.bench_config("app", "", 0)
    assert app.scene.scene_field == "hashgrid" and app.scene.beta_min == 0.3


def test_results_made_with_other_settings_stop_the_command(crowd: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    made = out / f"seed-{SEED}" / "photos.json"
    made.parent.mkdir(parents=True)
    made.write_text(json.dumps({"scale": "toy", "run-config": "", "steps": 9, "eval-every": 100}))
    argv = ["--crowds", str(crowd), "--scale", "toy", "--objectives", "photos", "--out", str(out)]
    with pytest.raises(SystemExit) as exit_info:
        bench.main(argv)
    assert exit_info.value.code == 2


def test_a_diverged_objective_is_reported_and_left_out_of_the_means(crowd: Path) -> None:
    """A non-finite loss ends that objective's training; the table names it instead of
    averaging its last scores (the cpu scale's NeRF-W diverged so at one seed)."""
    config = bench.bench_config("toy", "", SEED)
    data = CrowdData.load(crowd, 1.0)
    data.users[0].scene.images[0] = math.nan  # a loss that cannot stay finite
    history, diverged = bench.train_objective("nerfw", config, data, 4, 2, "cpu")
    assert diverged is not None and "loss is nan" in diverged
    scores = dict.fromkeys(bench.METRICS, 20.0)
    good = {"history": [scores], "diverged": None, "persons-kept-psnr": 17.0}
    results = {"photos": {0: good}, "nerfw": {0: {"history": history, "diverged": diverged}}}
    text = bench.table(results)
    assert "Left out: nerfw seed 0 diverged in the steps after" in text
    assert "| nerfw − photos |" not in text
