"""Benchmark: client-level DP (issue 36) against the attacks that measure leakage today.

For each noise multiplier z (`--noise-multipliers`, default 0 0.5 1 2) it runs, through Flower's
simulation engine (Ray) with the App's run-config defaults plus `--run-config`:

- task scene, on the Novel Blender crowd (`--users`): FedNeRF (strategy fedavg, plaintext, so
  DP is central: the server clips and noises the sum) and DecentNeRF (min-train-nodes 3; its
  DP runs under SecAgg+, so DP is distributed: each client clips and adds its noise share
  before masking). Utility: the observer's clean PSNR on every view. Leakage: PSNR inside the
  personal masks of what the server reads (each user's upload for FedNeRF, the aggregate for
  DecentNeRF) and of the released global field, against the floor of a field that renders no
  person.
- task photos (`--clients`): MAML and FedMeNF (gamma 0.75), strategy fedavg, plaintext, central
  DP. Utility: PSNR after test-time optimisation (TTO); leakage: PSNR_p of the last round's
  uploads and the membership CNN's accuracy on every client's last upload (chance 50%).

Epsilon is the run's own accountant at dp-delta (summary.json's final "dp-epsilon"). The clip
norm C of a method is the median L2 norm of its clients' updates in its z = 0 run, recorded by
a client mod (what DP-FedAvg clips: y_k - g, DecentNeRF's alpha_k (g_k - g) with alpha_k
itself); clipping at the median is the target of adaptive clipping (Andrew et al. 2021, the
default quantile of Flower's adaptive-clipping wrappers). DecentNeRF's z = 0 run is therefore
plaintext; without secure aggregation its aggregate is the one SecAgg+ would release
(docs/experiments/2026-11-26-secure-twins.md compares the two). `--clip-norm` gives C
instead. Writes dp.md (the table), dp.json (the rows) and dp.png (utility against leakage,
each point labelled with z, epsilon and the MIA accuracy) under `--out`; the runs go to
`--out`/runs. The replies column counts the successful train replies of all rounds: 0 means
every round timed out and the initial field was scored. `--report DIR ...` merges earlier
outputs (e.g. one process per method) into one table and figure.

    python -m simulations.bench.dp --users 4 --rounds 2 --clients 10 \
        --scene-run-config "local-steps=16 min-train-nodes=3 max-empty-rounds=0" \
        --photos-run-config "outer-steps=16 tto-steps=16"
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from flwr.app import Context, Message, MessageType
from flwr.clientapp.typing import ClientAppCallable
from flwr.common.config import parse_config_args
from matplotlib.figure import Figure

from fedfields import atomic
from fedfields.flower.protocol import ARRAYS, NUM_REPLIES, arrays_to_state
from fedfields.methods import ALPHA_KEY
from fedfields.privacy.accountant import EPSILON_METRIC
from fedfields.privacy.dp import scaled_difference
from fedfields.privacy.leakage import PERSONAL_FLOOR, UPLOAD_LEAK
from simulations import APP_DIR
from simulations.bench.devices import add_device_argument
from simulations.bench.fedmenf_table import read_row, run_one
from simulations.bench.scale import TreeMemory
from simulations.bench.secure_twins import twin_config
from simulations.planner import ENVIRONMENT, DataOptions, crowd_dataset, job_config
from simulations.run import run_with_ray

NOISE_MULTIPLIERS = (0.0, 0.5, 1.0, 2.0)
TASKS = ("scene", "photos")


@dataclass(frozen=True)
class Method:
    """One compared method: its task, its run-config, its DP form and the table's learner
    name in `fedmenf_table.LEARNERS` (photos)."""

    name: str
    task: str
    run_config: dict[str, Any]
    secure_dp: bool = False  # DP runs under SecAgg+ (distributed DP)
    learner: str = ""


METHODS = (
    Method("FedNeRF", "scene", {"strategy": "fedavg"}),
    Method("DecentNeRF", "scene", {"strategy": "decentnerf", "min-train-nodes": 3}, True),
    Method("MAML", "photos", {"strategy": "fedavg"}, learner="MAML"),
    Method("FedMeNF", "photos", {"strategy": "fedavg"}, learner="FedMeNF gamma 0.75"),
)
NORMS_FILE = "update-norms.jsonl"


@dataclass(frozen=True)
class Row:
    """One run's figures, read back from its run directory (None: not measured)."""

    task: str
    method: str
    noise_multiplier: float
    clip_norm: float | None
    dp_form: str
    epsilon: float | None
    utility: float | None  # scene: clean PSNR, all views; photos: PSNR after TTO
    server_reads: float | None  # scene: personal PSNR of what the server reads; photos: PSNR_p
    released: float | None  # scene: personal PSNR of the final global field
    floor: float | None  # scene: personal PSNR of a field rendering no person
    mia: float | None  # photos: membership CNN accuracy (chance 0.5)
    seconds: float
    run_dir: str
    error: str | None = None
    replies: int | None = None  # successful train replies over all rounds (0: nothing trained)
    sampled: int | None = None  # photos: clients sampled in the last round
    population: int | None = None  # photos: num-clients, the population sampled from
    peak_gib: float | None = None  # PSS of this process and its children (Ray), at its peak


