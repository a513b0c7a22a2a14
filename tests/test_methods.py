"""Each method is one Flower-free module of fedfields.methods, and the generic round names none.

The first test imports every module of the package in a fresh interpreter and fails if Flower
came with it; the second reads the generic round's modules for any registered method's name
(the text, docstrings included: what a newcomer reads).
"""

from __future__ import annotations

import inspect
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from test_method_digests import SMALL_SCENE

import strategies
from simulations import server_app
from simulations.federated_nerf import run_federated_nerf
from simulations.in_process_grid import InProcessGrid
from simulations.run import client_app

ROOT = Path(__file__).resolve().parents[1]
METHODS = ROOT / "fedfields" / "methods"
GENERIC_ROUND = (
    "fedfields/methods/base.py",
    "fedfields/methods/settings.py",
    "fedfields/flower/strategy.py",
    "fedfields/flower/round.py",
    "fedfields/flower/secagg_workflow.py",
    "fedfields/flower/secure_aggregation.py",
    "fedfields/flower/compressed_downloads.py",
    "fedfields/flower/client_hooks.py",
    "fedfields/flower/node.py",
    "fedfields/flower/resume.py",
    "fedfields/privacy/dp.py",
    "fedfields/download_chain.py",
    "fedfields/compression.py",
    "clients/client_app.py",
    "clients/client_call.py",
    "clients/scene_client.py",
)
"""Modules every method's round passes through, server and node, that name none (the others
are listed in docs/LIBRARY.md with why they still do): the node runs what the message's method
declares and never asks who sent it."""


