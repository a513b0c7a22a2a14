"""Benchmark: fedfields on one GPU against issue 34's targets, printed as one table.

Measured side by side in one run: (a) centralised hash-grid training on lego for --seconds
per hash-grid backend (torch, triton, tcnn; one that cannot run says why), with steps/s,
rays/s and PSNR on --eval-views held-out views; (b) one user's one-epoch FedNeRF local
round (novel_blender's in-process path) on the GPU and on --cpu-threads CPU threads (2: a
2-core machine); (c) one --users Novel Blender round of FedNeRF, DecentNeRF(-L) and
DecentNeRF (novel_blender_federation.run_federated, through fedfields.flower's strategies
in process; the last of --rounds is timed, so DecentNeRF's gradient query counts); (d) peak
GPU memory per part. (a), (b)'s GPU round and (c) run once per --step-modes (issue 44:
dynamic, static, cuda-graph; default dynamic and cuda-graph on CUDA, dynamic elsewhere), the
federated ones through LocalTrainConfig.step_mode, the run-config's `cuda-graph`
(DecentNeRF's global+personal step included). The targets follow as ratios of this
run's own figures, each met or missed, per step mode; --profile writes torch.profiler tables
of a few steps per path under --out/profile/. (a), (b) and (d) import neither Flower nor Ray;
(c) needs Flower (not Ray), and where it is absent its rows say so.

The prepared device call (one GPU; the repo's working tree travels, data/lego with it; build
the 100x100 crowd here first, 4.6 MB, and download the wheels (c) needs there, 16 MB, as
docs/BENCHMARKS.md's GPU section prints; carry both):

    fedfields data crowd --scene data/lego --downscale 2 --out runs/crowd_lego_nb_16x5_ds2
    pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp
        --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 -d .whl
        -r simulations/bench/gpu_wheels.txt
    run(command="python3 -m pip install -q --no-index --no-deps --no-compile --target
        /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site && python3 -m simulations.bench.gpu
        --crowd runs/crowd_lego_nb_16x5_ds2 --backends torch triton --methods fednerf
        decentnerf --step-modes dynamic cuda-graph --out $OUT/gpu --profile",
        carry=["runs/crowd_lego_nb_16x5_ds2", ".whl"], timeout_s=560)

On CPU (what the tests run): python -m simulations.bench.gpu --smoke --crowd DIR --out DIR
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

import torch

from fedfields import atomic
from fedfields.config import FederatedConfig
from fedfields.data import Scene, holdout_indices, load_scene
from fedfields.data.crowd import CrowdData
from fedfields.devices import canonical_device, resolve_device
from fedfields.fields import Field
from fedfields.metrics import psnr
from fedfields.render import OccupancyGrid, RenderConfig, render_image
from fedfields.train.builders import global_field
from fedfields.train.centralised import Setup, default_setup, train
from fedfields.train.federated import LocalTrainConfig, local_train
from fedfields.train.static_step import STEP_MODES, StepMode
from simulations.bench import novel_blender_setup

LEGO = Path(__file__).resolve().parents[2] / "data" / "lego"
BACKENDS = ("torch", "triton", "tcnn")
METHODS = ("fednerf", "decentnerf-l", "decentnerf")
TARGETS = {  # issue 34, on one H100
    "speedup": 4.0,  # triton / torch centralised steps/s
    "psnr": 33.0,  # lego 200x200 after 30 s, unseen views
    "fednerf": 2.0,  # seconds per 16-user round at 100x100
    "decentnerf": 4.0,
    "gpu_vs_cpu": 30.0,  # one local round, GPU vs 2 CPU cores
}
log = logging.getLogger("bench.gpu")


@dataclass(frozen=True)
class Options:
    """What to measure and how large; `target_sized` says whether issue 34's targets apply."""

    device: str
    seconds: float
    resolution: int
    eval_views: int
    target_samples: int | None
    backends: tuple[str, ...]
    step_modes: tuple[StepMode, ...]
    crowd: Path | None
    crowd_downscale: float
    users: int
    rounds: int
    max_local_steps: int
    methods: tuple[str, ...]
    cpu_threads: int
    repeats: int
    run_config: str
    profile: bool
    profile_steps: int
    out: Path

    @property
    def target_sized(self) -> bool:
        return (self.seconds, self.resolution, self.users) == (30.0, 200, 16) and (
            self.target_samples is None
        )