class UpdateNorms:
    """Client mod: appends the L2 norm of each plaintext train reply's update (its arrays
    minus the arrays sent, DecentNeRF's alpha_k g_k - alpha_k g with alpha_k) to a JSON-lines
    file. A secure reply holds no arrays and is not recorded."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __call__(self, msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
        reply = call_next(msg, context)
        if msg.metadata.message_type != MessageType.TRAIN or reply.has_error():
            return reply
        if ARRAYS not in msg.content or ARRAYS not in reply.content:
            return reply
        sent = arrays_to_state(msg.content[ARRAYS])
        update = scaled_difference(arrays_to_state(reply.content[ARRAYS]), sent, ALPHA_KEY)
        norm = math.sqrt(math.fsum(float(value.square().sum()) for value in update.values()))
        atomic.append_json_line(self.path, {"node": context.node_id, "norm": norm})
        return reply


def median_norm(path: Path) -> float:
    """The median of the update norms a z = 0 run recorded; ValueError when it recorded none."""
    lines = path.read_text().splitlines() if path.is_file() else []
    if not lines:
        raise ValueError(f"{path}: no update norms recorded, so no clip norm; pass --clip-norm")
    return statistics.median(json.loads(line)["norm"] for line in lines)


def dp_config(noise: float, clip_norm: float | None, preflight: bool = False) -> dict[str, Any]:
    """The dp-* run-config of noise multiplier `noise` ({} for none). Unless `preflight`, the
    pre-flight limit is lifted (dp-max-noise-ratio 0): the bench measures what noise that
    drowns the updates does to utility and leakage, which is what the limit would refuse to
    run; with it, a run the check refuses is a failed row."""
    if noise == 0:
        return {}
    assert clip_norm is not None
    lifted = {} if preflight else {"dp-max-noise-ratio": 0.0}
    return {"dp-noise-multiplier": noise, "dp-clip-norm": clip_norm, **lifted}


def round_lines(run_dir: Path) -> list[dict[str, Any]]:
    """The run's metrics.jsonl, one dict per round."""
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def replies_of(run_dir: Path) -> int:
    """Successful train replies over the run's rounds (a round that timed out counts 0)."""
    return int(sum(line.get(NUM_REPLIES, 0) for line in round_lines(run_dir)))


def scene_row(method: Method, noise: float, clip_norm: float | None, run_dir: Path) -> Row:
    """A scene run's row: the final audit on every view, the last round's upload leak."""
    summary = json.loads((run_dir / "summary.json").read_text())
    final = summary["final"]
    uploads = [line[UPLOAD_LEAK] for line in round_lines(run_dir) if UPLOAD_LEAK in line]
    secure = summary["secure-aggregation"]["enabled"]
    last_upload = uploads[-1] if uploads else None  # the last round whose uploads it read
    server_reads = final.get("personal-psnr") if secure else last_upload
    if method.name == "DecentNeRF":  # SecAgg+ would release the aggregate only (docstring)
        server_reads = final.get("personal-psnr")
    return Row(
        task=method.task,
        method=method.name,
        noise_multiplier=noise,
        clip_norm=clip_norm,
        dp_form=dp_form(noise, secure),
        epsilon=final.get(EPSILON_METRIC),
        utility=final.get("clean-psnr"),
        server_reads=server_reads,
        released=final.get("personal-psnr"),
        floor=final.get(PERSONAL_FLOOR),
        mia=None,
        seconds=summary["seconds"],
        run_dir=str(run_dir),
        replies=replies_of(run_dir),
    )


