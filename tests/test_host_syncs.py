"""The training steps read nothing back from the device each step (issue 34, point 2;
issue 44, point 1), DecentNeRF's global+personal step and Scaffold's corrected step included.

A host read (`.item()`, `.tolist()`, `float(t)`, `bool(t)`) stalls a GPU's stream until every
queued kernel finished. On CPU nothing stalls, so the reads fedfields' own code makes are
counted instead; the dynamic step's marching count (a nonzero) is not counted there. The
static step is checked below the Python level (`HostTraffic`, a dispatch mode): no read, no
data-shaped op and no host-to-device copy in a step, and the same loss and gradients as the
dynamic step.
"""

from __future__ import annotations

import contextlib
import sys
import warnings
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from graph_replay import assert_replays_match, deterministic_kernels
from tiny_fields import tiny_hashgrid_setup
from torch.utils._python_dispatch import TorchDispatchMode

from fedfields.data import holdout_indices, load_scene
from fedfields.data.pixels import PixelSampler
from fedfields.data.scene import Scene
from fedfields.fields import (
    GlobalPersonalField,
    HashGridConfig,
    PersonalField,
    PersonalFieldConfig,
    encodings,
)
from fedfields.fields.base import FieldOutputs
from fedfields.geometry.rays import Rays, intersect_aabb
from fedfields.methods.scaffold import CLIENT_CONTROL, ScaffoldHook
from fedfields.render import OccupancyGrid, RenderConfig, render_rays
from fedfields.train.centralised import default_setup, train
from fedfields.train.cuda_syncs import syncing_reason
from fedfields.train.federated import (
    FINITE_CHECK_EVERY,
    LocalTrainConfig,
    local_train,
)
from fedfields.train.nerfw import BETA_MIN, TRANSIENT_DENSITY_WEIGHT, PersonalLoss
from fedfields.train.static_step import (
    MIN_BATCH_RAYS,
    OVERFLOW_SIGMAS,
    WARMUP_STEPS,
    SampleProbe,
    StaticStep,
    max_samples_per_ray,
    set_learning_rate,
    static_batch_rays,
    static_capacity,
    static_loss,
    static_optimizer,
)

LEGO = Path(__file__).resolve().parents[1] / "data" / "lego"
READS = ("item", "tolist", "__bool__", "__float__", "__int__")
PACKAGE = str(Path(__file__).resolve().parents[1] / "fedfields")


@pytest.fixture(scope="module")
def tiny_lego() -> Scene:
    scene = load_scene(LEGO, downscale=8)
    return scene.subset(holdout_indices(len(scene), 8)[0])


@pytest.fixture
def deterministic() -> Iterator[None]:
    with deterministic_kernels():
        yield


@pytest.fixture
def host_reads(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """Every tensor-to-host read made from a fedfields module, as 'file:line'."""
    reads: list[str] = []
    for name in READS:
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _original=original, **kwargs):
            caller = sys._getframe(1)
            if caller.f_code.co_filename.startswith(PACKAGE):
                reads.append(f"{caller.f_code.co_filename}:{caller.f_lineno}")
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    yield reads


def _reads_of(run, steps: int, reads: list[str]) -> list[str]:
    """The host reads `run(steps)` makes, setup included."""
    reads.clear()
    run(steps)
    return list(reads)


def test_centralised_hashgrid_steps_read_the_device_only_at_log_and_grid_steps(
    tiny_lego: Scene, host_reads: list[str]
) -> None:
    def run(steps: int) -> None:
        setup = tiny_hashgrid_setup(tiny_lego)
        config = setup.train_config(
            steps=steps, target_samples=1 << 12, progress=False, log_every=24, device="cpu"
        )
        train(setup.field, tiny_lego, config, setup.render_config, setup.occupancy)

    short, long = _reads_of(run, 24, host_reads), _reads_of(run, 72, host_reads)
    # 48 more steps: 2 loss checks at log steps + 3 grid refreshes (every 16 steps); a read
    # per step (the loss, the march's step count) would add 48 or more
    assert len(long) - len(short) <= 5, long


def test_local_round_reads_the_device_every_sixteen_steps(
    tiny_lego: Scene, host_reads: list[str]
) -> None:
    def run(steps: int) -> None:
        setup = tiny_hashgrid_setup(tiny_lego)
        config = LocalTrainConfig(steps=steps, target_samples=1 << 12, device="cpu")
        local_train(setup.field, tiny_lego, config, setup.render_config, setup.occupancy)

    short, long = _reads_of(run, 16, host_reads), _reads_of(run, 64, host_reads)
    # 48 more steps: 3 loss checks + 3 grid refreshes
    assert len(long) - len(short) <= 6, long


