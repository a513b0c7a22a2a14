"""Sweeps (issue 41, point 4): `python -m simulations.sweep` expands a grid of run-configs times
seeds, launches each run once (skipping finished runs, resuming killed ones), and tabulates
mean ± std and paired differences; the numbers are checked against numpy and scipy."""

from __future__ import annotations

import csv
import inspect
import json
import math
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
from scipy import stats

from simulations import sweep
from simulations.sweep_statistics import (
    Paired,
    describe,
    expand_grid,
    final_metrics,
    is_complete,
    markdown_table,
    pair_csv_rows,
    pair_stats,
    paired_difference,
    parse_grid,
    setting_csv,
    setting_names,
    setting_stats,
    typed,
)

ROOT = Path(__file__).resolve().parents[1]
TINY = (
    "num-server-rounds=1 local-steps=1 orbit-frames=0 target-samples=1024 hash-log2-size=10 "
    "hash-levels=4 client-eval-views=0"
)
STRATEGIES = "strategy=['fedavg','decentnerf']"


# ------------------------------------------------------------------ grid and names


@pytest.mark.parametrize(
    ("text", "key", "values"),
    [
        ("strategy=['fedavg','decentnerf']", "strategy", ["fedavg", "decentnerf"]),
        ('strategy=["fedavg"]', "strategy", ["fedavg"]),
        ("alpha-lr=[0, 0.1, 1e-3]", "alpha-lr", [0, 0.1, 0.001]),
        ("secure-aggregation=[true, false]", "secure-aggregation", [True, False]),  # TOML
        ("secure-aggregation=[True, False]", "secure-aggregation", [True, False]),  # Python
        ("local-steps = (1, 2)", "local-steps", [1, 2]),  # a Python tuple
    ],
)
def test_a_grid_reads_toml_or_python_list_literals(text: str, key: str, values: list) -> None:
    assert parse_grid(text) == (key, values)
    assert [type(v) for v in parse_grid(text)[1]] == [type(v) for v in values]


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("strategy='fedavg'", "expected a non-empty list"),
        ("strategy=[]", "expected a non-empty list"),
        ("strategy=[fedavg]", "neither a TOML nor a Python list literal"),
        ("local-steps=[[1], [2]]", "[1] is not a run-config value"),
        ("local-steps=[1, 2, 1]", "repeats a value"),
        ("[1, 2]", "expected key=[v1, v2]"),
        ("Local_Steps=[1]", "expected key=[v1, v2]"),
    ],
)
def test_a_bad_grid_is_refused_naming_it(text: str, reason: str) -> None:
    with pytest.raises(ValueError, match=re.escape(reason)):
        parse_grid(text)


def test_the_grid_is_the_product_in_grid_order_with_deterministic_names() -> None:
    settings = expand_grid([("strategy", ["fedavg", "decentnerf"]), ("local-steps", [1, 8])])
    assert settings == [
        {"strategy": "fedavg", "local-steps": 1},
        {"strategy": "fedavg", "local-steps": 8},
        {"strategy": "decentnerf", "local-steps": 1},
        {"strategy": "decentnerf", "local-steps": 8},
    ]
    assert setting_names(settings) == [
        "strategy=fedavg,local-steps=1",
        "strategy=fedavg,local-steps=8",
        "strategy=decentnerf,local-steps=1",
        "strategy=decentnerf,local-steps=8",
    ]
    assert expand_grid([]) == [{}] and setting_names([{}]) == ["base"]
    assert setting_names([{"secure-aggregation": True, "alpha-lr": 1e-05}]) == [
        "secure-aggregation=true,alpha-lr=1e-05"
    ]
    assert setting_names([{"eval-scene-dir": "/data/a b"}]) == ["eval-scene-dir=_data_a_b"]
    with pytest.raises(ValueError, match="would both be named 'eval-scene-dir=a_b'"):
        setting_names([{"eval-scene-dir": "a/b"}, {"eval-scene-dir": "a b"}])
    with pytest.raises(ValueError, match="'local-steps' is given twice"):
        expand_grid([("local-steps", [1]), ("local-steps", [2])])


def test_grid_values_take_their_keys_declared_type() -> None:
    assert typed(0, float) == 0.0 and isinstance(typed(0, float), float)
    assert typed(True, float) is True  # left for the job's own check to refuse
    assert typed(3, int) == 3 and typed("x", str) == "x"


