"""Atomic writes: every file a run or a node writes is either its old version or its new one.

A file is written whole to a hidden temporary file in the same directory (`.<name>.<id>.partial`),
flushed and fsynced, renamed over the target (`os.replace`, atomic on POSIX), and the directory
is fsynced so the rename survives a power cut. A writer that fails part-way removes its
temporary file and leaves the old file as it was; one killed outright (SIGKILL) may leave a
hidden `.partial` file, never a half-written target.

Append-only JSON-lines files (metrics.jsonl) are the one exception, since rewriting them each
round would cost a copy per round: `append_json_line` writes one whole line in a single
`write`, then flushes and fsyncs, so a crash can cut short only the last line. Readers that
must go on after a crash (`fedfields.flower.resume.resumed_history`) drop a cut-short last
line and rewrite the file atomically without it.
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any, Protocol

import torch

PARTIAL_SUFFIX = ".partial"


class Figure(Protocol):
    """What `save_figure` needs of a matplotlib Figure."""

    def savefig(self, fname: IO[bytes], **kwargs: Any) -> None: ...


class Image(Protocol):
    """What `save_image` needs of a PIL Image."""

    def save(self, fp: IO[bytes], format: str | None = None) -> None: ...


@contextmanager
def replacing(path: str | Path) -> Iterator[IO[bytes]]:
    """A binary file that replaces `path` atomically when the block ends without an error;
    on an error the temporary file is removed and `path` keeps its old content (if any)."""
    path = Path(path)
    partial = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}{PARTIAL_SUFFIX}")
    out = partial.open("xb")  # exclusive: never another writer's temporary file
    try:
        with out:
            yield out
            out.flush()
            os.fsync(out.fileno())
        os.replace(partial, path)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    _fsync_directory(path.parent)


def write_bytes(path: str | Path, data: bytes) -> None:
    """Replace `path` with `data`, atomically."""
    with replacing(path) as out:
        out.write(data)


def write_text(path: str | Path, text: str) -> None:
    """Replace `path` with `text` (UTF-8), atomically."""
    write_bytes(path, text.encode("utf-8"))


def write_json(path: str | Path, value: Any) -> None:
    """Replace `path` with `value` as indented JSON, atomically."""
    write_text(path, json.dumps(value, indent=2))


def write_json_lines(path: str | Path, values: list[Any]) -> None:
    """Replace `path` with one JSON line per value, atomically."""
    write_text(path, "".join(json.dumps(value) + "\n" for value in values))


def save_torch(path: str | Path, payload: Any) -> None:
    """`torch.save(payload)` to `path`, atomically; keep `payload` to tensors and plain
    containers so that `torch.load(..., weights_only=True)` reads it back."""
    with replacing(path) as out:
        torch.save(payload, out)


def load_torch(path: str | Path, what: str) -> Any:
    """What `save_torch` wrote to `path`, on the CPU; a ValueError naming the file and `what`
    it should hold when it is cut short or damaged (torch raises many kinds for that)."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise
    except Exception as error:
        kind = type(error).__name__
        raise ValueError(
            f"{path} is not a readable {what} (cut short or damaged: {kind})"
        ) from None


def save_figure(path: str | Path, figure: Figure, **savefig: Any) -> None:
    """A matplotlib figure saved to `path` (format from its suffix), atomically."""
    with replacing(path) as out:
        figure.savefig(out, format=Path(path).suffix.lstrip(".") or "png", **savefig)


def save_image(path: str | Path, image: Image) -> None:
    """A PIL image saved to `path` (format from its suffix), atomically."""
    suffix = Path(path).suffix.lstrip(".").upper() or "PNG"
    with replacing(path) as out:
        image.save(out, format="JPEG" if suffix == "JPG" else suffix)


def append_json_line(path: str | Path, value: Any) -> None:
    """Append `value` as one JSON line in one write, flushed and fsynced: a crash can cut
    short only this last line, which resuming drops."""
    line = (json.dumps(value) + "\n").encode("utf-8")
    with Path(path).open("ab") as out:
        out.write(line)
        out.flush()
        os.fsync(out.fileno())


def _fsync_directory(directory: Path) -> None:
    """Make a rename inside `directory` durable (a no-op where directories cannot be opened)."""
    if not hasattr(os, "O_DIRECTORY"):
        return
    descriptor = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
