"""Benchmark: a miniature of paper 000's Table 4 (SplitNeRF defences vs the attack).

Rows: no defence (attack at the default ratio 100, and at the paper's ratio 0.01), S2NeRF
gradient noise with c in {0.6, 1.2, 2.4} and r in {1e-4, 1}, NoisyLabel with sigma_l in
{0.5, 2, 8}. Every row trains a fresh hash-grid field by in-process split learning from the
same seed (field, pixel sampler, defence noise, attack), then reports:

- utility: held-out PSNR and SSIM of the row's joint field (every 8th view held out);
- leakage: the Surrogate Model Attack on the row's transcript, its depth and grey renders of
  the held-out views (server part + surrogate head) scored with SSIM against a fixed
  reference, the undefended run's depth and grey renders, and against the row's own client
  model; LPIPS-depth against the reference where the lpips package is installed. Two
  attackers: offline (`surrogate_model_attack`, fedfields' defaults, `--epochs` passes over
  every `--record-every`-th exchange) and online (`online_surrogate_attack` with
  `paper_online_config`: the paper's 10/t-attack, one step per training step, so it sees
  every exchange; its cells repeat on the "ratio 0.01" row, which trains nothing new);
- the untrained-head baseline: a freshly initialised surrogate head (no transcript) on the
  row's server part, scored the same way, so the attack's gain is visible;
- the row's client model's own SSIM-depth against the reference (how far the defence moved
  the geometry the client learnt).

Scoring against the undefended reference matters: under strong noise the client's own model
is a haze, which even an untrained head matches well. A PNG grid (one held-out view; per row
the reference depth, the row's client depth, the offline and online attacks' depths and the
untrained head's depth) and a results.json go to --out.

--scene takes any scene folder `load_scene` reads. Besides lego, a procedural object (ray-cast
surfaces, `fedfields.data.objects`) rendered at the bench's 25x25 from 80 views:

    .venv/bin/fedfields data objects --count 1 --views 80 --resolution 25 \
        --out runs/objects_split_bench
    .venv/bin/python -m simulations.bench.split_defences --downscale 1 \
        --scene runs/objects_split_bench/object_000 --out runs/bench_split_defences_object

    .venv/bin/python -m simulations.bench.split_defences [--out runs/bench_split_defences]
        [--downscale 8] [--steps 300] [--batch-rays 128] [--samples 32] [--record-every 10]
        [--epochs 60] [--threads 1]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageDraw
from torch import Tensor

from fedfields.data import holdout_indices, load_scene
from fedfields.data.scene import Scene
from fedfields.fields import HashGridConfig, HashGridField, HashGridFieldConfig
from fedfields.geometry.rays import image_rays
from fedfields.metrics.image import lpips, ssim
from fedfields.privacy.attacks.surrogate import (
    SurrogateAttackConfig,
    SurrogateResult,
    depth_view,
    grey_view,
    make_surrogate_head,
    online_surrogate_attack,
    paper_online_config,
    surrogate_model_attack,
)
from fedfields.privacy.defences import ClientDefence, NoisyLabel, S2NeRFNoise
from fedfields.privacy.split import (
    ClientPart,
    RaySamples,
    ServerPart,
    SplitExchange,
    SplitTrainConfig,
    render_embeddings,
    sample_rays,
    server_forward,
    split_field,
    train_split,
)
from fedfields.render import RenderConfig
from fedfields.train.evaluation import evaluate
from simulations import APP_DIR
from simulations.bench.devices import add_device_argument

S2NERF_C = (0.6, 1.2, 2.4)
S2NERF_R = (1e-4, 1.0)
NOISY_LABEL_SIGMA = (0.5, 2.0, 8.0)
PAPER_RATIO = 0.01


@dataclass(frozen=True)
class Row:
    """One table row: a client defence and the attack's loss ratio (None: the attack default)."""

    defence: str  # "none", "s2nerf" or "noisylabel"
    c: float | None = None
    r: float | None = None
    sigma_l: float | None = None
    ratio: float | None = None

    @property
    def name(self) -> str:
        if self.defence == "s2nerf":
            return f"s2nerf c={self.c:g} r={self.r:g}"
        if self.defence == "noisylabel":
            return f"noisylabel sigma={self.sigma_l:g}"
        return "none" if self.ratio is None else f"none, ratio {self.ratio:g}"

    def client_defence(self, total_steps: int, seed: int) -> ClientDefence | None:
        if self.defence == "s2nerf":
            assert self.c is not None and self.r is not None
            return S2NeRFNoise(c=self.c, r=self.r, total_steps=total_steps, seed=seed)
        if self.defence == "noisylabel":
            assert self.sigma_l is not None
            return NoisyLabel(self.sigma_l, seed=seed)
        return None

    @property
    def training_key(self) -> tuple:
        """Rows with the same key share one split run (they differ in the attack only)."""
        return (self.defence, self.c, self.r, self.sigma_l)


