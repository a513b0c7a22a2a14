"""`python -m simulations.reproduce` end to end at its toy scale (issue 58, point 1): every seed
builds its own crowd with held-out poses and runs each setting through the App; the table puts
the paper's values beside ours with paired intervals; a rerun continues instead of restarting."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
from scipy import stats

from simulations import reproduce

SEEDS = ["0", "1"]
CHANGE = ["--run-config", "local-steps=1"]
"""The module's runs change the toy scale's 2 local steps to 1: `--run-config` end to end."""


@pytest.fixture(scope="module")
def reproduced(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("reproduce") / "table1"
    argv = ["decentnerf-table1", "--scale", "toy", "--seeds", *SEEDS, "--out", str(out)]
    assert reproduce.main([*argv, *CHANGE, "--no-progress"]) == 0
    return out


def _final(out: Path, setting: str, seed: str) -> dict:
    return json.loads((out / setting / f"seed-{seed}" / "summary.json").read_text())["final"]


def test_each_seed_has_its_own_crowd_with_held_out_poses(reproduced: Path) -> None:
    crowds = [json.loads((reproduced / "crowds" / f"seed-{s}" / "crowd.json").read_text())
              for s in SEEDS]  # fmt: skip
    assert [crowd["source"]["config"]["seed"] for crowd in crowds] == [0, 1]
    for crowd in crowds:
        assert len(crowd["heldout_views"]) >= 4  # the toy scale's 4 poses set aside
    for setting in ("fednerf", "decentnerf"):
        for seed in SEEDS:
            assert math.isfinite(_final(reproduced, setting, seed)["heldout-psnr"])


def test_the_table_shows_the_paper_beside_a_paired_interval_computed_from_the_runs(
    reproduced: Path,
) -> None:
    """The claimed difference's mean and 95% interval recomputed here from the runs' own
    summary.json files with scipy's t quantile."""
    record = json.loads((reproduced / "table.json").read_text())
    claim = next(d for d in record["differences"] if d["metric"] == "heldout-psnr")
    differences = [
        _final(reproduced, "decentnerf", s)["heldout-psnr"]
        - _final(reproduced, "fednerf", s)["heldout-psnr"]
        for s in SEEDS
    ]
    mean = sum(differences) / 2
    half = stats.t.ppf(0.975, 1) * abs(differences[0] - differences[1]) / math.sqrt(2) / 2**0.5
    assert claim["mean"] == pytest.approx(mean)
    assert (claim["low"], claim["high"]) == pytest.approx((mean - half, mean + half))
    assert claim["paper"] == 8.55 and claim["verdict"] == ("met" if mean - half > 0 else "missed")
    text = (reproduced / "table.md").read_text()
    assert "26.25 (Table 1)" in text and "Scale `toy`" in text and "| met? |" in text
    assert (reproduced / "figure.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_rerun_skips_finished_runs_and_finishes_a_cut_one(reproduced: Path) -> None:
    """summary.json of one run removed (as if killed after its last round checkpoint): the
    rerun resumes that run from its checkpoint; one cut before any checkpoint starts afresh;
    the others are left untouched."""
    cut = reproduced / "fednerf" / "seed-1"
    (cut / "summary.json").unlink()
    early = reproduced / "decentnerf" / "seed-1"  # cut before any round checkpoint
    (early / "summary.json").unlink()
    (early / "resume.pt").unlink()
    untouched = reproduced / "decentnerf" / "seed-0" / "summary.json"
    before = untouched.stat().st_mtime_ns
    argv = ["decentnerf-table1", "--scale", "toy", "--seeds", *SEEDS, "--out", str(reproduced)]
    assert reproduce.main([*argv, *CHANGE, "--no-progress"]) == 0
    assert untouched.stat().st_mtime_ns == before
    rounds = [
        json.loads(line)["round"] for line in (cut / "metrics.jsonl").read_text().splitlines()
    ]
    assert rounds == [1, 2] and "heldout-psnr" in _final(reproduced, "fednerf", "1")
    restarted = [
        json.loads(line)["round"] for line in (early / "metrics.jsonl").read_text().splitlines()
    ]
    assert restarted == [1, 2] and "heldout-psnr" in _final(reproduced, "decentnerf", "1")


def test_bad_arguments_are_refused_by_name(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit):
        reproduce.main(["decentnerf-table9"])
    assert "decentnerf-table9" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        reproduce.main(["decentnerf-table1", "--seeds", "0", "0"])
    assert "--seeds must be distinct" in capsys.readouterr().err


def test_run_config_changes_every_setting_and_is_named_in_the_table(reproduced: Path) -> None:
    """`--run-config` over the scale (as on a borrowed GPU, fewer steps): every setting's runs
    have it, the table and its JSON say so."""
    for setting in ("fednerf", "decentnerf"):
        for seed in SEEDS:
            config = json.loads((reproduced / setting / f"seed-{seed}" / "config.json").read_text())
            assert config["local-steps"] == 1
    assert "with --run-config local-steps=1" in (reproduced / "table.md").read_text()
    record = json.loads((reproduced / "table.json").read_text())
    assert record["differs"].endswith("local-steps=1")


@pytest.mark.parametrize(
    ("table", "run_config", "message"),
    [
        ("decentnerf-table1", "strategy='fedavg'", "--run-config strategy: set by the table's"),
        ("decentnerf-table1", "local-stepz=2", "local-stepz"),
        ("decentnerf-table1", "num-server-rounds=0", "num-server-rounds"),
        ("sdar-levels", "num-server-rounds=1", "runs no App job"),
    ],
)
def test_a_bad_run_config_is_refused_by_name_before_any_run(
    table: str, run_config: str, message: str, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    argv = [table, "--scale", "toy", "--out", str(tmp_path / "out"), "--run-config", run_config]
    assert reproduce.main(argv) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_finished_runs_made_with_other_values_stop_the_command(
    reproduced: Path, capsys: pytest.CaptureFixture
) -> None:
    """The module's runs have 1 local step: asking for the scale's 2 (no --run-config) into
    the same --out names the first finished run that differs and runs nothing."""
    before = sorted(path.stat().st_mtime_ns for path in reproduced.rglob("summary.json"))
    argv = ["decentnerf-table1", "--scale", "toy", "--seeds", *SEEDS, "--out", str(reproduced)]
    assert reproduce.main([*argv, "--no-progress"]) == 2
    error = capsys.readouterr().err
    assert "fednerf/seed-0 finished with other settings (local-steps: 1 -> 2)" in error
    assert "give another --out" in error
    assert sorted(path.stat().st_mtime_ns for path in reproduced.rglob("summary.json")) == before


def test_crowds_only_builds_the_crowds_a_later_run_reuses(tmp_path: Path) -> None:
    """`--crowds-only` writes each seed's crowd and runs nothing; the run then reuses it."""
    out = tmp_path / "out"
    argv = ["decentnerf-table1", "--scale", "toy", "--seeds", "4", "--out", str(out)]
    assert reproduce.main([*argv, "--crowds-only"]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["crowds"]
    crowd = out / "crowds" / "seed-4" / "crowd.json"
    assert json.loads(crowd.read_text())["source"]["config"]["seed"] == 4
    table = reproduce.TABLES["decentnerf-table1"]
    written = crowd.stat().st_mtime_ns
    assert reproduce.crowd_dir(out, table, table.scales["toy"], 4, reproduce.LEGO) == crowd.parent
    assert crowd.stat().st_mtime_ns == written  # found, not built again
    assert reproduce.main(["fedmenf-table1", "--out", str(out), "--crowds-only"]) == 2


def test_fedmenf_s_table_runs_the_meta_job_with_its_audit(tmp_path: Path) -> None:
    """Each (setting, seed) is the App's meta job with the simulation audit: PSNR_p and the
    membership attack are in its final scores, and a meta table builds no crowd."""
    out = tmp_path / "fedmenf"
    argv = ["fedmenf-table1", "--scale", "toy", "--seeds", "0", "--out", str(out)]
    assert reproduce.main([*argv, "--no-progress"]) == 0
    for setting in ("maml", "fedmenf"):
        config = json.loads((out / setting / "seed-0" / "config.json").read_text())
        assert config["meta-learner"] == setting and config["seed"] == 0
        final = _final(out, setting, "0")
        assert math.isfinite(final["psnr_p"]) and 0.0 <= final["mia-accuracy"] <= 1.0
    assert not (out / "crowds").exists()
    text = (out / "table.md").read_text()
    assert "16.57 (Table 1, PetFace, FedAvg)" in text and "Scale `toy`" in text


def test_s2nerf_s_table_runs_the_split_job_and_reads_its_attack(tmp_path: Path) -> None:
    """The split table's S2NeRF setting alone: the App's split job with the Surrogate Model
    Attack; the attack's scores (summary.json's "attack") become the table's metrics."""
    table = reproduce.TABLES["s2nerf-table4"]
    only = replace(table, settings={"s2nerf": table.settings["s2nerf"]}, differences=())
    results = reproduce.reproduce(
        only, table.scales["toy"], [0], tmp_path, reproduce.LEGO, progress=False
    )
    summary = json.loads((tmp_path / "s2nerf" / "seed-0" / "summary.json").read_text())
    config = json.loads((tmp_path / "s2nerf" / "seed-0" / "config.json").read_text())
    assert (config["split-noise-c"], config["split-noise-r"]) == (1.2, 1e-4)
    metric = "attack.attacked.ssim_depth"
    assert results.values("s2nerf", metric) == {0: summary["attack"]["attacked"]["ssim_depth"]}
    assert "heldout-psnr" in results.runs["s2nerf"][0]
    text, _ = reproduce.render_table(only, table.scales["toy"], results)
    assert "0.53 (Table 4, 3D-FRONT)" in text


def test_a_closeness_claim_is_met_only_below_its_bound() -> None:
    claim = reproduce.Difference("a", "b", "psnr", 0.39, "within 1 dB", within=1.0)
    inside = reproduce.Paired((0, 1, 2), (0.1, 0.2, 0.3), mean=0.2, low=-0.3, high=0.7)
    straddling = reproduce.Paired((0, 1, 2), (0.5, 0.6, 0.7), mean=0.6, low=0.1, high=1.1)
    assert reproduce.verdict(claim, inside) == "met"
    assert reproduce.verdict(claim, straddling) == "missed"


def test_sdar_s_table_compares_both_attacks_on_the_same_training(tmp_path: Path) -> None:
    """Each split level is one split-learning run of the digits CNN that SDAR and naive SDA
    both watch; the claim compares the two attacks' MSE within a run (metric_b)."""
    argv = ["sdar-levels", "--scale", "toy", "--seeds", "0", "--out", str(tmp_path)]
    assert reproduce.main([*argv, "--no-progress"]) == 0
    record = json.loads((tmp_path / "table.json").read_text())
    for level in (1, 2, 3):
        final = _final(tmp_path, f"blocks-{level}", "0")
        claim = next(d for d in record["differences"] if d["a"] == f"blocks-{level}")
        assert claim["mean"] == pytest.approx(final["naive-mse"] - final["sdar-mse"])
        config = json.loads((tmp_path / f"blocks-{level}" / "seed-0" / "config.json").read_text())
        assert config == {"steps": 10, "split-level": level, "seed": 0}
