"""A run survives its ServerApp dying: per-round checkpoints, `resume`, the same final model."""

from __future__ import annotations

import json
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
from fedfields.flower.resume import RESUME_FILE, ResumeError, load_round_checkpoint
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

    straight = run_meta_job(grid(config(tmp_path / "straight")), config(tmp_path / "straight"))
    crashed = config(tmp_path / "crashed")
    nodes = grid(crashed, crash_round=4)
    with pytest.raises(ServerCrash):
        run_meta_job(nodes, crashed)
    assert load_round_checkpoint(tmp_path / "crashed" / RESUME_FILE).server_round == 3
    assert metric_rounds(tmp_path / "crashed") == [1, 2, 3]
    nodes.crash_round = 0  # the SuperNodes survived; a new ServerApp resumes the run
    run_meta_job(nodes, config(tmp_path / "crashed", resume=True))

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

    straight = run_federated_nerf(grid(config(tmp_path / "a")), config(tmp_path / "a"), True)
    crashed = config(tmp_path / "b")
    nodes = grid(crashed, crash_round=2)
    with pytest.raises(ServerCrash):
        run_federated_nerf(nodes, crashed, True)
    with (tmp_path / "b" / "metrics.jsonl").open("a") as out:  # a line the crash left behind
        out.write(json.dumps({"round": 2, "half-written": True}) + "\n")
    nodes.crash_round = 0  # the nodes kept running; a new ServerApp resumes
    run_federated_nerf(nodes, config(tmp_path / "b", resume=True), True)

    assert metric_rounds(tmp_path / "b") == [1, 2]
    assert_bitwise_equal(final_state(straight), final_state(tmp_path / "b"))
    straight_alpha = load_round_checkpoint(straight / RESUME_FILE).strategy_state
    resumed_alpha = load_round_checkpoint(tmp_path / "b" / RESUME_FILE).strategy_state
    assert straight_alpha["last-aggregate"] == resumed_alpha["last-aggregate"]


def test_resume_refuses_what_it_cannot_continue(tmp_path: Path) -> None:
    """No run there, a run without a completed round, a changed setting: one clear error each."""
    with pytest.raises(ResumeError, match="config.json does not exist"):
        run_meta_job(InProcessGrid([]), tiny_meta(tmp_path / "none", resume=True))
    run_dir = tmp_path / "run"
    config = tiny_meta(run_dir)
    with pytest.raises(ServerCrash):
        nodes = [client_app(config)] * 4
        run_meta_job(CrashingGrid(nodes, raise_errors=True, crash_round=1), config)
    with pytest.raises(ResumeError, match="resume.pt does not exist"):
        run_meta_job(InProcessGrid([]), tiny_meta(run_dir, resume=True))
    with pytest.raises(ResumeError, match=r"outer-steps: 2 -> 3"):
        run_meta_job(InProcessGrid([]), tiny_meta(run_dir, resume=True, **{"outer-steps": 3}))
    with pytest.raises(ValueError, match="'resume' = true needs 'run-dir'"):
        FederatedConfig.from_run_config({"resume": True})
    with pytest.raises(ValueError, match="split runs"):
        FederatedConfig.from_run_config({"resume": True, "run-dir": "x", "mode": "split"})
    (run_dir / RESUME_FILE).write_bytes(b"not a checkpoint")
    with pytest.raises(ResumeError, match="unreadable"):
        load_round_checkpoint(run_dir / RESUME_FILE)