def table_rows() -> list[Row]:
    """The miniature Table 4: none (attack default and paper ratio), S2NeRF grid, NoisyLabel."""
    rows = [Row("none"), Row("none", ratio=PAPER_RATIO)]
    rows += [Row("s2nerf", c=c, r=r) for r in S2NERF_R for c in S2NERF_C]
    rows += [Row("noisylabel", sigma_l=sigma) for sigma in NOISY_LABEL_SIGMA]
    return rows


@dataclass
class SplitRun:
    """A trained split run: the joint field's two parts, transcript, utility and seconds."""

    server: ServerPart
    client: ClientPart
    transcript: list[SplitExchange]
    psnr: float
    ssim: float
    seconds: float


@dataclass
class Views:
    """Depth and grey renders [N, H, W] of the held-out views by one server part + head."""

    depth: Tensor
    grey: Tensor


def make_field(scene: Scene, log2_hashmap_size: int, seed: int) -> HashGridField:
    """The federated default field (`global_field`'s grid) with a smaller hash table."""
    torch.manual_seed(seed)
    resolution = max(scene.cameras.width, scene.cameras.height)
    encoding = HashGridConfig(
        max_resolution=max(64, 4 * resolution),
        log2_hashmap_size=log2_hashmap_size,
        implementation="torch",
    )
    aabb = tuple(scene.aabb.reshape(-1).tolist())
    return HashGridField(HashGridFieldConfig(encoding=encoding, aabb=aabb))


def every_kth(transcript: Sequence[SplitExchange], k: int) -> list[SplitExchange]:
    """The exchanges a server recording every k-th step keeps (steps 0, k, 2k, ...)."""
    return [exchange for exchange in transcript if exchange.step % k == 0]


def train_row(
    row: Row,
    train_scene: Scene,
    test_scene: Scene,
    config: SplitTrainConfig,
    render_config: RenderConfig,
    log2_hashmap_size: int,
) -> SplitRun:
    """Split-train one row's field from the shared seed and score it on the held-out views."""
    field = make_field(train_scene, log2_hashmap_size, config.seed)
    defence = row.client_defence(config.steps, config.seed)
    result = train_split(field, train_scene, config, render_config, defence)
    utility = evaluate(field, test_scene, render_config, progress=False)
    server, client = split_field(field, config.cut_layer)
    return SplitRun(server, client, result.transcript, utility.psnr, utility.ssim, result.seconds)


@dataclass
class ServerViews:
    """The server part's embeddings of the held-out views' samples, computed once per row.

    The hash grid dominates a render's cost; every head (the client's, the attack's, the
    untrained one) is rendered from the same cached embeddings.
    """

    samples: list[RaySamples]  # per view: its rays' stratified samples (no jitter)
    embeddings: list[Tensor]  # per view: [H*W*S, d]
    height: int
    width: int


@torch.no_grad()
def server_views(server: ServerPart, scene: Scene, render_config: RenderConfig) -> ServerViews:
    """Sample every view of `scene` as `render_split_view` does and run the server part once."""
    device = next(server.parameters()).device
    cameras = scene.cameras.to(device)
    samples = [
        sample_rays(image_rays(cameras, view), render_config, perturb=False)
        for view in range(len(scene))
    ]
    embeddings = [server_forward(server, s.points()) for s in samples]
    return ServerViews(samples, embeddings, cameras.height, cameras.width)


