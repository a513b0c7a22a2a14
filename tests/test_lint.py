"""The repository is `ruff` clean, lint and format both (`make lint`), so CI holds the style."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("check", [["check"], ["format", "--check"]], ids=" ".join)
def test_ruff_finds_nothing(check: list[str]) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "ruff", *check, "."],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-1000:]