@dataclass
class Row:
    """One line of the table: a measurement, or a target with its verdict."""

    what: str
    value: str
    target: str = ""
    verdict: str = ""
    note: str = ""


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextmanager
def timed(device: torch.device) -> Iterator[dict[str, float]]:
    """Wall seconds of the block with the device's queue drained at both ends."""
    result: dict[str, float] = {}
    synchronize(device)
    start = time.perf_counter()
    yield result
    synchronize(device)
    result["seconds"] = time.perf_counter() - start


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_mib(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    return torch.cuda.max_memory_allocated(device) / 2**20


def write_profile(options: Options, name: str, device: torch.device, work: Callable[[], Any]):
    """torch.profiler table (top ops by self time) of `work` under --out/profile/NAME.txt."""
    if not options.profile:
        return
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        work()
        synchronize(device)
    key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    folder = options.out / "profile"
    folder.mkdir(parents=True, exist_ok=True)
    table = prof.key_averages().table(sort_by=key, row_limit=30)
    atomic.write_text(folder / f"{name}.txt", table + "\n")


# ---------------------------------------------------------------- (a) centralised training


def lego_split(resolution: int, eval_views: int) -> tuple[Scene, Scene]:
    """Lego at `resolution` (its files are 200x200): training views and held-out views (every
    4th view: 20 of 80), the first `eval_views` of them scored."""
    scene = load_scene(LEGO, downscale=200 / resolution, background=(1.0, 1.0, 1.0))
    train_ids, heldout_ids = holdout_indices(len(scene), 4)
    return scene.subset(train_ids), scene.subset(heldout_ids[:eval_views])


def heldout_psnr(
    field: Field, views: Scene, settings: RenderConfig, grid: OccupancyGrid | None
) -> float:
    field.eval()
    values = [
        psnr(render_image(field, views.cameras, v, settings, grid).rgb.clamp(0, 1), image)
        for v, image in enumerate(views.images)
    ]
    field.train()
    return statistics.fmean(values)


def mode_unavailable(mode: StepMode, device: torch.device) -> str | None:
    """Why `mode` cannot run on `device` (a captured step needs CUDA), else None."""
    if mode == "cuda-graph" and device.type != "cuda":
        return f"unavailable: step mode cuda-graph needs a CUDA device (device {device})"
    return None


def centralised(
    options: Options, device: torch.device, backend: str, mode: StepMode
) -> dict[str, Any]:
    """Warm up on CUDA (Triton compiles on first call), then train a fresh field for --seconds
    with step mode `mode`."""
    train_scene, eval_scene = lego_split(options.resolution, options.eval_views)

    overrides: dict[str, Any] = {"progress": False, "device": str(device), "step_mode": mode}
    if options.target_samples is not None:
        overrides["target_samples"] = options.target_samples

    def fresh() -> Setup:
        """The CLI's hash-grid setup, this backend for the grid and (triton) compositing."""
        setup = default_setup("hashgrid", train_scene, implementation=backend)
        composite = "triton" if backend == "triton" else "torch"
        setup.render_config = replace(setup.render_config, composite=composite)
        return setup

    if device.type == "cuda":
        setup = fresh()
        warm = setup.train_config(steps=5, **overrides)
        train(setup.field, train_scene, warm, setup.render_config, setup.occupancy)
    setup = fresh()
    config = setup.train_config(minutes=options.seconds / 60, **overrides)
    reset_peak(device)
    with timed(device) as clock:
        result = train(setup.field, train_scene, config, setup.render_config, setup.occupancy)
    score = heldout_psnr(setup.field, eval_scene, setup.render_config, setup.occupancy)
    write_profile(
        options,
        f"centralised-{backend}-{mode}",
        device,
        lambda: train(
            setup.field,
            train_scene,
            replace(config, minutes=None, steps=options.profile_steps),
            setup.render_config,
            setup.occupancy,
        ),
    )
    return {
        "steps": result.steps,
        "seconds": clock["seconds"],
        "steps_per_s": result.steps / clock["seconds"],
        "rays_per_s": result.rays / clock["seconds"],
        "samples_per_ray": result.samples / max(result.rays, 1),
        "rays": result.rays,
        "dropped_rays": result.dropped_rays,
        "psnr": score,
        "peak_mib": peak_mib(device),
    }


# ---------------------------------------------------------------- (b) one user's local round


def load_crowd(options: Options) -> CrowdData:
    """The crowd's first --users users; ValueError says why there is none (the parts that
    need it then report it, and the table still prints)."""
    if options.crowd is None:
        raise ValueError("--crowd is required: build one with `fedfields data crowd`")
    data = CrowdData.load(options.crowd, options.crowd_downscale)
    if len(data.users) < options.users:
        raise ValueError(f"--users {options.users}: {options.crowd} holds {len(data.users)}")
    return replace(data, users=data.users[: options.users])


def federation(
    options: Options, rounds: int, mode: StepMode
) -> tuple[FederatedConfig, novel_blender_setup.Settings]:
    """The field's run-config and novel_blender's settings for `rounds` rounds of local steps
    in step mode `mode` (the run-config's `cuda-graph` is --step-modes' to set)."""
    run_config = novel_blender_setup.parse_run_config(options.run_config)
    config = FederatedConfig.from_run_config(run_config)
    settings = novel_blender_setup.Settings(
        rounds=rounds, max_steps=options.max_local_steps, step_mode=mode
    )
    if options.target_samples is not None:
        settings = replace(settings, target_samples=options.target_samples)
    return config, settings


def local_round(
    data: CrowdData,
    config: FederatedConfig,
    settings: novel_blender_setup.Settings,
    device: torch.device,
) -> tuple[float, Callable[[], Any]]:
    """Seconds of user 0's one-epoch FedNeRF round (global field only) from a fresh field on
    `device`, and a callable that runs it again (for the profile)."""
    user = data.users[0]
    render = novel_blender_setup.render_config(config, user.scene)

    def run() -> None:
        torch.manual_seed(settings.seed)
        model = global_field(config)
        local = replace(settings.local(1, 0, personal=False), device=str(device))
        local_train(model, user.scene, local, render, OccupancyGrid(model.aabb))

    with timed(device) as clock:
        run()
    return clock["seconds"], run


def gpu_local_round(
    options: Options, device: torch.device, data: CrowdData, mode: StepMode
) -> dict[str, Any]:
    """User 0's round on the GPU in step mode `mode`: a warm-up, then the median of --repeats."""
    config, settings = federation(options, 1, mode)
    local_round(data, config, settings, device)  # warm-up: Triton compiles here
    reset_peak(device)
    runs = [local_round(data, config, settings, device) for _ in range(options.repeats)]
    write_profile(options, f"local-round-gpu-{mode}", device, runs[0][1])
    return {"seconds": statistics.median(seconds for seconds, _ in runs),
            "peak_mib": peak_mib(device)}  # fmt: skip


def cpu_local_round(options: Options, data: CrowdData) -> dict[str, Any]:
    """User 0's round with the dynamic step on --cpu-threads CPU threads (one run: it is the
    slow one), the reference of every step mode's GPU round."""
    config, settings = federation(options, 1, "dynamic")
    threads = torch.get_num_threads()
    torch.set_num_threads(options.cpu_threads)
    try:
        cpu = torch.device("cpu")
        seconds, again = local_round(data, config, settings, cpu)
        write_profile(options, "local-round-cpu", cpu, again)
    finally:
        torch.set_num_threads(threads)
    return {"seconds": seconds}


# ---------------------------------------------------------------- (c) federated rounds


def federated_round(
    options: Options, device: torch.device, data: CrowdData, method: str, mode: StepMode
) -> dict[str, Any]:
    """--rounds rounds of `method` with every user in step mode `mode`; the last round's
    seconds (local training, DecentNeRF's gradient query, aggregation and the bench's
    per-round scoring)."""
    # Imported here: the federation runs through Flower, which the other parts do without.
    from simulations.bench.novel_blender_federation import run_federated

    config, settings = federation(options, options.rounds, mode)
    reset_peak(device)
    with timed(device):
        result = run_federated(method, data, config, settings)
    ends = [0.0] + [record["seconds"] for record in result["history"]]
    return {
        "round_seconds": ends[-1] - ends[-2],
        "train_seconds_per_round": result["train-seconds"] / options.rounds,
        "clean_psnr": result["history"][-1]["clean-psnr"],
        "rays": result["rays-drawn"],
        "dropped_rays": result["rays-dropped"],
        "peak_mib": peak_mib(device),
    }


# ---------------------------------------------------------------- the table


def verdict(value: float | None, target: float, at_least: bool, why_not: str | None) -> str:
    """met / missed, or why the target does not apply to this run."""
    if why_not is not None:
        return f"n/a: {why_not}"
    if value is None:
        return "not measured"
    return "met" if (value >= target if at_least else value <= target) else "missed"


def target_rows(options: Options, device: torch.device, found: dict[str, Any]) -> list[Row]:
    """Issue 34's targets as ratios of this run's figures, once per step mode."""
    why_not = None
    if device.type != "cuda":
        why_not = f"not a GPU run (device {device})"
    elif not options.target_sized:
        why_not = "settings differ from the target's (30 s, 200x200, 16 users)"
    rows = []
    for mode in options.step_modes:
        rows += mode_target_rows(options, mode, found, why_not)
    return rows


def mode_target_rows(
    options: Options, mode: StepMode, found: dict[str, Any], why_not: str | None
) -> list[Row]:
    """The targets for step mode `mode`: triton in this mode against the torch backend's
    dynamic step (the baseline), lego's PSNR, the rounds, the GPU round against the CPU's
    dynamic one."""
    centralised = found.get("centralised", {})
    central = centralised.get(mode, {})
    torch_rate = centralised.get("dynamic", {}).get("torch", {}).get("steps_per_s")
    triton_rate = central.get("triton", {}).get("steps_per_s")
    speedup = triton_rate / torch_rate if torch_rate and triton_rate else None
    same_mode_torch = central.get("torch", {}).get("steps_per_s")
    kernels_only = ""
    if mode != "dynamic" and same_mode_torch and triton_rate:
        kernels_only = f"triton / torch both {mode}: {triton_rate / same_mode_torch:.2f}x"
    default = "triton" if "psnr" in central.get("triton", {}) else "torch"
    lego = central.get(default, {}).get("psnr")
    rounds = found.get("federated", {}).get(mode, {})
    fednerf = rounds.get("fednerf", {}).get("round_seconds")
    local = found.get("local", {})
    gpu_seconds = local.get("gpu", {}).get(mode, {}).get("seconds")
    cpu_seconds = local.get("cpu", {}).get("seconds")
    ratio = cpu_seconds / gpu_seconds if gpu_seconds and cpu_seconds else None
    threads = f"CPU: torch.set_num_threads({options.cpu_threads}) on this machine"

    def fmt(value: float | None, unit: str) -> str:
        return "-" if value is None else f"{value:.2f}{unit}"

    rows = [
        Row(
            f"target: triton ({mode}) / torch (dynamic) centralised steps/s",
            fmt(speedup, "x"),
            ">= 4x",
            verdict(speedup, TARGETS["speedup"], True, why_not),
            kernels_only,
        ),  # fmt: skip
        Row(
            f"target: lego PSNR after {options.seconds:g} s ({default}, {mode})",
            fmt(lego, " dB"),
            ">= 33 dB",
            verdict(lego, TARGETS["psnr"], True, why_not),
        ),  # fmt: skip
        Row(
            f"target: FedNeRF round ({mode})",
            fmt(fednerf, " s"),
            "<= 2 s",
            verdict(fednerf, TARGETS["fednerf"], False, why_not),
        ),  # fmt: skip
    ]
    decent = rounds.get("decentnerf", {}).get("round_seconds")
    rows.append(
        Row(
            f"target: DecentNeRF round ({mode})",
            fmt(decent, " s"),
            "<= 4 s",
            verdict(decent, TARGETS["decentnerf"], False, why_not),
        )  # fmt: skip
    )
    rows.append(
        Row(
            f"target: GPU local round ({mode}) vs CPU (dynamic)",
            fmt(ratio, "x"),
            ">= 30x",
            verdict(ratio, TARGETS["gpu_vs_cpu"], True, why_not),
            threads,
        )  # fmt: skip
    )
    return rows


def measurement_rows(options: Options, found: dict[str, Any]) -> list[Row]:
    """One row per measured (or unavailable) path, each backend's and method's step modes
    side by side."""
    rows = []
    side = f"{options.resolution}x{options.resolution}"
    central = found.get("centralised", {})
    for backend in options.backends:
        for mode in options.step_modes:
            entry = central.get(mode, {}).get(backend)
            if entry is None:
                continue
            what = f"centralised {side}, {backend}, {mode}"
            if "error" in entry:
                rows.append(Row(what, entry["error"]))
                continue
            value = (
                f"{entry['steps_per_s']:.3g} steps/s, {entry['rays_per_s'] / 1e3:.0f}k rays/s, "
                f"{entry['psnr']:.2f} dB"
            )
            note = (
                f"{entry['steps']} steps in {entry['seconds']:.1f} s, "
                f"{entry['samples_per_ray']:.1f} samples/ray, {options.eval_views} held-out views"
            )
            if mode != "dynamic":  # rays whose samples overflowed the static step's buffer
                note += f", {entry['dropped_rays']} of {entry['rays']} rays dropped (overflow)"
            rows.append(Row(what, value, note=note + mib(entry.get("peak_mib"))))
    local = found.get("local", {})
    labelled = [(f"GPU, {mode}", local.get("gpu", {}).get(mode)) for mode in options.step_modes]
    labelled.append((f"CPU, {options.cpu_threads} threads, dynamic", local.get("cpu")))
    for label, entry in labelled:
        what = f"one user's one-epoch FedNeRF round, {label}"
        if entry is None:
            continue
        if "error" in entry:
            rows.append(Row(what, entry["error"]))
            continue
        note = mib(entry.get("peak_mib")).lstrip(", ")
        rows.append(Row(what, f"{entry['seconds']:.2f} s", note=note))
    federated = found.get("federated", {})
    for method in options.methods:
        for mode in options.step_modes:
            entry = federated.get(mode, {}).get(method)
            if entry is None:
                continue
            what = f"{options.users}-user round, {novel_blender_setup.LABELS[method]}, {mode}"
            if "error" in entry:
                rows.append(Row(what, entry["error"]))
                continue
            note = (
                f"last of {options.rounds} rounds; local training "
                f"{entry['train_seconds_per_round']:.2f} s/round; clean PSNR "
                f"{entry['clean_psnr']:.2f} dB"
            )
            if mode != "dynamic":  # rays whose samples overflowed the static step's buffer
                note += f", {entry['dropped_rays']} of {entry['rays']} rays dropped (overflow)"
            rows.append(
                Row(what, f"{entry['round_seconds']:.2f} s", note=note + mib(entry.get("peak_mib")))
            )
    if found.get("peak_mib") is not None:
        rows.append(Row("peak GPU memory (whole run)", f"{found['peak_mib']:.0f} MiB"))
    return rows


def mib(value: float | None) -> str:
    return "" if value is None else f", peak {value:.0f} MiB"


def markdown(rows: list[Row]) -> str:
    lines = ["| what | value | target | verdict | note |", "|---|---|---|---|---|"]
    lines += [f"| {r.what} | {r.value} | {r.target} | {r.verdict} | {r.note} |" for r in rows]
    return "\n".join(lines)


# ---------------------------------------------------------------- running it


def attempt(
    found: dict[str, Any], key: str, work: Callable[[], dict[str, Any]], label: str = ""
) -> None:
    """Store `work()`'s figures under `key`, or why it could not run (the rest still runs);
    `label` names the part in the log."""
    name = f"{label} {key}".strip()
    try:
        found[key] = work()
    except Exception as error:  # one broken path must not cost the GPU visit
        log.error("%s failed:\n%s", name, traceback.format_exc())
        found[key] = {"error": f"unavailable: {type(error).__name__}: {error}"}
    log.info("%s: %s", name, json.dumps(found[key]))


def run(options: Options) -> tuple[list[Row], dict[str, Any]]:
    device = resolve_device(options.device)
    found: dict[str, Any] = {"device": str(device)}
    if device.type == "cuda":
        found["card"] = torch.cuda.get_device_name(device)
        torch.cuda.reset_peak_memory_stats(device)
    central: dict[str, dict[str, Any]] = {mode: {} for mode in options.step_modes}
    for backend in options.backends:
        for mode in options.step_modes:
            why = mode_unavailable(mode, device)
            if why is not None:
                central[mode][backend] = {"error": why}
                continue
            work = partial(centralised, options, device, backend, mode)
            attempt(central[mode], backend, work, f"centralised {mode}")
    found["centralised"] = central
    try:  # inside the guard: without a crowd the other parts say so and the table prints
        data, no_crowd = load_crowd(options), None
    except Exception as error:
        log.error("crowd failed to load:\n%s", traceback.format_exc())
        data, no_crowd = None, f"unavailable: no crowd ({type(error).__name__}: {error})"
    gpu: dict[str, Any] = {}
    local: dict[str, Any] = {"gpu": gpu}
    for mode in options.step_modes:
        if device.type != "cuda":
            gpu[mode] = {"error": f"unavailable: no CUDA device (device {device})"}
        elif data is None:
            gpu[mode] = {"error": no_crowd}
        else:
            attempt(gpu, mode, partial(gpu_local_round, options, device, data, mode), "local GPU")
    if data is None:
        local["cpu"] = {"error": no_crowd}
    else:
        attempt(local, "cpu", partial(cpu_local_round, options, data), "local")
    found["local"] = local
    federated: dict[str, dict[str, Any]] = {mode: {} for mode in options.step_modes}
    trains_on = LocalTrainConfig(steps=1).device
    for method in options.methods:
        for mode in options.step_modes:
            why = mode_unavailable(mode, device)
            if data is None:
                federated[mode][method] = {"error": no_crowd}
            elif why is not None:
                federated[mode][method] = {"error": why}
            elif canonical_device(trains_on) != canonical_device(device):
                federated[mode][method] = {"error": f"unavailable: run_federated trains on "
                                                    f"{trains_on!r}, not {device}"}  # fmt: skip
            else:
                work = partial(federated_round, options, device, data, method, mode)
                attempt(federated[mode], method, work, f"federated {mode}")
    found["federated"] = federated
    if device.type == "cuda":  # each part resets the peak: the run's is the largest part's
        parts = [*gpu.values()]
        parts += [entry for per_mode in (central, federated) for entry in per_mode.values()]
        peaks = [part.get("peak_mib") for part in parts]
        found["peak_mib"] = max((peak for peak in peaks if peak is not None), default=None)
    rows = measurement_rows(options, found) + target_rows(options, device, found)
    return rows, found


SMOKE = {"seconds": 2.0, "resolution": 25, "eval_views": 2, "target_samples": 1 << 11,
         "users": 2, "rounds": 2, "max_local_steps": 3, "repeats": 1, "profile_steps": 2,
         "run_config": "hash-levels=4 hash-log2-size=12"}  # fmt: skip


def default_step_modes(device: str) -> tuple[StepMode, ...]:
    """Without and with the captured step where CUDA runs; the dynamic step elsewhere."""
    return ("dynamic", "cuda-graph") if resolve_device(device).type == "cuda" else ("dynamic",)


def parse(argv: list[str] | None) -> Options:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="auto", help="auto (CUDA when visible), cpu, cuda:N")
    parser.add_argument("--seconds", type=float, help="centralised budget per backend (30)")
    parser.add_argument("--resolution", type=int, help="lego side for centralised (200)")
    parser.add_argument("--eval-views", type=int, help="held-out lego views scored (20)")
    parser.add_argument(
        "--target-samples",
        type=int,
        help="field samples per step (default: 2^16 centralised, 2^14 local)",
    )
    parser.add_argument("--backends", nargs="+", choices=BACKENDS, default=list(BACKENDS))
    parser.add_argument("--crowd", type=Path, help="`fedfields data crowd` folder (100x100)")
    parser.add_argument("--crowd-downscale", type=float, default=1.0)
    parser.add_argument("--users", type=int, help="users in a federated round (16)")
    parser.add_argument("--rounds", type=int, help="rounds per method; the last is timed (2)")
    parser.add_argument("--max-local-steps", type=int, help="cap on a user's local steps (400)")
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    parser.add_argument(
        "--step-modes",
        nargs="+",
        choices=STEP_MODES,
        help="training steps measured side by side (default: dynamic cuda-graph on CUDA, "
        "dynamic elsewhere)",
    )
    parser.add_argument("--cpu-threads", type=int, default=2, help="threads of the CPU round")
    parser.add_argument("--repeats", type=int, help="GPU local rounds, median taken (3)")
    parser.add_argument("--run-config", help="the federated field's run-config, 'key=value ...'")
    parser.add_argument("--profile", action="store_true", help="torch.profiler tables per path")
    parser.add_argument("--profile-steps", type=int, help="training steps profiled per path (8)")
    parser.add_argument("--smoke", action="store_true",
                        help=f"tiny defaults for a CPU test: {SMOKE}")  # fmt: skip
    parser.add_argument("--out", type=Path, required=True, help="table.json, table.md, logs")
    args = parser.parse_args(argv)
    defaults = {"seconds": 30.0, "resolution": 200, "eval_views": 20, "target_samples": None,
                "users": 16, "rounds": 2, "max_local_steps": novel_blender_setup.Settings.max_steps,
                "repeats": 3, "run_config": "", "profile_steps": 8}  # fmt: skip
    if args.smoke:
        defaults.update(SMOKE)
    given = {k: getattr(args, k) for k in defaults if getattr(args, k) is not None}
    values = {**defaults, **given}
    for name in ("seconds", "resolution", "eval_views", "users", "rounds", "max_local_steps",
                 "repeats", "cpu_threads", "profile_steps"):  # fmt: skip
        value = values.get(name, getattr(args, name))
        if not value > 0:
            parser.error(f"--{name.replace('_', '-')} must be positive, got {value}")
    try:
        federated_keys = novel_blender_setup.parse_run_config(values["run_config"])
    except ValueError as error:
        parser.error(f"--run-config {values['run_config']!r}: {error}")
    if "cuda-graph" in federated_keys:
        parser.error("--run-config: 'cuda-graph' is set per part by --step-modes")
    step_modes = tuple(dict.fromkeys(args.step_modes or default_step_modes(args.device)))
    return Options(device=args.device, backends=tuple(args.backends), crowd=args.crowd,
                   step_modes=step_modes,
                   crowd_downscale=args.crowd_downscale, methods=tuple(args.methods),
                   cpu_threads=args.cpu_threads, profile=args.profile, out=args.out,
                   **values)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    options = parse(argv)
    options.out.mkdir(parents=True, exist_ok=True)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s",
                        handlers=[logging.StreamHandler(),
                                  logging.FileHandler(options.out / "bench.log")])  # fmt: skip
    log.info("options: %s", {k: str(v) for k, v in asdict(options).items()})
    rows, found = run(options)
    table = markdown(rows)
    atomic.write_json(options.out / "table.json",
                      {"rows": [asdict(r) for r in rows], "figures": found,
                       "options": {k: str(v) for k, v in asdict(options).items()}})  # fmt: skip
    atomic.write_text(options.out / "table.md", table + "\n")
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
