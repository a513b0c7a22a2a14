"""A real deployment on 127.0.0.1: flower-superlink and flower-supernode processes over TLS,
each SuperNode holding one user folder; one SuperNode is killed during round 2 and the run
completes with the survivors, reporting the failure. Nothing started here outlives the test.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from flwr.cli.flower_config import read_superlink_connection
from flwr.common.config import parse_config_args

from simulations import APP_DIR
from simulations.deploy import (
    FEDERATION,
    Deployment,
    federation_toml,
    node_config_text,
    processes_with_home_under,
)

USERS = 3
RUN_CONFIG = (
    "num-server-rounds=2 local-steps=2 min-train-nodes=2 min-available-nodes=3 fraction-train=1.0 "
    "target-samples=512 hash-log2-size=12 hash-levels=4 hash-max-resolution=64 "
    "eval-views-per-round=1"
)


def test_node_config_names_the_client_and_its_own_folders() -> None:
    text = node_config_text(1, 4, Path("/data/my photos/user_01"), Path("/state/node 1"))
    assert parse_config_args([text]) == {
        "partition-id": 1,
        "num-partitions": 4,
        "data-dir": "/data/my photos/user_01",
        "state-dir": "/state/node 1",
    }
    assert "data-dir" not in parse_config_args([node_config_text(0, 4, None, Path("/s"))])


def test_cli_config_is_a_default_tls_connection_for_flower(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ca = tmp_path / "tls" / "ca.crt"
    (tmp_path / "config.toml").write_text(federation_toml("127.0.0.1:9092", ca))
    monkeypatch.setenv("FLWR_HOME", str(tmp_path))
    connection = read_superlink_connection()  # the default one, as `flwr run` reads it
    assert connection.name == FEDERATION
    assert connection.address == "127.0.0.1:9092"
    assert connection.root_certificates == str(ca)
    assert not connection.insecure


@pytest.fixture
def deployment(tmp_path: Path) -> Iterator[Deployment]:
    """A deployment in tmp_path/deploy, stopped afterwards whatever happened."""
    directory = tmp_path / "deploy"
    with Deployment(directory) as started:
        yield started
    assert processes_with_home_under(directory) == [], "a deployed process outlived the test"


@pytest.mark.slow  # about 2.5-3 minutes: a dead node is declared after 2 missed 30 s heartbeats
def test_run_survives_a_supernode_killed_in_round_2(
    deployment: Deployment, crowd_dir: Path, tmp_path: Path
) -> None:
    """Each SuperNode holds one user folder of the shared tiny crowd (conftest)."""
    deployment.start_superlink()
    nodes = [
        deployment.start_supernode(user, USERS, crowd_dir / f"user_{user:02d}")
        for user in range(USERS)
    ]
    deployment.wait_for_nodes(USERS)
    victim = nodes[-1]
    killed: list[str] = []

    def kill_in_round_2(line: str) -> None:
        if "[ROUND 2/" in line and not killed:
            deployment.kill_node(victim)
            killed.append(victim)

    run_dir = tmp_path / "run"
    run_config = f"run-dir={json.dumps(str(run_dir))} {RUN_CONFIG}"
    outcome = deployment.run(APP_DIR, run_config, timeout=300.0, on_line=kill_in_round_2)

    assert killed == [victim], f"round 2 never started:\n{outcome.output[-3000:]}"
    assert outcome.status == "finished:completed", outcome.output[-3000:]
    assert (run_dir / "summary.json").is_file()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [row["round"] for row in rows] == [1, 2]
    assert rows[1].get("num-failures", 0) >= 1 or re.search(r"node \d+ failed", outcome.output)