class _TurnsNaN(torch.nn.Module):
    """A field that renders fine for `good_calls` forwards, then NaN density."""

    def __init__(self, good_calls: int) -> None:
        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones(1))
        self.calls, self.good_calls = 0, good_calls

    def density(self, points: torch.Tensor) -> torch.Tensor:
        bad = self.calls > self.good_calls
        return self.scale * torch.full_like(points[:, 0], float("nan") if bad else 1.0)

    def forward(
        self, points: torch.Tensor, directions: torch.Tensor, image_index: object = None
    ) -> FieldOutputs:
        self.calls += 1
        return FieldOutputs(self.density(points), torch.sigmoid(points) * self.scale)


def test_a_loss_checked_late_still_names_the_first_bad_step(tiny_lego: Scene) -> None:
    setup = default_setup("nerf", tiny_lego)
    render = replace(setup.render_config, num_samples=4, num_importance=0)
    config = setup.train_config(steps=20, progress=False, batch_rays=16, log_every=10)
    with pytest.raises(FloatingPointError, match="training diverged at step 7: loss is nan"):
        train(_TurnsNaN(good_calls=7), tiny_lego, config, render)


def test_local_training_names_the_first_bad_step_between_checks(tiny_lego: Scene) -> None:
    render = replace(default_setup("nerf", tiny_lego).render_config, num_samples=4)
    config = LocalTrainConfig(steps=40, batch_rays=16, device="cpu")
    with pytest.raises(FloatingPointError, match="local training diverged at step 21:"):
        local_train(_TurnsNaN(good_calls=21), tiny_lego, config, render, None)


def _box_grid() -> OccupancyGrid:
    grid = OccupancyGrid(torch.tensor([[-1.0, -1.0, -1.0], [1.0, 1.0, 1.0]]), resolution=8)
    generator = torch.Generator().manual_seed(1)
    grid.occupied = torch.rand((8, 8, 8), generator=generator) > 0.5
    return grid


def _rays(num: int, seed: int, spread: float) -> Rays:
    generator = torch.Generator().manual_seed(seed)
    origins = torch.nn.functional.normalize(torch.randn(num, 3, generator=generator), dim=-1) * 3
    targets = (torch.rand(num, 3, generator=generator) - 0.5) * spread
    return Rays(origins, torch.nn.functional.normalize(targets - origins, dim=-1))


@pytest.mark.parametrize("spread", [1.0, 6.0])  # 6: many rays miss the box
def test_march_with_a_static_step_bound_keeps_the_same_samples(spread: float) -> None:
    grid = _box_grid()
    rays = _rays(300, seed=2, spread=spread)
    config = RenderConfig(near=0.5, far=5.0, aabb=(-1.0, -1.0, -1.0, 1.0, 1.0, 1.0))
    t_near, t_far = intersect_aabb(rays, config.aabb_tensor, config.near, config.far)
    step = 0.013
    read = grid.march(rays, t_near, t_far, step, perturb=False)
    bound = grid.march(rays, t_near, t_far, step, perturb=False, max_length=config.max_ray_length)
    assert read.t_mid.numel() > 100
    assert torch.equal(read.ray_index, bound.ray_index)
    assert torch.equal(read.t_mid, bound.t_mid)
    torch.manual_seed(5)
    read = grid.march(rays, t_near, t_far, step, perturb=True)
    torch.manual_seed(5)
    bound = grid.march(rays, t_near, t_far, step, perturb=True, max_length=config.max_ray_length)
    assert torch.equal(read.ray_index, bound.ray_index)
    assert torch.equal(read.t_mid, bound.t_mid)


def test_max_ray_length_bounds_every_interval_in_the_box() -> None:
    config = RenderConfig(near=0.0, far=100.0, aabb=(-1.0, -2.0, -1.0, 1.0, 2.0, 1.0))
    rays = _rays(5000, seed=3, spread=4.0)
    t_near, t_far = intersect_aabb(rays, config.aabb_tensor, config.near, config.far)
    longest = (t_far - t_near).max().item()
    assert config.max_ray_length == pytest.approx(24**0.5)
    assert 0.9 * config.max_ray_length < longest <= config.max_ray_length + 1e-5


# ------------------------------------------------------------------ the static step (issue 44)