# ------------------------------------------------------------------ a run's final metrics


def test_final_metrics_are_the_numeric_leaves_of_final_dotted_and_the_runs_seconds() -> None:
    """A meta job's "final" is its last round's line: nested TTO scores, its round and its
    seconds at that round; bools, strings and lists are no metrics."""
    summary = {
        "secure-aggregation": {"enabled": False},
        "differential-privacy": {"enabled": True, "noise-multiplier": 1.0},
        "final": {"round": 3, "seconds": 12.0, "psnr": 24.5, "tto": {"1": 18, "32": 24.5},
                  "attack": {"mia": {"accuracy": 0.5}}, "ok": True, "note": "x", "curve": [1]},
        "rounds": [{"round": 1}],
        "seconds": 40.25,
    }  # fmt: skip
    assert final_metrics(summary) == {
        "psnr": 24.5, "tto.1": 18.0, "tto.32": 24.5, "attack.mia.accuracy": 0.5, "seconds": 40.25,
    }  # fmt: skip
    split = {"mode": "split", "client": {"psnr": 21.0}, "history": [], "seconds": 9.0}
    assert final_metrics(split) == {"psnr": 21.0, "seconds": 9.0}
    assert is_complete(summary) and is_complete(split)
    assert not is_complete({"final": {}})  # no seconds
    assert not is_complete({"seconds": 1.0}) and not is_complete([1])


# ------------------------------------------------------------------ statistics


def test_mean_and_sample_std_match_numpy() -> None:
    values = [12.605905291675542, 13.1, 11.9, 12.25]
    summary = describe(values)
    assert summary.n == 4
    assert summary.mean == pytest.approx(np.mean(values), rel=1e-15)
    assert summary.std == pytest.approx(np.std(values, ddof=1), rel=1e-14)
    assert describe([2.0, 4.0]).std == pytest.approx(math.sqrt(2.0))  # by hand
    one = describe([5.0])
    assert (one.n, one.mean) == (1, 5.0) and math.isnan(one.std)
    assert describe([]).n == 0 and math.isnan(describe([]).mean)


def test_paired_difference_matches_scipys_paired_t_test() -> None:
    """Over the seeds both settings finished (seed 3 only in A, seed 5 only in B)."""
    a = {0: 21.5, 1: 22.75, 2: 21.0, 3: 30.0, 4: 23.25}
    b = {0: 20.0, 1: 21.0, 2: 20.5, 4: 21.0, 5: 1.0}
    paired = paired_difference(a, b)
    seeds = [0, 1, 2, 4]
    assert paired.seeds == tuple(seeds)
    assert paired.differences == (1.5, 1.75, 0.5, 2.25)
    reference = stats.ttest_rel([a[s] for s in seeds], [b[s] for s in seeds])
    interval = reference.confidence_interval(0.95)
    assert paired.mean == pytest.approx(1.5)
    assert (paired.low, paired.high) == pytest.approx((interval.low, interval.high), rel=1e-12)
    assert paired.excludes_zero


def test_paired_interval_by_hand() -> None:
    """Differences 1, 2, 3: mean 2, sd 1; with 2 degrees of freedom Student's t has the closed-form
    quantile t_p = (2p - 1) / sqrt(2p(1 - p)), 4.3027 at p = 0.975: 2 ± 2.4841."""
    paired = paired_difference({0: 1.0, 1: 2.0, 2: 3.0}, {0: 0.0, 1: 0.0, 2: 0.0})
    half = 0.95 / math.sqrt(2 * 0.975 * 0.025) / math.sqrt(3)
    assert (paired.low, paired.high) == pytest.approx((2 - half, 2 + half), rel=1e-12)
    assert not paired.excludes_zero and type(paired.low) is float
    assert Paired((0, 1), (-3.0, -1.0), -2.0, -4.0, -0.5).excludes_zero  # wholly below 0
    single = paired_difference({0: 1.0}, {0: 0.5, 1: 2.0})
    assert single.seeds == (0,) and single.mean == 0.5 and math.isnan(single.low)


# ------------------------------------------------------------------ tables


