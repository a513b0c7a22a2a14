"""A run's experiment tracking: TensorBoard event files beside metrics.jsonl, MLflow on request.

Every run directory gets TensorBoard event files (`events.out.tfevents.*`, torch's
`SummaryWriter`), so `tensorboard --logdir runs` lists every run and sweep under runs/: each
metrics line's numbers as scalars `<group>/<metric>` in report.html's curve groups (quality,
privacy, cost, health, other) against the line's round (or step); the run-config as
hyper-parameters (TensorBoard's HParams tab); at the end the run directory's images (renders,
figures; a GIF's frames as one grid) at the last step. Only what the run directory holds goes
in: a secure run's per-user renders stay in `<run-dir>.audit/`.

Each launch writes its own event file. A resumed launch starts its file with a purge at its
first round, so TensorBoard drops what a crashed launch wrote of the rounds run again and no
curve doubles or goes backwards; the hyper-parameters are written once, by the first launch.

MLflow is optional (not a dependency): `FEDFIELDS_MLFLOW=1` in the environment of the process
that runs the job also logs the scalars, the run-config as params and the images as artifacts
to an MLflow run named after the run directory, at MLflow's own `MLFLOW_TRACKING_URI` and
`MLFLOW_EXPERIMENT_NAME`; a resumed launch continues that MLflow run (its id is kept in
mlflow-run.json). Without mlflow installed the switch is refused before the run writes anything.
"""

from __future__ import annotations

import importlib.util
import json
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import imageio.v3 as iio
import numpy as np
from tensorboard.plugins.hparams.summary_v2 import hparams_pb
from torch.utils.tensorboard import SummaryWriter

from fedfields import atomic
from fedfields.report import CURVE_X_KEYS, curve_group

MLFLOW_SWITCH = "FEDFIELDS_MLFLOW"
MLFLOW_RUN_FILE = "mlflow-run.json"  # in the run directory: the MLflow run a resume continues
SWITCH_ON = frozenset({"1", "true", "yes", "on"})
SWITCH_OFF = frozenset({"", "0", "false", "no", "off"})
IMAGE_SUFFIXES = (".png", ".gif")


class TrackingError(RuntimeError):
    """Tracking was asked for that this installation cannot do (MLflow without mlflow)."""


@dataclass(frozen=True)
class TrackingSettings:
    """Where a run is tracked besides its TensorBoard event files."""

    mlflow: bool = False

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> TrackingSettings:
        """`FEDFIELDS_MLFLOW` of `environ` (default os.environ); `TrackingError` for a value
        that is neither on nor off, or on without mlflow installed: refused before any write."""
        raw = (os.environ if environ is None else environ).get(MLFLOW_SWITCH, "")
        value = raw.strip().lower()
        if value not in SWITCH_ON | SWITCH_OFF:
            raise TrackingError(f"{MLFLOW_SWITCH}={raw!r}: set it to 1 (MLflow on) or 0 (off)")
        if value in SWITCH_ON and importlib.util.find_spec("mlflow") is None:
            raise TrackingError(
                f"{MLFLOW_SWITCH}={raw!r} asks for MLflow, which is not installed: "
                f"`pip install mlflow`, or unset {MLFLOW_SWITCH}"
            )
        return cls(mlflow=value in SWITCH_ON)


def x_axis(line: Mapping[str, Any]) -> tuple[str, int]:
    """(key, value) of the round (or step) a metrics line is about: report.html's x axis."""
    for key in CURVE_X_KEYS:
        if key in line:
            return key, int(line[key])
    raise ValueError(f"a metrics line needs one of {CURVE_X_KEYS}; it has {sorted(line)}")


def scalar_tags(line: Mapping[str, Any], x_key: str) -> dict[str, float]:
    """The line's numbers (its x axis aside) as tags `<report.html's group>/<metric>`."""
    return {
        f"{curve_group(key)}/{key}": float(value)
        for key, value in line.items()
        if key != x_key and isinstance(value, int | float) and not isinstance(value, bool)
    }


def image_files(run_dir: Path) -> list[Path]:
    """The run directory's PNGs and GIFs, relative to it and sorted; hidden folders and the
    temporary files of atomic writes skipped."""
    return sorted(
        path.relative_to(run_dir)
        for path in run_dir.rglob("*")
        if path.suffix in IMAGE_SUFFIXES
        and path.is_file()
        and not any(part.startswith(".") for part in path.relative_to(run_dir).parts)
    )


