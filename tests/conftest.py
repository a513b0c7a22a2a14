"""Fixtures shared by several test modules."""

from __future__ import annotations

import json
import os
import random
import zlib
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from fedfields.data import load_scene
from fedfields.data.crowd import CrowdConfig, build_crowd, write_crowd
from fedfields.metrics.image import NO_DOWNLOADS
from fedfields.privacy import dp
from simulations.in_process_grid import set_task_identity

LEGO = Path(__file__).resolve().parents[1] / "data" / "lego"
HULL_RESOLUTION = 48
"""Voxels per axis of the crowd's visual hull: at 25x25 pixels 48^3 gives the persons their
depth as well as the default 128^3 does, at a fraction of its cost (tests/test_crowd.py tests
the hull itself)."""


def pytest_configure(config: pytest.Config) -> None:
    """One compute thread per test process and per process a test starts (OMP_NUM_THREADS
    is inherited, as is FEDFIELDS_NO_DOWNLOADS): the suite runs its modules on parallel
    workers (pytest-xdist, one per core), and tiny tensors gain nothing from a second thread
    while two threads per process on busy cores spin-wait each other (a small convolution:
    20x slower)."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    # No test reaches the network: LPIPS never tries to download its backbone (an offline
    # machine's try took 8 s, or hung, per process); tests that need it provide the weights.
    os.environ[NO_DOWNLOADS] = "1"


SLOWEST_MODULES = (
    "test_method_digests.py", "test_deployment.py", "test_dp_federation.py", "test_meta_job.py",
    "test_resume.py", "test_federated_nerf.py", "test_setting_extremes.py", "test_bench_dp.py",
    "test_reproduce.py", "test_sweep.py", "test_bench_gpu.py", "test_crowd.py", "test_scale.py",
    "test_side_by_side.py", "test_reply_faults.py", "test_real_federation.py",
    "test_packed_secure_sum.py", "test_secure_mode.py",
)  # fmt: skip
"""Modules of 30 s or more, slowest first (measured 2026-12-06 on 2 cores)."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The slowest modules first, the rest in their order: pytest-xdist's loadscope hands out
    modules in collection order, and a long one drawn last ran alone while the other worker sat
    idle (53 s of a 775 s suite)."""
    rank = {name: index for index, name in enumerate(SLOWEST_MODULES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


@pytest.fixture(autouse=True)
def seeded_randomness(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every test starts from global generators seeded by its own name, draws DP noise from a
    generator seeded the same way (not the OS's secret randomness) and builds Flower messages
    as the server of run 1, so no outcome depends on chance or on the tests run before it."""
    seed = zlib.crc32(request.node.nodeid.encode())
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    seeded = SimpleNamespace(randbits=random.Random(seed).getrandbits)
    monkeypatch.setattr(dp, "secrets", seeded)  # what noise_generator() seeds from
    set_task_identity()  # Flower's process-wide message identity, whatever ran before


@pytest.fixture(scope="session")
def crowd_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """3 users x 3 views of lego at 25x25, with 2 held-out views kept (the rest dropped).

    Built once per session: every scene run only reads it (node state and run directories
    go elsewhere).
    """
    lego = load_scene(LEGO, downscale=8, background=(0.0, 0.0, 0.0))
    config = CrowdConfig(users=3, views_per_user=3, seed=0, hull_resolution=HULL_RESOLUTION)
    crowd = build_crowd(lego, config, progress=False)
    out = tmp_path_factory.mktemp("fed") / "crowd"
    write_crowd(crowd, out)
    heldout = out / "heldout" / "transforms.json"
    meta = json.loads(heldout.read_text())
    meta["frames"] = meta["frames"][:2]  # keeps the audit fast
    heldout.write_text(json.dumps(meta))
    return out
