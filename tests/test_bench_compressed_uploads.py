"""The compression benchmark's parser, plan, run-configs and table, at tiny settings (no run)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from fedfields import atomic
from fedfields.train.builders import global_field
from fedfields.train.federated import federated_state
from simulations.bench.compressed_uploads import (
    Row,
    Setting,
    accepted,
    figure,
    load_rows,
    main,
    parse_args,
    plan,
    read_row,
    run_config_extra,
    save_rows,
    seed_table,
    seeded_runs,
    setting_run_config,
    table,
    upload_bytes,
)
from strategies import parse_app_config


def test_the_plan_is_none_then_each_scheme_at_each_strength_per_strategy_and_sum() -> None:
    args = parse_args(["--schemes", "topk", "quantise", "--fractions", "0.05", "--bits", "4", "2",
                       "--strategies", "fedavg"])  # fmt: skip
    assert [s.name for s in plan(args)] == [
        "fedavg-none", "fedavg-topk-0.05", "fedavg-quantise-4", "fedavg-quantise-2"
    ]  # fmt: skip
    defaults = parse_args([])
    assert len(plan(defaults)) == 2 * (1 + 2 + 3 + 3) and defaults.rounds == 8
    both = parse_args(["--strategies", "decentnerf", "--sums", "plaintext", "secure",
                       "--schemes", "quantise"])  # fmt: skip
    assert [s.name for s in plan(both)][4:6] == ["decentnerf-secure-none",
                                                 "decentnerf-secure-quantise-8"]  # fmt: skip
    down = parse_args(["--strategies", "fedavg", "--schemes", "quantise", "--bits", "4",
                       "--download"])  # fmt: skip
    assert [s.name for s in plan(down)] == ["fedavg-none", "fedavg-quantise-4-down"]


def test_each_setting_is_a_valid_run_config_and_a_refused_one_is_skipped_with_why(
    capsys: pytest.CaptureFixture[str],
) -> None:
    config = setting_run_config(Setting("lowrank", 2), "num-server-rounds=2")
    assert config["compression"] == "lowrank" and config["compression-rank"] == 2
    assert config["strategy"] == "fedavg" and config["num-server-rounds"] == 2
    assert setting_run_config(Setting("none"))["compression"] == "none"
    with pytest.raises(ValueError, match="compression-bits"):
        setting_run_config(Setting("quantise", 3))
    secure = setting_run_config(Setting("quantise", 4, "decentnerf", secure=True))
    assert secure["secure-aggregation"] is True and secure["compression-bits"] == 4
    assert setting_run_config(Setting("quantise", 4, download=True))["compression-download"]
    settings = [Setting("topk", 0.05, "decentnerf", True), Setting("none", None, "decentnerf")]
    assert list(accepted(settings, "")) == settings[1:]
    assert "decentnerf-secure-topk-0.05: refused by the App" in capsys.readouterr().out


def test_a_row_reads_its_run_and_the_table_compares_with_its_own_none(tmp_path: Path) -> None:
    runs = (
        (Setting("none"), [800, 1200], 20.0),
        (Setting("topk", 0.05), [90, 110], 19.6),
        (Setting("none", None, "decentnerf", True), [4000, 4000], 21.0),
        (Setting("quantise", 4, "decentnerf", True), [1000, 1000], 20.9),
        (Setting("quantise", 4, download=True), [125, 125], 19.9),
    )
    rows = []
    for setting, up, psnr in runs:
        run = tmp_path / setting.name
        run.mkdir()
        down = 2 * up[0] if setting.download else 2000
        lines = [
            json.dumps({"round": i + 1, "bytes-up": b, "bytes-down": down})
            for i, b in enumerate(up)
        ]
        (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
        final = {"clean-psnr": psnr, "personal-psnr": 9.5}
        (run / "summary.json").write_text(json.dumps({"seed": 3, "final": final}))
        rows.append(read_row(setting, run, seconds=10.0))
    assert rows[1] == Row(Setting("topk", 0.05), 100.0, 5.0, 19.6, 9.5, 2000.0, seed=3)
    text = table(rows)
    topk = "| fedavg | plaintext | topk 0.05 | 100 | 10.0 | 2,000 | 1.0 | 5.0 | 19.60 | -0.40 |"
    assert topk in text
    secure_row = "| decentnerf | SecAgg+ | quantise 4 | 1,000 | 4.0 | 2,000 | 1.0 | 5.0 | 20.90 |"
    assert secure_row in text
    down = "| fedavg | plaintext | quantise 4, downloads too | 125 | 8.0 | 250 | 8.0 | 5.0 |"
    assert down in text
    atomic.save_figure(tmp_path / "compression.png", figure(rows))
    assert (tmp_path / "compression.png").stat().st_size > 1000


def test_bytes_only_counts_one_upload_of_the_runs_field() -> None:
    """On a small hash grid, counted from the field's shapes: quantise at 4 bits sends
    ceil(n / 2) code bytes, a 4-byte scale and a 1-byte bit width per tensor of n entries."""
    small = "hash-log2-size=10 hash-levels=2"
    config = setting_run_config(Setting("quantise", 4), small)
    sizes = [
        tensor.numel()
        for tensor in federated_state(global_field(parse_app_config(config))).values()
    ]
    sent, full = upload_bytes(Setting("quantise", 4), config)
    assert full == 4 * sum(sizes)
    assert sent == sum(math.ceil(n / 2) + 5 for n in sizes)
    assert upload_bytes(Setting("none"), setting_run_config(Setting("none"), small)) == (full, full)


def test_combine_writes_one_table_and_figure_from_earlier_runs(tmp_path: Path) -> None:
    first, second = tmp_path / "a", tmp_path / "b"
    for folder in (first, second):
        folder.mkdir()
    save_rows(first, [Row(Setting("none"), 100.0, 5.0, 17.0, 4.9)])
    save_rows(second, [Row(Setting("none"), 100.0, 5.0, 17.0, 4.9),
                       Row(Setting("quantise", 2), 10.0, 4.0, 17.1, 4.8)])  # fmt: skip
    main(["--combine", str(first), str(second), "--out", str(tmp_path / "both")])
    text = (tmp_path / "both" / "compression.md").read_text()
    assert text.count("| fedavg | plaintext | none |") == 1  # each setting once
    assert "| fedavg | plaintext | quantise 2 | 10 | 10.0 | - | - |" in text  # no bytes down yet
    assert (tmp_path / "both" / "compression.png").stat().st_size > 1000
    assert load_rows(tmp_path / "both")[1].setting == Setting("quantise", 2)
    (first / "rows.json").write_text('[{"setting": {"scheme": "none"}}')  # cut short
    with pytest.raises(ValueError, match=r"a[/\\]rows.json: not the rows"):
        load_rows(first)


def test_seeds_run_every_setting_at_each_seed_in_turn() -> None:
    args = parse_args(["--strategies", "fedavg", "--schemes", "quantise", "--bits", "2",
                       "--seeds", "0", "1"])  # fmt: skip
    runs = seeded_runs(accepted(plan(args), "num-server-rounds=2"), args.seeds)
    assert [(name, config["seed"]) for name, _, config in runs] == [
        ("fedavg-none-seed0", 0), ("fedavg-quantise-2-seed0", 0),
        ("fedavg-none-seed1", 1), ("fedavg-quantise-2-seed1", 1),
    ]  # fmt: skip
    once = seeded_runs(accepted(plan(parse_args(["--strategies", "fedavg", "--schemes", "topk",
                                                 "--fractions", "0.1"])), ""), None)  # fmt: skip
    assert [name for name, _, _ in once] == ["fedavg-none", "fedavg-topk-0.1"]


def test_the_table_over_seeds_pairs_each_run_with_its_own_seeds_none(tmp_path: Path) -> None:
    """Three seeds of none and quantise 2, written as three bench folders and combined: the
    per-run table shows seed 0, the table over seeds the mean and sample std of the clean PSNR
    and of the paired change (computed here by hand), a setting run once is not in it."""
    none = {0: 17.4, 1: 17.0, 2: 17.9}
    quantise = {0: 17.5, 1: 17.3, 2: 17.8}  # changes +0.1, +0.3, -0.1: mean +0.10, std 0.20
    folders = []
    for seed in (0, 1, 2):
        folder = tmp_path / f"seed{seed}"
        folder.mkdir()
        rows = [Row(Setting("none"), 800.0, 5.0, none[seed], seed=seed),
                Row(Setting("quantise", 2), 50.0, 4.0, quantise[seed], seed=seed)]  # fmt: skip
        if seed == 0:
            rows.append(Row(Setting("topk", 0.01), 25.0, 4.0, 13.0, seed=0))
        save_rows(folder, rows)
        folders.append(str(folder))
    main(["--combine", *folders, "--out", str(tmp_path / "all")])
    text = (tmp_path / "all" / "compression.md").read_text()
    assert "| fedavg | plaintext | quantise 2 | 50 | 16.0 | - | - | 4.0 | 17.50 | +0.10 |" in text
    assert "| fedavg-quantise-2 | 0, 1, 2 | 17.53 ± 0.25 | +0.10 ± 0.20 | 16.0 |" in text
    assert "| fedavg-none | 0, 1, 2 | 17.43 ± 0.45 | +0.00 ± 0.00 | 1.0 |" in text
    assert "fedavg-topk-0.01 |" not in seed_table(load_rows(tmp_path / "all"))
    assert seed_table(load_rows(tmp_path / "seed0")) == ""


def test_runs_wait_for_every_reply_unless_the_run_config_says_otherwise(tmp_path: Path) -> None:
    """A bench run's rounds wait a day (a loaded machine slows a run, it does not cut replies);
    `--run-config` overrides a wait without a duplicate key; a run that missed replies anyway
    says so in its row and the table."""
    patient = run_config_extra(parse_args([]))
    assert setting_run_config(Setting("none"), patient)["round-timeout"] == 86_400.0
    secure = setting_run_config(Setting("quantise", 4, "decentnerf", secure=True), patient)
    assert secure["round-timeout"] == secure["secagg-timeout"] == 86_400.0
    hasty = run_config_extra(parse_args(["--run-config", "round-timeout=5"]))
    assert setting_run_config(Setting("none"), hasty)["round-timeout"] == 5
    stage = run_config_extra(parse_args(["--run-config", "secagg-timeout=7"]))
    secure_none = Setting("none", None, "decentnerf", secure=True)
    assert setting_run_config(secure_none, stage)["secagg-timeout"] == 7
    run = tmp_path / "fedavg-none"
    run.mkdir()
    lines = [{"round": 1, "bytes-up": 800, "bytes-down": 800},
             {"round": 2, "bytes-up": 400, "bytes-down": 800, "num-missing": 4}]  # fmt: skip
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    (run / "summary.json").write_text(json.dumps({"seed": 0, "final": {"clean-psnr": 20.0}}))
    row = read_row(Setting("none"), run, seconds=4.0)
    assert row.missing == 4
    assert "| fedavg | plaintext | none (4 replies missing) | 600 |" in table([row])
