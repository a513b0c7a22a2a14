"""The triton backends equal the torch reference: hash grid and packed compositing, both ways.

Every case is built here, deterministically, on the CPU. Where CUDA and triton are present the
kernels run on the GPU in this process; elsewhere one subprocess runs them through Triton's
interpreter on CPU tensors (TRITON_INTERPRET=1 must be set before triton is first imported,
and set only there it cannot leak into other tests). Each test then compares one case against
the torch backend computed in this process. `python tests/test_triton_kernels.py OUT` is
that subprocess.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import Tensor

from fedfields.fields import HashGridConfig, HashGridEncoding, HashGridField, HashGridFieldConfig
from fedfields.geometry.rays import Rays
from fedfields.render import OccupancyGrid, RenderConfig, render_rays
from fedfields.render.volume import render_packed
from fedfields.train.builders import global_field
from strategies import parse_app_config

ROOT = Path(__file__).resolve().parents[1]
ON_GPU = torch.cuda.is_available()
REFERENCE = "cuda" if ON_GPU else "cpu"  # where the torch backend runs for the comparisons
TRITON = importlib.util.find_spec("triton") is not None
pytestmark = pytest.mark.skipif(not TRITON, reason="triton is not installed (dev extra, Linux)")

Outputs = dict[str, Tensor]

# ------------------------------------------------------------------ cases


def _grid(levels: int, log2: int, base: int, finest: int, features: int = 2) -> dict:
    return dict(
        num_levels=levels,
        log2_hashmap_size=log2,
        base_resolution=base,
        max_resolution=finest,
        features_per_level=features,
    )


def _edge_points() -> Tensor:
    """Every mix of coordinates outside, at and inside the cube's faces and on cell edges."""
    values = torch.tensor([-0.5, 0.0, 1 / 3, 0.5, 0.7, 1.0, 1.5])
    return torch.cartesian_prod(values, values, values)


def _hash_cases() -> dict[str, tuple[dict, Tensor]]:
    """Grid settings and points. Levels of SMALL: resolutions 3, 5 (dense in 2^9), 10, 20."""
    generator = torch.Generator().manual_seed(0)
    small = _grid(4, 9, 3, 20)
    random = torch.rand(200, 3, generator=generator) * 1.2 - 0.1
    same = torch.tensor([[0.3, 0.6, 0.9], [0.31, 0.6, 0.9]]).repeat_interleave(64, dim=0)
    return {
        "random": (small, random),
        "edges": (small, _edge_points()),
        # resolutions 7 and 8: (7+1)^3 = 512 rows is exactly 2^9 (dense), 9^3 is hashed
        "dense-hashed-boundary": (_grid(2, 9, 7, 8), torch.cat([random, _edge_points()])),
        "single-dense-level": (_grid(1, 8, 4, 4), random),
        "single-hashed-level": (_grid(1, 10, 16, 16), random),
        # lower corner x stride passes 2^31 (int32 wraps as the hash wants)
        "huge-resolutions": (_grid(2, 20, 8192, 32768), random),
        # one coarse cell holds every point: 128 atomic adds into the same 8 rows
        "duplicates": (_grid(3, 6, 1, 4), same),
        "three-features": (_grid(4, 9, 3, 20, features=3), random[:64]),
        "one-feature": (_grid(2, 9, 3, 20, features=1), random[:64]),
        "no-points": (small, torch.zeros(0, 3)),
    }


def _encoding(settings: dict, implementation: str, seed: int = 1) -> HashGridEncoding:
    encoding = HashGridEncoding(HashGridConfig(**settings, implementation=implementation))
    with torch.no_grad():
        encoding.table.normal_(generator=torch.Generator().manual_seed(seed))
    return encoding


def _hash_grid(encoding: HashGridEncoding, points: Tensor, device: str) -> Outputs:
    """Features of the points and the table's gradient under a fixed cotangent."""
    encoding = encoding.to(device)
    features = encoding(points.to(device))
    cotangent = torch.randn(features.shape, generator=torch.Generator().manual_seed(2))
    (grad,) = torch.autograd.grad((features * cotangent.to(device)).sum(), encoding.table)
    return {"features": features.detach().cpu(), "grad_table": grad.cpu()}


