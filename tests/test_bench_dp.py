"""The DP benchmark (issue 36, point 3) as a user types it: `python -m simulations.bench.dp`
through Ray with tiny settings writes its table, rows and figure, C is the median update norm
its z = 0 run recorded, and epsilon is Flower's RdpAccountant's for the run's sampling."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from dp_reference import headline_epsilons
from flwr.app import Context, Message, MessageType, RecordDict
from PIL import Image

from fedfields.flower.protocol import ARRAYS, state_to_arrays
from fedfields.methods import ALPHA_KEY
from simulations.bench.dp import (
    METHODS,
    NORMS_FILE,
    Setup,
    UpdateNorms,
    dp_config,
    failed_row,
    overrides,
    parse_args,
)
from simulations.in_process_grid import set_task_identity

ROOT = Path(__file__).resolve().parents[1]
CLIENTS, PER_ROUND = 5, 2
TINY_PHOTOS = (
    f"outer-steps=1 tto-steps=2 field-width=16 field-depth=2 clients-per-round={PER_ROUND}"
)


def test_the_bench_as_typed_measures_c_then_runs_dp_and_writes_table_rows_and_figure(
    tmp_path: Path,
) -> None:
    out = tmp_path / "bench"
    command = [sys.executable, "-m", "simulations.bench.dp", "--tasks", "photos"]
    command += ["--methods", "MAML", "--noise-multipliers", "1", "0", "--rounds", "1"]
    command += ["--clients", str(CLIENTS), "--photos-run-config", TINY_PHOTOS, "--out", str(out)]
    command += ["--dp-run-config", "dp-adaptive-clipping=true dp-clipped-count-stddev=1.0"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=480)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    rows = json.loads((out / "dp.json").read_text())
    assert [(r["method"], r["noise_multiplier"]) for r in rows] == [("MAML", 0.0), ("MAML", 1.0)]
    plain, noised = rows
    assert plain["error"] is None and noised["error"] is None
    assert plain["epsilon"] is None and plain["clip_norm"] is None and plain["dp_form"] == "none"
    # C: the median of the norms the z = 0 run's clients recorded, one per reply
    norms = [json.loads(line)["norm"] for line in (out / "runs" / f"MAML-{NORMS_FILE}").open()]
    assert len(norms) == PER_ROUND
    assert noised["clip_norm"] == pytest.approx(float(np.median(norms)), rel=1e-12)
    config = json.loads((Path(noised["run_dir"]) / "config.json").read_text())
    assert config["dp-clip-norm"] == noised["clip_norm"]
    assert config["dp-noise-multiplier"] == 1.0
    assert config["dp-adaptive-clipping"] is True  # --dp-run-config: the DP runs only
    assert config["dp-max-noise-ratio"] == 0.0  # no --preflight: the check is lifted
    plain_config = json.loads((Path(plain["run_dir"]) / "config.json").read_text())
    assert plain_config["dp-adaptive-clipping"] is False
    assert all(row["peak_gib"] > 0.1 for row in rows)  # this process and its Ray workers
    # epsilon: one round of PER_ROUND of CLIENTS without replacement at z = 1, delta 1e-5,
    # by Flower's accountant (replace-one, z/2)
    expected = headline_epsilons(PER_ROUND, CLIENTS, 1.0, 1, config["dp-delta"])[-1]
    assert noised["dp_form"] == "central"
    assert noised["epsilon"] == pytest.approx(expected, rel=1e-9)
    for row in rows:  # utility and PSNR_p read back from the runs' summaries
        summary = json.loads((Path(row["run_dir"]) / "summary.json").read_text())
        assert row["utility"] == summary["final"]["psnr"]
        assert row["server_reads"] == summary["final"]["psnr_p"]
        assert row["replies"] == PER_ROUND  # every sampled client trained: not a timed-out run

    table = (out / "dp.md").read_text().splitlines()
    assert table[0].startswith("| task | method | z | C | DP | epsilon |")
    assert table[2].startswith("| photos | MAML | 0 | - | none | - |")
    assert table[3].startswith(f"| photos | MAML | 1 | {noised['clip_norm']:.3g} | central | ")
    assert f"{expected:.3g}" in table[3]
    with Image.open(out / "dp.png") as figure:
        assert figure.format == "PNG" and figure.width > 300
    assert not list(out.glob(".*"))  # atomic writes leave no temporary behind
    # --report reads the same rows back from the run directories
    merged = tmp_path / "merged"
    report = [
        sys.executable,
        "-m",
        "simulations.bench.dp",
        "--report",
        str(out),
        "--out",
        str(merged),
    ]
    done = subprocess.run(report, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads((merged / "dp.json").read_text()) == rows


def message_pair(
    sent: dict[str, torch.Tensor], replied: dict[str, torch.Tensor]
) -> tuple[Message, Message]:
    """A train message carrying `sent` and a reply to it carrying `replied`."""
    set_task_identity()
    msg = Message(RecordDict({ARRAYS: state_to_arrays(sent)}), dst_node_id=7, message_type="train")
    reply = Message(RecordDict({ARRAYS: state_to_arrays(replied)}), reply_to=msg)
    return msg, reply


def test_the_recorder_measures_what_dp_fedavg_clips(tmp_path: Path) -> None:
    """FedAvg's y_k - g; DecentNeRF's alpha_k g_k - alpha_k g together with alpha_k."""
    g = {"a": torch.tensor([1.0, 2.0]), "b": torch.tensor([[0.5]])}
    y = {"a": torch.tensor([4.0, 6.0]), "b": torch.tensor([[0.5]])}  # y - g = (3, 4, 0)
    alpha = 2.0
    scaled = {k: alpha * v for k, v in y.items()} | {ALPHA_KEY: torch.tensor([alpha])}
    path = tmp_path / "norms.jsonl"
    recorder = UpdateNorms(path)
    context = Context(run_id=1, node_id=7, node_config={}, state=RecordDict(), run_config={})
    for replied in (y, scaled):
        msg, reply = message_pair(g, replied)
        assert msg.metadata.message_type == MessageType.TRAIN
        assert recorder(msg, context, lambda m, c, reply=reply: reply) is reply
    norms = [json.loads(line)["norm"] for line in path.read_text().splitlines()]
    assert norms == pytest.approx([5.0, math.hypot(alpha * 5.0, alpha)], rel=1e-12)


@pytest.mark.parametrize(
    ("argv", "complaint"),
    [
        (["--noise-multipliers", "0", "-1"], "--noise-multipliers must be finite and >= 0"),
        (["--noise-multipliers", "nan"], "--noise-multipliers must be finite and >= 0"),
        (["--noise-multipliers", "1", "2"], "no run to measure C: --clip-norm"),
        (["--clip-norm", "0"], "--clip-norm must be > 0 and finite"),
        (["--rounds", "0"], "--rounds must be >= 1"),
        (["--methods", "NeRF"], "invalid choice: 'NeRF'"),
        (["--device", "tpu"], "argument --device: --device = 'tpu'"),
    ],
)
def test_bad_flags_get_one_error_naming_the_flag(
    argv: list[str], complaint: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        parse_args(argv)
    assert complaint in capsys.readouterr().err


def test_preflight_keeps_the_noise_over_signal_check_in_the_dp_runs() -> None:
    args = parse_args(["--preflight", "--dp-run-config", "dp-adaptive-clipping=true"])
    assert args.preflight and overrides(args.dp_run_config) == {"dp-adaptive-clipping": True}
    assert "dp-max-noise-ratio" not in dp_config(1.5, 0.2, preflight=True)
    assert dp_config(1.5, 0.2)["dp-max-noise-ratio"] == 0.0 and dp_config(0.0, None) == {}


def bench_row(method: str, task: str, noise: float, **figures: float | None) -> dict:
    """A dp.json row of a finished run (its run directory not needed: replies given)."""
    return {
        "task": task, "method": method, "noise_multiplier": noise,
        "clip_norm": None if noise == 0 else 0.5, "dp_form": "none" if noise == 0 else "central",
        "epsilon": None if noise == 0 else 3.0, "utility": 20.0 - noise, "server_reads": 9.0,
        "released": None, "floor": None, "mia": 0.6, "seconds": 1.0, "run_dir": "",
        "error": None, "replies": 4, **figures,
    }  # fmt: skip


def test_report_merges_earlier_outputs_sorted_and_names_a_missing_one(tmp_path: Path) -> None:
    """`--report A B` writes one table and figure of both folders' rows, by task, method, z."""
    first, second, out = tmp_path / "a", tmp_path / "b", tmp_path / "merged"
    first.mkdir(), second.mkdir()
    (first / "dp.json").write_text(json.dumps([bench_row("FedMeNF", "photos", 1.0)]))
    rows = [bench_row("MAML", "photos", 2.0), bench_row("FedMeNF", "photos", 0.0)]
    rows.append(bench_row("FedNeRF", "scene", 0.0, floor=3.0, released=6.0, mia=None))
    (second / "dp.json").write_text(json.dumps(rows))
    command = [sys.executable, "-m", "simulations.bench.dp", "--report", str(first), str(second)]
    done = subprocess.run([*command, "--out", str(out)], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = (out / "dp.md").read_text().splitlines()[2:]
    assert [line.split(" | ")[:3] for line in lines] == [
        ["| scene", "FedNeRF", "0"],
        ["| photos", "MAML", "2"],
        ["| photos", "FedMeNF", "0"],
        ["| photos", "FedMeNF", "1"],
    ]
    assert len(json.loads((out / "dp.json").read_text())) == 4
    with Image.open(out / "dp.png") as figure:
        assert figure.format == "PNG"
    missing = subprocess.run(
        [*command, str(tmp_path / "none"), "--out", str(out)], cwd=ROOT, capture_output=True,
        text=True,
    )  # fmt: skip
    assert missing.returncode == 2 and "Traceback" not in missing.stderr
    assert f"--report: {tmp_path / 'none' / 'dp.json'} does not exist" in missing.stderr


def test_a_failed_scene_run_keeps_the_epsilon_it_spent_and_its_replies(tmp_path: Path) -> None:
    """A run that raised (e.g. no round formed an aggregate) is a row with its error, the
    epsilon of its last recorded round and its replies; without metrics, only the error."""
    decentnerf = next(method for method in METHODS if method.name == "DecentNeRF")
    setup = Setup(tmp_path, 2, {}, None, 4, 10, "cpu")
    run_dir = tmp_path / "runs" / "DecentNeRF-z1"
    run_dir.mkdir(parents=True)
    lines = [{"round": 1, "num-replies": 3, "dp-epsilon": 4.4}, {"round": 2, "dp-epsilon": 8.3}]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    row = failed_row(decentnerf, 1.0, 52.0, setup, "EmptyRoundsError: no aggregate; more")
    assert (row.epsilon, row.replies, row.run_dir) == (8.3, 3, str(run_dir))
    assert row.error == "EmptyRoundsError: no aggregate; more" and row.utility is None
    assert row.dp_form == "distributed (SecAgg+)"
    bare = failed_row(decentnerf, 2.0, 52.0, setup, "ValueError: refused")
    assert (bare.epsilon, bare.replies, bare.run_dir) == (None, None, "")
