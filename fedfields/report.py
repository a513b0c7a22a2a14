"""A run's `report.html`: its settings, curves, headline numbers and figures on one page.

A run directory holds a dozen files (config.json, metrics.jsonl, summary.json, audit.json,
PNGs); the report puts them on one page that opens offline in any browser, so a run can be
read, or sent to someone, without Python. It is self-contained: every image is embedded as a
`data:` URI, the style is inline, and a Content-Security-Policy forbids loading anything
else. It reads only the run directory (never `<run-dir>.audit/` beside a secure run, which
holds what the server must not), escapes every string taken from a file, and is rewritten
whole, atomically, by each writer: the end of a run and `fedfields audit`.
"""

from __future__ import annotations

import base64
import html
import io
import json
import math
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from fedfields import atomic

REPORT_FILE = "report.html"
CURVE_COLUMNS = 3
CURVE_X_KEYS = ("round", "step")  # the first one every metrics line has is the x axis

STYLE = """
body { font: 14px/1.4 system-ui, sans-serif; margin: 1.5em auto; max-width: 72em;
       padding: 0 1em; color: #222; }
h1 { font-size: 1.5em; } h2 { border-bottom: 1px solid #ccc; margin-top: 1.8em; }
h3 { font-size: 1em; margin: 1.2em 0 0.4em; }
table { border-collapse: collapse; margin: 0.3em 0; }
th, td { border: 1px solid #ddd; padding: 0.2em 0.6em; text-align: left; }
td.number { text-align: right; font-variant-numeric: tabular-nums; }
th { background: #f4f4f4; font-weight: 600; }
figure { display: inline-block; margin: 0.5em; vertical-align: top; }
figure img { max-width: 100%; border: 1px solid #eee; }
figcaption, .note { color: #666; font-size: 0.9em; }
.lede { font-size: 1.1em; color: #444; margin-top: -0.5em; }
td.meaning { color: #555; }
.renders figure { display: block; margin: 0.8em 0; }
.renders img { width: 100%; max-width: 60em; image-rendering: pixelated; }
.renders img.orbit { width: 20em; }
"""
# Only inline style and data: images: nothing can be fetched and no script runs.
CSP = "default-src 'none'; img-src data:; style-src 'unsafe-inline'"


def write_report(run_dir: Path) -> Path:
    """Write `<run_dir>/report.html` from the files in `run_dir`; returns its path.

    A reader sees, in order: the run's name and what ran, the final figures each with what it
    means, the server's renders (the orbit animation, then each render beside its ground
    truth) and the other figures, the per-round curves grouped as quality, privacy, cost and
    health (constant series as one line of text), then the audit, the federation weights, the
    summary and the run config. Sections appear for the files that exist. The page names the
    run, never its absolute path (a report is shared).
    """
    run_dir = Path(run_dir)
    config, _ = _read_json(run_dir / "config.json")
    summary, _ = _read_json(run_dir / "summary.json")
    sections = [
        _final_section(summary),
        _renders_section(run_dir),
        _figures_section(run_dir),
        _curves_section(run_dir / "metrics.jsonl"),
        _json_section("Audit", run_dir / "audit.json"),
        _alphas_section(run_dir / "alphas.jsonl"),
        _json_section("Summary", run_dir / "summary.json"),
        _json_section("Run config", run_dir / "config.json"),
    ]
    title = f"fedfields run {run_dir.name}"
    page = (
        "<!DOCTYPE html>\n<html lang='en'>\n<head>\n<meta charset='utf-8'>\n"
        f"<meta http-equiv='Content-Security-Policy' content=\"{CSP}\">\n"
        f"<title>{_text(title)}</title>\n<style>{STYLE}</style>\n</head>\n<body>\n"
        f"<h1>{_text(title)}</h1>\n<p class='lede'>{_text(what_ran(config, summary))}</p>\n"
        + "".join(sections)
        + "</body>\n</html>\n"
    )
    path = run_dir / REPORT_FILE
    atomic.write_text(path, page)
    return path


