"""Each method is one Flower-free module of fedfields.methods, and the generic round names none.

The first test imports every module of the package in a fresh interpreter and fails if Flower
came with it; the second reads the generic round's modules for any registered method's name
(the text, docstrings included: what a newcomer reads).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import strategies

ROOT = Path(__file__).resolve().parents[1]
METHODS = ROOT / "fedfields" / "methods"
GENERIC_ROUND = (
    "fedfields/methods/base.py",
    "fedfields/methods/settings.py",
    "fedfields/methods/states.py",
    "fedfields/flower/method_strategy.py",
    "fedfields/flower/round_loop.py",
    "fedfields/flower/sampling.py",
    "fedfields/flower/streaming.py",
    "fedfields/flower/strategy_options.py",
    "fedfields/flower/user_keys.py",
    "fedfields/flower/evaluation.py",
    "fedfields/flower/secure_sum.py",
    "fedfields/downloads.py",
    "fedfields/compression.py",
)
"""Modules every method's round passes through that already name none (the others are listed
in docs/LIBRARY.md with why they still do)."""


def test_no_module_of_fedfields_methods_imports_flower() -> None:
    names = sorted(f"fedfields.methods.{p.stem}" for p in METHODS.glob("*.py"))
    script = (
        "import importlib, sys\n"
        f"for name in {names!r}: importlib.import_module(name)\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('flwr', 'ray')))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[]", f"fedfields.methods imported {out.stdout.strip()}"
    assert len(names) >= 10  # the package was found: the check is not vacuous


def test_the_generic_round_names_no_method() -> None:
    names = [name for name in strategies.STRATEGIES if name != "fedavg"] + ["proximal"]
    pattern = re.compile("|".join(names), re.IGNORECASE)
    found = {
        path: sorted({m.group(0).lower() for m in pattern.finditer((ROOT / path).read_text())})
        for path in GENERIC_ROUND
    }
    assert {path: hits for path, hits in found.items() if hits} == {}
    assert pattern.search("Scaffold's control") is not None  # the pattern does match names
