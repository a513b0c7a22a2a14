"""Every run writes TensorBoard event files beside metrics.jsonl (`fedfields.tracking`), read
back here with TensorBoard's own reader: each line's numbers as scalars in report.html's groups,
the run directory's images, the run-config as hyper-parameters; a resumed run's curves hold each
round once; MLflow is off by default and refused cleanly when asked for without mlflow."""

from __future__ import annotations

import importlib.machinery
import json
import shutil
import sys
import time
import types
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image
from tensorboard.backend.event_processing.event_accumulator import (
    IMAGES,
    SCALARS,
    EventAccumulator,
)
from tensorboard.plugins.hparams.metadata import SESSION_START_INFO_TAG
from tensorboard.plugins.hparams.plugin_data_pb2 import HParamsPluginData
from test_federated_nerf import tiny as tiny_scene
from test_job import serve
from test_meta_job import run_in_process as run_meta
from test_meta_job import tiny as tiny_meta
from test_split_job import tiny as tiny_split

from fedfields.flower.resume import RESUME_FILE
from fedfields.render.orbit import ORBIT_FILE
from fedfields.report import curve_group
from fedfields.tracking import (
    EVENT_FILE_PREFIX,
    MLFLOW_RUN_FILE,
    MLFLOW_SWITCH,
    RunTracker,
    TrackingError,
    TrackingSettings,
    image_files,
    image_tag,
)
from simulations.in_process_grid import InProcessGrid
from simulations.meta_job import run_meta_job
from simulations.run import client_app
from strategies import parse_app_config


def events(path: Path) -> EventAccumulator:
    """A run directory's event files (or one file), loaded as TensorBoard loads a run, all
    images kept."""
    accumulator = EventAccumulator(str(path), size_guidance={IMAGES: 0, SCALARS: 0})
    return accumulator.Reload()


