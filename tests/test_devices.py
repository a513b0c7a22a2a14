"""Devices (issue 34): a node's node-config `device`, the server's run-config `server-device`,
the wire's CPU float32, rendering that follows the field's device, and the launchers' flags.

No GPU here: CUDA is made to look visible (`torch.cuda.is_available`) and the library's
training and rendering entry points the clients call are spied on: each records the device
it was given and then runs on the CPU. Any code path that ignored the node's setting and
picked a device by itself would ask this CPU-only torch for CUDA and fail the run.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.app import Context, RecordDict

import clients.meta_client as meta_client
import clients.scene_client as scene_client
import fedfields.fields.encodings as encodings
import fedfields.fields.hashgrid_triton as hashgrid_triton
from fedfields.devices import canonical_device, parse_device
from fedfields.fields import HashGridConfig, HashGridField, HashGridFieldConfig
from fedfields.flower.node import is_simulated, node_data_dir, node_device
from fedfields.flower.protocol import state_to_arrays
from fedfields.geometry.cameras import orbit_cameras
from fedfields.methods.scaffold import CLIENT_CONTROL, CONTROL_DELTA, ScaffoldHook
from fedfields.render import OccupancyGrid, RenderConfig, render_image
from fedfields.train.federated import (
    LocalTrainConfig,
    federated_state,
    local_train,
    loss_gradient,
)
from simulations import APP_DIR
from simulations.federated_nerf import run_federated_nerf
from simulations.in_process_grid import InProcessGrid
from simulations.meta_job import run_meta_job
from simulations.run import client_app
from simulations.split_job import run_split_job
from strategies import parse_app_config

CPU = torch.device("cpu")
CUDA = torch.device("cuda")
LEGO = APP_DIR / "data" / "lego"


@pytest.fixture
def cuda_visible(monkeypatch: pytest.MonkeyPatch) -> None:
    """This process reports one CUDA device to fedfields (it has none: using it fails); torch's
    own accelerator check (Adam's capture health check reads it) still sees the real machine,
    so a CUDA build of torch without a GPU runs these tests as the CPU build does."""
    real = torch.accelerator.current_accelerator(check_available=True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(
        torch.accelerator, "current_accelerator", lambda check_available=False: real
    )


def _context(node_config: dict, node_id: int = 7) -> Context:
    return Context(
        run_id=1, node_id=node_id, node_config=node_config, state=RecordDict(), run_config={}
    )


# ------------------------------------------------------------------ parsing the setting


def test_device_settings_parse_once_with_one_clear_error() -> None:
    assert parse_device("cpu", "k") == CPU
    assert parse_device(" AUTO ", "k") == (CUDA if torch.cuda.is_available() else CPU)
    for bad in ("gpu", "cuda:", "cuda:-1", "cuda:x", "cpu:0", "", "mps"):
        with pytest.raises(ValueError, match=rf"^k = '{bad}': expected auto, cpu, cuda or cuda:N"):
            parse_device(bad, "k")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
def test_cuda_without_a_visible_device_is_refused_not_run_on_the_cpu() -> None:
    for value in ("cuda", "cuda:0"):
        with pytest.raises(ValueError, match=rf"'{value}': no CUDA device is visible"):
            parse_device(value, "node-config 'device'")


def test_auto_and_cuda_n_pick_visible_cuda_devices(cuda_visible: None) -> None:
    assert parse_device("auto", "k") == CUDA
    assert parse_device("cuda:0", "k") == torch.device("cuda", 0)
    with pytest.raises(ValueError, match=r"'cuda:1': only 1 CUDA device\(s\) are visible"):
        parse_device("cuda:1", "k")


def test_cuda_and_its_current_index_are_one_device(
    cuda_visible: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 55: torch.device("cuda") != torch.device("cuda:0"), so the GPU bench read every
    federated row of `--device cuda:0` as unavailable and 'auto' checked triton twice."""
    assert canonical_device("cuda") == canonical_device("cuda:0") == torch.device("cuda", 0)
    assert canonical_device("auto") == torch.device("cuda", 0)
    assert canonical_device("cuda:1") == torch.device("cuda", 1)
    assert canonical_device("cpu") == CPU
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)  # a process that chose
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)  # cuda:1 as its current one
    assert canonical_device("cuda") == torch.device("cuda", 1)


