"""Per-round checkpoints a federated run resumes from after its ServerApp died.

After each completed round the ServerApp writes, atomically, what the next round needs: the
global state, the strategy's own state (`ProtocolStrategy.resumable_state`: the method's controls,
moments or bookkeeping), the strategy's node-sampling RNG
(`ProtocolStrategy.sampling_rng`) and torch's RNG. `ProtocolStrategy.start(first_round=k+1)`
then continues from round k; the clients continue from their own node state.

Resuming also reads what the crash may have damaged: config.json must be a whole JSON object,
and metrics.jsonl (appended a line per round, `fedfields.atomic.append_json_line`) loses a
cut-short last line, while a damaged line before it stops the resume naming the line. The
checkpoint is validated whole before any file of the run is touched: its keys and types when
read (`load_round_checkpoint`), then its state against the model the run builds and its
strategy state against the strategy (`RoundCheckpoint.check`); every failure is a ResumeError
naming the file.
"""

from __future__ import annotations

import json
import random
from collections.abc import Mapping
from dataclasses import dataclass, field
from logging import WARNING
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from flwr.app import ArrayRecord
from flwr.common.logger import log
from torch import Tensor

from fedfields import atomic
from fedfields.flower.protocol import arrays_to_state, state_to_arrays

if TYPE_CHECKING:
    from fedfields.flower.strategy import ProtocolStrategy

RESUME_FILE = "resume.pt"
"""The round checkpoint's file name inside a run directory."""
CONFIG_FILE = "config.json"
METRICS_FILE = "metrics.jsonl"
FORMAT = 1


class ResumeError(ValueError):
    """A run cannot be resumed: no checkpoint, an unreadable one, or different settings."""


@dataclass
class RoundCheckpoint:
    """Everything a run needs to go on after round `server_round`."""

    server_round: int
    state: dict[str, Tensor]
    strategy_state: dict[str, Any]
    sampling_rng: tuple[Any, ...]
    torch_rng: Tensor
    extra: dict[str, Any] = field(default_factory=dict)
    source: str = ""
    """The file it was read from, for errors ("" when captured in memory)."""

    @classmethod
    def capture(
        cls,
        server_round: int,
        arrays: ArrayRecord,
        strategy: ProtocolStrategy,
        extra: Mapping[str, Any] | None = None,
    ) -> RoundCheckpoint:
        """The checkpoint of the round that just ended, RNG states as they are now."""
        return cls(
            server_round=server_round,
            state=arrays_to_state(arrays),
            strategy_state=strategy.resumable_state(),
            sampling_rng=strategy.sampling_rng.getstate(),
            torch_rng=torch.get_rng_state(),
            extra=dict(extra or {}),
        )

    def arrays(self) -> ArrayRecord:
        """The global state as the ArrayRecord the next round starts from."""
        return state_to_arrays(self.state)

    def check(self, initial: Mapping[str, Tensor], strategy: ProtocolStrategy) -> None:
        """ResumeError naming the file unless the state has the keys, shapes and dtypes of
        `initial` (the model this run builds) and the strategy takes its state back (the
        strategy's in-memory state is set as a side effect; no file is touched)."""
        where = f"cannot resume: {self.source or 'the checkpoint'}"
        if set(self.state) != set(initial):
            missing, extra = (
                sorted(set(initial) - set(self.state)),
                sorted(set(self.state) - set(initial)),
            )
            raise ResumeError(
                f"{where}: its model has other keys (missing {missing}, extra {extra})"
            )
        for key, value in initial.items():
            saved = self.state[key]
            if saved.shape != value.shape or saved.dtype != value.dtype:
                raise ResumeError(
                    f"{where}: {key!r} is {saved.dtype} {tuple(saved.shape)}, the run's model has "
                    f"{value.dtype} {tuple(value.shape)}"
                )
        try:
            strategy.restore_state(self.strategy_state)
        except Exception as error:  # a missing key, a wrong type, a refused value
            kind = type(error).__name__
            raise ResumeError(
                f"{where}: its strategy state does not fit {type(strategy).__name__} "
                f"({kind}: {error})"
            ) from error

    def restore(self, strategy: ProtocolStrategy) -> None:
        """Put the strategy's state and both RNGs back as they were after `server_round`."""
        strategy.restore_state(self.strategy_state)
        strategy.sampling_rng.setstate(self.sampling_rng)
        torch.set_rng_state(self.torch_rng)


def save_round_checkpoint(path: Path, checkpoint: RoundCheckpoint) -> None:
    """Write `checkpoint` to `path` atomically: a crash leaves the previous file whole."""
    payload = {
        "format": FORMAT,
        "server-round": checkpoint.server_round,
        "state": checkpoint.state,
        "strategy": checkpoint.strategy_state,
        "sampling-rng": checkpoint.sampling_rng,
        "torch-rng": checkpoint.torch_rng,
        "extra": checkpoint.extra,
    }
    atomic.save_torch(path, payload)