@torch.no_grad()
def render_views(head: ClientPart, views: ServerViews, render_config: RenderConfig) -> Views:
    """Depth and grey renders (the attack's `depth_view`, `grey_view`) of the cached views."""
    background = torch.tensor(render_config.background, device=views.embeddings[0].device)
    shape = (views.height, views.width)
    depths, greys = [], []
    for samples, embeddings in zip(views.samples, views.embeddings, strict=True):
        rendered = render_embeddings(head, embeddings, samples, background)
        depths.append(depth_view(rendered, render_config).view(shape).cpu())
        greys.append(grey_view(rendered.rgb.view(*shape, 3)).cpu())
    return Views(depth=torch.stack(depths), grey=torch.stack(greys))


def _rgb(images: Tensor) -> np.ndarray:
    """[N, H, W] single-channel images as an [N, H, W, 3] numpy batch (what SSIM/LPIPS take)."""
    return np.repeat(images.numpy()[..., None], 3, axis=-1)


def similarity(prediction: Views, truth: Views) -> dict[str, float | None]:
    """SSIM of depth and grey, LPIPS of depth (None without lpips), mean over views."""
    return {
        "ssim_depth": ssim(_rgb(prediction.depth), _rgb(truth.depth)),
        "ssim_grey": ssim(_rgb(prediction.grey), _rgb(truth.grey)),
        "lpips_depth": lpips(_rgb(prediction.depth), _rgb(truth.depth)),
    }


def untrained_head(server: ServerPart, config: SurrogateAttackConfig) -> ClientPart:
    """The attack's surrogate head as seeded, before spectral init and training."""
    torch.manual_seed(config.seed)
    device = next(server.parameters()).device
    return make_surrogate_head(server.embedding_dim, config).to(device)


def bench_setup(
    args: argparse.Namespace, seed: int
) -> tuple[Scene, Scene, RenderConfig, SplitTrainConfig]:
    """Training and held-out views, stratified render settings and the split-run config."""
    scene = load_scene(args.scene, downscale=args.downscale)
    train_ids, test_ids = holdout_indices(len(scene), args.holdout)
    render_config = RenderConfig(
        near=scene.near,
        far=scene.far,
        aabb=tuple(scene.aabb.reshape(-1).tolist()),
        background=scene.background,
        num_samples=args.samples,
        num_importance=0,
    )
    split_config = SplitTrainConfig(
        steps=args.steps,
        batch_rays=args.batch_rays,
        random_background=False,
        record_every=args.record_every,
        log_every=max(1, args.steps),
        device=args.device,
        seed=seed,
    )
    return scene.subset(train_ids), scene.subset(test_ids), render_config, split_config


