"""`fedfields.atomic`: a write that fails or is killed part-way leaves the old file whole and,
unless killed outright, no temporary file; and every run and node file goes through it."""

from __future__ import annotations

import ast
import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from matplotlib.figure import Figure
from PIL import Image

from fedfields import atomic

ROOT = Path(__file__).resolve().parents[1]
OLD = {"round": 1, "kept": True}

WRITE_CALLS = {"write_text", "write_bytes", "savefig", "save"}
"""Calls that write a file in place: pathlib's, matplotlib's, torch's, numpy's and PIL's."""
IN_PLACE_ALLOWED = {
    "fedfields/atomic.py": "the one implementation",
    "strategies/reference.py": "a developer tool regenerating docs/RUN_CONFIG.md",
    "fedfields/data/crowd/writer.py": "builds the crowd in a hidden staging folder, renamed whole",
    "fedfields/data/objects.py": "builds the collection in a hidden staging folder, renamed whole",
    "fedfields/report.py:_curve_group": "draws into an in-memory buffer",
    "simulations/deploy.py": "SuperLink/SuperNode logs streamed as they run; the CLI's config",
    "simulations/certificates.py": "TLS files made once before anything starts",
    "simulations/sweep.py:execute": "each run's launcher log, appended as the launcher runs",
    "simulations/sweep.py:locked": "the sweep folder's empty lock file, held with flock",
}
"""Where a file may be written without `fedfields.atomic`, and why."""


def files_in(directory: Path) -> list[str]:
    """Every name in `directory`, hidden ones (temporary files) included."""
    return sorted(path.name for path in directory.iterdir())


def test_each_flavour_replaces_the_file_whole(tmp_path: Path) -> None:
    target = tmp_path / "summary.json"
    target.write_text("old")
    atomic.write_json(target, OLD)
    assert json.loads(target.read_text()) == OLD
    atomic.write_json_lines(tmp_path / "alphas.jsonl", [OLD, OLD])
    assert (tmp_path / "alphas.jsonl").read_text() == 2 * (json.dumps(OLD) + "\n")
    atomic.write_bytes(tmp_path / "blob", b"\x00\xff")
    assert (tmp_path / "blob").read_bytes() == b"\x00\xff"
    atomic.save_torch(tmp_path / "state.pt", {"w": torch.arange(3.0), "meta": ["a", 1]})
    loaded = torch.load(tmp_path / "state.pt", weights_only=True)
    assert torch.equal(loaded["w"], torch.arange(3.0)) and loaded["meta"] == ["a", 1]
    figure = Figure(figsize=(1, 1))
    figure.subplots().plot([0, 1])
    atomic.save_figure(tmp_path / "curve.png", figure, dpi=20)
    atomic.save_image(tmp_path / "photo.jpg", Image.new("RGB", (3, 2), "red"))
    with Image.open(tmp_path / "curve.png") as png, Image.open(tmp_path / "photo.jpg") as jpg:
        assert (png.format, jpg.format, jpg.size) == ("PNG", "JPEG", (3, 2))
    assert files_in(tmp_path) == sorted(
        ["summary.json", "alphas.jsonl", "blob", "state.pt", "curve.png", "photo.jpg"]
    )


def test_a_new_file_gets_the_same_permissions_as_a_plain_write(tmp_path: Path) -> None:
    (tmp_path / "plain").write_text("x")
    atomic.write_text(tmp_path / "atomic", "x")
    assert (tmp_path / "atomic").stat().st_mode == (tmp_path / "plain").stat().st_mode


def test_a_writer_failing_mid_way_leaves_the_old_file_and_no_temporary(tmp_path: Path) -> None:
    target = tmp_path / "config.json"
    atomic.write_json(target, OLD)
    with pytest.raises(RuntimeError, match="crash"), atomic.replacing(target) as out:
        out.write(b'{"round": 2, "cut')
        raise RuntimeError("crash while writing")
    with pytest.raises(TypeError):  # json.dumps fails before anything is written
        atomic.write_json(target, {"bad": object()})
    with pytest.raises(AttributeError):  # torch.save fails part-way through its archive
        atomic.save_torch(tmp_path / "config.json", {"w": torch.zeros(8), "f": lambda: 0})
    assert json.loads(target.read_text()) == OLD
    assert files_in(tmp_path) == ["config.json"]


