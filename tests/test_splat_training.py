"""Centralised splat training (`fedfields.train.splats`): it learns the bundled lego at 25x25,
gsplat's density control changes the Gaussians, and a node's cap on their count holds."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fedfields.data.scene import load_scene
from fedfields.fields.splats import SplatField, SplatFieldConfig
from fedfields.train import evaluate
from fedfields.train.splats import SplatTrainConfig, splat_render_config, train_splats

pytest.importorskip("gsplat.strategy")
LEGO = Path(__file__).resolve().parents[1] / "data" / "lego"


@pytest.fixture(scope="module")
def lego_tiny():
    """The bundled lego at 25x25: even views train, odd views are held out."""
    scene = load_scene(LEGO, downscale=8)
    return scene.subset(range(0, 80, 2)), scene.subset(range(1, 12, 2))


def test_splats_learn_the_lego_and_density_control_changes_the_gaussians(lego_tiny) -> None:
    """Seeded, 80 steps from 500 Gaussians: the loss falls by half and the held-out PSNR ends
    3 dB above an untrained field's; densification and pruning ran (the count moved)."""
    train, held_out = lego_tiny
    config = SplatTrainConfig(steps=80, initial_count=500, sh_degree=1, sh_degree_every=40,
                              refine_start=20, refine_every=20, reset_every=10_000,
                              refine_fraction=1.0)  # fmt: skip
    log: list[tuple[int, float, int]] = []
    field = train_splats(train, config, on_step=lambda *entry: log.append(entry))
    losses = [loss for _, loss, _ in log]
    assert sum(losses[-5:]) < 0.5 * sum(losses[:5]), losses
    assert {count for _, _, count in log} != {500} and field.config.count == log[-1][2]
    untrained = SplatField(SplatFieldConfig(count=500, aabb=field.config.aabb))
    settings = splat_render_config(held_out)
    scores = [evaluate(f, held_out, settings, progress=False).psnr for f in (field, untrained)]
    assert scores[0] > scores[1] + 3.0, scores  # 15.4 vs 11.4


def test_a_node_s_gaussian_cap_holds_through_densification(lego_tiny) -> None:
    train, _ = lego_tiny
    config = SplatTrainConfig(steps=45, initial_count=400, max_gaussians=420, sh_degree=0,
                              refine_start=10, refine_every=10, reset_every=10_000,
                              refine_fraction=1.0)  # fmt: skip
    counts: list[int] = []
    train_splats(train, config, on_step=lambda step, loss, count: counts.append(count))
    assert max(counts) <= 420


@pytest.mark.parametrize(
    ("options", "message"),
    [({"steps": 0}, "steps must be >= 1"), ({"initial_count": 10, "max_gaussians": 5},
     "initial_count 10 is above max_gaussians 5"),
     ({"refine_fraction": 1.5}, "refine_fraction must be in \\[0, 1\\], got 1.5")],
)  # fmt: skip
def test_bad_splat_training_settings_are_refused_by_name(options: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SplatTrainConfig(**options)


def test_the_cli_trains_splats_and_eval_scores_the_checkpoint_the_same(
    tmp_path: Path, capsys
) -> None:
    """`fedfields train --model splats` as docs/CLI.md prints it (tiny settings), then
    `fedfields eval` on its checkpoint's held-out views: the same PSNR, and the files."""
    from fedfields.cli import main

    out = tmp_path / "splats"
    common = ["--scene", str(LEGO), "--downscale", "8"]
    flags = ["--model", "splats", "--gaussians", "500", "--steps", "30", "--holdout", "8",
             "--out", str(out)]  # fmt: skip
    assert main(["train", *common, *flags, "--no-progress"]) == 0
    trained = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    metrics = json.loads((out / "metrics.json").read_text())
    assert (
        metrics["train"]["gaussians"] == trained["gaussians"] == metrics["config"]["field"]["count"]
    )
    assert metrics["train"]["bytes"] == trained["gaussians"] * (3 + 3 + 4 + 1 + 16 * 3) * 4
    assert len(list((out / "renders").glob("*.png"))) == 10  # every 8th of 80 views
    checkpoint = str(out / "checkpoint.pt")
    assert (
        main(["eval", "--checkpoint", checkpoint, *common, "--views", "holdout", "--no-progress"])
        == 0
    )
    evaluated = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert evaluated["psnr"] == pytest.approx(trained["psnr"]) and evaluated["views"] == 10
    assert main(["train", *common, *flags, "--static-step", "--no-progress"]) == 2
    assert "--static-step and --cuda-graph are for ray-marched" in capsys.readouterr().err
    assert main(["train", *common, *flags, "--max-gaussians", "400", "--no-progress"]) == 2
    assert "initial_count 500 is above max_gaussians 400" in capsys.readouterr().err


def test_the_lego_bench_runs_splats_and_reports_their_count_and_size(capsys) -> None:
    """`simulations.bench.lego_fields --models splats` at 25x25 for 0.6 seconds: one JSON row
    with the held-out scores, the Gaussian count and megabytes (the hash grid's row beside it
    is the bench's older path)."""
    from simulations.bench.lego_fields import main

    main(["--minutes", "0.01", "--downscale", "8", "--models", "splats"])
    lines = capsys.readouterr().out.strip().splitlines()
    rows = [json.loads(line) for line in lines if line.startswith("{")]
    assert [row["model"] for row in rows] == ["splats"] and rows[0]["psnr"] > 0
    assert rows[0]["gaussians"] > 0 and rows[0]["megabytes"] > 0