def _packed_case(counts: list[int], seed: int, density_scale: float = 5.0) -> dict:
    generator = torch.Generator().manual_seed(seed)
    samples, rays = sum(counts), len(counts)

    def uniform(*shape: int) -> Tensor:
        return torch.rand(*shape, generator=generator)

    return {
        "counts": torch.tensor(counts, dtype=torch.long),
        "densities": uniform(samples) * density_scale,
        "deltas": uniform(samples) * 0.1 + 0.001,
        "t_mid": uniform(samples) * 4.0 + 2.0,
        "rgb": uniform(samples, 3),
        "background": uniform(rays, 3),
        "cotangents": [uniform(rays, 3), uniform(rays), uniform(rays), uniform(samples)],
    }


def _composite_cases() -> dict[str, tuple[dict, bool]]:
    """Packed batches; the flag: every input needs a gradient and the loss reads the weights
    (as NeRF-W's uncertainty does), else only densities and colours (the plain renderer)."""
    random_counts = torch.randint(0, 13, (24,), generator=torch.Generator().manual_seed(3))
    random = _packed_case(random_counts.tolist(), seed=4)
    return {
        "random-all-inputs": (random, True),
        "random-renderer": (random, False),
        "zero-one-two-samples": (_packed_case([0, 1, 0, 0, 2, 1, 0], seed=5), True),
        "one-long-ray": (_packed_case([3, 256, 0, 5], seed=6, density_scale=0.5), True),
        "opaque": (_packed_case([7, 30, 2], seed=7, density_scale=500.0), True),
        "no-samples": (_packed_case([0, 0, 0], seed=8), True),
        "no-rays": (_packed_case([], seed=9), True),
    }


def _composite(
    case: dict, all_inputs: bool, backend: str, device: str, dtype: torch.dtype = torch.float32
) -> Outputs:
    """Weights and per-ray outputs of `render_packed`, and the gradients of a fixed loss.

    Returned in float32 whatever `dtype` the sums ran in.
    """
    names = ("densities", "deltas", "t_mid", "rgb", "background")
    differentiable = names if all_inputs else ("densities", "rgb")
    inputs = {
        name: case[name].to(device, dtype).requires_grad_(name in differentiable) for name in names
    }
    counts = case["counts"].to(device)
    ray_index = torch.repeat_interleave(torch.arange(len(counts), device=device), counts)
    rendered, weights = render_packed(
        inputs["densities"], inputs["deltas"], inputs["rgb"], inputs["t_mid"], ray_index,
        len(counts), inputs["background"], backend,
    )  # fmt: skip
    directions = [c.to(device, dtype) for c in case["cotangents"]]
    loss = (rendered.rgb * directions[0]).sum() + (rendered.depth * directions[1]).sum()
    loss = loss + (rendered.opacity * directions[2]).sum()
    if all_inputs:
        loss = loss + (weights * directions[3]).sum()
    grads = torch.autograd.grad(loss, [inputs[name] for name in differentiable])
    outputs = {"rgb": rendered.rgb, "depth": rendered.depth, "opacity": rendered.opacity}
    outputs |= {"weights": weights}
    outputs |= {f"grad_{name}": grad for name, grad in zip(differentiable, grads, strict=True)}
    return {name: value.detach().float().cpu() for name, value in outputs.items()}


FIELD_GRID = _grid(4, 9, 3, 20)


def _field(implementation: str) -> HashGridField:
    torch.manual_seed(0)
    encoding = HashGridConfig(**FIELD_GRID, implementation=implementation)
    return HashGridField(HashGridFieldConfig(encoding=encoding, density_hidden=16, color_hidden=16))