def run_benchmark(args: argparse.Namespace) -> tuple[list[dict], list[list[np.ndarray]]]:
    """Train and attack every row; return its figures and its depth panels for the grid.

    Every exchange is recorded for the online attacker; the offline one gets every
    `--record-every`-th. Rows sharing a split run are consecutive, so only the current run
    (and its online attack) is kept.
    """
    train_scene, test_scene, render_config, split_config = bench_setup(args, args.seed)
    split_config = dataclasses.replace(split_config, record_every=1)
    attack_config = SurrogateAttackConfig(epochs=args.epochs, seed=args.seed)
    online_config = paper_online_config(args.seed)
    background = torch.tensor(test_scene.background)
    print(
        f"{args.scene.name} {test_scene.cameras.width}x{test_scene.cameras.height}: "
        f"{len(train_scene)} training / "
        f"{len(test_scene)} held-out views; {args.steps} split steps of {args.batch_rays} rays x "
        f"{args.samples} samples, 2^{args.log2_hashmap_size} table; offline attack "
        f"{args.epochs} epochs over every {args.record_every}th exchange, online attack over "
        f"every exchange; seed {args.seed}; torch threads {torch.get_num_threads()}",
        flush=True,
    )
    run_key: tuple | None = None
    reference: Views | None = None
    figures: list[dict] = []
    panels: list[list[np.ndarray]] = []
    for row in table_rows():
        if row.training_key != run_key:
            run_key = row.training_key
            run = train_row(
                row, train_scene, test_scene, split_config, render_config, args.log2_hashmap_size
            )
            cached = server_views(run.server, test_scene, render_config)
            own = render_views(run.client, cached, render_config)
            online = online_surrogate_attack(run.server, run.transcript, background, online_config)
            online_views = render_views(online.head, cached, render_config)
        if reference is None:  # the first row is the undefended run
            reference = own
        config = attack_config
        if row.ratio is not None:
            config = dataclasses.replace(attack_config, ratio=row.ratio)
        offline = every_kth(run.transcript, args.record_every)
        attack = surrogate_model_attack(run.server, offline, background, config)
        attacked = render_views(attack.head, cached, render_config)
        untrained = render_views(untrained_head(run.server, config), cached, render_config)
        vs_reference = similarity(attacked, reference)
        vs_own = similarity(attacked, own)
        online_vs_reference = similarity(online_views, reference)
        figures.append(
            {
                "row": row.name,
                "defence": row.defence,
                "c": row.c,
                "r": row.r,
                "sigma_l": row.sigma_l,
                "attack_ratio": config.ratio,
                "ratio_override": row.ratio is not None,
                "psnr": run.psnr,
                "ssim": run.ssim,
                "attack_vs_reference": vs_reference,
                "attack_vs_own": vs_own,
                "untrained_vs_reference": similarity(untrained, reference),
                "untrained_vs_own": similarity(untrained, own),
                "client_vs_reference": similarity(own, reference),
                "online_vs_reference": online_vs_reference,
                "online_vs_own": similarity(online_views, own),
                "split_seconds": run.seconds,
                "attack_seconds": attack.seconds,
                "online_seconds": online.seconds,
                "final_relative_gradient_loss": attack.history[-1]["relative_gradient_loss"],
                "online_final_relative_gradient_loss": late_mean(online, "relative_gradient_loss"),
            }
        )
        view = args.grid_view
        panels.append(
            [
                reference.depth[view].numpy(),
                own.depth[view].numpy(),
                attacked.depth[view].numpy(),
                online_views.depth[view].numpy(),
                untrained.depth[view].numpy(),
            ]
        )
        print(
            f"{row.name}: PSNR {run.psnr:.2f} dB, attack SSIM-depth vs ref "
            f"{vs_reference['ssim_depth']:.3f}, vs own {vs_own['ssim_depth']:.3f}; online "
            f"{online_vs_reference['ssim_depth']:.3f} (split {run.seconds:.0f} s, attack "
            f"{attack.seconds:.0f} s, online {online.seconds:.0f} s)",
            flush=True,
        )
    return figures, panels


def late_mean(result: SurrogateResult, name: str, fraction: float = 0.1) -> float:
    """Mean of a history entry over the last `fraction` of the records (at least one)."""
    tail = result.history[-max(1, int(len(result.history) * fraction)) :]
    return sum(record[name] for record in tail) / len(tail)


def _fmt(value: float | None, digits: int = 3) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    return f"{value:.{digits}f}"