def what_ran(config: Any, summary: Any) -> str:
    """One line of what ran: strategy, task and mode, rounds, seed, aggregation and time."""
    config = config if isinstance(config, Mapping) else {}
    summary = summary if isinstance(summary, Mapping) else {}
    task, mode = config.get("task", "?"), config.get("mode", "federated")
    strategy = config.get("strategy") or summary.get("strategy") or "the task's default strategy"
    if mode == "split":
        parts = [f"split learning on task {task}", f"{config.get('split-steps', '?')} steps"]
    else:
        parts = [f"{strategy} on task {task} ({mode})"]
        rounds = summary.get("rounds")
        done = len(rounds) if isinstance(rounds, list) else "?"
        parts.append(f"{done} of {config.get('num-server-rounds', '?')} rounds")
    if "seed" in config:
        parts.append(f"seed {config['seed']}")
    secure = summary.get("secure-aggregation")
    if isinstance(secure, Mapping) and "enabled" in secure:
        parts.append("secure aggregation " + ("on" if secure["enabled"] else "off"))
    seconds = summary.get("seconds")
    if isinstance(seconds, int | float) and not isinstance(seconds, bool):
        parts.append(f"{seconds:.0f} s")
    return " · ".join(str(part) for part in parts)


def _text(value: object) -> str:
    """`value` as HTML text: every string from a file goes through here."""
    return html.escape(str(value), quote=True)


def _read_json(path: Path) -> tuple[Any, str | None]:
    """(content, None), or (None, why) when the file is not valid JSON: a report of a run
    cut short still shows the rest."""
    try:
        return json.loads(path.read_text(encoding="utf-8")), None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        return None, f"{path.name} is unreadable: {error}"


def _read_lines(path: Path) -> list[dict[str, Any]]:
    """The JSON objects of a .jsonl file; a line a crash cut short is left out."""
    records = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict):
            records.append(record)
    return records


def _section(title: str, body: str) -> str:
    return f"<section>\n<h2>{_text(title)}</h2>\n{body}</section>\n"


def _json_section(title: str, path: Path) -> str:
    """One file's JSON as tables (`_json_tables`); empty when the file does not exist."""
    if not path.is_file():
        return ""
    content, problem = _read_json(path)
    if problem is not None:
        return _section(title, f"<p class='note'>{_text(problem)}</p>\n")
    return _section(title, _json_tables(content))


def _json_tables(content: Any) -> str:
    """Any JSON as tables: the top level's plain values in one key/value table, then each
    nested object under its key, as a grid when it maps names to objects (run -> metrics,
    step -> qualities), else as a key/value table with dotted keys."""
    if not isinstance(content, Mapping):
        return f"<pre>{_text(json.dumps(content, indent=2))}</pre>\n"
    plain = [(key, value) for key, value in content.items() if not isinstance(value, Mapping)]
    parts = [_key_value_table(plain)] if plain else []
    for key, value in content.items():
        if isinstance(value, Mapping):
            parts.append(f"<h3>{_text(key)}</h3>\n{_mapping_table(value)}")
    return "".join(parts)


def _mapping_table(mapping: Mapping[str, Any]) -> str:
    """A grid (rows: keys, columns: their objects' flattened keys) when every value is an
    object, else a key/value table of the flattened mapping."""
    if not mapping:
        return "<p class='note'>none</p>\n"
    if all(isinstance(value, Mapping) for value in mapping.values()):
        return _grid_table({key: dict(_flatten(value)) for key, value in mapping.items()})
    return _key_value_table(_flatten(mapping))