def read_frames(path: Path) -> np.ndarray:
    """An image file's frames as uint8 RGB [N, H, W, 3] (one frame for a PNG)."""
    frames = iio.imread(path, index=None, mode="RGB")
    return frames if frames.ndim == 4 else frames[None]


def image_tag(relative: Path) -> str:
    """An image's tag: its path in the run directory without the suffix (renders/user_00)."""
    return relative.with_suffix("").as_posix()


class MlflowRun:
    """The run's MLflow run through MLflow's fluent API (its environment picks the tracking
    server and experiment); a launch continues the run whose id mlflow-run.json keeps."""

    def __init__(self, run_dir: Path, run_config: Mapping[str, Any]) -> None:
        import mlflow  # optional: `TrackingSettings.from_environ` checked it is installed

        self.mlflow = mlflow
        saved = run_dir / MLFLOW_RUN_FILE
        run_id = json.loads(saved.read_text())["run_id"] if saved.is_file() else None
        run = mlflow.start_run(run_id=run_id, run_name=run_dir.name)
        if run_id is None:
            atomic.write_json(saved, {"run_id": run.info.run_id})
            mlflow.log_params(dict(run_config))

    def log_scalars(self, scalars: Mapping[str, float], step: int) -> None:
        """One metrics line's tags and values at `step`."""
        self.mlflow.log_metrics(dict(scalars), step=step)

    def log_image(self, path: Path, relative: Path) -> None:
        """An image file as an artifact, under its folder in the run directory."""
        folder = relative.parent.as_posix()
        self.mlflow.log_artifact(str(path), artifact_path=None if folder == "." else folder)

    def end(self, failed: bool) -> None:
        """End the MLflow run as FINISHED, or FAILED when the launch raised."""
        self.mlflow.end_run(status="FAILED" if failed else "FINISHED")


EVENT_FILE_PREFIX = "events.out.tfevents."


def wait_to_sort_last(run_dir: Path) -> None:
    """Wait (under a second) until the clock's second is past every event file's in `run_dir`.

    TensorBoard reads a run's event files in name order, and a name is the creation second,
    then the host, the PID and a per-process counter compared as text: two launches in one
    second of one process could be read out of order ('.10' before '.9'), so a resumed
    launch's purge would come before the rounds it purges."""
    seconds = [
        int(stamp)
        for path in run_dir.glob(f"{EVENT_FILE_PREFIX}*")
        if (stamp := path.name[len(EVENT_FILE_PREFIX) :].split(".")[0]).isdigit()
    ]
    if seconds:
        time.sleep(max(0.0, max(seconds) + 1 - time.time()))


class RunTracker:
    """One launch's tracking of the run in `run_dir` (module docstring); `resumed_after` is
    the last round a resumed launch keeps (None: the run starts). A context manager: leaving
    it, on success or error, flushes and closes the event file (and ends the MLflow run)."""

    def __init__(
        self,
        run_dir: Path,
        run_config: Mapping[str, Any],
        settings: TrackingSettings,
        resumed_after: int | None = None,
    ) -> None:
        self.run_dir = run_dir
        self.step = resumed_after or 0
        self.mlflow = MlflowRun(run_dir, run_config) if settings.mlflow else None
        purge_step = None if resumed_after is None else resumed_after + 1
        wait_to_sort_last(run_dir)
        self.writer = SummaryWriter(log_dir=str(run_dir), purge_step=purge_step)
        if resumed_after is None:
            self.writer.file_writer.add_summary(hparams_pb(dict(run_config)))

    def log_line(self, line: Mapping[str, Any]) -> None:
        """A metrics line's numbers as scalars at its round (or step), flushed: a running
        TensorBoard shows the round, and a killed server loses none."""
        x_key, self.step = x_axis(line)
        scalars = scalar_tags(line, x_key)
        for tag, value in scalars.items():
            self.writer.add_scalar(tag, value, self.step)
        self.writer.flush()
        if self.mlflow is not None:
            self.mlflow.log_scalars(scalars, self.step)

    def log_images(self) -> None:
        """The run directory's images at the last step logged (the run's final figures)."""
        for relative in image_files(self.run_dir):
            path = self.run_dir / relative
            frames = read_frames(path)
            self.writer.add_images(image_tag(relative), frames, self.step, dataformats="NHWC")
            if self.mlflow is not None:
                self.mlflow.log_image(path, relative)

    def close(self, failed: bool = False) -> None:
        """Flush and close the event file; end the MLflow run (FAILED when `failed`)."""
        self.writer.close()
        if self.mlflow is not None:
            self.mlflow.end(failed)

    def __enter__(self) -> RunTracker:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close(failed=exc_type is not None)
