"""A run survives its ServerApp dying: per-round checkpoints, `resume`, the same final model;
and what the crash damaged (a cut config.json, a cut last line of metrics.jsonl) is refused or
dropped with one clear message."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path

import pytest
import torch
from flower_harness import InProcessGrid
from flwr.app import Message
from test_federated_nerf import tiny
from test_meta_job import tiny as tiny_meta

from fedfields.config import FederatedConfig
from fedfields.config.presets import meta_settings
from fedfields.flower.resume import (
    RESUME_FILE,
    ResumeError,
    load_round_checkpoint,
    read_run_config,
    resumed_history,
)
from simulations.federated_nerf import run_federated_nerf
from simulations.meta_job import run_meta_job
from simulations.run import client_app


class ServerCrash(RuntimeError):
    """Stands for the ServerApp process dying."""


class CrashingGrid(InProcessGrid):
    """An in-process grid whose server 'dies' when it first pushes a train message of
    `crash_round`: rounds before it completed, that round never reaches a node."""

    def __init__(self, *args: object, crash_round: int, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        self.crash_round = crash_round

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        messages = list(messages)
        if any(m.metadata.group_id == str(self.crash_round) for m in messages):
            raise ServerCrash(f"server killed at the start of round {self.crash_round}")
        return super().push_messages(messages)


def final_state(run_dir: Path) -> dict[str, torch.Tensor]:
    """The global model the run ended with (its last round checkpoint)."""
    return load_round_checkpoint(run_dir / RESUME_FILE).state


def metric_rounds(run_dir: Path) -> list[int]:
    """The round of every line of metrics.jsonl, in order."""
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["round"] for line in lines]


def assert_bitwise_equal(first: dict[str, torch.Tensor], second: dict[str, torch.Tensor]) -> None:
    assert first.keys() == second.keys()
    for key in first:
        assert torch.equal(first[key], second[key]), key


def test_meta_run_killed_after_round_3_of_6_resumes_to_the_same_model(tmp_path: Path) -> None:
    """Scaffold (server control in the strategy state, client controls in the nodes' state) on
    faces: 6 rounds straight, or the server killed at round 4 and a new ServerApp (new strategy,
    new report) resuming while the same nodes, holding their state, stay connected."""

    def config(run_dir: Path, **extra: object) -> dict:
        return tiny_meta(run_dir, strategy="scaffold", **{"num-server-rounds": 6, **extra})

    clients = meta_settings(FederatedConfig.from_run_config(config(tmp_path / "x"))).num_clients

    def grid(config: dict, crash_round: int = 0) -> InProcessGrid:
        nodes = [client_app(config)] * clients
        return CrashingGrid(nodes, raise_errors=True, crash_round=crash_round)

    straight = run_meta_job(
        grid(config(tmp_path / "straight")),
        FederatedConfig.from_run_config(config(tmp_path / "straight")),
    )
    crashed = config(tmp_path / "crashed")
    nodes = grid(crashed, crash_round=4)
    with pytest.raises(ServerCrash):
        run_meta_job(nodes, FederatedConfig.from_run_config(crashed))
    assert load_round_checkpoint(tmp_path / "crashed" / RESUME_FILE).server_round == 3
    assert metric_rounds(tmp_path / "crashed") == [1, 2, 3]
    metrics = tmp_path / "crashed" / "metrics.jsonl"
    whole = metrics.read_text()
    nodes.crash_round = 0  # the SuperNodes survived; a new ServerApp resumes the run
    lines = whole.splitlines(keepends=True)
    metrics.write_text(lines[0] + lines[1][: len(lines[1]) // 2] + "\n" + lines[2])
    with pytest.raises(ResumeError, match=f"{metrics} line 2 is damaged"):
        run_meta_job(
            nodes, FederatedConfig.from_run_config(config(tmp_path / "crashed", resume=True))
        )
    metrics.write_text(whole + '{"round": 4, "train-lo')  # round 4's line, cut by the crash
    run_meta_job(nodes, FederatedConfig.from_run_config(config(tmp_path / "crashed", resume=True)))

    assert metric_rounds(tmp_path / "crashed") == [1, 2, 3, 4, 5, 6]
    assert_bitwise_equal(final_state(straight), final_state(tmp_path / "crashed"))
    assert (tmp_path / "crashed" / "summary.json").is_file()


def test_decentnerf_resume_continues_alpha_and_bookkeeping(
    crowd_dir: Path,
    tmp_path: Path,
) -> None:
    """DecentNeRF keeps state on both sides (the server's last aggregate, each node's alpha
    and fields in its state directory): killed at round 2 of 2 and resumed, it ends where the
    uninterrupted run ends, bit for bit, and a round the crash cut short is not in the metrics."""

    def config(run_dir: Path, **extra: object) -> dict:
        return tiny(crowd_dir, run_dir, "decentnerf", **{"num-server-rounds": 2, **extra})

    def grid(config: dict, crash_round: int = 0) -> InProcessGrid:
        return CrashingGrid([client_app(config)] * 3, raise_errors=True, crash_round=crash_round)

    straight = run_federated_nerf(
        grid(config(tmp_path / "a")), FederatedConfig.from_run_config(config(tmp_path / "a")), True
    )
    crashed = config(tmp_path / "b")
    nodes = grid(crashed, crash_round=2)
    with pytest.raises(ServerCrash):
        run_federated_nerf(nodes, FederatedConfig.from_run_config(crashed), True)
    with (tmp_path / "b" / "metrics.jsonl").open("a") as out:  # a line the crash left behind
        out.write(json.dumps({"round": 2, "half-written": True}) + "\n")
    nodes.crash_round = 0  # the nodes kept running; a new ServerApp resumes
    run_federated_nerf(
        nodes, FederatedConfig.from_run_config(config(tmp_path / "b", resume=True)), True
    )

    assert metric_rounds(tmp_path / "b") == [1, 2]
    assert_bitwise_equal(final_state(straight), final_state(tmp_path / "b"))
    straight_alpha = load_round_checkpoint(straight / RESUME_FILE).strategy_state
    resumed_alpha = load_round_checkpoint(tmp_path / "b" / RESUME_FILE).strategy_state
    assert straight_alpha["last-aggregate"] == resumed_alpha["last-aggregate"]


def test_resume_refuses_what_it_cannot_continue(tmp_path: Path) -> None:
    """No run there, a run without a completed round, a changed setting: one clear error each."""
    with pytest.raises(ResumeError, match="config.json does not exist"):
        run_meta_job(
            InProcessGrid([]),
            FederatedConfig.from_run_config(tiny_meta(tmp_path / "none", resume=True)),
        )
    run_dir = tmp_path / "run"
    config = tiny_meta(run_dir)
    with pytest.raises(ServerCrash):
        nodes = [client_app(config)] * 4
        run_meta_job(
            CrashingGrid(nodes, raise_errors=True, crash_round=1),
            FederatedConfig.from_run_config(config),
        )
    with pytest.raises(ResumeError, match="resume.pt does not exist"):
        run_meta_job(
            InProcessGrid([]), FederatedConfig.from_run_config(tiny_meta(run_dir, resume=True))
        )
    with pytest.raises(ResumeError, match=r"outer-steps: 2 -> 3"):
        run_meta_job(
            InProcessGrid([]),
            FederatedConfig.from_run_config(tiny_meta(run_dir, resume=True, **{"outer-steps": 3})),
        )
    with pytest.raises(ValueError, match="'resume' = true needs 'run-dir'"):
        FederatedConfig.from_run_config({"resume": True})
    with pytest.raises(ValueError, match="split runs"):
        FederatedConfig.from_run_config({"resume": True, "run-dir": "x", "mode": "split"})
    (run_dir / RESUME_FILE).write_bytes(b"not a checkpoint")
    with pytest.raises(ResumeError, match="unreadable"):
        load_round_checkpoint(run_dir / RESUME_FILE)


ROUNDS = [{"round": r, "train-psnr": 10.0 + r} for r in (1, 2, 3)]
WHOLE = "".join(json.dumps(line) + "\n" for line in ROUNDS)


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        (json.dumps(tiny_meta(Path("run")), indent=2)[:40].encode(), "is damaged, not JSON"),
        (b"\xff\xfe\x00 not text", "is damaged, not JSON"),
        (b"[1, 2]", "holds a JSON list, not the run-config object"),
        (b"", "is damaged, not JSON"),
    ],
)
def test_resume_refuses_a_damaged_config_json(tmp_path: Path, content: bytes, reason: str) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.json").write_bytes(content)
    message = f"cannot resume: {run_dir / 'config.json'} {reason}"
    with pytest.raises(ResumeError, match=message):
        run_meta_job(
            InProcessGrid([]), FederatedConfig.from_run_config(tiny_meta(run_dir, resume=True))
        )
    with pytest.raises(ResumeError, match=message):
        read_run_config(run_dir)
    assert (run_dir / "config.json").read_bytes() == content  # nothing rewritten


def test_the_launcher_refuses_a_cut_config_json_in_one_line(tmp_path: Path) -> None:
    """`python -m simulations.launch --resume DIR` as a user types it: exit 2, one line naming
    the file, no traceback, nothing started."""
    (tmp_path / "config.json").write_text('{"strategy": "fedavg", "num-ser')
    process = subprocess.run(
        [sys.executable, "-m", "simulations.launch", "--resume", str(tmp_path)],
        cwd=Path(__file__).resolve().parents[1],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert process.returncode == 2, process.stderr
    assert process.stderr.strip().splitlines() == [
        f"fedfields: cannot resume: {tmp_path / 'config.json'} is damaged, not JSON "
        "(Unterminated string starting at: line 1 column 24 (char 23))"
    ]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json"]


@pytest.mark.parametrize(
    "cut", ['{"round": 4, "train-ps', '{"round": 4', "4", '{"round": 4, "x": [1,', "\xff"]
)
def test_a_cut_last_metrics_line_is_dropped_and_the_file_rewritten(
    tmp_path: Path, cut: str, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(WHOLE.encode() + cut.encode("latin-1"))
    with caplog.at_level(logging.WARNING):
        assert resumed_history(tmp_path, last_round=3) == ROUNDS
    assert path.read_text() == WHOLE
    assert f"dropping {path} line 4, cut short by the crash" in caplog.text
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]


def test_metrics_lines_after_the_checkpoint_go_and_a_whole_last_line_stays(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text(WHOLE.rstrip("\n"))  # the last line whole but its newline never written
    assert resumed_history(tmp_path, last_round=3) == ROUNDS
    assert path.read_text() == WHOLE
    assert resumed_history(tmp_path, last_round=2) == ROUNDS[:2]
    assert path.read_text() == "".join(json.dumps(line) + "\n" for line in ROUNDS[:2])
    (tmp_path / "empty").mkdir()
    assert resumed_history(tmp_path / "empty", last_round=2) == []


@pytest.mark.parametrize(
    ("middle", "reason"),
    [
        ('{"round": 2, "train-ps', "Unterminated string"),
        ("[2]", "not an object with an integer 'round'"),
        ('{"psnr": 1.0}', "not an object with an integer 'round'"),
    ],
)
def test_a_damaged_metrics_line_before_the_last_is_refused_naming_it(
    tmp_path: Path, middle: str, reason: str
) -> None:
    path = tmp_path / "metrics.jsonl"
    lines = WHOLE.splitlines(keepends=True)
    damaged = lines[0] + middle + "\n" + lines[2]
    path.write_text(damaged)
    with pytest.raises(ResumeError, match=rf"{path} line 2 is damaged \({reason}"):
        resumed_history(tmp_path, last_round=3)
    assert path.read_text() == damaged  # left as found, for the user to look at
