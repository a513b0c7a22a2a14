"""The server job skeleton (simulations/job.py): the ServerApp parses the run-config once.

Each job runs one short round (or three split steps) in process through the ServerApp's
`main`, with a counting wrapper around `FederatedConfig.from_run_config`; the in-process
clients parse too, so their calls are told apart and left out of the server's count.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from flwr.app import Context, Message, RecordDict
from test_federated_nerf import tiny as tiny_scene
from test_meta_job import tiny as tiny_meta
from test_split_job import tiny as tiny_split

from fedfields.config import FederatedConfig
from simulations import server_app
from simulations.in_process_grid import InProcessGrid
from simulations.run import client_app


class ParseCounter:
    """Counts `FederatedConfig.from_run_config` calls made outside a client's handler."""

    def __init__(self) -> None:
        self.server = 0
        self.in_client = False

    def client(self, run_config: dict[str, Any]) -> Callable[[Message, Context], Message]:
        """The ClientApp of `run_config` as a node handler whose parses are not counted."""
        app = client_app(run_config)

        def node(message: Message, context: Context) -> Message:
            self.in_client = True
            try:
                return app(message, context)
            finally:
                self.in_client = False

        return node


@pytest.fixture
def parses(monkeypatch: pytest.MonkeyPatch) -> Iterator[ParseCounter]:
    counter = ParseCounter()
    parse = FederatedConfig.from_run_config.__func__  # type: ignore[attr-defined]

    def counting(
        cls: type[FederatedConfig], run_config: dict[str, Any], strategies: Any = None
    ) -> FederatedConfig:
        if not counter.in_client:
            counter.server += 1
        return parse(cls, run_config, strategies)

    monkeypatch.setattr(FederatedConfig, "from_run_config", classmethod(counting))
    yield counter


def serve(run_config: dict[str, Any], nodes: list) -> Path:
    """The ServerApp's `main` over in-process `nodes`; returns the run directory."""
    server_app.main(InProcessGrid(nodes, raise_errors=True), _context(run_config))
    return Path(run_config["run-dir"])


def _context(run_config: dict[str, Any]) -> Context:
    return Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config=run_config)


def test_the_scene_server_parses_its_run_config_once(
    parses: ParseCounter, crowd_dir: Path, tmp_path: Path
) -> None:
    config = tiny_scene(crowd_dir, tmp_path / "run", "fedavg", **{"num-server-rounds": 1})
    run_dir = serve(config, [parses.client(config)] * 3)
    assert (run_dir / "summary.json").is_file()  # the audit ran: simulation-audit is on
    assert (run_dir / "leakage.png").is_file()
    assert parses.server == 1


def test_the_meta_server_parses_its_run_config_once(parses: ParseCounter, tmp_path: Path) -> None:
    config = tiny_meta(tmp_path / "run", **{"num-server-rounds": 1})
    run_dir = serve(config, [parses.client(config)] * 4)
    assert (run_dir / "privacy.png").is_file()  # the privacy audit was attached
    assert parses.server == 1


def test_the_split_server_parses_its_run_config_once(parses: ParseCounter, tmp_path: Path) -> None:
    config = tiny_split(tmp_path / "run", **{"split-steps": 3})
    run_dir = serve(config, [parses.client(config)])
    assert (run_dir / "client.json").is_file()  # the split audit copied the client's report
    assert parses.server == 1
