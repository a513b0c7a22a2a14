"""simulations/bench/gpu.py as a user runs it: on CPU, tiny, without Flower or Ray."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from simulations.bench.gpu import Options, main, target_rows

ROOT = Path(__file__).resolve().parents[1]
BLOCKER = """
import importlib.abc, runpy, sys
class Blocker(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in ("flwr", "ray"):
            raise ImportError(f"blocked import of {name}: the GPU machine has no flwr or ray")
sys.meta_path.insert(0, Blocker())
sys.argv = ["gpu"] + sys.argv[1:]
runpy.run_module("simulations.bench.gpu", run_name="__main__")
"""


def test_the_smoke_run_prints_one_table_and_says_why_gpu_rows_are_missing(
    crowd_dir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "bench"
    command = [sys.executable, "-c", BLOCKER, "--smoke", "--crowd", str(crowd_dir),
               "--users", "1", "--methods", "fednerf", "--backends", "torch", "triton",
               "--device", "cpu", "--profile", "--out", str(out)]  # fmt: skip
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    table = (out / "table.md").read_text()
    assert done.stdout.strip().endswith(table.strip())  # the table is printed last
    rows = {row["what"]: row for row in json.loads((out / "table.json").read_text())["rows"]}
    torch_row = rows["centralised 25x25, torch"]
    steps_per_s, _, rest = torch_row["value"].partition(" steps/s")
    assert float(steps_per_s) > 0 and rest.endswith(" dB")
    assert rows["centralised 25x25, triton"]["value"].startswith("unavailable: RuntimeError")
    assert "cannot run on cpu" in rows["centralised 25x25, triton"]["value"]
    gpu_round = rows["one user's one-epoch FedNeRF round, GPU"]["value"]
    assert gpu_round == "unavailable: no CUDA device (device cpu)"
    assert rows["one user's one-epoch FedNeRF round, CPU, 2 threads"]["value"].endswith(" s")
    assert rows["1-user round, FedNeRF (FedAvg, global field only)"]["value"].endswith(" s")
    targets = [row for what, row in rows.items() if what.startswith("target:")]
    assert len(targets) == 5
    assert all(row["verdict"] == "n/a: not a GPU run (device cpu)" for row in targets)
    assert (out / "bench.log").is_file()
    assert (out / "profile" / "centralised-torch.txt").read_text().count("aten::") > 5
    assert (out / "profile" / "local-round-cpu.txt").is_file()


def _options(**overrides: object) -> Options:
    values = dict(device="cuda", seconds=30.0, resolution=200, eval_views=20,
                  target_samples=None, backends=("torch", "triton"), crowd=None,
                  crowd_downscale=1.0, users=16, rounds=2, max_local_steps=400,
                  methods=("fednerf", "decentnerf"), cpu_threads=2, repeats=3, run_config="",
                  profile=False, profile_steps=8, out=Path("."))  # fmt: skip
    return Options(**{**values, **overrides})


def test_targets_are_ratios_of_the_run_s_own_figures() -> None:
    import torch

    found = {
        "centralised": {
            "torch": {"steps_per_s": 80.0, "psnr": 32.0},
            "triton": {"steps_per_s": 400.0, "psnr": 33.5},
        },  # fmt: skip
        "federated": {"fednerf": {"round_seconds": 2.5}, "decentnerf": {"round_seconds": 3.0}},
        "local": {"gpu_seconds": 0.5, "cpu_seconds": 10.0},
    }
    rows = target_rows(_options(), torch.device("cuda"), found)
    verdicts = {row.what: (row.value, row.verdict) for row in rows}
    assert verdicts["target: triton / torch centralised steps/s"] == ("5.00x", "met")
    assert verdicts["target: lego PSNR after 30 s (triton)"] == ("33.50 dB", "met")
    assert verdicts["target: FedNeRF round"] == ("2.50 s", "missed")
    assert verdicts["target: DecentNeRF round"] == ("3.00 s", "met")
    assert verdicts["target: GPU local round vs CPU"] == ("20.00x", "missed")
    smaller = target_rows(_options(seconds=5.0), torch.device("cuda"), found)
    assert all(row.verdict.startswith("n/a: settings differ") for row in smaller)
    found["centralised"]["triton"] = {"error": "unavailable: RuntimeError: no triton"}
    rows = target_rows(_options(), torch.device("cuda"), found)
    assert rows[0].verdict == "not measured" and rows[1].what.endswith("(torch)")


@pytest.mark.parametrize("flag", ["--seconds", "--users", "--rounds"])
def test_non_positive_sizes_are_refused(flag: str, tmp_path: Path) -> None:
    command = [sys.executable, "-m", "simulations.bench.gpu", flag, "0", "--out", str(tmp_path)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert f"{flag} must be positive, got 0" in done.stderr


def test_without_a_crowd_the_table_still_prints(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    out = tmp_path / "bench"
    missing = tmp_path / "no-crowd"
    argv = ["--smoke", "--crowd", str(missing), "--backends", "torch", "--device", "cpu",
            "--seconds", "0.5", "--methods", "fednerf", "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    rows = {row["what"]: row for row in json.loads((out / "table.json").read_text())["rows"]}
    assert rows["centralised 25x25, torch"]["value"].endswith(" dB")
    for what in ("one user's one-epoch FedNeRF round, CPU, 2 threads",
                 "2-user round, FedNeRF (FedAvg, global field only)"):  # fmt: skip
        assert rows[what]["value"].startswith("unavailable: no crowd"), rows[what]
    assert capsys.readouterr().out.strip().endswith((out / "table.md").read_text().strip())
