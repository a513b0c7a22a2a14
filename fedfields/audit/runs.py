"""Audit several finished runs side by side: one table, and audit.json + audit.png per run.

Every run directory is checked before any attack starts, and every audit finishes before
any file is written, so a bad path or a failing attack leaves no run half-audited; each
file is written atomically (`fedfields.atomic`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

from matplotlib.figure import Figure

from fedfields import atomic
from fedfields.audit.pipeline import AuditConfig, AuditResult, RunInfo, open_run
from fedfields.report import write_report

AUDIT_JSON = "audit.json"
AUDIT_PNG = "audit.png"
PipelineAudit = Callable[[RunInfo, AuditConfig], AuditResult]


def pipeline_audit(pipeline: str) -> PipelineAudit:
    """The audit of one pipeline, imported on demand (the split one needs the attacks)."""
    if pipeline == "scene":
        from fedfields.audit.scene import audit_scene

        return audit_scene
    if pipeline == "meta":
        from fedfields.audit.meta import audit_meta

        return audit_meta
    from fedfields.audit.split import audit_split

    return audit_split


def audit_runs(paths: Sequence[Path], config: AuditConfig) -> list[AuditResult]:
    """Check every run directory, then audit each; writes nothing (`write_audit` does)."""
    runs = [open_run(Path(path)) for path in paths]
    return [pipeline_audit(run.pipeline)(run, config) for run in runs]


def _cell(key: str | None, values: dict[str, float | None], unit: str = "") -> str:
    """`key value` with 3 significant decimals, or "-" when the key has no value."""
    if key is None or values.get(key) is None:
        return "-"
    return f"{key} {values[key]:.3f}{unit}"


def _unit(key: str) -> str:
    """ " dB" for PSNR-valued keys."""
    return " dB" if "psnr" in key else ""


def table_rows(results: Sequence[AuditResult]) -> list[list[str]]:
    """Header and one row per run: utility, leakage, its no-leak reference, the other
    leakage figures, what the run recorded itself, and the attacks skipped."""
    rows = [
        [
            "run",
            "pipeline",
            "utility",
            "leakage (headline)",
            "reference",
            "other leakage",
            "recorded during the run",
            "skipped",
        ]
    ]
    for result in results:
        utility_key, leakage_key, reference_key = result.headline
        others = [
            _cell(key, result.leakage, _unit(key))
            for key in result.leakage
            if key != leakage_key and result.leakage[key] is not None
        ]
        recorded = [_cell(key, dict(result.recorded), _unit(key)) for key in result.recorded]
        rows.append(
            [
                result.name,
                f"{result.pipeline} ({result.label})",
                _cell(utility_key, result.utility, _unit(utility_key)),
                _cell(leakage_key, result.leakage, _unit(leakage_key)),
                _cell(reference_key, result.reference, _unit(reference_key or "")),
                ", ".join(others) or "-",
                ", ".join(recorded) or "-",
                ", ".join(result.skipped) or "-",
            ]
        )
    return rows


def format_table(results: Sequence[AuditResult]) -> str:
    """The utility-versus-leakage table as aligned text, with why each skipped attack was
    skipped below it."""
    rows = table_rows(results)
    widths = [max(len(row[column]) for row in rows) for column in range(len(rows[0]))]
    lines = [
        " | ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True))
        for row in rows
    ]
    lines.insert(1, "-+-".join("-" * width for width in widths))
    notes = [
        f"{result.name}: {attack} skipped: {why}"
        for result in results
        for attack, why in result.skipped.items()
    ]
    return "\n".join(line.rstrip() for line in lines + notes)


def plot_audit(results: Sequence[AuditResult]) -> Figure:
    """Utility against headline leakage, one labelled point per run; one panel per pair of
    metrics (runs of different pipelines measure different things), the no-leak reference
    as a grey cross below each point."""
    groups: dict[tuple[str, str], list[AuditResult]] = {}
    for result in results:
        groups.setdefault(result.headline[:2], []).append(result)
    figure = Figure(figsize=(5.5 * len(groups), 4.5))
    axes = figure.subplots(1, len(groups), squeeze=False)[0]
    for axis, ((utility_key, leakage_key), members) in zip(axes, groups.items(), strict=True):
        for result in members:
            utility, leakage, reference = result.headline_values()
            if utility is None or leakage is None:
                axis.text(0.02, 0.02, f"{result.name}: not measured", transform=axis.transAxes)
                continue
            axis.scatter([utility], [leakage], marker="o")
            axis.annotate(
                result.name,
                (utility, leakage),
                fontsize=7,
                xytext=(4, 4),
                textcoords="offset points",
            )
            if reference is not None:
                axis.scatter(
                    [utility], [reference], marker="x", color="grey", label=result.headline[2]
                )
        handles, labels = axis.get_legend_handles_labels()
        if handles:  # one legend entry for the reference, whichever runs have one
            axis.legend(handles[:1], [f"reference (no leak): {labels[0]}"], fontsize=7)
        axis.set(
            xlabel=f"utility: {utility_key}{_unit(utility_key)}",
            ylabel=f"leakage: {leakage_key}{_unit(leakage_key)} (higher leaks more)",
            title=f"{members[0].pipeline}: utility vs leakage",
        )
    figure.tight_layout()
    return figure


def write_audit(results: Sequence[AuditResult]) -> list[Path]:
    """audit.json (that run's numbers and settings, and the runs it was compared with) and
    audit.png (every run) into each run directory, then each run's report.html
    (`fedfields.report.write_report`, which shows audit.json); returns the files written."""
    figure = plot_audit(results)
    written = []
    for result in results:
        payload = result.to_json() | {"compared-with": [str(r.run_dir) for r in results]}
        atomic.write_json(result.run_dir / AUDIT_JSON, payload)
        png = result.run_dir / AUDIT_PNG
        atomic.save_figure(png, figure, dpi=120)
        written += [result.run_dir / AUDIT_JSON, png]
    return written + [write_report(result.run_dir) for result in results]
