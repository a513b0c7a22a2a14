"""simulations/bench/gpu.py as a user runs it: on CPU, tiny, without Flower or Ray."""

from __future__ import annotations

import importlib.metadata
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from simulations.bench.gpu import Options, federation, main, parse, target_rows

ROOT = Path(__file__).resolve().parents[1]
BLOCKER = """
import importlib.abc, runpy, sys
class Blocker(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in ("flwr", "ray"):
            raise ImportError(f"blocked import of {name}: the GPU machine has no flwr or ray")
sys.meta_path.insert(0, Blocker())
sys.argv = ["gpu"] + sys.argv[1:]
runpy.run_module("simulations.bench.gpu", run_name="__main__")
"""
DEVICE_IMAGE = """
    absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs
    botorch build certifi charset-normalizer chex click cloudpickle cmake colorama contourpy
    coverage cuda-bindings cuda-core cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython
    diffrax e3nn einops equinox etils execnet filelock flatbuffers flax fonttools formulaic
    frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub
    humanize hypothesis idna imageio iniconfig interface-meta jax jax-cuda13-pjrt
    jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib kiwisolver lazy-loader lightning
    lightning-utilities linear-operator lineax llvmlite lxml markdown markdown-it-py
    markupsafe matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict
    multipledispatch mypy-extensions nanobind narwhals networkx ninja numba numba-cuda numpy
    numpyro nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime
    nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver
    nvidia-cusparse nvidia-cusparselt-cu13 nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink
    nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime onnxscript
    opencv-python-headless optax opt-einsum opt-einsum-fx optimistix orbax-checkpoint
    packaging pandas pathspec patsy peft pillow pip pluggy portalocker prometheus-client
    propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments pyparsing pyproject-hooks
    pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout
    pytest-xdist python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu
    safetensors scikit-build-core scikit-image scikit-learn scipy seaborn sentencepiece
    sentence-transformers setuptools shellingham simplejson six sortedcontainers statsmodels
    sympy tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl tifffile
    tiktoken timm tokenizers toolz torch torchaudio torchdiffeq torch-geometric torchmetrics
    torchvision tqdm transformers treescope triton typer typing-extensions typing-inspect
    urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray xxhash yarl zipp
""".split()
"""The GPU machine's Python distributions (its CUDA image, as the device docs listed them on
2026-11-17): no flwr, ray, cryptography or pycryptodome."""
WHEELS = ROOT / "simulations" / "bench" / "gpu_wheels.txt"
ONLY_THESE = """
import os, runpy, sys
shadow, blocked = sys.argv[1], set(sys.argv[2].split(","))
for index, entry in enumerate(sys.path):  # site-packages as if `blocked` were never installed
    if entry.endswith("site-packages"):
        os.makedirs(shadow)
        for item in os.listdir(entry):
            if item.split(".")[0] not in blocked:
                os.symlink(os.path.join(entry, item), os.path.join(shadow, item))
        sys.path[index] = shadow
sys.argv = ["gpu"] + sys.argv[3:]
runpy.run_module("simulations.bench.gpu", run_name="__main__")
"""


