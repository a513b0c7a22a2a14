"""What every pipeline's audit shares: its settings, its result, and the run directory it reads.

A run directory is what a fedfields job wrote: config.json (the run-config), checkpoint.pt,
metrics.jsonl and summary.json. The audit is the experimenter's tool, not the server's: it
reads the ground truth the run-config names (`data-dir`), which a deployed server never opens.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from fedfields.config import FederatedConfig, without_ignored_keys

CONFIG_FILE = "config.json"
CHECKPOINT_FILE = "checkpoint.pt"
SUMMARY_FILE = "summary.json"
METRICS_FILE = "metrics.jsonl"
PIPELINES = ("scene", "meta", "split")


class RunError(ValueError):
    """A path that cannot be audited; the message names the path and why."""


@dataclass(frozen=True)
class AuditConfig:
    """Settings of an audit: seeds, how much of the ground truth to score, progress bars.

    `max_views` caps each scene user's views (None: all); `max_clients` caps the meta clients
    whose query sets are scored (None: all); `sdar_aux` is the procedural object the SDAR
    attacker owns (its auxiliary scene). `device` renders and optimises the scene and meta
    audits (auto: CUDA when visible); the split audit's attacks run on the CPU.
    """

    seed: int = 0
    max_views: int | None = None
    max_clients: int | None = None
    sdar_aux: str = "car"
    progress: bool = True
    device: str = "auto"

    def __post_init__(self) -> None:
        for name in ("max_views", "max_clients"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1 or None, got {value}")


@dataclass
class AuditResult:
    """One run's audit: utility and leakage measured now, the run's own recorded figures,
    the attacks skipped (name -> why), and which two numbers sum it up (`headline`)."""

    run_dir: Path
    pipeline: str
    label: str  # what ran: the strategy (scene), meta-learner/strategy/task (meta), "split"
    headline: tuple[str, str, str | None]  # utility key, leakage key, reference key (or None)
    utility: dict[str, float | None] = field(default_factory=dict)
    leakage: dict[str, float | None] = field(default_factory=dict)
    reference: dict[str, float | None] = field(default_factory=dict)  # leakage of no-leak
    recorded: dict[str, float] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    settings: dict[str, Any] = field(default_factory=dict)

    @property
    def name(self) -> str:
        """The run directory's name: the run's label in the table and the figure."""
        return self.run_dir.name

    def headline_values(self) -> tuple[float | None, float | None, float | None]:
        """(utility, leakage, reference) of the headline keys."""
        utility_key, leakage_key, reference_key = self.headline
        reference = self.reference.get(reference_key) if reference_key else None
        return self.utility.get(utility_key), self.leakage.get(leakage_key), reference

    def to_json(self) -> dict[str, Any]:
        """audit.json's content."""
        utility_key, leakage_key, reference_key = self.headline
        return {
            "run": str(self.run_dir),
            "pipeline": self.pipeline,
            "label": self.label,
            "headline": {
                "utility": utility_key,
                "leakage": leakage_key,
                "reference": reference_key,
            },
            "utility": self.utility,
            "leakage": self.leakage,
            "reference": self.reference,
            "recorded-during-the-run": self.recorded,
            "skipped": self.skipped,
            "settings": self.settings,
        }


@dataclass(frozen=True)
class RunInfo:
    """A checked run directory: its run-config (raw and parsed) and its pipeline."""

    run_dir: Path
    run_config: dict[str, Any]
    config: FederatedConfig
    pipeline: str

    def summary(self) -> dict[str, Any]:
        """summary.json ({} when the run wrote none)."""
        path = self.run_dir / SUMMARY_FILE
        return json.loads(path.read_text()) if path.is_file() else {}

    def metric_lines(self) -> list[dict[str, Any]]:
        """metrics.jsonl, one dict per round or block ([] when absent)."""
        path = self.run_dir / METRICS_FILE
        if not path.is_file():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def pipeline_of(config: FederatedConfig) -> str:
    """ "split" (mode split), "scene" (federated NeRF of a crowd) or "meta" (FedMeNF tasks)."""
    if config.common.mode == "split":
        return "split"
    return "scene" if config.common.task == "scene" else "meta"


def needs_data_dir(config: FederatedConfig) -> bool:
    """Whether the audit reads ground truth from run-config `data-dir` (faces and video come
    from scikit-image's data instead)."""
    return pipeline_of(config) != "meta" or config.common.task == "objects"


def open_run(path: Path) -> RunInfo:
    """Check that `path` is a finished fedfields run the audit can read; RunError if not."""
    if not path.is_dir():
        raise RunError(f"{path}: not a directory")
    if not (path / CONFIG_FILE).is_file():
        raise RunError(f"{path}: not a fedfields run (no {CONFIG_FILE})")
    try:
        run_config = json.loads((path / CONFIG_FILE).read_text())
        config = FederatedConfig.from_run_config(without_ignored_keys(run_config))
    except ValueError as error:
        raise RunError(f"{path / CONFIG_FILE}: not a fedfields run-config: {error}") from error
    if not (path / CHECKPOINT_FILE).is_file():
        raise RunError(f"{path}: no {CHECKPOINT_FILE}: the run did not finish, nothing to audit")
    data_dir = config.deployment.data_dir
    if needs_data_dir(config) and not (data_dir and Path(data_dir).is_dir()):
        raise RunError(
            f"{path}: run-config 'data-dir' {data_dir!r} is missing: the audit reads the "
            "ground truth there (the users' photos and masks, or the client's scene)"
        )
    return RunInfo(path, run_config, config, pipeline_of(config))


def progress_bar(items: list[Any], desc: str, config: AuditConfig) -> Iterator[Any]:
    """`items` with a tqdm bar on stderr (none with `config.progress` off)."""
    return iter(tqdm(items, desc=desc, disable=not config.progress, leave=False))


def counted(call: Callable[..., Any], total: int, desc: str, config: AuditConfig) -> Callable:
    """`call` wrapped so that each call advances a tqdm bar of `total` steps."""
    bar = tqdm(total=total, desc=desc, disable=not config.progress, leave=False)

    def advance(*args: Any) -> Any:
        result = call(*args)
        bar.update()
        if bar.n >= total:
            bar.close()
        return result

    return advance


def last_values(lines: list[dict[str, Any]], keys: tuple[str, ...]) -> dict[str, float]:
    """The last value of each of `keys` in the run's metric lines (keys never seen are left
    out): what the run's observers recorded in its final round."""
    found: dict[str, float] = {}
    for line in lines:
        found |= {key: float(line[key]) for key in keys if isinstance(line.get(key), int | float)}
    return found
