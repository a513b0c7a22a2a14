"""The demo's quality guard (`python -m simulations.bench.regression`): the figures it reads
from docs/BENCHMARKS.md, its verdicts against them, and the sweep it would launch."""

from __future__ import annotations

from pathlib import Path

import pytest

from simulations import APP_DIR, sweep
from simulations.bench import regression
from simulations.bench.regression import Comparison, Figure, compare, recorded_figures

PAGE = """# Results

## Demo regression guard

| strategy | seed | rounds | clean PSNR (dB) | date | command |
|---|---|---|---|---|---|
| decentnerf | 0 | 8 | 20.837 | 2026-12-04 | (r0) |
| `fedavg` | 0 | 8 | 21.99 | 2026-12-04 | (r0) |

## Next section

| decentnerf | 1 | 8 | 99.0 | not this section's |
"""


def test_the_recorded_figures_are_the_guard_sections_rows_only() -> None:
    assert recorded_figures(PAGE) == [
        Figure("decentnerf", 0, 8, 20.837),
        Figure("fedavg", 0, 8, 21.99),
    ]


def test_the_results_page_records_the_guarded_settings() -> None:
    figures = recorded_figures((APP_DIR / "docs" / "BENCHMARKS.md").read_text())
    guarded = {(f.strategy, f.seed, f.rounds) for f in figures}
    assert {("decentnerf", 0, 8), ("fedavg", 0, 8)} <= guarded


@pytest.mark.parametrize(
    ("markdown", "reason"),
    [("# Results\n", "no section headed"), ("## Demo regression guard\n\ntext\n", "no figure")],
)
def test_a_page_without_figures_is_one_error_naming_it(markdown: str, reason: str) -> None:
    with pytest.raises(ValueError, match=f"page.md: .*{reason}"):
        recorded_figures(markdown, "page.md")


def test_a_change_beyond_the_tolerance_is_flagged_and_one_within_is_not() -> None:
    recorded = recorded_figures(PAGE)
    today = {"decentnerf": 20.837 + 0.1, "fedavg": 21.99 - 0.1001}
    found = compare(recorded, today, seed=0, rounds=8)
    assert [c.verdict(0.1) for c in found] == ["same", "CHANGED"]
    assert found[1].change == pytest.approx(-0.1001)


def test_a_failed_run_or_an_unrecorded_setting_is_never_same() -> None:
    recorded = recorded_figures(PAGE)
    found = compare(recorded, {"decentnerf": None, "fedavg": 22.0}, seed=1, rounds=8)
    assert [c.verdict(0.1) for c in found] == ["RUN FAILED", "NOT RECORDED"]
    assert Comparison("fedavg", 0, 8, 21.99, 21.99).verdict(0.0) == "same"


def test_the_table_prints_recorded_today_and_change() -> None:
    text = regression.table([Comparison("fedavg", 0, 8, 21.99, 21.5)], 0.1)
    assert "| fedavg | 0 | 8 | 21.990 | 21.500 | -0.490 | CHANGED |" in text
    same = regression.table([Comparison("decentnerf", 0, 8, 20.837, 20.83693)], 0.1)
    assert "| 20.837 | 20.837 | +0.000 | same |" in same


def test_the_guard_launches_the_demos_setting_per_strategy_at_one_seed(tmp_path: Path) -> None:
    args = regression.parse_args(["--seed", "2", "--rounds", "8", "--", "--ray-cpus", "2"])
    plan = sweep.plan_sweep(sweep.parse_args(regression.sweep_argv(args, tmp_path)))
    assert [run.label for run in plan.runs] == [
        "strategy=decentnerf/seed-2",
        "strategy=fedavg/seed-2",
    ]
    assert all("num-server-rounds=8" in run.run_config for run in plan.runs)
    assert plan.launcher_args == ("--ray-cpus", "2")


def test_finished_runs_are_compared_without_training(tmp_path: Path, capsys) -> None:
    page = tmp_path / "BENCHMARKS.md"
    page.write_text(PAGE)
    for strategy, value in (("decentnerf", 20.837), ("fedavg", 21.5)):
        run = tmp_path / "runs" / f"strategy={strategy}" / "seed-0"
        run.mkdir(parents=True)
        (run / "summary.json").write_text(f'{{"final": {{"clean-psnr": {value}}}, "seconds": 1.0}}')
    status = regression.main(["--results", str(page), "--runs", str(tmp_path / "runs")])
    out = capsys.readouterr().out
    assert status == 1
    assert "| decentnerf | 0 | 8 | 20.837 | 20.837 | +0.000 | same |" in out
    assert "| fedavg | 0 | 8 | 21.990 | 21.500 | -0.490 | CHANGED |" in out