def markdown_table(figures: Sequence[dict]) -> str:
    """The benchmark's markdown table, one line per row."""
    header = (
        "| defence | c | r | sigma_l | held-out PSNR | SSIM | attack SSIM-depth vs ref "
        "| attack SSIM-grey vs ref | attack LPIPS-depth vs ref | attack SSIM-depth vs own "
        "| attack SSIM-grey vs own | online SSIM-depth vs ref | online SSIM-grey vs ref "
        "| online SSIM-depth vs own | untrained SSIM-depth vs ref | untrained SSIM-depth vs own "
        "| client SSIM-depth vs ref | split s | attack s | online s |"
    )
    lines = [header, "|" + "---|" * header.count(" | ") + "---|"]
    for f in figures:
        name = f["defence"]
        if f["ratio_override"]:
            name += f" (attack ratio {f['attack_ratio']:g})"
        cells = [
            name,
            "-" if f["c"] is None else f"{f['c']:g}",
            "-" if f["r"] is None else f"{f['r']:g}",
            "-" if f["sigma_l"] is None else f"{f['sigma_l']:g}",
            f"{f['psnr']:.2f} dB",
            _fmt(f["ssim"]),
            _fmt(f["attack_vs_reference"]["ssim_depth"]),
            _fmt(f["attack_vs_reference"]["ssim_grey"]),
            _fmt(f["attack_vs_reference"]["lpips_depth"]),
            _fmt(f["attack_vs_own"]["ssim_depth"]),
            _fmt(f["attack_vs_own"]["ssim_grey"]),
            _fmt(f["online_vs_reference"]["ssim_depth"]),
            _fmt(f["online_vs_reference"]["ssim_grey"]),
            _fmt(f["online_vs_own"]["ssim_depth"]),
            _fmt(f["untrained_vs_reference"]["ssim_depth"]),
            _fmt(f["untrained_vs_own"]["ssim_depth"]),
            _fmt(f["client_vs_reference"]["ssim_depth"]),
            f"{f['split_seconds']:.0f}",
            f"{f['attack_seconds']:.0f}",
            f"{f['online_seconds']:.0f}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_grid(path: Path, names: Sequence[str], panels: Sequence[Sequence[np.ndarray]]) -> None:
    """PNG: one line per row, reference | client | offline | online | untrained depth."""
    scale, label_width, header = 4, 200, 16
    height, width = panels[0][0].shape
    cell_h, cell_w = height * scale, width * scale
    columns = ("reference", "client", "offline", "online", "untrained")
    canvas = Image.new(
        "L", (label_width + len(columns) * (cell_w + 2), header + len(panels) * (cell_h + 2)), 255
    )
    draw = ImageDraw.Draw(canvas)
    for j, column in enumerate(columns):
        draw.text((label_width + j * (cell_w + 2) + 2, 2), column, fill=0)
    for i, (name, row_panels) in enumerate(zip(names, panels, strict=True)):
        top = header + i * (cell_h + 2)
        draw.text((4, top + cell_h // 2 - 6), name, fill=0)
        for j, panel in enumerate(row_panels):
            image = Image.fromarray((np.clip(panel, 0.0, 1.0) * 255.0 + 0.5).astype(np.uint8))
            image = image.resize((cell_w, cell_h), Image.NEAREST)
            canvas.paste(image, (label_width + j * (cell_w + 2), top))
    canvas.save(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--scene",
        type=Path,
        default=APP_DIR / "data" / "lego",
        help="scene folder (lego, or a procedural object: see the module docstring)",
    )
    parser.add_argument("--out", type=Path, default=APP_DIR / "runs" / "bench_split_defences")
    parser.add_argument("--downscale", type=float, default=8.0)
    parser.add_argument("--holdout", type=int, default=8)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch-rays", type=int, default=128)
    parser.add_argument("--samples", type=int, default=32)
    parser.add_argument("--log2-hashmap-size", type=int, default=14)
    parser.add_argument(
        "--record-every",
        type=int,
        default=10,
        help="the offline attacker's transcript: every k-th exchange (the online one sees all)",
    )
    parser.add_argument("--epochs", type=int, default=60)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--grid-view", type=int, default=1, help="held-out view in the PNG")
    add_device_argument(parser, "split training and the attacks", default="cpu")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads; 1 because on the shared 2-core machine 2 threads ran 5x (split "
        "steps) to 40x (attack) slower than 1 while other processes held the cores",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", message="LPIPS unavailable")
    start = time.perf_counter()
    figures, panels = run_benchmark(args)
    seconds = time.perf_counter() - start
    table = markdown_table(figures)
    print(table)
    print(f"wall time {seconds:.0f} s")
    args.out.mkdir(parents=True, exist_ok=True)
    settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    report = {"settings": settings, "seconds": seconds, "rows": figures}
    (args.out / "results.json").write_text(json.dumps(report, indent=2))
    (args.out / "table.md").write_text(table + "\n")
    write_grid(args.out / "depth_grid.png", [f["row"] for f in figures], panels)
    print(f"wrote {args.out / 'results.json'}, table.md and depth_grid.png")


if __name__ == "__main__":
    main()
