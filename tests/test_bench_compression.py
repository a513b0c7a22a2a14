"""The compression benchmark's parser, plan, run-configs and table, at tiny settings (no run)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from simulations.bench.compression import (
    Row,
    Setting,
    parse_args,
    plan,
    read_row,
    setting_run_config,
    table,
)


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