def _flatten(mapping: Mapping[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    """Nested objects as (dotted key, plain value) pairs."""
    pairs: list[tuple[str, Any]] = []
    for key, value in mapping.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            pairs += _flatten(value, f"{name}.")
        else:
            pairs.append((name, value))
    return pairs


def _key_value_table(pairs: Iterable[tuple[str, Any]]) -> str:
    rows = "".join(f"<tr><th>{_text(key)}</th>{_cell(value)}</tr>\n" for key, value in pairs)
    return f"<table>\n{rows}</table>\n"


def _grid_table(rows: Mapping[str, Mapping[str, Any]]) -> str:
    """Rows by name, one column per key any row has (in order of first appearance)."""
    columns = list(dict.fromkeys(key for row in rows.values() for key in row))
    head = "".join(f"<th>{_text(column)}</th>" for column in columns)
    body = "".join(
        f"<tr><th>{_text(name)}</th>"
        + "".join(_cell(row.get(column)) for column in columns)
        + "</tr>\n"
        for name, row in rows.items()
    )
    return f"<table>\n<tr><th></th>{head}</tr>\n{body}</table>\n"


def _cell(value: Any) -> str:
    """A table cell: numbers to 4 significant digits and right-aligned, a list of records
    counted (metrics.jsonl's curves show them), anything else as escaped text."""
    if isinstance(value, bool) or value is None:
        return f"<td>{'-' if value is None else str(value).lower()}</td>"
    if isinstance(value, int | float):
        shown = f"{value:.4g}" if isinstance(value, float) else str(value)
        return f"<td class='number'>{shown}</td>"
    if isinstance(value, list) and value and all(isinstance(item, Mapping) for item in value):
        return f"<td class='note'>{len(value)} records</td>"
    if isinstance(value, list | Mapping):
        value = json.dumps(value)
    return f"<td>{_text(value)}</td>"


# What each headline figure says, in one line; a figure not listed shows without one.
MEANINGS = {
    "clean-psnr": "the server's field on clean views (no people), in dB: scene quality",
    "clean-ssim": "structural similarity of the same renders (1 is perfect)",
    "eval-scene-psnr": "the server's field on the public eval-scene-dir views, in dB",
    "eval-scene-ssim": "structural similarity on the eval-scene-dir views (1 is perfect)",
    "personal-psnr": "users' personal content (their masks) rendered from what the server "
    "reads, in dB: the closer to its floor, the less leaks",
    "dp-epsilon": "client-level differential privacy spent so far: epsilon at dp-delta for "
    "what runs, k of n clients sampled without replacement (replace-one neighbours; smaller is "
    "more private; the accountant's bound, not a measurement)",
    "dp-epsilon-poisson": "the same rounds' epsilon had clients been Poisson-sampled (an "
    "assumption the runs do not meet; Flower's RdpAccountant)",
    "dp-epsilon-poisson-pld": "the Poisson figure through the tighter PLD accountant",
    "personal-psnr-floor": "the same score of a field that renders no person: no leak at all",
    "upload-personal-psnr": "personal content rendered from each user's own upload (what a "
    "server without secure aggregation reads), in dB",
    "psnr": "a new task's query views after test-time optimisation from the global "
    "initialisation, in dB: utility",
    "ssim": "structural similarity after test-time optimisation (1 is perfect)",
    "lpips": "perceptual distance after test-time optimisation (0 is identical)",
    "psnr_p": "a client's query images rendered by the server straight from its upload, in "
    "dB (FedMeNF's PSNR_p): lower leaks less",
    "ssim_p": "structural similarity of those server renders of private query images",
    "lpips_p": "perceptual distance of those server renders (higher leaks less)",
    "delta": "psnr minus psnr_p: how far the server's view of a client's data stays behind "
    "what the client itself reaches",
    "mia-accuracy": "membership attack on uploads: accuracy (0.5 is chance, no leak)",
    "mia-auc": "membership attack on uploads: ROC AUC (0.5 is chance)",
    "pia-accuracy": "property attack on uploads: accuracy against its chance level",
    "theta-mia-accuracy": "membership attack on the global initialisation: accuracy",
    "theta-mia-auc": "membership attack on the global initialisation: ROC AUC (0.5 is chance)",
    "theta-mia-chance": "that attack's chance level",
    "heldout-psnr": "the client's joint field on its held-out views, in dB: utility",
    "heldout-ssim": "structural similarity on the held-out views (1 is perfect)",
    "heldout-lpips": "perceptual distance on the held-out views (0 is identical)",
    "clean-lpips": "perceptual distance of the clean-view renders (0 is identical)",
    "eval-scene-lpips": "perceptual distance on the eval-scene-dir views (0 is identical)",
}
LEAK_MARGIN_DB = 1.0  # personal-psnr this close to its floor reads as "no more than the floor"


def _final_section(summary: Any) -> str:
    """summary.json's final quality and privacy figures (split runs: the client's held-out
    scores), each with its meaning, then what personal-psnr against its floor says; training
    losses, costs and counts stay in the curves."""
    if not isinstance(summary, Mapping):
        return ""
    final = summary.get("final") or summary.get("client")
    if not isinstance(final, Mapping):
        return ""
    numbers = {
        key: value
        for key, value in final.items()
        if isinstance(value, int | float)
        and not isinstance(value, bool)
        and curve_group(key) in ("quality", "privacy")
        and not key.startswith("train-")
    }
    if not numbers:
        return ""
    rows = "".join(
        f"<tr><th>{_text(key)}</th>{_cell(value)}"
        f"<td class='meaning'>{_text(MEANINGS.get(key, ''))}</td></tr>\n"
        for key, value in numbers.items()
    )
    verdict = _leak_verdict(numbers)
    note = f"<p>{_text(verdict)}</p>\n" if verdict else ""
    return _section("Final figures", f"<table>\n{rows}</table>\n{note}")


def _leak_verdict(final: Mapping[str, float]) -> str:
    """What personal-psnr against its floor says, in a sentence; empty without both."""
    if "personal-psnr" not in final or "personal-psnr-floor" not in final:
        return ""
    gap = final["personal-psnr"] - final["personal-psnr-floor"]
    if gap <= LEAK_MARGIN_DB:
        return (
            f"personal-psnr is {gap:+.2f} dB from its floor: the server's field renders the "
            "users' personal content no better than a field without any person."
        )
    return (
        f"personal-psnr is {gap:.2f} dB above its floor: the server's field renders the users' "
        "personal content; it leaks."
    )


def _renders_section(run_dir: Path) -> str:
    """The server's orbit animation (GIFs) and each render beside its ground truth (renders/),
    at a readable size."""
    gifs = sorted(path for path in run_dir.glob("*.gif") if path.is_file())
    renders = sorted(path for path in (run_dir / "renders").glob("*.png") if path.is_file())
    if not gifs and not renders:
        return ""
    body = ""
    for path in gifs:
        image = _image(path.read_bytes(), path.name, "gif", "orbit")
        body += (
            f"<figure>{image}<figcaption>{_text(path.name)}: the server's final field, "
            "orbiting</figcaption></figure>\n"
        )
    if renders:
        body += (
            "<p class='note'>renders/: per user, the clean ground truth, the server's render of "
            "the same view and the user's photo</p>\n"
        )
    for path in renders:
        name = f"renders/{path.name}"
        body += f"<figure>{_image(path.read_bytes(), name)}<figcaption>{_text(name)}</figcaption>"
        body += "</figure>\n"
    return f"<section class='renders'>\n<h2>Renders</h2>\n{body}</section>\n"


# Curve groups, tried in order; a metric whose name holds none of the words is "other".
CURVE_GROUPS = (
    ("health", ("num-", "failures", "dropped", "rounds-", "empty")),
    ("cost", ("bytes", "flops", "seconds", "steps")),
    ("privacy", ("personal", "psnr_p", "ssim_p", "lpips_p", "mia", "pia", "delta", "epsilon")),
    ("quality", ("psnr", "ssim", "lpips", "loss")),
)


CURVE_ORDER = ("quality", "privacy", "cost", "health", "other")


def curve_group(metric: str) -> str:
    """The group a metric's curve is drawn in: quality, privacy, cost, health or other."""
    for group, words in CURVE_GROUPS:
        if any(word in metric for word in words):
            return group
    return "other"


def _curves_section(path: Path) -> str:
    """metrics.jsonl drawn per group (quality, privacy, cost, health, other): one small plot
    per metric that changes against the round (or step); constant ones in one line each."""
    if not path.is_file():
        return ""
    records = _read_lines(path)
    x_key = next((key for key in CURVE_X_KEYS if records and all(key in r for r in records)), None)
    metrics = list(
        dict.fromkeys(
            key
            for record in records
            for key, value in record.items()
            if key != x_key and isinstance(value, int | float) and not isinstance(value, bool)
        )
    )
    if not metrics:
        return _section("Curves", "<p class='note'>metrics.jsonl holds no numeric metric</p>\n")
    body = ""
    for group in CURVE_ORDER:
        members = [metric for metric in metrics if curve_group(metric) == group]
        if members:
            body += f"<h3>{_text(group)}</h3>\n" + _curve_group(records, x_key, members, group)
    return _section("Curves", body)


def _curve_group(
    records: list[dict[str, Any]], x_key: str | None, metrics: list[str], group: str
) -> str:
    """One group's changing metrics as a grid of small plots, its constant ones as text."""
    constant = {metric: _constant_value(records, metric) for metric in metrics}
    constant = {metric: value for metric, value in constant.items() if value is not None}
    changing = [metric for metric in metrics if metric not in constant]
    note = ""
    if constant:
        listed = ", ".join(f"{metric} {value:.4g}" for metric, value in constant.items())
        note = f"<p class='note'>constant over the run: {_text(listed)}</p>\n"
    if not changing:
        return note
    rows = math.ceil(len(changing) / CURVE_COLUMNS)
    figure = Figure(figsize=(4 * CURVE_COLUMNS, 2.6 * rows))
    axes = figure.subplots(rows, CURVE_COLUMNS, squeeze=False).ravel()
    for axis, metric in zip(axes, changing, strict=False):
        points = [
            (record[x_key] if x_key else index + 1, record[metric])
            for index, record in enumerate(records)
            if isinstance(record.get(metric), int | float)
        ]
        axis.plot(*zip(*points, strict=True), marker="o", markersize=3)
        axis.set_title(metric, fontsize=9)
        axis.set_xlabel(x_key or "line", fontsize=8)
        axis.xaxis.set_major_locator(MaxNLocator(integer=True))
        axis.tick_params(labelsize=7)
        axis.grid(alpha=0.3)
    for axis in axes[len(changing) :]:
        axis.set_visible(False)
    figure.tight_layout()
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=80)
    image = _image(buffer.getvalue(), f"{group} curves from metrics.jsonl")
    return (
        f"<figure>{image}<figcaption>{_text(group)}, metrics.jsonl</figcaption></figure>\n" + note
    )


def _constant_value(records: list[dict[str, Any]], metric: str) -> Any:
    """The metric's value when every record holding it has the same one (and more than one
    record holds it), else None: a flat line is read better as a number."""
    values = [record[metric] for record in records if metric in record]
    if len(values) > 1 and all(value == values[0] for value in values):
        return values[0]
    return None


def _figures_section(run_dir: Path) -> str:
    """Every other PNG under the run directory (renders/ and hidden folders aside), grouped by
    folder."""
    pngs = sorted(
        (path.relative_to(run_dir) for path in run_dir.rglob("*.png") if path.is_file()),
        key=lambda relative: (len(relative.parts) > 1, str(relative)),
    )
    pngs = [
        relative
        for relative in pngs
        if not any(p.startswith(".") for p in relative.parts) and relative.parts[0] != "renders"
    ]
    if not pngs:
        return ""
    body, folder = "", None
    for relative in pngs:
        if relative.parent != folder:
            folder = relative.parent
            if str(folder) != ".":
                body += f"<h3>{_text(folder)}/</h3>\n"
        image = _image((run_dir / relative).read_bytes(), str(relative))
        body += f"<figure>{image}<figcaption>{_text(relative)}</figcaption></figure>\n"
    return _section("Figures", body)


def _image(data: bytes, alt: str, kind: str = "png", css_class: str = "") -> str:
    """An <img> holding the image bytes (PNG or GIF) as a data: URI."""
    encoded = base64.b64encode(data).decode("ascii")
    extra = f" class='{css_class}'" if css_class else ""
    return f"<img src='data:image/{kind};base64,{encoded}' alt='{_text(alt)}'{extra}>"


def _alphas_section(path: Path) -> str:
    """alphas.jsonl (DecentNeRF's learned federation weights) as a round x user grid."""
    if not path.is_file():
        return ""
    grid: dict[str, dict[str, Any]] = {}
    for record in _read_lines(path):
        if {"round", "user", "alpha"} <= record.keys():
            grid.setdefault(f"round {record['round']}", {})[f"user {record['user']}"] = record[
                "alpha"
            ]
    return _section("Federation weights (alphas.jsonl)", _mapping_table(grid))