def metric_lines(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def expected_scalars(lines: list[dict[str, Any]], x_key: str) -> dict[str, list[tuple]]:
    """tag -> [(step, value)] of metrics.jsonl's numbers, tagged `<report group>/<metric>`."""
    scalars: dict[str, list[tuple]] = {}
    for line in lines:
        for key, value in line.items():
            if key != x_key and isinstance(value, int | float) and not isinstance(value, bool):
                scalars.setdefault(f"{curve_group(key)}/{key}", []).append((line[x_key], value))
    return scalars


def tracked_scalars(accumulator: EventAccumulator) -> dict[str, list[tuple]]:
    return {
        tag: [(event.step, event.value) for event in accumulator.Scalars(tag)]
        for tag in accumulator.Tags()["scalars"]
    }


def hparams(accumulator: EventAccumulator) -> dict[str, Any]:
    """The run's hyper-parameters as written once, in its first event file."""
    content = accumulator.PluginTagToContent("hparams")[SESSION_START_INFO_TAG]
    start = HParamsPluginData.FromString(content).session_start_info
    return {name: getattr(value, value.WhichOneof("kind")) for name, value in start.hparams.items()}


def assert_scalars_match(accumulator: EventAccumulator, run_dir: Path, x_key: str) -> None:
    """Each tracked curve is its metrics.jsonl column, step for step (float32 in the events)."""
    expected = expected_scalars(metric_lines(run_dir), x_key)
    tracked = tracked_scalars(accumulator)
    assert tracked.keys() == expected.keys()
    for tag, points in expected.items():
        assert [step for step, _ in tracked[tag]] == [step for step, _ in points], tag
        values = [value for _, value in tracked[tag]]
        assert values == pytest.approx([value for _, value in points], rel=1e-6), tag


def scene_config(tmp_path: Path, request: pytest.FixtureRequest) -> tuple[dict, int]:
    crowd_dir = request.getfixturevalue("crowd_dir")
    return tiny_scene(
        crowd_dir, tmp_path / "run", "fedavg", **{"num-server-rounds": 1, "orbit-frames": 2}
    ), 3


def meta_config(tmp_path: Path, request: pytest.FixtureRequest) -> tuple[dict, int]:
    return tiny_meta(tmp_path / "run"), 4


def split_config(tmp_path: Path, request: pytest.FixtureRequest) -> tuple[dict, int]:
    return tiny_split(tmp_path / "run"), 1  # 40 steps: lines at steps 25 and 40


# job -> (run-config and node count, the x axis, the start of an image tag the run must track)
JOBS = {
    "scene": (scene_config, "round", Path(ORBIT_FILE).stem),  # the server's orbit, a GIF
    "meta": (meta_config, "round", "tto"),
    "split": (split_config, "step", "renders/"),  # the client's renders the audit copied
}


@pytest.mark.parametrize("job", JOBS)
def test_a_run_tracks_its_lines_images_and_run_config_in_tensorboard(
    job: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    make_config, x_key, image = JOBS[job]
    config, nodes = make_config(tmp_path, request)
    run_dir = serve(config, [client_app(config)] * nodes)  # through the ServerApp's main
    accumulator = events(run_dir)
    assert len(list(run_dir.glob("events.out.tfevents.*"))) == 1

    assert metric_lines(run_dir)
    assert_scalars_match(accumulator, run_dir, x_key)

    files = image_files(run_dir)
    assert {image_tag(relative) for relative in files} == set(accumulator.Tags()["images"])
    assert any(tag.startswith(image) for tag in accumulator.Tags()["images"])
    last_step = metric_lines(run_dir)[-1][x_key]
    for relative in files:
        (tracked,) = accumulator.Images(image_tag(relative))
        assert tracked.step == last_step
        if relative.suffix == ".png":  # a GIF's frames are tracked as one grid
            assert (tracked.width, tracked.height) == Image.open(run_dir / relative).size

    run_config = json.loads((run_dir / "config.json").read_text())
    assert hparams(accumulator) == run_config


def test_a_resumed_run_tracks_each_round_once(tmp_path: Path) -> None:
    """Launch 1 runs round 1, launch 2 resumes for round 2, whose checkpoint is then lost (the
    server died before saving it); launch 3 runs rounds 2 and 3 again from round 1's: the curves
    hold rounds 1, 2, 3 once each with metrics.jsonl's values, the hyper-parameters once."""
    run_dir = tmp_path / "run"

    def launch(rounds: int, resume: bool) -> None:
        settings = {"num-server-rounds": rounds, "resume": resume, "tto-steps": 1}
        run_meta(tiny_meta(run_dir, **settings), observers=[])

    launch(1, resume=False)
    shutil.copy(run_dir / RESUME_FILE, tmp_path / "round-1.pt")
    launch(2, resume=True)
    shutil.copy(tmp_path / "round-1.pt", run_dir / RESUME_FILE)
    launch(3, resume=True)

    assert [line["round"] for line in metric_lines(run_dir)] == [1, 2, 3]
    files = list(run_dir.glob("events.out.tfevents.*"))
    assert len(files) == 3
    accumulator = events(run_dir)
    assert_scalars_match(accumulator, run_dir, "round")
    assert [event.step for event in accumulator.Images("tto")] == [1, 3]  # launch 2's purged
    assert sum(SESSION_START_INFO_TAG in events(file).Tags()["tensors"] for file in files) == 1
    assert hparams(accumulator)["num-server-rounds"] == 1  # the first launch's


def test_a_launch_s_event_file_sorts_after_one_from_the_same_second(tmp_path: Path) -> None:
    """TensorBoard reads event files in name order; an earlier launch's file stamped this very
    second with a counter that sorts later as text ('.9' after '.10') still sorts first."""
    earlier = tmp_path / f"{EVENT_FILE_PREFIX}{int(time.time()):010d}.host.1.9"
    earlier.write_bytes(b"")
    with RunTracker(tmp_path, {}, TrackingSettings(mlflow=False)):
        pass
    names = sorted(path.name for path in tmp_path.glob(f"{EVENT_FILE_PREFIX}*"))
    assert len(names) == 2 and names[0] == earlier.name


def test_mlflow_is_off_unless_switched_on() -> None:
    assert TrackingSettings.from_environ({}) == TrackingSettings(mlflow=False)
    for off in ("", "0", "false", "No"):
        assert not TrackingSettings.from_environ({MLFLOW_SWITCH: off}).mlflow
    with pytest.raises(TrackingError, match=f"{MLFLOW_SWITCH}='maybe'"):
        TrackingSettings.from_environ({MLFLOW_SWITCH: "maybe"})


@pytest.mark.skipif(
    importlib.util.find_spec("mlflow") is not None, reason="mlflow is installed here"
)
def test_mlflow_without_mlflow_is_refused_before_anything_is_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(MLFLOW_SWITCH, "1")
    config = tiny_meta(tmp_path / "run")
    grid = InProcessGrid([client_app(config)] * 4, raise_errors=True)
    with pytest.raises(TrackingError, match="asks for MLflow, which is not installed"):
        run_meta_job(grid, parse_app_config(config))
    assert not (tmp_path / "run").exists()
    split = tiny_split(tmp_path / "split")
    with pytest.raises(TrackingError, match="pip install mlflow"):
        serve(split, [client_app(split)])  # through the ServerApp's main
    assert not (tmp_path / "split").exists()


class FakeMlflow(types.ModuleType):
    """Records the fluent-API calls `fedfields.tracking.MlflowRun` makes."""

    def __init__(self) -> None:
        super().__init__("mlflow")
        self.__spec__ = importlib.machinery.ModuleSpec("mlflow", None)
        self.calls: list[tuple[str, Any]] = []

    def start_run(self, run_id: str | None, run_name: str) -> Any:
        self.calls.append(("start_run", (run_id, run_name)))
        return types.SimpleNamespace(info=types.SimpleNamespace(run_id=run_id or "run-1"))

    def log_params(self, params: dict) -> None:
        self.calls.append(("log_params", params))

    def log_metrics(self, metrics: dict, step: int) -> None:
        self.calls.append(("log_metrics", (metrics, step)))

    def log_artifact(self, path: str, artifact_path: str | None) -> None:
        self.calls.append(("log_artifact", (Path(path).name, artifact_path)))

    def end_run(self, status: str) -> None:
        self.calls.append(("end_run", status))


def test_mlflow_gets_the_params_lines_and_images_and_a_resume_continues_its_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = FakeMlflow()
    monkeypatch.setitem(sys.modules, "mlflow", fake)
    settings = TrackingSettings.from_environ({MLFLOW_SWITCH: "1"})
    (tmp_path / "renders").mkdir()
    Image.fromarray(np.zeros((4, 6, 3), np.uint8)).save(tmp_path / "renders" / "user_00.png")
    with RunTracker(tmp_path, {"seed": 3}, settings) as tracker:
        tracker.log_line({"round": 1, "clean-psnr": 20.0, "flag": True})
        tracker.log_images()
    assert fake.calls == [
        ("start_run", (None, tmp_path.name)),
        ("log_params", {"seed": 3}),
        ("log_metrics", ({"quality/clean-psnr": 20.0}, 1)),
        ("log_artifact", ("user_00.png", "renders")),
        ("end_run", "FINISHED"),
    ]
    assert json.loads((tmp_path / MLFLOW_RUN_FILE).read_text()) == {"run_id": "run-1"}
    fake.calls.clear()
    with pytest.raises(RuntimeError), RunTracker(tmp_path, {"seed": 3}, settings, resumed_after=1):
        raise RuntimeError("the server died")
    assert fake.calls == [("start_run", ("run-1", tmp_path.name)), ("end_run", "FAILED")]