def _exchanged_field(state: dict[str, Tensor], implementation: str, device: str) -> Outputs:
    """A field of `implementation` loaded with `state`, rendering rays through an occupancy
    grid (`render_rays`, packed samples); its outputs and its table's gradient."""
    field = _field(implementation)
    field.load_state_dict(state)
    field.to(device)
    generator = torch.Generator().manual_seed(10)
    origins = torch.tensor([0.0, 0.0, 4.0]) + torch.rand(6, 3, generator=generator) * 0.4
    directions = torch.nn.functional.normalize(
        torch.tensor([0.0, 0.0, -1.0]) + torch.rand(6, 3, generator=generator) * 0.3, dim=-1
    )
    rays = Rays(origins.to(device), directions.to(device))
    grid = OccupancyGrid(torch.tensor([-1.5, -1.5, -1.5, 1.5, 1.5, 1.5]).view(2, 3), 8)
    composite = "torch" if implementation == "torch" else "triton"
    config = RenderConfig(step_size=0.1, composite=composite)  # type: ignore[arg-type]
    rendered, _ = render_rays(field, rays, config, grid)
    loss = rendered.rgb.sum() + rendered.depth.sum() * 0.1
    (grad,) = torch.autograd.grad(loss, field.encoding.table)
    outputs = {"rgb": rendered.rgb, "depth": rendered.depth, "opacity": rendered.opacity}
    return {name: value.detach().cpu() for name, value in outputs.items()} | {
        "grad_table": grad.cpu()
    }


def _run_triton(device: str) -> dict[str, object]:
    """Every case through the triton backends on `device` (this is the subprocess's job)."""
    results: dict[str, object] = {}
    for name, (settings, points) in _hash_cases().items():
        results[f"hash/{name}"] = _hash_grid(_encoding(settings, "triton"), points, device)
    for name, (case, all_inputs) in _composite_cases().items():
        results[f"composite/{name}"] = _composite(case, all_inputs, "triton", device)
    field = _field("triton")
    results["field/state"] = {k: tuple(v.shape) for k, v in field.state_dict().items()}
    results["field/render"] = _exchanged_field(_field("torch").state_dict(), "triton", device)
    from fedfields.fields.hashgrid_triton import check_launch

    check_launch(torch.device(device))  # 'auto''s one-off check passes where triton runs
    results["check_launch"] = True
    return results


# ------------------------------------------------------------------ the triton side


@pytest.fixture(scope="module")
def triton_results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """The triton side of every case: on CUDA here, else through the interpreter elsewhere."""
    if ON_GPU:
        return _run_triton("cuda")
    out = tmp_path_factory.mktemp("triton") / "results.pt"
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    process = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert process.returncode == 0, process.stderr[-4000:]
    return torch.load(out)


def _close(actual: Outputs, expected: Outputs, atol: float = 1e-5) -> None:
    assert actual.keys() == expected.keys()
    for name, value in expected.items():
        torch.testing.assert_close(actual[name], value, rtol=1e-5, atol=atol, msg=name)


@pytest.mark.parametrize("name", list(_hash_cases()))
def test_triton_hash_grid_equals_torch(name: str, triton_results: dict) -> None:
    settings, points = _hash_cases()[name]
    expected = _hash_grid(_encoding(settings, "torch"), points, REFERENCE)
    _close(triton_results[f"hash/{name}"], expected, atol=1e-5)
    assert expected["features"].shape == (len(points), settings["num_levels"] * settings[
        "features_per_level"
    ])  # fmt: skip
    if len(points):
        assert expected["grad_table"].abs().sum() > 0


@pytest.mark.parametrize("name", list(_composite_cases()))
def test_triton_packed_compositing_equals_torch(name: str, triton_results: dict) -> None:
    """Against the torch backend run in float64: in float32 its global cumulative sums lose
    more than the kernels' per-ray float64 sums (5e-5 on the opaque case's delta gradients)."""
    case, all_inputs = _composite_cases()[name]
    expected = _composite(case, all_inputs, "torch", REFERENCE, torch.float64)
    _close(triton_results[f"composite/{name}"], expected, atol=1e-5)
    torch.testing.assert_close(
        _composite(case, all_inputs, "torch", REFERENCE), expected, rtol=1e-4, atol=1e-4
    )
    if name == "no-samples":  # rays without samples show the background only
        torch.testing.assert_close(expected["rgb"], case["background"])


def test_triton_and_torch_fields_exchange_weights(triton_results: dict) -> None:
    field = _field("torch")
    assert triton_results["field/state"] == {
        k: tuple(v.shape) for k, v in field.state_dict().items()
    }
    expected = _exchanged_field(field.state_dict(), "torch", REFERENCE)
    assert expected["opacity"].min() > 0.0  # every ray met samples
    _close(triton_results["field/render"], expected, atol=1e-5)


# ------------------------------------------------------------------ where triton cannot run