def photos_row(method: Method, noise: float, clip_norm: float | None, run_dir: Path) -> Row:
    """A photos run's row, read by the FedMeNF table's reader, plus its epsilon."""
    table_row = read_row(run_dir)
    summary = json.loads((run_dir / "summary.json").read_text())
    return Row(
        task=method.task,
        method=method.name,
        noise_multiplier=noise,
        clip_norm=clip_norm,
        dp_form=dp_form(noise, summary["secure-aggregation"]["enabled"]),
        epsilon=summary["final"].get(EPSILON_METRIC),
        utility=table_row.psnr,
        server_reads=table_row.psnr_p,
        released=None,
        floor=None,
        mia=table_row.mia,
        seconds=table_row.seconds,
        run_dir=str(run_dir),
        replies=replies_of(run_dir),
        sampled=len(summary["final"]["clients"]),
        population=summary["settings"]["num_clients"],
    )


def dp_form(noise: float, secure: bool) -> str:
    """none, central (server noises the plaintext sum) or distributed (under SecAgg+)."""
    if noise == 0:
        return "none (SecAgg+)" if secure else "none"
    return "distributed (SecAgg+)" if secure else "central"


@dataclass(frozen=True)
class Setup:
    """What every run shares: the output folder, rounds, extra run-config, the crowd."""

    out: Path
    rounds: int
    extra: dict[str, Any]
    crowd: Path | None
    users: int
    clients: int
    device: str
    dp_extra: dict[str, Any] = field(default_factory=dict)
    """Run-config of the DP runs only (z > 0), such as adaptive clipping."""
    preflight: bool = False
    """Keep the pre-flight noise-over-signal check in the DP runs (`dp_config`)."""


def run_method(method: Method, noise: float, clip_norm: float | None, setup: Setup) -> Path:
    """One run of `method` at noise multiplier `noise`; its run directory. A z = 0 run records
    its clients' update norms (`NORMS_FILE` beside the run directory)."""
    name = f"{method.name}-z{noise:g}"
    runs = setup.out / "runs"
    runs.mkdir(parents=True, exist_ok=True)
    mods = (UpdateNorms(runs / f"{method.name}-{NORMS_FILE}"),) if noise == 0 else ()
    dp = {**dp_config(noise, clip_norm, setup.preflight), **(setup.dp_extra if noise > 0 else {})}
    overrides = {**method.run_config, **setup.extra, **dp}
    if method.task == "scene":
        assert setup.crowd is not None
        base = job_config("").to_run_config() | {"num-server-rounds": setup.rounds} | overrides
        secure = method.secure_dp and noise > 0
        config = twin_config(base, runs, name, setup.crowd, secure)
        return run_with_ray(config, setup.users, mods=mods, client_device=setup.device)
    overrides |= {"num-clients": setup.clients}
    return run_one(
        "photos",
        overrides.pop("strategy"),
        method.learner,
        setup.rounds,
        runs / name,
        overrides,
        mods=mods,
        device=setup.device,
    )


def measure(
    method: Method, noises: list[float], setup: Setup, clip: float | None, rows: list[Row]
) -> None:
    """Every noise multiplier of `method`, z = 0 first (it sets C unless `clip` is given),
    appended to `rows` and `setup.out`/dp.json after each run; a run that fails is a row with
    its error."""
    clip_norm = clip
    for noise in sorted(noises):
        started = time.perf_counter()
        try:
            if noise > 0 and clip_norm is None:
                clip_norm = median_norm(setup.out / "runs" / f"{method.name}-{NORMS_FILE}")
            with TreeMemory(os.getpid()) as memory:
                run_dir = run_method(method, noise, clip_norm, setup)
            reader = scene_row if method.task == "scene" else photos_row
            row = reader(method, noise, clip_norm if noise > 0 else None, run_dir)
            row = replace(row, peak_gib=memory.peak_bytes / 2**30)
        except Exception as error:  # a failed run is a result: its row says why
            message = f"{type(error).__name__}: {error}"[:300]
            row = failed_row(method, noise, clip_norm, setup, message)
            row = replace(row, seconds=time.perf_counter() - started)
        rows.append(row)
        atomic.write_json(setup.out / "dp.json", [asdict(row) for row in rows])
        print(f"{method.name} z={noise:g}: {json.dumps(asdict(row))}", flush=True)