class HostTraffic(TorchDispatchMode):
    """Every op that waits for the device or moves host data onto it, as the dispatcher sees
    it (below Python: the scene box built by `torch.tensor(...).to(device)` counts too): the
    operators `fedfields.train.cuda_syncs` lists (they sync inside their CUDA implementation,
    invisible to a CPU run otherwise) and copies from the host to another device.
    """

    def __init__(self) -> None:
        super().__init__()
        self.events: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        name = str(func)
        kwargs = kwargs or {}
        if syncing_reason(name, kwargs) is not None:
            self.events.append(name)
        elif name.startswith(("aten._to_copy", "aten.copy_")) and _host_to_device(args, kwargs):
            self.events.append(name)
        return func(*args, **kwargs)


@pytest.fixture
def cuda_ops(monkeypatch: pytest.MonkeyPatch) -> None:
    """The hash grid's backward adds with the op CUDA uses (index_add_), not the CPU's faster
    bincount, so that a CPU trace shows what a CUDA step would run."""
    monkeypatch.setattr(encodings, "BINCOUNT_DEVICES", ())


def _host_to_device(args: tuple, kwargs: dict) -> bool:
    """A copy whose source is on the CPU and whose target is not."""
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if not tensors:
        return False
    target = kwargs.get("device")
    if target is None and len(tensors) > 1:  # copy_(self, src): self is the target
        target, source = tensors[0].device, tensors[1].device
    else:
        source = tensors[0].device
    return source.type == "cpu" and target is not None and torch.device(target).type != "cpu"


def _static_case(tiny_lego: Scene) -> tuple:
    setup = tiny_hashgrid_setup(tiny_lego)
    torch.manual_seed(0)
    setup.occupancy.update(setup.field.density, setup.render_config.step_size)
    return setup.field, PixelSampler(tiny_lego, True), setup.render_config, setup.occupancy


def _gradients(field: torch.nn.Module, loss: torch.Tensor) -> list[torch.Tensor]:
    return list(torch.autograd.grad(loss, list(field.parameters())))