RESULTS = {
    "strategy=fedavg": {0: {"psnr": 20.0, "seconds": 10.0}, 1: {"psnr": 21.0, "seconds": 12.0}},
    "strategy=decentnerf": {0: {"psnr": 23.0, "seconds": 11.0}, 2: {"psnr": 26.0}},
}


def test_the_settings_table_in_csv_and_markdown() -> None:
    found = setting_stats(RESULTS)
    assert setting_csv(found) == (
        "metric,setting,n,mean,std\n"
        f"psnr,strategy=fedavg,2,20.5,{math.sqrt(0.5)!r}\n"
        f"psnr,strategy=decentnerf,2,24.5,{math.sqrt(4.5)!r}\n"
        f"seconds,strategy=fedavg,2,11.0,{math.sqrt(2.0)!r}\n"
        "seconds,strategy=decentnerf,1,11.0,\n"
    )
    assert markdown_table(["a", "b"], [["x|y", "1"]]) == "| a | b |\n| --- | --- |\n| x\\|y | 1 |\n"


def test_the_pair_rows_use_the_seeds_both_finished() -> None:
    rows = pair_csv_rows(
        "strategy=decentnerf",
        "strategy=fedavg",
        pair_stats("strategy=decentnerf", "strategy=fedavg", RESULTS),
    )
    assert rows == [
        ["strategy=decentnerf", "strategy=fedavg", "psnr", "1", "3.0", "", "", "", "0", "3.0"],
        ["strategy=decentnerf", "strategy=fedavg", "seconds", "1", "1.0", "", "", "", "0", "1.0"],
    ]


# ------------------------------------------------------------------ checking a sweep up front


def plan(*argv: str) -> sweep.SweepPlan:
    """The sweep `argv` asks for, as main() plans it."""
    return sweep.plan_sweep(sweep.parse_args(list(argv)))


@pytest.mark.parametrize(
    ("argv", "reason"),
    [
        (["--grid", "strategy=['fedavg','fedavgg']"], "setting strategy=fedavgg: run-config "
         "'strategy' 'fedavgg' is unknown"),
        (["--grid", "local-step=[1, 2]"], "setting local-step=1: unknown run-config key "
         "'local-step'; did you mean 'local-steps'?"),
        (["--grid", "local-steps=[1, 2.5]"], "setting local-steps=2.5: run-config 'local-steps' "
         "must be int"),
        (["--grid", "seed=[1, 2]"], "--grid seed: the sweep sets 'seed' itself"),
        (["--run-config", "run-dir='/x'"], "--run-config run-dir: the sweep sets 'run-dir'"),
        (["--grid", "local-steps=[1]", "--run-config", "local-steps=2"],
         "'local-steps' is both in --grid and in --run-config"),
        (["--run-config", "local-steps=x y"], "--run-config 'local-steps=x y': The provided"),
        (["--seeds", "0", "0"], "--seeds must be distinct"),
        (["--grid", STRATEGIES, "--pair", "strategy=fedavg", "strategy=fedprox"],
         "--pair strategy=fedavg strategy=fedprox: name two different settings of this sweep: "
         "strategy=fedavg, strategy=decentnerf"),
        (["--", "--run-dir", "x"], "launcher flag --run-dir: the sweep sets it per run"),
    ],
)  # fmt: skip
def test_a_bad_sweep_is_refused_before_anything_runs(argv: list[str], reason: str) -> None:
    with pytest.raises(ValueError, match=re.escape(reason)):
        plan(*argv)