def failed_row(
    method: Method, noise: float, clip_norm: float | None, setup: Setup, message: str
) -> Row:
    """The row of a run that raised: its error, and for a scene run the epsilon it spent and
    the replies of the rounds its metrics.jsonl holds (its run directory is known)."""
    run_dir = setup.out / "runs" / f"{method.name}-z{noise:g}"
    partial = run_dir / "metrics.jsonl"
    lines = round_lines(run_dir) if method.task == "scene" and partial.is_file() else []
    return Row(
        method.task, method.name, noise, clip_norm, dp_form(noise, method.secure_dp and noise > 0),
        lines[-1].get(EPSILON_METRIC) if lines else None, None, None, None, None, None, 0.0,
        str(run_dir) if lines else "", message,
        replies=replies_of(run_dir) if lines else None,
    )  # fmt: skip


def cell(value: float | None, pattern: str = "{:.2f}") -> str:
    """A table cell: '-' for a figure not measured."""
    return "-" if value is None else pattern.format(value)


def table(rows: list[Row]) -> str:
    """Markdown table: one line per run."""
    lines = [
        "| task | method | z | C | DP | epsilon | utility dB | server reads, personal dB "
        "| released field, personal dB | floor dB | MIA CNN | replies | job s | peak GiB "
        "| sampled |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        epsilon = "-" if row.noise_multiplier == 0 else cell(row.epsilon, "{:.3g}")
        if row.error:  # the error's first clause; the whole message is in dp.json
            epsilon = f"{cell(row.epsilon, '{:.3g}')}, failed: {row.error.split(';')[0][:90]}"
        lines.append(
            f"| {row.task} | {row.method} | {row.noise_multiplier:g} | "
            f"{cell(row.clip_norm, '{:.3g}')} | {row.dp_form} | {epsilon} | {cell(row.utility)} | "
            f"{cell(row.server_reads)} | {cell(row.released)} | {cell(row.floor)} | "
            f"{cell(row.mia, '{:.1%}')} | {cell(row.replies, '{:d}')} | {row.seconds:.0f} | "
            f"{cell(row.peak_gib)} | {scale(row) or '-'} |"
        )
    return "\n".join(lines)


def scale(row: Row) -> str:
    """'M of N' clients a round when the row records it (photos), else ''."""
    return "" if row.population is None else f"{row.sampled} of {row.population}"


def line_name(row: Row) -> str:
    """The figure's line of `row`: its method, and its scale when recorded, so runs of one
    method at different federation sizes are separate lines."""
    return f"{row.method}, {scale(row)} a round" if scale(row) else row.method


def plot(path: Path, rows: list[Row]) -> None:
    """Utility against the leakage of what the server reads, one panel per task and one line
    per method through its noise multipliers, each point labelled with z, epsilon and (photos)
    the MIA accuracy."""
    tasks = [task for task in TASKS if any(r.task == task for r in rows)]
    figure = Figure(figsize=(6 * max(1, len(tasks)), 4.5))
    panels = figure.subplots(1, max(1, len(tasks)), squeeze=False)[0]
    for axes, task in zip(panels[: len(tasks)], tasks, strict=True):
        ours = [r for r in rows if r.task == task]
        measured = [r for r in ours if r.utility is not None and math.isfinite(r.utility)]
        unplotted = [r for r in ours if r not in measured]
        if unplotted:  # failed runs and fields that render NaN, named with what they spent
            notes = [
                f"{r.method} z {r.noise_multiplier:g} (eps {cell(r.epsilon, '{:.3g}')}): "
                + (r.error.split(":")[0] if r.error else f"utility {r.utility}")
                for r in unplotted
            ]
            axes.text(0.02, 0.02, "not plotted:\n" + "\n".join(notes), fontsize=7,
                      transform=axes.transAxes, va="bottom")  # fmt: skip
        for name in dict.fromkeys(line_name(r) for r in measured):
            points = [r for r in measured if line_name(r) == name and r.server_reads is not None]
            xs, ys = [r.server_reads for r in points], [r.utility for r in points]
            axes.plot(xs, ys, marker="o", label=name)
            for r in points:
                epsilon = "no DP" if r.noise_multiplier == 0 else f"eps {cell(r.epsilon, '{:.3g}')}"
                text = f"z {r.noise_multiplier:g}, {epsilon}"
                if r.mia is not None:
                    text += f", MIA {r.mia:.0%}"
                axes.annotate(text, (r.server_reads, r.utility), fontsize=7, xytext=(4, 4),
                              textcoords="offset points")  # fmt: skip
        floors = [r.floor for r in measured if r.floor is not None]
        if floors:
            axes.axvline(statistics.mean(floors), linestyle="--", color="grey",
                         label="floor: no person rendered")  # fmt: skip
        leak = "personal-mask PSNR the server reads" if task == "scene" else "PSNR_p of uploads"
        utility = "clean PSNR, all views" if task == "scene" else "PSNR after TTO"
        axes.set(xlabel=f"{leak} (dB, lower leaks less)", ylabel=f"{utility} (dB)", title=task)
        axes.legend(fontsize=8)
    figure.suptitle("client-level DP: utility against leakage, per noise multiplier z")
    figure.tight_layout()
    atomic.save_figure(path, figure, dpi=120)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The benchmark's flags."""
    parser = argparse.ArgumentParser(
        prog="python -m simulations.bench.dp", description=(__doc__ or "").split("\n")[0]
    )
    parser.add_argument("--tasks", nargs="+", choices=TASKS, default=list(TASKS))
    names = [method.name for method in METHODS]
    parser.add_argument(
        "--methods", nargs="+", choices=names, default=names, help="of the --tasks' methods"
    )
    parser.add_argument(
        "--noise-multipliers", nargs="+", type=float, default=list(NOISE_MULTIPLIERS),
        help="dp-noise-multiplier values (0: no DP; it runs first and measures the clip norm)",
    )  # fmt: skip
    parser.add_argument("--rounds", type=int, default=8, help="num-server-rounds of every run")
    parser.add_argument("--users", type=int, default=16, help="scene: crowd users, one node each")
    parser.add_argument("--views-per-user", type=int, default=5, help="scene: crowd views a user")
    parser.add_argument("--downscale", type=float, default=2.0, help="scene: crowd image downscale")
    parser.add_argument("--crowd", type=Path, default=None, help="scene: crowd folder (built)")
    parser.add_argument("--clients", type=int, default=20, help="photos: num-clients")
    parser.add_argument(
        "--clip-norm", type=float, default=None,
        help="dp-clip-norm of every DP run (default: each method's median update norm at z=0)",
    )  # fmt: skip
    add_device_argument(parser, "the server and the Ray clients")
    parser.add_argument("--run-config", default="", help="extra run-config for every run")
    parser.add_argument(
        "--scene-run-config", default="", help="extra run-config for the scene runs only"
    )
    parser.add_argument(
        "--photos-run-config", default="", help="extra run-config for the photos runs only"
    )
    parser.add_argument(
        "--dp-run-config", default="",
        help="extra run-config for the DP runs only, e.g. \"dp-adaptive-clipping=true\" (C from "
        "the z = 0 median is then the initial clip norm)",
    )  # fmt: skip
    parser.add_argument(
        "--preflight", action="store_true",
        help="keep the pre-flight noise-over-signal check in the DP runs (default: lifted, to "
        "measure what drowning noise does)",
    )  # fmt: skip
    parser.add_argument(
        "--out", type=Path, default=None, help="output folder (default runs/<time>-dp)"
    )
    parser.add_argument(
        "--report", nargs="+", type=Path, default=None,
        help="no runs: one table and figure of these earlier --out folders' dp.json",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if any(not math.isfinite(z) or z < 0 for z in args.noise_multipliers):
        parser.error(f"--noise-multipliers must be finite and >= 0, got {args.noise_multipliers}")
    if args.clip_norm is None and 0 not in args.noise_multipliers:
        parser.error("without 0 in --noise-multipliers there is no run to measure C: --clip-norm")
    if args.clip_norm is not None and not (math.isfinite(args.clip_norm) and args.clip_norm > 0):
        parser.error(f"--clip-norm must be > 0 and finite, got {args.clip_norm}")
    for path in [folder / "dp.json" for folder in args.report or []]:
        if not path.is_file():
            parser.error(f"--report: {path} does not exist (no benchmark output there)")
    for flag in ("run_config", "scene_run_config", "photos_run_config", "dp_run_config"):
        try:
            overrides(getattr(args, flag))
        except ValueError as error:
            parser.error(f"--{flag.replace('_', '-')}: {error}")
    for flag in ("rounds", "users", "views_per_user", "clients"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    return args


def overrides(text: str) -> dict[str, Any]:
    """A `--run-config` string as a dict ({} when empty)."""
    return parse_config_args([text]) if text.strip() else {}


def main(argv: list[str] | None = None) -> None:
    """Run every method at every noise multiplier; write the table, the rows and the figure."""
    args = parse_args(argv)
    os.environ.update(ENVIRONMENT)
    out = args.out or APP_DIR / "runs" / f"{time.strftime('%Y%m%d-%H%M%S')}-dp"
    out.mkdir(parents=True, exist_ok=True)
    if args.report is not None:
        rows = [reread(Row(**row)) for f in args.report for row in read_rows(f / "dp.json")]
        write_results(out, rows)
        return
    extra = overrides(args.run_config)
    extra["server-device"] = args.device
    crowd = None
    if any(m.task == "scene" and m.name in args.methods for m in METHODS) and "scene" in args.tasks:
        data = DataOptions(
            scene=APP_DIR / "data" / "lego",
            users=args.users,
            views_per_user=args.views_per_user,
            downscale=args.downscale,
            crowd=args.crowd,
        )
        crowd = crowd_dataset(data, dict(os.environ))
    rows: list[Row] = []
    for method in METHODS:
        if method.task not in args.tasks or method.name not in args.methods:
            continue
        task_extra = args.scene_run_config if method.task == "scene" else args.photos_run_config
        task_config = extra | overrides(task_extra)
        setup = Setup(
            out, args.rounds, task_config, crowd, args.users, args.clients, args.device,
            overrides(args.dp_run_config), args.preflight,
        )  # fmt: skip
        measure(method, args.noise_multipliers, setup, args.clip_norm, rows)
    write_results(out, rows)


def read_rows(path: Path) -> list[dict[str, Any]]:
    """The rows an earlier run wrote."""
    return json.loads(path.read_text())


def reread(row: Row) -> Row:
    """`row` read again from its finished run directory (the current readers; its peak memory
    kept), or with its run's replies counted when the run failed."""
    run_dir = Path(row.run_dir)
    if not row.run_dir:
        return row
    if row.error is not None or not (run_dir / "summary.json").is_file():
        return row if row.replies is not None else replace(row, replies=replies_of(run_dir))
    method = next(method for method in METHODS if method.name == row.method)
    reader = scene_row if method.task == "scene" else photos_row
    fresh = reader(method, row.noise_multiplier, row.clip_norm, run_dir)
    return replace(fresh, peak_gib=row.peak_gib)  # measured while it ran, not in the run dir


def write_results(out: Path, rows: list[Row]) -> None:
    """dp.json, dp.md and dp.png under `out`, each replaced whole (rows by task, method,
    population and z); the table printed."""
    names = [method.name for method in METHODS]
    rows = sorted(
        rows,
        key=lambda r: (
            TASKS.index(r.task), names.index(r.method), r.population or 0, r.noise_multiplier
        ),
    )  # fmt: skip
    atomic.write_json(out / "dp.json", [asdict(row) for row in rows])
    markdown = table(rows)
    atomic.write_text(out / "dp.md", markdown + "\n")
    plot(out / "dp.png", rows)
    print(markdown)
    print(f"table {out / 'dp.md'}, rows {out / 'dp.json'}, figure {out / 'dp.png'}")


if __name__ == "__main__":
    main()