@pytest.mark.parametrize("failing", ["replace", "fsync"])
def test_a_failed_rename_or_fsync_leaves_the_old_file_and_no_temporary(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, failing: str
) -> None:
    target = tmp_path / "resume.pt"
    atomic.save_torch(target, {"round": 1})

    def fail(*args: object) -> None:
        raise OSError(f"{failing} failed")

    monkeypatch.setattr(atomic.os, failing, fail)
    with pytest.raises(OSError, match=f"{failing} failed"):
        atomic.save_torch(target, {"round": 2})
    monkeypatch.undo()
    assert torch.load(target, weights_only=True) == {"round": 1}
    assert files_in(tmp_path) == ["resume.pt"]


def test_a_process_killed_mid_write_leaves_the_old_file(tmp_path: Path) -> None:
    """A real writer killed by SIGKILL half-way: the target keeps its old content; only the
    hidden temporary file remains (no cleanup runs after SIGKILL)."""
    target = tmp_path / "summary.json"
    atomic.write_json(target, OLD)
    writer = (
        "import os, signal, sys\n"
        "from fedfields import atomic\n"
        "with atomic.replacing(sys.argv[1]) as out:\n"
        '    out.write(b\'{"round": 2, "cu\'); out.flush()\n'
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    process = subprocess.run([sys.executable, "-c", writer, str(target)], cwd=ROOT, timeout=120)
    assert process.returncode == -signal.SIGKILL
    assert json.loads(target.read_text()) == OLD
    leftover = [name for name in files_in(tmp_path) if name != "summary.json"]
    assert len(leftover) == 1 and leftover[0].startswith(".summary.json.")
    assert leftover[0].endswith(atomic.PARTIAL_SUFFIX)


def test_appended_lines_are_whole_json_lines(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    for server_round in (1, 2, 3):
        atomic.append_json_line(path, {"round": server_round, "psnr": 10.0 + server_round})
    lines = path.read_text().splitlines(keepends=True)
    assert [json.loads(line)["round"] for line in lines] == [1, 2, 3]
    assert all(line.endswith("\n") for line in lines)


class InPlaceWrites(ast.NodeVisitor):
    """Collects `<file>:<function>:<line> <call>` for each in-place file write of a module."""

    def __init__(self, file: str) -> None:
        self.file, self.functions, self.found = file, ["<module>"], []

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        self.functions.append(node.name)
        self.generic_visit(node)
        self.functions.pop()

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
        modes = [str(arg.value) for arg in node.args if isinstance(arg, ast.Constant)]
        opened = name == "open" and any(set(mode) & set("wax+") for mode in modes)
        through_atomic = (
            isinstance(func, ast.Attribute) and getattr(func.value, "id", "") == "atomic"
        )
        if (name in WRITE_CALLS or opened) and not through_atomic:
            self.found.append(f"{self.file}:{self.functions[-1]}:{node.lineno} {name}")
        self.generic_visit(node)


def in_place_writes(path: Path) -> list[str]:
    """Every in-place file write in the module at `path`."""
    visitor = InPlaceWrites(str(path.relative_to(ROOT)))
    visitor.visit(ast.parse(path.read_text()))
    return visitor.found


def test_every_run_and_node_file_is_written_atomically() -> None:
    """No module of the library, the clients or the jobs writes a file in place, except those
    `IN_PLACE_ALLOWED` names (the benchmarks' result files are not run files)."""
    modules = [*(ROOT / "fedfields").rglob("*.py"), *(ROOT / "clients").rglob("*.py")]
    modules += [p for p in (ROOT / "simulations").rglob("*.py") if "bench" not in p.parts]
    offending = []
    for module in modules:
        for write in in_place_writes(module):
            file, function = write.split(":")[:2]
            if file not in IN_PLACE_ALLOWED and f"{file}:{function}" not in IN_PLACE_ALLOWED:
                offending.append(write)
    assert offending == []
    assert in_place_writes(ROOT / "fedfields" / "report.py")  # the scan does find calls