@pytest.mark.skipif(ON_GPU, reason="a CUDA device is present here")
def test_run_config_triton_on_a_node_without_cuda_refuses(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    config = parse_app_config({"hash-backend": "triton"})
    with pytest.raises(RuntimeError, match="'triton' cannot run on cpu.*CUDA tensors"):
        global_field(config)
    with pytest.raises(RuntimeError, match="compositing backend 'triton' cannot run on cpu"):
        render_packed(*[torch.zeros(1)] * 2, torch.zeros(1, 3), torch.zeros(1),
                      torch.zeros(1, dtype=torch.long), 1, torch.zeros(3), "triton")  # fmt: skip


def test_default_backend_trains_and_renders_without_triton() -> None:
    """`import fedfields` and the default ('auto') field and renderer work with triton absent."""
    script = (
        "import sys; sys.modules['triton'] = None\n"
        "import torch\n"
        "from fedfields.config import FederatedConfig\n"
        "from fedfields.train.builders import global_field\n"
        "from fedfields.render.volume import render_packed\n"
        "field = global_field(FederatedConfig())\n"
        "field(torch.rand(5, 3), torch.rand(5, 3)).density.sum().backward()\n"
        "out, w = render_packed(torch.ones(2), torch.ones(2), torch.rand(2, 3), torch.ones(2),\n"
        "                       torch.tensor([0, 0]), 1, torch.zeros(3))\n"
        "print(field.config.encoding.implementation, round(float(out.opacity), 4))\n"
    )
    process = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert process.returncode == 0, process.stderr[-4000:]
    assert process.stdout.split() == ["auto", f"{1 - torch.exp(torch.tensor(-2.0)).item():.4f}"]


if __name__ == "__main__":
    torch.save(_run_triton("cpu"), sys.argv[1])


def test_auto_s_one_off_check_passes_where_triton_runs(triton_results: dict) -> None:
    assert triton_results["check_launch"] is True


def test_auto_falls_back_to_torch_with_one_warning_when_the_check_fails(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A device where triton imports but cannot compile or launch (no C compiler, a broken
    driver): 'auto' warns once and runs torch; an explicit 'triton' still refuses."""
    from fedfields.fields import encodings, hashgrid_triton
    from fedfields.render.volume import composite_backend

    def broken(device: torch.device) -> None:
        raise RuntimeError("Failed to find C compiler")

    monkeypatch.setattr(encodings, "triton_available", lambda: True)
    monkeypatch.setattr(encodings, "_TRITON_WORKS", {})
    monkeypatch.setattr(hashgrid_triton, "check_launch", broken)
    device = torch.device("cuda", 0)
    with pytest.warns(RuntimeWarning, match="triton cannot run on cuda:0 .*C compiler") as caught:
        chosen = [
            encodings.resolve_implementation(HashGridConfig(implementation="auto"), device),
            composite_backend("auto", device),
            encodings.resolve_implementation(HashGridConfig(implementation="auto"), device),
        ]
    assert chosen == ["torch", "torch", "torch"] and len(caught) == 1
    monkeypatch.setattr(encodings, "_TRITON_WORKS", {})
    monkeypatch.setattr(hashgrid_triton, "check_launch", lambda device: None)
    assert composite_backend("auto", device) == "triton"
    assert composite_backend("auto", torch.device("cpu")) == "torch"


def test_every_triton_launch_sits_inside_a_device_guard() -> None:
    """Triton launches on the current CUDA device: each `kernel[grid](...)` call is inside
    `with triton_launch_guard(tensor.device)`, which makes the tensors' device current."""
    import ast

    from fedfields.devices import triton_launch_guard

    for module in ("fedfields/fields/hashgrid_triton.py", "fedfields/render/composite_triton.py"):
        tree = ast.parse((ROOT / module).read_text())
        guarded: set[int] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.With) and "triton_launch_guard" in ast.unparse(node.items[0]):
                guarded |= {id(inner) for inner in ast.walk(node)}
        launches = [
            node for node in ast.walk(tree)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript)
        ]  # fmt: skip
        assert launches, module
        assert all(id(launch) in guarded for launch in launches), module
    assert triton_launch_guard(torch.device("cuda", 1)).idx == 1
    with triton_launch_guard(torch.device("cpu")):
        pass