PAYLOAD_KEYS = ("format", "server-round", "state", "strategy", "sampling-rng", "torch-rng", "extra")


def load_round_checkpoint(path: Path) -> RoundCheckpoint:
    """The checkpoint at `path`, its keys and types checked (`parse_checkpoint`); ResumeError
    naming the file if it is missing, unreadable or malformed."""
    if not path.is_file():
        raise ResumeError(f"cannot resume: {path} does not exist (no round was completed)")
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # torch.load raises many kinds on a damaged file
        reason = type(error).__name__
        raise ResumeError(f"cannot resume: {path} is unreadable ({reason})") from error
    return parse_checkpoint(payload, str(path))


def parse_checkpoint(payload: Any, source: str) -> RoundCheckpoint:
    """A `RoundCheckpoint` from what `save_round_checkpoint` wrote; ResumeError naming
    `source` and the key for a wrong format, a missing key, a wrong type, a round below 1, a
    non-finite model tensor or an RNG state Python or torch would refuse."""

    def bad(what: str) -> ResumeError:
        return ResumeError(f"cannot resume: {source} {what}")

    if not isinstance(payload, dict):
        raise bad(f"holds a {type(payload).__name__}, not a checkpoint")
    if payload.get("format") != FORMAT:
        raise bad(f"has format {payload.get('format')!r}, expected {FORMAT}")
    if missing := [key for key in PAYLOAD_KEYS if key not in payload]:
        raise bad(f"lacks {missing}")
    server_round = payload["server-round"]
    if isinstance(server_round, bool) or not isinstance(server_round, int) or server_round < 1:
        raise bad(f"has server-round {server_round!r}, not a round >= 1")
    state = payload["state"]
    if not isinstance(state, dict) or not state:
        raise bad("has no model state")
    for key, value in state.items():
        if not isinstance(key, str) or not isinstance(value, Tensor):
            raise bad(f"has a model entry {key!r} that is not a named tensor")
        if value.is_floating_point() and not bool(torch.isfinite(value).all()):
            raise bad(f"has NaN or infinite values in {key!r}")
    for key in ("strategy", "extra"):
        if not isinstance(payload[key], dict):
            raise bad(f"has {key!r} of type {type(payload[key]).__name__}, not a mapping")
    sampling_rng = payload["sampling-rng"]
    try:
        random.Random().setstate(tuple(sampling_rng))
    except (TypeError, ValueError) as error:
        raise bad(f"has a damaged sampling-rng ({error})") from error
    torch_rng = payload["torch-rng"]
    if not isinstance(torch_rng, Tensor) or torch_rng.dtype != torch.uint8:
        raise bad("has a torch-rng that is not torch's byte state")
    try:
        torch.Generator().set_state(torch_rng)
    except RuntimeError as error:
        raise bad(f"has a damaged torch-rng ({error})") from error
    return RoundCheckpoint(
        server_round=server_round,
        state=dict(state),
        strategy_state=dict(payload["strategy"]),
        sampling_rng=tuple(sampling_rng),
        torch_rng=torch_rng,
        extra=dict(payload["extra"]),
        source=source,
    )


def read_run_config(run_dir: Path) -> dict[str, Any]:
    """The run-config a run saved in `run_dir`/config.json; ResumeError naming the file when
    it is missing, not JSON (e.g. cut short) or not a JSON object."""
    path = Path(run_dir) / CONFIG_FILE
    if not path.is_file():
        raise ResumeError(f"cannot resume: {path} does not exist (not a fedfields run)")
    try:
        saved = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ResumeError(f"cannot resume: {path} is damaged, not JSON ({error})") from error
    if not isinstance(saved, dict):
        kind = type(saved).__name__
        raise ResumeError(f"cannot resume: {path} holds a JSON {kind}, not the run-config object")
    return saved


def resumed_history(run_dir: Path, last_round: int) -> list[dict[str, Any]]:
    """metrics.jsonl's lines of rounds 1..`last_round`, the file rewritten atomically to hold
    only them: a cut-short last line (the crash's) is dropped with a log line, a damaged line
    before it is a ResumeError naming the file and line."""
    path = Path(run_dir) / METRICS_FILE
    lines = path.read_bytes().split(b"\n") if path.is_file() else []
    numbered = [(number, line) for number, line in enumerate(lines, 1) if line.strip()]
    history = []
    for number, line in numbered:
        try:
            record = json.loads(line)
            if not isinstance(record, dict) or not isinstance(record.get("round"), int):
                raise ValueError("not an object with an integer 'round'")
        except ValueError as error:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
            if number == numbered[-1][0]:
                log(WARNING, "fedfields: dropping %s line %d, cut short by the crash", path, number)
                break
            raise ResumeError(
                f"cannot resume: {path} line {number} is damaged ({error})"
            ) from error
        if record["round"] <= last_round:
            history.append(record)
    atomic.write_json_lines(path, history)
    return history