def test_no_module_of_fedfields_methods_imports_flower() -> None:
    names = sorted(f"fedfields.methods.{p.stem}" for p in METHODS.glob("*.py"))
    script = (
        "import importlib, sys\n"
        f"for name in {names!r}: importlib.import_module(name)\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('flwr', 'ray')))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[]", f"fedfields.methods imported {out.stdout.strip()}"
    assert len(names) >= 10  # the package was found: the check is not vacuous


def test_the_generic_round_names_no_method() -> None:
    names = [name for name in strategies.STRATEGIES if name != "fedavg"] + ["proximal"]
    pattern = re.compile("|".join(names), re.IGNORECASE)
    found = {
        path: sorted({m.group(0).lower() for m in pattern.finditer((ROOT / path).read_text())})
        for path in GENERIC_ROUND
    }
    assert {path: hits for path, hits in found.items() if hits} == {}
    assert pattern.search("Scaffold's control") is not None  # the pattern does match names


# ------------------------------------------------------------------ one FedAvg round, file by file


def repository_file(name: str) -> str | None:
    """`name` relative to the repository, or None for a test, the test grid or a package."""
    if not name.startswith(f"{ROOT}/"):
        return None
    relative = Path(name).relative_to(ROOT).as_posix()
    skipped = (".venv/", "tests/", "simulations/in_process_grid")
    return None if relative.startswith(skipped) else relative


def round_walk(crowd_dir: Path, run_dir: Path) -> list[str]:
    """The repository files one FedAvg round's server runs, in order: those on the call stack
    from the ServerApp's `run_job` into `RoundLoop.run`, then every file whose code runs from
    there to the first round's `finish_round`; the nodes' handlers left out."""
    config = {
        **SMALL_SCENE,
        "strategy": "fedavg",
        "num-server-rounds": 1,
        "data-dir": str(crowd_dir),
        "state-dir": str(run_dir / "nodes"),
        "run-dir": str(run_dir / "run"),
    }
    order: list[str] = []
    state = {"active": False, "inside": 0}

    def add(name: str) -> None:
        relative = repository_file(name)
        if relative is not None and relative not in order:
            order.append(relative)

    def profile(frame: Any, event: str, arg: Any) -> None:
        name, code = frame.f_code.co_filename, frame.f_code.co_name
        if event == "call" and code == "run" and name.endswith("flower/strategy.py"):
            state["active"] = True
            for caller in reversed(inspect.getouterframes(frame)):
                add(caller.filename)
        if not state["active"]:
            return
        if event == "return" and code == "finish_round":
            state["active"] = False
        elif code == "_dispatch" and name.endswith("in_process_grid.py"):
            state["inside"] += {"call": 1, "return": -1}.get(event, 0)
        elif event == "call" and not state["inside"]:
            add(name)

    grid = InProcessGrid([client_app(config)] * 3, raise_errors=True)
    sys.setprofile(profile)
    try:
        server_app.run_job(grid, config)
    finally:
        sys.setprofile(None)
    return order


def test_one_fedavg_round_crosses_the_eight_files_library_md_lists(
    crowd_dir: Path, tmp_path: Path
) -> None:
    listed = re.findall(
        r"`((?:fedfields|simulations|strategies)/[\w/]+\.py)`",
        (ROOT / "docs" / "LIBRARY.md")
        .read_text()
        .split("### One FedAvg round, file by file")[1]
        .split("\nThat is ")[0],
    )
    walked = round_walk(crowd_dir, tmp_path)
    assert walked[0] == "simulations/server_app.py" and len(walked) <= 8
    assert [path for path in listed if path != "fedfields/methods/fedavg.py"] == walked


# ------------------------------------------------------------------ a client-side method added


def run_toy(config: dict, crowd_dir: Path, run_dir: Path) -> tuple[dict, list[dict]]:
    """The App's scene job in process over 3 users: the final global and the round lines."""
    config = {
        **SMALL_SCENE,
        "data-dir": str(crowd_dir),
        "state-dir": str(run_dir / "nodes"),
        "run-dir": str(run_dir / "run"),
        **config,
    }
    grid = InProcessGrid([client_app(config)] * 3, raise_errors=True)
    out = run_federated_nerf(grid, strategies.parse_app_config(config))
    state = torch.load(out / "checkpoint.pt", map_location="cpu", weights_only=False)
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return state["state_dict"], [line for line in lines if "toy-mean-steps" in line]


def test_a_toy_client_side_method_is_one_module_and_one_registry_line(
    monkeypatch: pytest.MonkeyPatch, crowd_dir: Path, tmp_path: Path
) -> None:
    """tests/toy_method.py plus one registry line, through the App's ServerApp job and
    ClientApp: its loss term reaches the one local loop (weight 0 trains FedAvg's weights bit
    for bit, weight 1 others), its reply record is summed by the server (the clients' 2
    local steps come back as the summed mean), in plaintext, under SecAgg+ and with
    compressed uploads."""
    from toy_method import MEAN_STEPS, FedToyDecay

    monkeypatch.setitem(strategies.STRATEGIES, "fedtoydecay", strategies.entry(FedToyDecay))
    fedavg, _ = run_toy({"strategy": "fedavg"}, crowd_dir, tmp_path / "fedavg")
    plain, lines = run_toy({"strategy": "fedtoydecay"}, crowd_dir, tmp_path / "plain")
    assert all(torch.equal(plain[key], fedavg[key]) for key in fedavg)
    assert [line[MEAN_STEPS] for line in lines] == [2.0, 2.0]
    decayed, lines = run_toy(
        {"strategy": "fedtoydecay", "toy-weight": 1.0}, crowd_dir, tmp_path / "decayed"
    )
    assert [line[MEAN_STEPS] for line in lines] == [2.0, 2.0]
    norm = sum(float(value.square().sum()) for value in decayed.values())
    assert norm < sum(float(value.square().sum()) for value in plain.values())
    secure = {"secure-aggregation": True, "min-train-nodes": 3}
    _, lines = run_toy({"strategy": "fedtoydecay", **secure}, crowd_dir, tmp_path / "secure")
    assert [line[MEAN_STEPS] for line in lines] == pytest.approx([2.0, 2.0], rel=1e-4)
    compressed, lines = run_toy(
        {"strategy": "fedtoydecay", "compression": "quantise"}, crowd_dir, tmp_path / "quantise"
    )
    assert [line[MEAN_STEPS] for line in lines] == [2.0, 2.0]
    assert not all(torch.equal(compressed[key], plain[key]) for key in plain)  # it was coded