def test_triton_works_checks_cuda_and_cuda0_once(
    cuda_visible: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    checked: list[torch.device] = []
    monkeypatch.setattr(encodings, "triton_available", lambda: True)
    monkeypatch.setattr(encodings, "_TRITON_WORKS", {})
    monkeypatch.setattr(hashgrid_triton, "check_launch", checked.append)
    assert encodings.triton_works(torch.device("cuda"))
    assert encodings.triton_works(torch.device("cuda:0"))
    assert checked == [torch.device("cuda", 0)]


def test_node_device_names_node_key_and_value() -> None:
    assert node_device(_context({"partition-id": 0, "num-partitions": 2, "device": "cpu"})) == CPU
    with pytest.raises(ValueError, match=r"node 7: node-config 'device' = 'gpu0': expected"):
        node_device(_context({"partition-id": 0, "num-partitions": 2, "device": "gpu0"}))


def test_a_device_in_node_config_marks_a_deployed_node(tmp_path: Path) -> None:
    """Only Flower's exact {partition-id, num-partitions} is a virtual node; a node-config
    naming its device is a deployed SuperNode's, whose data comes from its own node-config."""
    simulated = _context({"partition-id": 0, "num-partitions": 2})
    deployed = _context({"partition-id": 0, "num-partitions": 2, "device": "cpu"})
    assert is_simulated(simulated) and not is_simulated(deployed)
    deployed.run_config = {"data-dir": str(tmp_path)}  # the server's root: never read
    with pytest.raises(ValueError, match="node-config has no 'data-dir'"):
        node_data_dir(deployed, "user")


def test_server_device_is_a_checked_run_config_key() -> None:

    assert parse_app_config({}).common.server_device == "auto"
    with pytest.raises(ValueError, match=r"run-config 'server-device' must be auto, cpu, cuda"):
        parse_app_config({"server-device": "gpu"})


# ------------------------------------------------------------------ the wire


def _tiny_field(dtype: torch.dtype = torch.float32) -> HashGridField:
    torch.manual_seed(0)
    encoding = HashGridConfig(num_levels=2, log2_hashmap_size=10, max_resolution=32)
    return HashGridField(HashGridFieldConfig(encoding=encoding)).to(dtype)


def _cameras():
    return orbit_cameras(np.random.default_rng(0), 2, 16, 4.0, (10.0, 40.0))


def _tiny_scene():
    from fedfields.data import load_scene

    return load_scene(LEGO, downscale=25).subset([0, 1])


def test_uploads_are_cpu_float32_whatever_the_training_dtype() -> None:
    """A float64 field's state, gradient and Scaffold control go out as float32 numpy arrays
    holding the same values to float32 precision."""
    field, scene = _tiny_field(torch.float64), _tiny_scene()
    render = RenderConfig(num_samples=8, chunk=256)
    state = federated_state(field)
    assert {t.dtype for t in state.values()} == {torch.float32}
    assert {t.device for t in state.values()} == {CPU}
    for name, parameter in field.named_parameters():
        assert torch.equal(state[name], parameter.detach().float())
    gradient = loss_gradient(field, scene, render, None, num_rays=64, device="cpu")
    assert {t.dtype for t in gradient.values()} == {torch.float32}
    zeros = {name: torch.zeros_like(t) for name, t in state.items()}
    result = local_train(
        field,
        scene,
        LocalTrainConfig(steps=2, batch_rays=32, device="cpu"),
        render,
        None,
        hooks=[ScaffoldHook(zeros, zeros)],
    )
    (kept,) = result.hook_results
    for upload in (state, gradient, kept.kept[CLIENT_CONTROL], kept.records[CONTROL_DELTA]):
        arrays = state_to_arrays(upload)
        assert {array.numpy().dtype for array in arrays.values()} == {np.dtype("float32")}


# ------------------------------------------------------------------ rendering follows the field


def test_rendering_follows_the_field_not_the_grid_or_cameras() -> None:
    """The crash issue 34 reports (occupancy.py cell_index): a field elsewhere than its grid.
    A grid built on a copy of the box and cameras on another device object still render what
    the plain call renders.
    (Here every device is the CPU; with CUDA the same test runs on it below.)"""
    field = _tiny_field().eval()
    cameras = _cameras()
    grid = OccupancyGrid(field.aabb.clone())
    grid.update(field.density, RenderConfig().step_size)
    expected = render_image(field, cameras, 0, RenderConfig(chunk=128), grid).rgb
    assert torch.isfinite(expected).all()
    points = torch.rand(5, 3) * 3 - 1.5
    assert grid.cell_index(points).device == points.device


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_cuda_field_renders_with_a_cpu_grid_scene_and_background() -> None:
    field = _tiny_field().eval()
    cameras = _cameras()
    grid = OccupancyGrid(field.aabb.clone())
    grid.update(field.density, RenderConfig().step_size)
    expected = render_image(field, cameras, 0, RenderConfig(chunk=128), grid).rgb
    field.cuda()
    cpu_grid = OccupancyGrid(field.aabb.cpu())
    cpu_grid.load_state_dict(grid.state_dict())
    rendered = render_image(field, cameras, 0, RenderConfig(chunk=128), cpu_grid).rgb
    torch.testing.assert_close(rendered.cpu(), expected, atol=1e-4, rtol=1e-4)


# ------------------------------------------------------------------ clients


def _spy_scene_client(monkeypatch: pytest.MonkeyPatch) -> Counter:
    """Spy on every training and rendering call of the scene client: count (call, device),
    then run it on the CPU."""
    seen: Counter = Counter()
    real_train, real_score = scene_client.local_train, scene_client.heldout_psnr
    real_gradient = scene_client.loss_gradient_of

    def local_train_spy(field, scene, config, *args, **kwargs):
        seen["train", torch.device(config.device)] += 1
        return real_train(field, scene, dataclasses.replace(config, device="cpu"), *args, **kwargs)

    def score_spy(field, views, settings, device, passes):
        seen["score", device] += 1
        return real_score(field, views, settings, "cpu", passes)

    def gradient_spy(*args, device, **kwargs):
        seen["gradient", device] += 1
        return real_gradient(*args, device="cpu", **kwargs)

    monkeypatch.setattr(scene_client, "local_train", local_train_spy)
    monkeypatch.setattr(scene_client, "heldout_psnr", score_spy)
    monkeypatch.setattr(scene_client, "loss_gradient_of", gradient_spy)
    return seen


def _deployed_nodes(grid: InProcessGrid, devices: list[str], folders: list[Path], root: Path):
    """Give the grid's nodes a deployed SuperNode's node-config: own data, state and device."""
    for index, (node_id, device) in enumerate(zip(grid.contexts, devices, strict=True)):
        grid.contexts[node_id].node_config = {
            "partition-id": index,
            "num-partitions": len(devices),
            "data-dir": str(folders[index]),
            "state-dir": str(root / f"node_{index}"),
            "device": device,
        }


def _reply_dtypes(grid: InProcessGrid) -> set[np.dtype]:
    return {
        array.numpy().dtype
        for reply in grid.received
        for record in reply.content.array_records.values()
        for array in record.values()
    }


def test_node_config_device_reaches_every_scene_client_call(
    crowd_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cuda_visible: None
) -> None:
    """DecentNeRF, 2 rounds, 2 deployed nodes (cuda, cpu) while CUDA looks visible:
    local training, the held-out score and the gradient query each get the node's device;
    the server (server-device cpu) never asks for CUDA; every reply array is float32."""
    seen = _spy_scene_client(monkeypatch)
    config = {
        "run-dir": str(tmp_path / "run"),
        "strategy": "decentnerf",
        "server-device": "cpu",
        "num-server-rounds": 2,
        "local-steps": 1,
        "fraction-train": 1.0,
        "target-samples": 2048,
        "hash-log2-size": 10,
        "hash-levels": 2,
        "hash-max-resolution": 32,
        "orbit-frames": 0,
    }
    grid = InProcessGrid([client_app(config)] * 2, raise_errors=True)
    folders = [crowd_dir / f"user_{i:02d}" for i in range(2)]
    _deployed_nodes(grid, ["cuda", "cpu"], folders, tmp_path / "nodes")
    run_federated_nerf(grid, parse_app_config(config), observe=False)
    assert seen == Counter(
        {
            ("train", CUDA): 2,
            ("train", CPU): 2,
            ("score", CUDA): 2,
            ("score", CPU): 2,
            ("gradient", CUDA): 1,
            ("gradient", CPU): 1,
        }
    )
    assert _reply_dtypes(grid) == {np.dtype("float32")}


def test_node_config_device_reaches_meta_learning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cuda_visible: None
) -> None:
    seen: Counter = Counter()
    real = meta_client.meta_train_parts

    def spy(msg, model, tasks, meta, state):
        seen[meta.device] += 1
        return real(msg, model, tasks, dataclasses.replace(meta, device="cpu"), state)

    monkeypatch.setattr(meta_client, "meta_train_parts", spy)
    config = {
        "task": "faces",
        "run-dir": str(tmp_path / "run"),
        "server-device": "cpu",
        "num-server-rounds": 1,
        "num-clients": 2,
        "clients-per-round": 2,
        "outer-steps": 1,
        "inner-steps": 1,
        "field-width": 8,
        "field-depth": 2,
        "tto-steps": 1,
    }
    grid = InProcessGrid([client_app(config)] * 2, raise_errors=True)
    for index, (node_id, device) in enumerate(zip(grid.contexts, ["cuda", "cpu"], strict=True)):
        grid.contexts[node_id].node_config = {
            "partition-id": index,
            "num-partitions": 2,
            "device": device,
        }
    run_meta_job(grid, parse_app_config(config), observers=[])
    assert seen == Counter({CUDA: 1, CPU: 1})
    assert _reply_dtypes(grid) == {np.dtype("float32")}