def test_a_launcher_flag_the_launcher_lacks_stops_the_sweep(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        plan("--", "--no-such-flag")
    assert "unrecognized arguments: --no-such-flag" in capsys.readouterr().err


def test_each_run_gets_its_folder_and_run_config(tmp_path: Path) -> None:
    checked = plan(
        "--grid", STRATEGIES, "--seeds", "0", "3", "--run-config", "local-steps=2",
        "--sweep-dir", str(tmp_path), "--", "--no-audit",
    )  # fmt: skip
    assert [(run.label, run.run_config) for run in checked.runs] == [
        ("strategy=fedavg/seed-0", 'strategy="fedavg" seed=0 local-steps=2'),
        ("strategy=fedavg/seed-3", 'strategy="fedavg" seed=3 local-steps=2'),
        ("strategy=decentnerf/seed-0", 'strategy="decentnerf" seed=0 local-steps=2'),
        ("strategy=decentnerf/seed-3", 'strategy="decentnerf" seed=3 local-steps=2'),
    ]
    run = checked.runs[1]
    assert run.run_dir == tmp_path / "strategy=fedavg" / "seed-3"
    assert run.log == tmp_path / "strategy=fedavg" / "seed-3.log"
    assert run.state_dir == tmp_path / "strategy=fedavg" / "seed-3.nodes"
    default = plan("--grid", STRATEGIES).sweep_dir
    assert default == plan("--grid", STRATEGIES, "--seeds", "5").sweep_dir  # seeds extend it
    assert default != plan("--grid", STRATEGIES, "--", "--no-audit").sweep_dir
    assert default.parent == ROOT / "runs" and default.name.startswith("sweep-")


# ------------------------------------------------------------------ running, with a fake launcher


def fake_psnr(strategy: str, seed: int) -> float:
    """The fake launcher's final clean-psnr: decentnerf 1.5 + 0.1 seed^2 above fedavg."""
    return 20.0 + 0.5 * seed + (1.5 + 0.1 * seed**2 if strategy == "decentnerf" else 0.0)


FAKE_LAUNCHER = '''
"""A stand-in for `python -m simulations.launch`: records its call, writes a run directory."""
import json, os, sys, tomllib
from pathlib import Path

{fake_psnr}

args = sys.argv[1:]
resume = args[0] == "--resume"
run_dir = Path(args[1] if resume else args[args.index("--run-dir") + 1])
started_with = sorted(p.name for p in run_dir.iterdir()) if run_dir.is_dir() else None
with open(os.environ["FAKE_CALLS"], "a") as calls:
    calls.write(json.dumps({{"argv": args, "run_dir_held": started_with}}) + "\\n")
if resume:
    config = json.loads((run_dir / "config.json").read_text())
else:
    text = args[args.index("--run-config") + 1]
    config = tomllib.loads("\\n".join(f"{{k}} = {{v}}" for k, v in
                                      (w.split("=", 1) for w in text.split())))
    if started_with:
        sys.exit("FileExistsError: run directory is not empty")
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.json").write_text(json.dumps(config))
for line in range(50):
    print(f"INFO: launcher line {{line}} of {{run_dir}}")
if config["strategy"] == "fedprox":
    print("Traceback (most recent call last):\\nValueError: fake failure in round 1")
    print("fedfields: run 7 failed: ValueError: fake failure in round 1", file=sys.stderr)
    sys.exit(1)
psnr = fake_psnr(config["strategy"], config["seed"])
summary = {{"final": {{"clean-psnr": psnr, "tto": {{"8": psnr - 1}}, "round": 1}},
           "rounds": [], "seconds": 2.0 + config["seed"]}}
(run_dir / "summary.json").write_text(json.dumps(summary))
'''


@pytest.fixture
def fake_launcher(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The fake launcher in place of the real one; returns the file its calls are logged to."""
    script = tmp_path / "fake_launch.py"
    script.write_text(FAKE_LAUNCHER.format(fake_psnr=inspect.getsource(fake_psnr)))
    calls = tmp_path / "calls.jsonl"
    monkeypatch.setenv("FAKE_CALLS", str(calls))
    monkeypatch.setattr(sweep, "LAUNCHER", (sys.executable, str(script)))
    return calls


def calls_of(path: Path) -> list[dict]:
    """The fake launcher's calls, in order."""
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def sweep_argv(sweep_dir: Path, crowd_dir: Path, *extra: str) -> list[str]:
    """Two strategies x seeds 0-2 on the session's crowd, A − B paired."""
    return [
        "--grid", STRATEGIES, "--seeds", "0", "1", "2", "--sweep-dir", str(sweep_dir),
        "--pair", "strategy=decentnerf", "strategy=fedavg", *extra,
        "--", "--crowd", str(crowd_dir), "--no-audit",
    ]  # fmt: skip


def run_dir_of(argv: list[str]) -> Path:
    """The run directory a launcher call names (`--resume DIR` or `--run-dir DIR`)."""
    return Path(argv[1] if argv[0] == "--resume" else argv[argv.index("--run-dir") + 1])


def read_csv(path: Path) -> list[dict[str, str]]:
    with path.open() as file:
        return list(csv.DictReader(file))


def test_a_killed_sweep_skips_finished_runs_resumes_checkpointed_and_restarts_the_rest(
    tmp_path: Path, crowd_dir: Path, fake_launcher: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """As a killed sweep leaves it: fedavg seed 0 finished, seed 1 killed after a round
    (resume.pt), seed 2 killed before one (config.json, node state); decentnerf not started."""
    sweep_dir = tmp_path / "sweep"
    fedavg = sweep_dir / "strategy=fedavg"
    (fedavg / "seed-0").mkdir(parents=True)
    finished = {"final": {"clean-psnr": 99.0}, "rounds": [], "seconds": 5.0}
    (fedavg / "seed-0" / "summary.json").write_text(json.dumps(finished))
    (fedavg / "seed-1").mkdir()
    (fedavg / "seed-1" / "config.json").write_text(json.dumps({"strategy": "fedavg", "seed": 1}))
    (fedavg / "seed-1" / "resume.pt").write_bytes(b"checkpoint")
    (fedavg / "seed-2").mkdir()
    (fedavg / "seed-2" / "config.json").write_text("{}")
    (fedavg / "seed-2.nodes" / "node_00").mkdir(parents=True)

    assert sweep.main(sweep_argv(sweep_dir, crowd_dir)) == 0
    calls = {run_dir_of(call["argv"]): call for call in calls_of(fake_launcher)}
    assert len(calls) == 5 and fedavg / "seed-0" not in calls  # all but the finished run
    launcher_flags = ["--crowd", str(crowd_dir), "--no-audit"]
    assert calls[fedavg / "seed-1"]["argv"] == ["--resume", str(fedavg / "seed-1"), *launcher_flags]
    assert calls[fedavg / "seed-1"]["run_dir_held"] == ["config.json", "resume.pt"]
    assert calls[fedavg / "seed-2"]["argv"] == [
        "--run-dir", str(fedavg / "seed-2"), "--run-config", 'strategy="fedavg" seed=2',
        *launcher_flags,
    ]  # fmt: skip
    assert calls[fedavg / "seed-2"]["run_dir_held"] is None  # the partial run removed first
    assert not (fedavg / "seed-2.nodes").exists()
    assert "resuming" in (fedavg / "seed-1.log").read_text()
    assert "restarting" in (fedavg / "seed-2.log").read_text()
    assert "cleanly: the unfinished run left no resume.pt" in (fedavg / "seed-2.log").read_text()
    assert "launcher line 49" in (sweep_dir / "strategy=decentnerf" / "seed-0.log").read_text()
    out = capsys.readouterr()
    assert "launcher line" not in out.out + out.err  # the runs' output is in their logs only
    assert "1 of 6 runs done" in out.out

    rows = read_csv(sweep_dir / "table.csv")
    by_key = {(row["metric"], row["setting"]): row for row in rows}
    fedavg_psnr = [99.0, fake_psnr("fedavg", 1), fake_psnr("fedavg", 2)]
    row = by_key[("clean-psnr", "strategy=fedavg")]
    assert row["n"] == "3"
    assert float(row["mean"]) == pytest.approx(np.mean(fedavg_psnr), rel=1e-14)
    assert float(row["std"]) == pytest.approx(np.std(fedavg_psnr, ddof=1), rel=1e-14)
    assert [row["metric"] for row in rows] == ["clean-psnr"] * 2 + ["seconds"] * 2 + ["tto.8"] * 2
    pairs = {row["metric"]: row for row in read_csv(sweep_dir / "pairs.csv")}
    decent = [fake_psnr("decentnerf", seed) for seed in range(3)]
    reference = stats.ttest_rel(decent, [99.0, *fedavg_psnr[1:]]).confidence_interval(0.95)
    assert float(pairs["clean-psnr"]["ci95-low"]) == pytest.approx(reference.low, rel=1e-12)
    assert float(pairs["clean-psnr"]["ci95-high"]) == pytest.approx(reference.high, rel=1e-12)
    assert pairs["clean-psnr"]["seeds"] == "0 1 2"
    markdown = (sweep_dir / "table.md").read_text()
    assert "| clean-psnr | `strategy=decentnerf` |" in markdown
    assert "### `strategy=decentnerf` − `strategy=fedavg`" in markdown

    # the same command again: nothing to launch; --table-only rebuilds the same tables
    tables = {name: (sweep_dir / name).read_text() for name in ("table.md", "table.csv")}
    (sweep_dir / "table.md").unlink()
    assert sweep.main(sweep_argv(sweep_dir, crowd_dir)) == 0
    assert len(calls_of(fake_launcher)) == 5
    assert sweep.main(sweep_argv(sweep_dir, crowd_dir, "--table-only")) == 0
    assert {name: (sweep_dir / name).read_text() for name in tables} == tables


def test_a_failed_run_is_reported_and_the_others_still_run(
    tmp_path: Path, crowd_dir: Path, fake_launcher: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    sweep_dir = tmp_path / "sweep"
    argv = ["--grid", "strategy=['fedprox','fedavg']", "--seeds", "0", "1", "--parallel", "2",
            "--sweep-dir", str(sweep_dir), "--", "--crowd", str(crowd_dir)]  # fmt: skip
    assert sweep.main(argv) == 1
    err = capsys.readouterr().err
    for seed in (0, 1):
        assert (
            f"strategy=fedprox/seed-{seed} failed (exit 1): ValueError: fake failure in round 1"
            in err
        )
        assert (sweep_dir / "strategy=fedavg" / f"seed-{seed}" / "summary.json").is_file()
    rows = read_csv(sweep_dir / "table.csv")
    assert {row["setting"] for row in rows} == {"strategy=fedavg"}


def test_a_stopped_sweep_terminates_its_running_launchers() -> None:
    """Ctrl-C or SIGTERM sets the sweep's stop: each running launcher gets a SIGTERM (on which
    it stops what it started) instead of running on unwatched."""
    stop = threading.Event()
    quick = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    assert sweep.wait_or_stop(quick, stop) == 3
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    stop.set()
    assert sweep.wait_or_stop(sleeper, stop) == -signal.SIGTERM  # killed, not run out


def test_a_second_sweep_in_the_same_folder_is_refused(tmp_path: Path) -> None:
    with sweep.locked(tmp_path), pytest.raises(ValueError, match="another sweep is running"):
        with sweep.locked(tmp_path):
            pass


# ------------------------------------------------------------------ a real sweep


def test_a_tiny_sweep_through_the_launcher(crowd_dir: Path, tmp_path: Path) -> None:
    """`python -m simulations.sweep` as a user types it: one tiny FedAvg setting x seeds 0 and 1,
    side by side, each a real `python -m simulations.launch` on the session's 3-user crowd; the
    launchers' output goes to the runs' logs; rerun, it launches nothing (Ray: ~1-2 min)."""
    sweep_dir = tmp_path / "sweep"
    command = [
        sys.executable, "-m", "simulations.sweep", "--grid", "strategy=['fedavg']",
        "--seeds", "0", "1", "--parallel", "2", "--run-config", TINY,
        "--sweep-dir", str(sweep_dir), "--", "--crowd", str(crowd_dir), "--ray-cpus", "1",
    ]  # fmt: skip
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=900)
    logs = "".join(path.read_text() for path in sweep_dir.rglob("*.log"))
    assert done.returncode == 0, done.stderr[-3000:] + logs[-3000:]
    assert "Starting Flower Simulation" in logs and "Starting Flower" not in done.stdout
    rows = {row["metric"]: row for row in read_csv(sweep_dir / "table.csv")}
    clean = [
        json.loads((sweep_dir / "strategy=fedavg" / f"seed-{s}" / "summary.json").read_text())[
            "final"
        ]["clean-psnr"]
        for s in (0, 1)
    ]
    assert rows["clean-psnr"]["n"] == "2"
    assert float(rows["clean-psnr"]["mean"]) == pytest.approx(np.mean(clean), rel=1e-14)
    assert float(rows["clean-psnr"]["std"]) == pytest.approx(np.std(clean, ddof=1), rel=1e-14)
    assert {"clean-ssim", "personal-psnr", "heldout-psnr", "seconds"} <= set(rows)
    again = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and "2 of 2 runs done" in again.stdout, again.stderr[-2000:]
    assert "".join(path.read_text() for path in sweep_dir.rglob("*.log")) == logs  # no launch