def test_the_smoke_run_prints_one_table_and_says_why_gpu_rows_are_missing(
    crowd_dir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "bench"
    command = [sys.executable, "-c", BLOCKER, "--smoke", "--crowd", str(crowd_dir),
               "--users", "1", "--methods", "fednerf", "--backends", "torch", "triton",
               "--device", "cpu", "--profile", "--out", str(out)]  # fmt: skip
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    table = (out / "table.md").read_text()
    assert done.stdout.strip().endswith(table.strip())  # the table is printed last
    rows = {row["what"]: row for row in json.loads((out / "table.json").read_text())["rows"]}
    torch_row = rows["centralised 25x25, torch, dynamic"]
    steps_per_s, _, rest = torch_row["value"].partition(" steps/s")
    assert float(steps_per_s) > 0 and rest.endswith(" dB")
    triton_row = rows["centralised 25x25, triton, dynamic"]["value"]
    assert triton_row.startswith("unavailable: RuntimeError") and "cannot run on cpu" in triton_row
    gpu_round = rows["one user's one-epoch FedNeRF round, GPU, dynamic"]["value"]
    assert gpu_round == "unavailable: no CUDA device (device cpu)"
    cpu_round = rows["one user's one-epoch FedNeRF round, CPU, 2 threads, dynamic"]
    assert cpu_round["value"].endswith(" s")
    fednerf = rows["1-user round, FedNeRF (FedAvg, global field only), dynamic"]["value"]
    assert fednerf.startswith("unavailable: ImportError: blocked import of flwr")  # (c) needs it
    targets = [row for what, row in rows.items() if what.startswith("target:")]
    assert len(targets) == 5  # CPU's default step modes: the dynamic step alone
    assert all(row["verdict"] == "n/a: not a GPU run (device cpu)" for row in targets)
    assert (out / "bench.log").is_file()
    profile = out / "profile" / "centralised-torch-dynamic.txt"
    assert profile.read_text().count("aten::") > 5
    assert (out / "profile" / "local-round-cpu.txt").is_file()


def _distribution(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _carried() -> set[str]:
    lines = WHEELS.read_text().splitlines()
    return {_distribution(line.split("==")[0]) for line in lines if line and line[0] != "#"}


def _modules_off_the_device() -> set[str]:
    """Top-level modules installed here whose distributions are neither in the GPU image nor
    carried: what the bench must not import there."""
    allowed = {_distribution(name) for name in DEVICE_IMAGE} | _carried() | {"fedfields"}
    owners = importlib.metadata.packages_distributions()
    return {
        module
        for module, distributions in owners.items()
        if not any(_distribution(d) in allowed for d in distributions)
    }


def test_the_carried_wheels_are_all_the_federated_rounds_need_on_the_device(
    crowd_dir: Path, tmp_path: Path
) -> None:
    """The bench with every module off the GPU image blocked but the wheels of
    gpu_wheels.txt: the DecentNeRF round runs (Flower in process, static step)."""
    blocked = _modules_off_the_device()
    assert {"ray", "dp_accounting", "uvicorn"} <= blocked  # installed here, not there
    assert not blocked & {"flwr", "cryptography", "Crypto", "grpc_health", "torch", "skimage"}
    out = tmp_path / "bench"
    command = [sys.executable, "-c", ONLY_THESE, str(tmp_path / "site"),
               ",".join(sorted(blocked)), "--smoke",
               "--crowd", str(crowd_dir), "--methods", "decentnerf", "--backends", "torch",
               "--step-modes", "static", "--seconds", "0.5", "--device", "cpu",
               "--out", str(out)]  # fmt: skip
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {row["what"]: row for row in json.loads((out / "table.json").read_text())["rows"]}
    decent = rows["2-user round, DecentNeRF (learned alpha), static"]
    assert decent["value"].endswith(" s"), decent
    assert float(decent["value"].removesuffix(" s")) > 0
    counts = re.search(r", (\d+) of (\d+) rays dropped \(overflow\)", decent["note"])
    assert counts is not None and 0 <= int(counts[1]) <= int(counts[2]) and int(counts[2]) > 0


def test_the_reproduce_command_needs_nothing_but_the_image_and_the_carried_wheels(
    tmp_path: Path,
) -> None:
    """Issue 58's GPU calls: `simulations.reproduce decentnerf-table1` (toy scale, one seed,
    one round), then the objectives bench on the crowd it built, each with every module
    blocked that is neither on the GPU image nor carried."""
    blocked = ",".join(sorted(_modules_off_the_device()))
    code = ONLY_THESE.replace("simulations.bench.gpu", "simulations.reproduce")
    out = tmp_path / "reproduce"
    command = [sys.executable, "-c", code, str(tmp_path / "site"), blocked,
               "decentnerf-table1", "--scale", "toy", "--seeds", "0", "--run-config",
               "num-server-rounds=1", "--no-progress", "--out", str(out)]  # fmt: skip
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    record = json.loads((out / "table.json").read_text())
    assert record["scale"] == "toy" and record["differs"].endswith("num-server-rounds=1")
    for setting in ("fednerf", "decentnerf"):
        assert (out / setting / "seed-0" / "summary.json").is_file()
    code = ONLY_THESE.replace("simulations.bench.gpu", "simulations.bench.novel_blender_objectives")
    objectives = tmp_path / "objectives"
    command = [sys.executable, "-c", code, str(tmp_path / "site-2"), blocked, "--crowds",
               str(out / "crowds" / "seed-0"), "--scale", "toy", "--objectives", "nerfw",
               "--steps", "2", "--device", "cpu", "--out", str(objectives)]  # fmt: skip
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "| heldout-psnr |" in (objectives / "table.md").read_text()


def _options(**overrides: object) -> Options:
    values = dict(device="cuda", seconds=30.0, resolution=200, eval_views=20,
                  target_samples=None, backends=("torch", "triton"),
                  step_modes=("dynamic", "cuda-graph"), crowd=None,
                  crowd_downscale=1.0, users=16, rounds=2, max_local_steps=400,
                  methods=("fednerf", "decentnerf"), cpu_threads=2, repeats=3, run_config="",
                  profile=False, profile_steps=8, out=Path("."))  # fmt: skip
    return Options(**{**values, **overrides})


def test_targets_are_ratios_of_the_run_s_own_figures() -> None:
    import torch

    found = {
        "centralised": {
            "dynamic": {"torch": {"steps_per_s": 80.0, "psnr": 32.0},
                        "triton": {"steps_per_s": 240.0, "psnr": 32.5}},
            "cuda-graph": {"torch": {"steps_per_s": 160.0, "psnr": 32.8},
                           "triton": {"steps_per_s": 400.0, "psnr": 33.5}},
        },  # fmt: skip
        "federated": {
            "dynamic": {"fednerf": {"round_seconds": 2.5}, "decentnerf": {"round_seconds": 3.0}},
            "cuda-graph": {"fednerf": {"round_seconds": 1.5},
                           "decentnerf": {"round_seconds": 4.5}},
        },  # fmt: skip
        "local": {"cpu": {"seconds": 10.0},
                  "gpu": {"dynamic": {"seconds": 0.5}, "cuda-graph": {"seconds": 0.25}}},
    }  # fmt: skip
    rows = target_rows(_options(), torch.device("cuda"), found)
    verdicts = {row.what: (row.value, row.verdict) for row in rows}
    assert verdicts == {
        "target: triton (dynamic) / torch (dynamic) centralised steps/s": ("3.00x", "missed"),
        "target: lego PSNR after 30 s (triton, dynamic)": ("32.50 dB", "missed"),
        "target: FedNeRF round (dynamic)": ("2.50 s", "missed"),
        "target: DecentNeRF round (dynamic)": ("3.00 s", "met"),
        "target: GPU local round (dynamic) vs CPU (dynamic)": ("20.00x", "missed"),
        # the captured step against the torch backend's dynamic step (the baseline)
        "target: triton (cuda-graph) / torch (dynamic) centralised steps/s": ("5.00x", "met"),
        "target: lego PSNR after 30 s (triton, cuda-graph)": ("33.50 dB", "met"),
        "target: FedNeRF round (cuda-graph)": ("1.50 s", "met"),
        "target: DecentNeRF round (cuda-graph)": ("4.50 s", "missed"),
        "target: GPU local round (cuda-graph) vs CPU (dynamic)": ("40.00x", "met"),
    }
    notes = {row.what: row.note for row in rows}
    assert notes["target: triton (cuda-graph) / torch (dynamic) centralised steps/s"] == (
        "triton / torch both cuda-graph: 2.50x"
    )
    smaller = target_rows(_options(seconds=5.0), torch.device("cuda"), found)
    assert all(row.verdict.startswith("n/a: settings differ") for row in smaller)
    found["centralised"]["cuda-graph"]["triton"] = {"error": "unavailable: RuntimeError: x"}
    rows = target_rows(_options(step_modes=("cuda-graph",)), torch.device("cuda"), found)
    assert rows[0].verdict == "not measured" and rows[1].what.endswith("(torch, cuda-graph)")
    assert len(rows) == 5  # DecentNeRF's round in the captured step too


@pytest.mark.parametrize("flag", ["--seconds", "--users", "--rounds"])
def test_non_positive_sizes_are_refused(flag: str, tmp_path: Path) -> None:
    command = [sys.executable, "-m", "simulations.bench.gpu", flag, "0", "--out", str(tmp_path)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert f"{flag} must be positive, got 0" in done.stderr


def test_step_modes_default_to_what_the_device_runs_and_the_round_takes_them(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    assert parse(["--device", "cpu", "--out", str(tmp_path)]).step_modes == ("dynamic",)
    argv = ["--device", "cpu", "--step-modes", "cuda-graph", "static", "cuda-graph",
            "--out", str(tmp_path)]  # fmt: skip
    options = parse(argv)
    assert options.step_modes == ("cuda-graph", "static")
    _, settings = federation(options, rounds=1, mode="static")
    assert settings.local(1, 0, personal=False).step_mode == "static"
    with pytest.raises(SystemExit) as refused:
        parse(["--run-config", "cuda-graph=true", "--out", str(tmp_path)])
    assert refused.value.code == 2
    assert "'cuda-graph' is set per part by --step-modes" in capsys.readouterr().err


def test_without_a_crowd_the_table_still_prints(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    out = tmp_path / "bench"
    missing = tmp_path / "no-crowd"
    argv = ["--smoke", "--crowd", str(missing), "--backends", "torch", "--device", "cpu",
            "--seconds", "0.5", "--methods", "fednerf", "decentnerf",
            "--step-modes", "dynamic", "static", "cuda-graph", "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    rows = {row["what"]: row for row in json.loads((out / "table.json").read_text())["rows"]}
    assert rows["centralised 25x25, torch, dynamic"]["value"].endswith(" dB")
    assert rows["centralised 25x25, torch, static"]["value"].endswith(" dB")
    assert " rays dropped (overflow)" in rows["centralised 25x25, torch, static"]["note"]
    assert rows["centralised 25x25, torch, cuda-graph"]["value"] == (
        "unavailable: step mode cuda-graph needs a CUDA device (device cpu)"
    )
    for what in ("one user's one-epoch FedNeRF round, CPU, 2 threads, dynamic",
                 "2-user round, FedNeRF (FedAvg, global field only), dynamic",
                 "2-user round, FedNeRF (FedAvg, global field only), static",
                 "2-user round, DecentNeRF (learned alpha), cuda-graph"):  # fmt: skip
        assert rows[what]["value"].startswith("unavailable: no crowd"), rows[what]
    gpu_round = rows["one user's one-epoch FedNeRF round, GPU, static"]["value"]
    assert gpu_round == "unavailable: no CUDA device (device cpu)"
    whats = list(rows)  # each backend's step modes side by side
    assert whats.index("centralised 25x25, torch, static") == 1 + whats.index(
        "centralised 25x25, torch, dynamic"
    )
    targets = [what for what in rows if what.startswith("target:")]
    assert len(targets) == 3 * 5  # every target in every step mode
    assert capsys.readouterr().out.strip().endswith((out / "table.md").read_text().strip())
