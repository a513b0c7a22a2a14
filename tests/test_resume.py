"""A run survives its ServerApp dying: per-round checkpoints, `resume`, the same final model;
and what the crash damaged (a cut config.json, a cut last line of metrics.jsonl) is refused or
dropped with one clear message."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from collections.abc import Callable, Iterable
from pathlib import Path

import pytest
import torch
from flwr.app import Message
from test_federated_nerf import tiny
from test_meta_job import tiny as tiny_meta

from fedfields.config.presets import meta_settings
from fedfields.flower.resume import (
    RESUME_FILE,
    ResumeError,
    load_round_checkpoint,
    read_run_config,
    resumed_history,
)
from simulations.federated_nerf import run_federated_nerf
from simulations.in_process_grid import InProcessGrid
from simulations.meta_job import run_meta_job
from simulations.run import client_app
from strategies import parse_app_config


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


class LateCrashingGrid(InProcessGrid):
    """An in-process grid whose server 'dies' once the nodes have trained in `crash_round`:
    every node ran the round's train message and kept its state, the server never summed it."""

    def __init__(self, *args: object, crash_round: int, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        self.crash_round = crash_round

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        messages = list(messages)
        ids = super().push_messages(messages)
        crashing = any(m.metadata.group_id == str(self.crash_round) for m in messages)
        if crashing and any(m.metadata.message_type == "train" for m in messages):
            raise ServerCrash(f"server killed after the nodes trained in round {self.crash_round}")
        return ids


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

    clients = meta_settings(parse_app_config(config(tmp_path / "x"))).num_clients

    def grid(config: dict, crash_round: int = 0) -> InProcessGrid:
        nodes = [client_app(config)] * clients
        return CrashingGrid(nodes, raise_errors=True, crash_round=crash_round)

    straight = run_meta_job(
        grid(config(tmp_path / "straight")),
        parse_app_config(config(tmp_path / "straight")),
    )
    crashed = config(tmp_path / "crashed")
    nodes = grid(crashed, crash_round=4)
    with pytest.raises(ServerCrash):
        run_meta_job(nodes, parse_app_config(crashed))
    assert load_round_checkpoint(tmp_path / "crashed" / RESUME_FILE).server_round == 3
    assert metric_rounds(tmp_path / "crashed") == [1, 2, 3]
    metrics = tmp_path / "crashed" / "metrics.jsonl"
    whole = metrics.read_text()
    nodes.crash_round = 0  # the SuperNodes survived; a new ServerApp resumes the run
    lines = whole.splitlines(keepends=True)
    metrics.write_text(lines[0] + lines[1][: len(lines[1]) // 2] + "\n" + lines[2])
    with pytest.raises(ResumeError, match=f"{metrics} line 2 is damaged"):
        run_meta_job(nodes, parse_app_config(config(tmp_path / "crashed", resume=True)))
    metrics.write_text(whole + '{"round": 4, "train-lo')  # round 4's line, cut by the crash
    run_meta_job(nodes, parse_app_config(config(tmp_path / "crashed", resume=True)))

    assert metric_rounds(tmp_path / "crashed") == [1, 2, 3, 4, 5, 6]
    assert_bitwise_equal(final_state(straight), final_state(tmp_path / "crashed"))
    assert (tmp_path / "crashed" / "summary.json").is_file()


def straight_then_crashed(
    crowd_dir: Path, tmp_path: Path, rounds: int, grid_class: type
) -> tuple[Callable[..., dict], Path, InProcessGrid]:
    """DecentNeRF (`tiny`) for `rounds` rounds straight in tmp_path/a, then in tmp_path/b on a
    `grid_class` grid whose server dies in round 2: the config maker, the straight run's
    directory and the crashed run's grid (its nodes alive)."""

    def config(run_dir: Path, **extra: object) -> dict:
        return tiny(crowd_dir, run_dir, "decentnerf", **{"num-server-rounds": rounds, **extra})

    def grid(run_dir: Path, crash_round: int) -> InProcessGrid:
        app = client_app(config(run_dir))
        return grid_class([app] * 3, raise_errors=True, crash_round=crash_round)

    straight = run_federated_nerf(
        grid(tmp_path / "a", 0), parse_app_config(config(tmp_path / "a")), True
    )
    nodes = grid(tmp_path / "b", 2)
    with pytest.raises(ServerCrash):
        run_federated_nerf(nodes, parse_app_config(config(tmp_path / "b")), True)
    return config, straight, nodes


def test_decentnerf_resume_continues_alpha_and_bookkeeping(
    crowd_dir: Path,
    tmp_path: Path,
) -> None:
    """DecentNeRF keeps state on both sides (the server's last aggregate, each node's alpha
    and fields in its state directory): killed at round 2 of 2 and resumed, it ends where the
    uninterrupted run ends, bit for bit, and a round the crash cut short is not in the metrics."""

    config, straight, nodes = straight_then_crashed(crowd_dir, tmp_path, 2, CrashingGrid)
    with (tmp_path / "b" / "metrics.jsonl").open("a") as out:  # a line the crash left behind
        out.write(json.dumps({"round": 2, "half-written": True}) + "\n")
    nodes.crash_round = 0  # the nodes kept running; a new ServerApp resumes
    run_federated_nerf(nodes, parse_app_config(config(tmp_path / "b", resume=True)), True)

    assert metric_rounds(tmp_path / "b") == [1, 2]
    assert_bitwise_equal(final_state(straight), final_state(tmp_path / "b"))
    straight_alpha = load_round_checkpoint(straight / RESUME_FILE).strategy_state
    resumed_alpha = load_round_checkpoint(tmp_path / "b" / RESUME_FILE).strategy_state
    assert straight_alpha["last-aggregate"] == resumed_alpha["last-aggregate"]


def test_a_run_killed_after_its_nodes_trained_continues_as_if_never_stopped(
    crowd_dir: Path, tmp_path: Path
) -> None:
    """DecentNeRF killed in round 2 of 3 after every node trained and wrote its state (personal
    field, alpha, occupancy), then continued from round 1's checkpoint: each node reads the
    version the checkpoint kept ("resume-points"), so the replayed round 2 and round 3 end
    bit for bit where the uninterrupted run ends; twice killed, the same."""

    config, straight, nodes = straight_then_crashed(crowd_dir, tmp_path, 3, LateCrashingGrid)
    nodes.crash_round = 3  # the nodes kept running; a new ServerApp continues, and dies again
    with pytest.raises(ServerCrash):
        run_federated_nerf(nodes, parse_app_config(config(tmp_path / "b", resume=True)), True)
    nodes.crash_round = 0
    run_federated_nerf(nodes, parse_app_config(config(tmp_path / "b", resume=True)), True)

    assert metric_rounds(tmp_path / "b") == [1, 2, 3]
    assert_bitwise_equal(final_state(straight), final_state(tmp_path / "b"))
    sent = [m.content["config"] for m in nodes.sent if m.metadata.message_type == "train"]
    assert [c.get("resume-points", "") for c in sent][-3:] == ["1,2"] * 3


def test_resume_refuses_what_it_cannot_continue(tmp_path: Path) -> None:
    """No run there, a run without a completed round, a changed setting: one clear error each."""
    with pytest.raises(ResumeError, match="config.json does not exist"):
        run_meta_job(
            InProcessGrid([]),
            parse_app_config(tiny_meta(tmp_path / "none", resume=True)),
        )
    run_dir = tmp_path / "run"
    config = tiny_meta(run_dir)
    with pytest.raises(ServerCrash):
        nodes = [client_app(config)] * 4
        run_meta_job(
            CrashingGrid(nodes, raise_errors=True, crash_round=1),
            parse_app_config(config),
        )
    with pytest.raises(ResumeError, match="resume.pt does not exist"):
        run_meta_job(InProcessGrid([]), parse_app_config(tiny_meta(run_dir, resume=True)))
    with pytest.raises(ResumeError, match=r"outer-steps: 2 -> 3"):
        run_meta_job(
            InProcessGrid([]),
            parse_app_config(tiny_meta(run_dir, resume=True, **{"outer-steps": 3})),
        )
    with pytest.raises(ValueError, match="'resume' = true needs 'run-dir'"):
        parse_app_config({"resume": True})
    with pytest.raises(ValueError, match="split runs"):
        parse_app_config({"resume": True, "run-dir": "x", "mode": "split"})
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
        run_meta_job(InProcessGrid([]), parse_app_config(tiny_meta(run_dir, resume=True)))
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


def valid_payload() -> dict:
    """What `save_round_checkpoint` writes for a 2-entry model after round 1."""
    import random as stdlib_random

    return {
        "format": 1, "server-round": 1, "state": {"w": torch.ones(3), "b": torch.zeros(1)},
        "strategy": {"rounds-started": 1}, "sampling-rng": stdlib_random.Random(0).getstate(),
        "torch-rng": torch.get_rng_state(), "extra": {},
    }  # fmt: skip


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        (lambda p: p.pop("state"), r"lacks \['state'\]"),
        (lambda p: p.update({"format": 9}), "has format 9"),
        (lambda p: p.update({"server-round": 0}), "server-round 0, not a round >= 1"),
        (lambda p: p.update({"server-round": "2"}), "server-round '2'"),
        (lambda p: p["state"].update({"w": torch.tensor([1.0, float("nan"), 0.0])}), "NaN"),
        (lambda p: p["state"].update({"w": [1.0, 2.0]}), "'w' that is not a named tensor"),
        (lambda p: p.update({"state": {}}), "has no model state"),
        (lambda p: p.update({"strategy": [1]}), "'strategy' of type list"),
        (lambda p: p.update({"sampling-rng": (3, (1, 2), None)}), "damaged sampling-rng"),
        (lambda p: p.update({"torch-rng": torch.zeros(3)}), "torch-rng that is not"),
        (lambda p: p.update({"torch-rng": torch.zeros(3, dtype=torch.uint8)}), "damaged torch-rng"),
    ],
)
def test_a_malformed_checkpoint_is_one_resume_error_naming_the_file(
    tmp_path: Path, change, reason: str
) -> None:
    """Each damage a hostile or buggy writer could leave in resume.pt: a ResumeError naming the
    file and what is wrong, never a KeyError or a torch error from deeper down."""
    payload = valid_payload()
    change(payload)
    path = tmp_path / RESUME_FILE
    torch.save(payload, path)
    with pytest.raises(ResumeError, match=reason) as error:
        load_round_checkpoint(path)
    assert str(path) in str(error.value)


def test_a_checkpoint_of_another_model_fails_before_any_file_is_touched(tmp_path: Path) -> None:
    """A resume.pt whose model has other shapes (or whose strategy state does not fit): the
    meta job stops with a ResumeError naming resume.pt, and no file of the run directory was
    written, metrics.jsonl included."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    config = parse_app_config(tiny_meta(run_dir))
    atomic_json = json.dumps(config.to_run_config())
    (run_dir / "config.json").write_text(atomic_json)
    (run_dir / "metrics.jsonl").write_text(WHOLE)
    payload = valid_payload()
    torch.save(payload, run_dir / RESUME_FILE)
    before = {path.name: path.read_bytes() for path in run_dir.iterdir()}
    resume = parse_app_config(tiny_meta(run_dir, resume=True))
    with pytest.raises(ResumeError, match="resume.pt: its model has other keys"):
        run_meta_job(InProcessGrid([]), resume)
    assert {path.name: path.read_bytes() for path in run_dir.iterdir()} == before


def test_a_strategy_state_that_does_not_fit_is_a_resume_error(tmp_path: Path) -> None:
    """The same model but a strategy state without its keys (or a DP run's without its
    accountant): ResumeError naming the file and the strategy."""
    from fedfields.flower import FedAvg
    from fedfields.flower.resume import parse_checkpoint
    from fedfields.privacy.dp import DPConfig

    payload = valid_payload()
    payload["strategy"] = {}
    checkpoint = parse_checkpoint(payload, "run/resume.pt")
    with pytest.raises(ResumeError, match="run/resume.pt: its strategy state does not fit FedAvg"):
        checkpoint.check(payload["state"], FedAvg())
    payload["strategy"] = {"rounds-started": 1}
    checkpoint = parse_checkpoint(payload, "run/resume.pt")
    checkpoint.check(payload["state"], FedAvg())
    with pytest.raises(ResumeError, match="no DP accountant"):
        checkpoint.check(payload["state"], FedAvg(differential_privacy=DPConfig(1.0, 1.0)))
    with pytest.raises(ResumeError, match=r"'w' is torch.float32 \(3,\), the run's model has"):
        checkpoint.check({"w": torch.ones(4), "b": torch.zeros(1)}, FedAvg())