def test_split_node_on_the_cpu_while_cuda_looks_visible(tmp_path: Path, cuda_visible: None) -> None:
    """The split client and server follow node-config device and server-device cpu: nothing
    picks CUDA by itself; the gradients and rays sent are float32."""
    config = {
        "mode": "split",
        "run-dir": str(tmp_path / "run"),
        "server-device": "cpu",
        "downscale": 8.0,
        "split-steps": 3,
        "split-batch-rays": 16,
        "split-samples": 8,
        "split-attack": False,
        "hash-log2-size": 10,
    }
    grid = InProcessGrid([client_app(config)], raise_errors=True)
    node_id = next(iter(grid.contexts))
    grid.contexts[node_id].node_config = {
        "partition-id": 0,
        "num-partitions": 1,
        "data-dir": str(LEGO),
        "state-dir": str(tmp_path / "node"),
        "device": "cpu",
    }
    run_split_job(grid, parse_app_config(config), observers=[])
    assert _reply_dtypes(grid) == {np.dtype("float32")}


# ------------------------------------------------------------------ launchers


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
def test_launch_with_client_gpus_refuses_without_cuda(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "simulations.launch", "--client-gpus", "0.5",
         "--run-dir", str(tmp_path / "run")],
        cwd=APP_DIR, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 2
    assert "--client-gpus 0.5: no CUDA device is visible on this machine" in result.stderr
    assert not (tmp_path / "run").exists()