def test_the_static_step_gives_the_dynamic_step_s_loss_and_gradients(tiny_lego: Scene) -> None:
    field, sampler, render, grid = _static_case(tiny_lego)
    torch.manual_seed(3)
    batch = sampler.sample(256)
    rendered, num_samples = render_rays(field, batch.rays, render, grid, True, batch.background)
    squared = (rendered.rgb - batch.colors).square().mean(-1)
    dynamic_loss = torch.nn.functional.mse_loss(rendered.rgb, batch.colors)
    dynamic = _gradients(field, dynamic_loss)
    torch.manual_seed(3)  # the same draws: pixels, background, marching offsets
    static = static_loss(field, sampler, render, grid, 256, capacity=num_samples + 500)
    assert int(static.samples) == num_samples > 1000 and int(static.dropped_rays) == 0
    torch.testing.assert_close(static.loss, dynamic_loss, rtol=1e-6, atol=0)
    for got, expected in zip(_gradients(field, static.loss), dynamic, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-9)
    # a buffer too small: the rays whose samples overflow leave the loss, counted
    torch.manual_seed(3)
    short = static_loss(field, sampler, render, grid, 256, capacity=num_samples // 2)
    ray_samples = torch.bincount(
        grid.march(batch.rays, *_interval(batch.rays, render), render.step_size, False,
                   render.max_ray_length).ray_index, minlength=256,
    )  # fmt: skip
    complete = torch.cumsum(ray_samples, 0) <= num_samples // 2
    assert 0 < int(short.dropped_rays) == int((~complete).sum()) < 256
    torch.testing.assert_close(short.loss, squared[complete].mean(), rtol=1e-5, atol=0)


def _interval(rays: Rays, render: RenderConfig) -> tuple[torch.Tensor, torch.Tensor]:
    return intersect_aabb(rays, render.aabb_tensor, render.near, render.far)


def test_a_static_step_waits_on_nothing_and_copies_nothing_from_the_host(
    tiny_lego: Scene,
    cuda_ops: None,
) -> None:
    field, sampler, render, grid = _static_case(tiny_lego)
    optimizer = static_optimizer(field, 1e-2, 1e-6, torch.device("cpu"))
    step = StaticStep(
        lambda g, rays: static_loss(field, sampler, render, g, rays, 1 << 14), optimizer, grid,
        cuda_graph=False,
    )  # fmt: skip
    step(128)  # Adam makes its state on the first step
    with HostTraffic() as traffic:
        for _ in range(3):
            set_learning_rate(optimizer, 5e-3)
            outputs = step(128)
        grid.update(field.density, render.step_size)  # between steps, every 16: no read either
    assert traffic.events == []
    assert float(outputs.samples) > 0  # it did march
    # the counter sees what the dynamic step does: nonzero per march, the box built per call
    with HostTraffic() as traffic:
        batch = sampler.sample(128)
        render_rays(field, batch.rays, render, grid, True, batch.background)
        render.aabb_tensor.to(batch.rays.origins.device)
    assert "aten.nonzero.default" in traffic.events
    assert "aten.lift_fresh.default" in traffic.events


def test_static_training_counts_its_samples_at_the_checks(tiny_lego: Scene) -> None:
    setup = tiny_hashgrid_setup(tiny_lego)
    config = setup.train_config(
        steps=5, batch_rays=64, target_samples=1 << 12, progress=False, log_every=2,
        device="cpu", step_mode="static",
    )  # fmt: skip
    result = train(setup.field, tiny_lego, config, setup.render_config, setup.occupancy)
    assert [record["step"] for record in result.history] == [2, 4]
    assert result.samples > 5 * 64  # every step's count, the last one's after the loop
    assert result.history[0]["samples_per_ray"] * 64 * 2 <= result.samples


def test_a_log_record_s_samples_per_ray_spans_the_batches_of_its_window(
    tiny_lego: Scene,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Grid refreshes every 2 steps re-size the batch inside a 4-step log window: the record's
    samples per ray divides the window's samples by the rays its steps drew."""
    drawn: list[int] = []
    original = StaticStep.__call__

    def recording(self: StaticStep, batch_rays: int):
        drawn.append(batch_rays)
        return original(self, batch_rays)

    monkeypatch.setattr(StaticStep, "__call__", recording)
    setup = default_setup(
        "hashgrid", tiny_lego, implementation="torch", seed=1
    )  # seed 1: batches move
    config = setup.train_config(
        steps=4, batch_rays=64, target_samples=1 << 14, progress=False, log_every=4,
        device="cpu", step_mode="static", occupancy_update_every=2,
    )  # fmt: skip
    result = train(setup.field, tiny_lego, config, setup.render_config, setup.occupancy)
    assert len(set(drawn)) > 1, drawn  # the batch moved within the window
    record = result.history[0]
    assert result.rays == sum(drawn)
    assert record["samples_per_ray"] == pytest.approx(result.samples / sum(drawn))


@pytest.mark.parametrize(
    ("mean", "std", "capacity"),
    [(40.0, 0.0, 1 << 14), (40.0, 60.0, 1 << 14), (3.0, 9.0, 1 << 16), (150.0, 80.0, 12736)],
)
def test_the_static_batch_is_the_largest_rung_that_fits_at_three_sigmas(
    mean: float, std: float, capacity: int
) -> None:
    rungs = sorted({int(2 ** (k / 4)) for k in range(24, 72)})  # the ladder from 64 rays

    def fits(rays: int) -> bool:
        return rays * mean + OVERFLOW_SIGMAS * rays**0.5 * std <= capacity

    expected = max((rung for rung in rungs if fits(rung)), default=MIN_BATCH_RAYS)
    assert static_batch_rays(mean, std, capacity, maximum=1 << 18) == expected
    assert static_batch_rays(mean, std, capacity, maximum=100) == min(expected, 100)
    assert static_batch_rays(0.0, 0.0, capacity, maximum=4096) == 4096  # an empty grid


@pytest.mark.parametrize("target_samples", [None, 1 << 10, 1 << 14])
def test_the_capacity_holds_the_lowest_rung_s_worst_case(
    tiny_lego: Scene, target_samples: int | None
) -> None:
    render = tiny_hashgrid_setup(tiny_lego).render_config
    worst = max_samples_per_ray(render)
    assert worst == 199  # far - near = 4 over lego's step 3 sqrt(3) / 256: 198 steps, +1
    capacity = static_capacity(target_samples, 1024, render)
    assert capacity >= max(target_samples or 1024 * worst, MIN_BATCH_RAYS * worst)
    assert static_batch_rays(worst, 0.0, capacity, maximum=1 << 18) >= MIN_BATCH_RAYS


def test_the_probe_counts_what_marching_keeps(tiny_lego: Scene) -> None:
    """The probe's moments against `march`'s packed samples (a nonzero) on the same rays."""
    field, sampler, render, grid = _static_case(tiny_lego)
    for _ in range(3):  # a grid with empty cells: rays differ
        grid.update(field.density, render.step_size)
    probe = SampleProbe(sampler, render, count=500)
    assert len(probe.rays) == 500
    t_near, t_far = intersect_aabb(probe.rays, render.aabb_tensor, render.near, render.far)
    packed = grid.march(probe.rays, t_near, t_far, render.step_size, False, render.max_ray_length)
    counts = torch.bincount(packed.ray_index, minlength=500).double()
    mean, std = probe.moments(grid)
    assert counts.min() < counts.max()
    assert mean == pytest.approx(counts.mean().item(), rel=1e-6)
    assert std == pytest.approx(counts.std(correction=0).item(), rel=1e-5)


def test_a_static_round_reads_the_device_at_checks_and_refreshes_only(
    tiny_lego: Scene, host_reads: list[str]
) -> None:
    def run(steps: int) -> None:
        setup = tiny_hashgrid_setup(tiny_lego)
        config = LocalTrainConfig(
            steps=steps, batch_rays=64, target_samples=1 << 13, device="cpu", step_mode="static"
        )
        local_train(setup.field, tiny_lego, config, setup.render_config, setup.occupancy)

    short, long = _reads_of(run, 16, host_reads), _reads_of(run, 64, host_reads)
    # 48 more steps: 3 loss checks, 3 count reads, 3 probes at the grid's refreshes
    assert len(long) - len(short) <= 9, long


def test_the_first_static_window_keeps_its_rays(tiny_lego: Scene) -> None:
    """The grid starts fully occupied: the configured 1024 rays overflow a 2^12-sample buffer
    (most rays dropped); the first window's batch, sized from the probe through the grid of
    the first refresh, drops none, in training and in a local round."""
    field, sampler, render, grid = _static_case(tiny_lego)
    capacity = static_capacity(1 << 12, 1024, render)
    torch.manual_seed(0)
    configured = static_loss(field, sampler, render, grid, 1024, capacity)
    assert int(configured.dropped_rays) > 1024 // 2  # what a start at the configured batch does
    setup = tiny_hashgrid_setup(tiny_lego)
    config = setup.train_config(
        steps=4, batch_rays=1024, target_samples=1 << 12, progress=False, log_every=4,
        device="cpu", step_mode="static",
    )  # fmt: skip
    result = train(setup.field, tiny_lego, config, setup.render_config, setup.occupancy)
    first = result.history[0]
    assert first["dropped_rays"] == 0 and first["batch_rays"] < 1024
    assert result.dropped_rays == 0 and result.samples > 4 * MIN_BATCH_RAYS
    setup = tiny_hashgrid_setup(tiny_lego)
    local = LocalTrainConfig(steps=FINITE_CHECK_EVERY // 4, batch_rays=1024,
                             target_samples=1 << 12, device="cpu", step_mode="static")  # fmt: skip
    round_ = local_train(setup.field, tiny_lego, local, setup.render_config, setup.occupancy)
    assert round_.dropped_rays == 0 and round_.rays < local.steps * 1024


def test_cuda_graph_is_refused_on_a_cpu_run(tiny_lego: Scene) -> None:
    setup = tiny_hashgrid_setup(tiny_lego)
    config = setup.train_config(steps=1, progress=False, device="cpu", step_mode="cuda-graph")
    with pytest.raises(
        ValueError, match="'cuda-graph' .*needs a CUDA device; this run trains on cpu"
    ):
        train(setup.field, tiny_lego, config, setup.render_config, setup.occupancy)


def test_a_cpu_node_asked_for_cuda_graph_runs_the_static_step(tiny_lego: Scene) -> None:
    results = {}
    for mode in ("static", "cuda-graph"):
        torch.manual_seed(0)  # the same initial field
        setup = tiny_hashgrid_setup(tiny_lego)
        config = LocalTrainConfig(steps=3, batch_rays=64, device="cpu", step_mode=mode)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            results[mode] = local_train(
                setup.field, tiny_lego, config, setup.render_config, setup.occupancy
            )
        warned = [str(w.message).split(";")[0] for w in caught]
        assert warned == (["step mode 'cuda-graph' needs CUDA"] if mode == "cuda-graph" else [])
    assert results["static"].loss == results["cuda-graph"].loss


class _FakeStream:
    """Stands in for a CUDA stream on the CPU: warm-up only asks it to wait."""

    def __init__(self, device: torch.device | None = None) -> None:
        self.device = device

    def wait_stream(self, other: object) -> None:
        pass


def test_a_failed_capture_warns_once_restores_the_stream_and_trains_on_uncaptured(
    tiny_lego: Scene, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 55: capture is made to fail as a syncing operator makes it fail on CUDA. The
    step warns once naming the cause, puts torch back on the stream it was on, and trains on:
    its losses and weights are the uncaptured step's, bit for bit."""
    current, devices, restored = _FakeStream(), [], []

    def entered(device: torch.device | None) -> contextlib.AbstractContextManager:
        devices.append(device)
        return contextlib.nullcontext()

    def refuse(graph: object) -> None:
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(torch.cuda, "device", entered)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current)
    monkeypatch.setattr(torch.cuda, "Stream", _FakeStream)
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "set_stream", restored.append)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", object)
    monkeypatch.setattr(torch.cuda, "graph", refuse)
    runs = {}
    for cuda_graph in (False, True):
        torch.manual_seed(0)
        field, sampler, render, grid = _static_case(tiny_lego)
        optimizer = static_optimizer(field, 1e-2, 1e-6, torch.device("cpu"))
        step = StaticStep(
            lambda g, rays: static_loss(field, sampler, render, g, rays, 1 << 14),  # noqa: B023
            optimizer, grid, cuda_graph=cuda_graph, device=torch.device("cpu"),
        )  # fmt: skip
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            losses = []
            for index in range(WARMUP_STEPS + 3):
                torch.manual_seed(100 + index)
                losses.append(step(128).loss.detach())
        runs[cuda_graph] = (torch.stack(losses), field.encoding.table.detach().clone())
        failures = [str(w.message) for w in caught if "capture failed" in str(w.message)]
        assert failures == ([] if not cuda_graph else [
            "CUDA graph capture failed (RuntimeError: operation not permitted when stream is "
            "capturing); the static steps go on uncaptured"
        ])  # fmt: skip
    assert restored == [current]  # the one failed capture, then no more attempts
    assert set(devices) == {torch.device("cpu")} and len(devices) == WARMUP_STEPS + 1
    assert step.capture_error is not None and not step.cuda_graph
    assert torch.equal(runs[True][0], runs[False][0])
    assert torch.equal(runs[True][1], runs[False][1])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
@pytest.mark.usefixtures("deterministic")
def test_a_captured_step_gives_the_uncaptured_step_s_numbers(tiny_lego: Scene) -> None:
    """Both runs take the same draws (one generator state per step), so the losses and the
    trained weights agree: the graph replays the eager step."""
    runs = {}
    for captured in (False, True):
        torch.manual_seed(0)
        setup = tiny_hashgrid_setup(tiny_lego)
        field, grid = setup.field.cuda(), setup.occupancy.to("cuda")
        scene = tiny_lego.to("cuda")
        sampler = PixelSampler(scene, True)
        optimizer = static_optimizer(field, 1e-2, 1e-6, torch.device("cuda"))
        step = StaticStep(
            lambda g, rays: static_loss(field, sampler, setup.render_config, g, rays, 1 << 14),  # noqa: B023
            optimizer, grid, cuda_graph=captured,
        )  # fmt: skip
        losses = []
        for index in range(8):
            torch.manual_seed(100 + index)
            if index % 4 == 0:
                grid.update(field.density, setup.render_config.step_size)
            losses.append(step(128).loss)
        runs[captured] = (torch.stack(losses).cpu(), field.encoding.table.detach().cpu())
    assert_replays_match(runs[True][0], runs[False][0], runs[True][1], runs[False][1])


# ------------------------------------------------- DecentNeRF's composite, Scaffold's step


def _personal(num_images: int, seed: int = 1) -> PersonalField:
    torch.manual_seed(seed)
    encoding = HashGridConfig(
        num_levels=4, log2_hashmap_size=10, max_resolution=32, implementation="torch"
    )
    return PersonalField(PersonalFieldConfig(num_images=num_images, encoding=encoding, hidden=16))


def _composite_case(tiny_lego: Scene) -> tuple:
    """The hash-grid case with a personal field beside the global one, the grid following
    their composite density (as `local_train` runs DecentNeRF)."""
    field, sampler, render, _ = _static_case(tiny_lego)
    composite = GlobalPersonalField(field, _personal(len(tiny_lego)))
    grid = OccupancyGrid(tiny_lego.aabb)
    grid.update(composite.density, render.step_size)
    return composite, sampler, render, grid


def _equation_13(rendered, colors: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """NeRF-W's Eq. 13 written out per ray: (colour / (2 beta^2) + log beta [R], the
    transient density of each sample [S]); beta = beta_min + the rendered uncertainty."""
    beta = BETA_MIN + rendered.uncertainty
    per_ray = (rendered.rgb - colors).square().sum(-1) / (2 * beta.square()) + beta.log()
    return per_ray, rendered.personal_density


def test_the_static_step_gives_decentnerf_s_loss_and_gradients(tiny_lego: Scene) -> None:
    composite, sampler, render, grid = _composite_case(tiny_lego)
    terms = PersonalLoss(BETA_MIN, TRANSIENT_DENSITY_WEIGHT)
    torch.manual_seed(3)
    batch = sampler.sample(256)
    rendered, num_samples = render_rays(
        composite, batch.rays, render, grid, True, batch.background, batch.image_index
    )
    per_ray, density = _equation_13(rendered, batch.colors)
    dynamic_loss = per_ray.mean() + TRANSIENT_DENSITY_WEIGHT * density.mean()
    dynamic = _gradients(composite, dynamic_loss)
    torch.manual_seed(3)  # the same draws: pixels, background, marching offsets
    static = static_loss(composite, sampler, render, grid, 256, num_samples + 500, personal=terms)
    assert int(static.samples) == num_samples > 1000 and int(static.dropped_rays) == 0
    torch.testing.assert_close(static.loss, dynamic_loss, rtol=1e-6, atol=0)
    mse = torch.nn.functional.mse_loss(rendered.rgb, batch.colors)
    torch.testing.assert_close(static.photometric, mse, rtol=1e-6, atol=0)
    gradients = _gradients(composite, static.loss)
    assert len(gradients) == len(dynamic) > len(list(composite.global_field.parameters()))
    for got, expected in zip(gradients, dynamic, strict=True):  # sums of other orders
        scale = float(expected.abs().max())
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6 * scale)
    # overflow: the complete rays' terms and the kept samples' density, nothing else
    capacity = num_samples // 2
    torch.manual_seed(3)
    short = static_loss(composite, sampler, render, grid, 256, capacity, personal=terms)
    ray_samples = torch.bincount(
        grid.march(batch.rays, *_interval(batch.rays, render), render.step_size, False,
                   render.max_ray_length).ray_index, minlength=256,
    )  # fmt: skip
    complete = torch.cumsum(ray_samples, 0) <= capacity
    assert 0 < int(short.dropped_rays) == int((~complete).sum()) < 256
    expected = per_ray[complete].mean() + TRANSIENT_DENSITY_WEIGHT * density[:capacity].mean()
    torch.testing.assert_close(short.loss, expected, rtol=1e-5, atol=0)


def _scaffold(field: torch.nn.Module, seed: int) -> ScaffoldHook:
    """Controls of the field's shapes, c - c_i of the order of a step's gradients."""
    generator = torch.Generator().manual_seed(seed)
    server, client = {}, {}
    for name, parameter in field.named_parameters():
        server[name] = 1e-4 * torch.randn(parameter.shape, generator=generator)
        client[name] = 1e-4 * torch.randn(parameter.shape, generator=generator)
    return ScaffoldHook(server, client)


def _composite_scaffold_step(
    composite: GlobalPersonalField,
    sampler: PixelSampler,
    render: RenderConfig,
    grid: OccupancyGrid,
    cuda_graph: bool,
) -> tuple[StaticStep, ScaffoldHook]:
    """A static step of the composite under NeRF-W's loss with Scaffold's corrector (seeded
    controls), on the composite's device."""
    device = next(composite.parameters()).device
    optimizer = static_optimizer(composite, 1e-2, 1e-6, device)
    parameters = dict(composite.global_field.named_parameters())
    corrector = _scaffold(composite.global_field, 0)
    corrector.bind(parameters)
    terms = PersonalLoss(BETA_MIN, TRANSIENT_DENSITY_WEIGHT)
    step = StaticStep(
        lambda g, rays: static_loss(composite, sampler, render, g, rays, 1 << 14, personal=terms),
        optimizer, grid, cuda_graph=cuda_graph, after_backward=corrector.after_backward,
    )  # fmt: skip
    return step, corrector


def test_a_decentnerf_or_scaffold_static_step_waits_on_nothing(
    tiny_lego: Scene, cuda_ops: None
) -> None:
    composite, sampler, render, grid = _composite_case(tiny_lego)
    step, corrector = _composite_scaffold_step(composite, sampler, render, grid, False)
    step(128)
    with HostTraffic() as traffic:
        for _ in range(3):
            outputs = step(128)
        grid.update(composite.density, render.step_size)
    assert traffic.events == []
    assert float(outputs.samples) > 0
    control = corrector.control(4)  # the mean uncorrected gradient, summed on the device
    assert any(float(value.abs().sum()) > 0 for value in control.values())


@pytest.mark.parametrize("strategy", ["decentnerf", "scaffold"])
def test_a_static_round_trains_what_the_dynamic_round_trains(
    tiny_lego: Scene, strategy: str
) -> None:
    """Three steps of one fixed batch (the dynamic batch does not move: its samples are the
    target), the same draws: the static round's loss, weights, personal field and Scaffold
    control are the dynamic round's, up to the fused Adam's rounding."""
    rounds = {}
    for mode in ("dynamic", "static"):
        setup = tiny_hashgrid_setup(tiny_lego)
        torch.manual_seed(0)
        field = type(setup.field)(setup.field.config)
        personal = _personal(len(tiny_lego)) if strategy == "decentnerf" else None
        scaffold = _scaffold(field, 1) if strategy == "scaffold" else None
        render = replace(setup.render_config, num_samples=16)
        config = LocalTrainConfig(
            steps=3, batch_rays=64, target_samples=64 * 16, max_batch_rays=64, device="cpu",
            step_mode=mode,
        )  # fmt: skip
        hooks = [] if scaffold is None else [scaffold]
        result = local_train(field, tiny_lego, config, render, None, personal, hooks)
        trained = [p.detach().clone() for p in field.parameters()]
        if personal is not None:
            trained += [p.detach().clone() for p in personal.parameters()]
        rounds[mode] = (result, trained)
    (dynamic, dynamic_weights), (static, static_weights) = rounds["dynamic"], rounds["static"]
    assert dynamic.rays == static.rays == 3 * 64 and static.dropped_rays == 0
    assert static.loss == pytest.approx(dynamic.loss, rel=1e-4)
    for got, expected in zip(static_weights, dynamic_weights, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-3, atol=1e-5)
    if strategy == "scaffold":
        static_control = static.hook_results[0].kept[CLIENT_CONTROL]
        for name, value in dynamic.hook_results[0].kept[CLIENT_CONTROL].items():
            torch.testing.assert_close(static_control[name], value, rtol=1e-3, atol=1e-7)


def test_a_decentnerf_static_round_keeps_its_rays_and_its_sample_target(tiny_lego: Scene) -> None:
    """The personal field's density opens cells at each grid refresh; the batch, sized then
    from the probe (3 sigmas within 4/3 of the target), drops no ray, and a step holds about
    the target's samples, as a dynamic step does."""
    setup = tiny_hashgrid_setup(tiny_lego)
    torch.manual_seed(0)
    target = 1 << 14  # above the capacity's floor, the lowest rung's worst case
    per_step = {}
    for mode in ("dynamic", "static"):
        torch.manual_seed(0)
        field = type(setup.field)(setup.field.config)
        config = LocalTrainConfig(
            steps=2 * FINITE_CHECK_EVERY, batch_rays=1024, target_samples=target, device="cpu",
            step_mode=mode,
        )  # fmt: skip
        grid = OccupancyGrid(field.aabb)
        personal = _personal(len(tiny_lego))
        result = local_train(field, tiny_lego, config, setup.render_config, grid, personal)
        assert result.dropped_rays == 0
        per_step[mode] = result.samples / result.steps
    assert 0.75 * target < per_step["static"] < 1.25 * target, per_step
    assert per_step["static"] == pytest.approx(per_step["dynamic"], rel=0.25)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
@pytest.mark.usefixtures("deterministic")
def test_a_captured_decentnerf_scaffold_step_gives_the_uncaptured_numbers(
    tiny_lego: Scene,
) -> None:
    """The global+personal step with Scaffold's correction inside the graph: the losses, both
    fields' weights and the summed control of a captured run are the eager run's."""
    runs = {}
    for captured in (False, True):
        torch.manual_seed(0)
        composite, sampler, render, grid = _composite_case(tiny_lego)
        composite, grid = composite.cuda(), grid.to("cuda")
        sampler = PixelSampler(tiny_lego.to("cuda"), True)
        step, corrector = _composite_scaffold_step(composite, sampler, render, grid, captured)
        losses = []
        for index in range(8):
            torch.manual_seed(100 + index)
            if index % 4 == 0:
                grid.update(composite.density, render.step_size)
            losses.append(step(128).loss)
        weights = torch.cat([p.detach().reshape(-1) for p in composite.parameters()]).cpu()
        control = torch.cat([v.reshape(-1) for v in corrector.control(8).values()])
        runs[captured] = (torch.stack(losses).cpu(), torch.cat([weights, control]))
    assert_replays_match(runs[True][0], runs[False][0], runs[True][1], runs[False][1])
