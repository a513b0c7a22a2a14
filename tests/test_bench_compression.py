"""The compression benchmark's parser, plan, run-configs and table, at tiny settings (no run)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from fedfields.train.builders import global_field
from fedfields.train.federated import federated_state
from simulations.bench.compression import (
    Row,
    Setting,
    parse_args,
    plan,
    read_row,
    setting_run_config,
    table,
    upload_bytes,
)
from strategies import parse_app_config


def test_the_plan_is_none_then_each_scheme_at_each_strength() -> None:
    args = parse_args(["--schemes", "topk", "quantise", "--fractions", "0.05", "--bits", "4", "2"])
    assert [s.name for s in plan(args)] == ["none", "topk-0.05", "quantise-4", "quantise-2"]
    defaults = parse_args([])
    assert len(plan(defaults)) == 1 + 2 + 3 + 3 and defaults.rounds == 8


def test_each_setting_is_a_valid_run_config_and_a_bad_one_is_refused() -> None:
    config = setting_run_config(Setting("lowrank", 2), "num-server-rounds=2")
    assert config["compression"] == "lowrank" and config["compression-rank"] == 2
    assert config["strategy"] == "fedavg" and config["num-server-rounds"] == 2
    assert setting_run_config(Setting("none"))["compression"] == "none"
    with pytest.raises(ValueError, match="compression-bits"):
        setting_run_config(Setting("quantise", 3))


def test_a_row_reads_its_run_and_the_table_compares_with_none(tmp_path: Path) -> None:
    for name, up, psnr in (("none", [800, 1200], 20.0), ("topk-0.05", [90, 110], 19.6)):
        run = tmp_path / name
        run.mkdir()
        lines = [json.dumps({"round": i + 1, "bytes-up": b}) for i, b in enumerate(up)]
        (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
        (run / "summary.json").write_text(json.dumps({"final": {"clean-psnr": psnr}}))
    rows = [read_row(Setting("none"), tmp_path / "none"),
            read_row(Setting("topk", 0.05), tmp_path / "topk-0.05")]  # fmt: skip
    assert rows[1] == Row("topk-0.05", 100.0, 19.6)
    assert "| topk-0.05 | 100 | 10.0 | 19.60 | -0.40 |" in table(rows)


def test_bytes_only_counts_one_upload_of_the_runs_field() -> None:
    """On a small hash grid, counted from the field's shapes: quantise at 4 bits sends
    ceil(n / 2) code bytes, a 4-byte scale and a 1-byte bit width per tensor of n entries."""
    small = "hash-log2-size=10 hash-levels=2"
    config = setting_run_config(Setting("quantise", 4), small)
    sizes = [
        tensor.numel()
        for tensor in federated_state(
            global_field(parse_app_config(config))
        ).values()
    ]
    sent, full = upload_bytes(Setting("quantise", 4), config)
    assert full == 4 * sum(sizes)
    assert sent == sum(math.ceil(n / 2) + 5 for n in sizes)
    assert upload_bytes(Setting("none"), setting_run_config(Setting("none"), small)) == (full, full)