def test_deploy_refuses_a_device_its_nodes_cannot_use(capsys: pytest.CaptureFixture) -> None:
    from simulations import deploy

    with pytest.raises(SystemExit) as exit_info:
        deploy.parse_args(["--device", "tpu"])
    assert exit_info.value.code == 2
    assert "--device = 'tpu': expected auto, cpu, cuda or cuda:N" in capsys.readouterr().err
    assert deploy.parse_args(["--device", "cpu"]).device == "cpu"


def test_audit_refuses_a_bad_device(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from fedfields.cli import main

    assert main(["audit", str(tmp_path), "--device", "gpu"]) == 2
    assert "--device = 'gpu': expected auto, cpu, cuda or cuda:N" in capsys.readouterr().err


BENCH_HELPERS = ("__init__", "devices", "novel_blender_federation", "novel_blender_setup")
"""Modules of simulations/bench that are not benchmarks themselves."""
BENCHMARKS = sorted(
    path.stem
    for path in (APP_DIR / "simulations" / "bench").glob("*.py")
    if path.stem not in BENCH_HELPERS
)
CHECKED_ELSEWHERE = ("dp", "gpu", "kernels")
"""Benchmarks whose `--device` their own authors check (issue 34 point 2/3, issue 36)."""


@pytest.mark.parametrize("bench", BENCHMARKS)
def test_every_benchmark_takes_device(
    bench: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """`--device` is in every benchmark's usage; the ones built here refuse a bad value with
    argparse's one-line error."""
    import importlib

    module = importlib.import_module(f"simulations.bench.{bench}")
    monkeypatch.setattr(sys, "argv", [bench, "--help"])
    with pytest.raises(SystemExit):
        module.main()
    assert "--device" in capsys.readouterr().out
    if bench in CHECKED_ELSEWHERE:
        return
    monkeypatch.setattr(sys, "argv", [bench, "--device", "tpu"])
    with pytest.raises(SystemExit) as exit_info:
        module.main()
    assert exit_info.value.code == 2
    assert "argument --device" in capsys.readouterr().err
