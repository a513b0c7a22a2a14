"""Every method's seeded run, digested: the redesign of issue 56 must leave them bit-identical.

Each case runs the App's job in process (the ClientApp every node runs, the ServerApp's job)
for two rounds on the shared 3-user crowd (or 4 face clients for FedMeNF's meta-aggregation)
with a fixed seed, and digests the final global weights with every round's metrics (wall-clock
figures left out). `tests/method_digests.json` holds the digests recorded before the code
moved; a case that differs names itself. To record them again (only when a change of numbers
is meant, and said in the commit):

    FEDFIELDS_RECORD_DIGESTS=1 python -m pytest -n0 tests/test_method_digests.py
"""

from __future__ import annotations

import hashlib
import json
import os
import random
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from fedfields.privacy import dp
from simulations.federated_nerf import run_federated_nerf
from simulations.in_process_grid import InProcessGrid
from simulations.meta_job import run_meta_job
from simulations.run import client_app
from strategies import parse_app_config

DIGESTS = Path(__file__).with_name("method_digests.json")
RECORD = os.environ.get("FEDFIELDS_RECORD_DIGESTS") == "1"
SMALL_SCENE = {
    "num-server-rounds": 2,
    "local-steps": 2,
    "fraction-train": 1.0,
    "eval-views-per-round": 1,
    "client-eval-views": 0,
    "target-samples": 2048,
    "hash-log2-size": 10,
    "hash-levels": 2,
    "hash-max-resolution": 32,
    "seed": 3,
    "orbit-frames": 0,  # the orbit is not digested; tests/test_federated_nerf.py looks at one
}
SECURE = {"secure-aggregation": True, "min-train-nodes": 3}  # SecAgg+ among all 3 users
DP = {"dp-noise-multiplier": 0.5, "dp-clip-norm": 1.0, "dp-max-noise-ratio": 0.0}
"""Noise far above the tiny field's updates: 3 clients a round only have to run it."""
WALL_CLOCK = ("second", "time", "duration")
"""Metric names holding wall-clock figures: left out of the digest."""

SCENE_CASES: dict[str, dict[str, Any]] = {
    **{
        name: {"strategy": name}
        for name in (
            "decentnerf",
            "fedavg",
            "fedprox",
            "scaffold",
            "fednova",
            "fedexp",
            "fedacg",
            "fedavgm",
            "fedadam",
            "fedyogi",
            "fedadagrad",
        )
    },  # fmt: skip
    "fedavg-trimmed-mean": {"strategy": "fedavg", "aggregation-rule": "trimmed-mean"},
    "fedavg-median": {"strategy": "fedavg", "aggregation-rule": "median"},
    "fedavg-krum": {"strategy": "fedavg", "aggregation-rule": "krum"},
    "fedavg-multi-krum": {"strategy": "fedavg", "aggregation-rule": "multi-krum"},
    "fedavg-lowrank": {"strategy": "fedavg", "compression": "lowrank"},
    "fedavg-quantise": {"strategy": "fedavg", "compression": "quantise"},
    "scaffold-topk-downloads": {
        "strategy": "scaffold",
        "compression": "topk",
        "compression-download": True,
    },  # fmt: skip
    "scaffold-static": {"strategy": "scaffold", "cuda-graph": True},  # static, uncaptured
    "decentnerf-static": {"strategy": "decentnerf", "cuda-graph": True},
    "fedavg-secagg": {"strategy": "fedavg", **SECURE},
    "decentnerf-secagg": {"strategy": "decentnerf", **SECURE},
    "fedavg-central-dp": {"strategy": "fedavg", **DP},
    "fedavg-adaptive-dp": {
        "strategy": "fedavg",
        **DP,
        "dp-adaptive-clipping": True,
        "dp-clipped-count-stddev": 0.5,
    },  # fmt: skip
    "fedprox-distributed-dp": {"strategy": "fedprox", **SECURE, **DP},
    "decentnerf-central-dp": {"strategy": "decentnerf", **DP},
    "decentnerf-distributed-dp": {"strategy": "decentnerf", **SECURE, **DP},
    "decentnerf-quantise": {"strategy": "decentnerf", "compression": "quantise"},
    "decentnerf-topk-downloads": {
        "strategy": "decentnerf",
        "compression": "topk",
        "compression-download": True,
    },  # fmt: skip
}
META_CASES: dict[str, dict[str, Any]] = {
    f"{strategy}-{learner}": {"strategy": strategy, "meta-learner": learner}
    for strategy, learner in (
        ("fedmenf", "fedmenf"), ("fedavg", "maml"), ("fedprox", "fomaml"),
        ("scaffold", "reptile"), ("fednova", "maml"), ("fedexp", "maml"), ("fedacg", "maml"),
    )
}  # fmt: skip


@pytest.fixture
def fixed_randomness(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same global generators and DP noise source for a case whatever its test id."""
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    monkeypatch.setattr(dp, "secrets", SimpleNamespace(randbits=random.Random(0).getrandbits))


def digest(run_dir: Path) -> str:
    """SHA-256 of the final global weights (name, dtype, shape, bytes) and every round's
    metrics but wall-clock ones, in the order written."""
    hasher = hashlib.sha256()
    checkpoint = torch.load(run_dir / "checkpoint.pt", map_location="cpu", weights_only=False)
    state = checkpoint["state_dict"]
    for name in sorted(state):
        tensor = state[name].contiguous()
        hasher.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)}".encode())
        hasher.update(tensor.numpy().tobytes())
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        kept = {k: v for k, v in record.items() if not any(w in k for w in WALL_CLOCK)}
        hasher.update(json.dumps(kept, sort_keys=True).encode())
    return hasher.hexdigest()


def check(case: str, run_dir: Path) -> None:
    """Compare the case's digest with the recorded one (or record it)."""
    found = digest(run_dir)
    recorded = json.loads(DIGESTS.read_text()) if DIGESTS.exists() else {}
    if RECORD:
        DIGESTS.write_text(json.dumps({**recorded, case: found}, indent=1, sort_keys=True) + "\n")
        return
    assert case in recorded, f"no digest recorded for {case}: see this module's docstring"
    assert found == recorded[case], f"{case}: the seeded run's numbers changed"


@pytest.mark.usefixtures("fixed_randomness")
@pytest.mark.parametrize("case", sorted(SCENE_CASES))
def test_a_scene_method_s_seeded_run_is_unchanged(
    case: str, crowd_dir: Path, tmp_path: Path
) -> None:
    config = {
        **SMALL_SCENE,
        "data-dir": str(crowd_dir),
        "state-dir": str(tmp_path / "nodes"),
        "run-dir": str(tmp_path / "run"),
        **SCENE_CASES[case],
    }
    grid = InProcessGrid([client_app(config)] * 3, raise_errors=True)
    check(case, run_federated_nerf(grid, parse_app_config(config)))


@pytest.mark.usefixtures("fixed_randomness")
@pytest.mark.parametrize("case", sorted(META_CASES))
def test_a_meta_aggregation_s_seeded_run_is_unchanged(case: str, tmp_path: Path) -> None:
    config = {
        "task": "faces",
        "run-dir": str(tmp_path / "meta"),
        "num-server-rounds": 2,
        "num-clients": 4,
        "clients-per-round": 2,
        "outer-steps": 2,
        "inner-steps": 1,
        "field-width": 16,
        "field-depth": 2,
        "tto-steps": 2,
        "seed": 3,
        **META_CASES[case],
    }
    grid = InProcessGrid([client_app(config)] * 4, raise_errors=True)
    check(case, run_meta_job(grid, parse_app_config(config)))
