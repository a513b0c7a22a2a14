"""Benchmark: SDAR against naive SDA on split-learned digits, per split level, and two defences.

For each split level (client conv blocks) in vanilla and U-shaped split learning, the
digits CNN of `fedfields.privacy.attacks.sdar_digits` is trained once per seed while SDAR
and naive SDA both watch the same transcript. Reported (mean over seeds, min-max in
brackets): the joint model's test accuracy (utility), each attack's MSE on all the client's
private digits (images in [0, 1]; lower = more leakage), the MSE of the auxiliary mean digit
(what the domain alone gives away), the MSE of the auxiliary mean digit of each private
digit's class (what the labels a vanilla server holds give away: an attack below it shows more
than the label) and, U-shaped, the label accuracy (chance 0.10). Then
SDAR under paper 001 Sec. VI's defences (dropout before the classifier, l2 on every party's
weights, mirrored on the attacker's simulators) in vanilla split learning; Table V's ablation
(every component of SDAR removed in turn, all attacks watching the same training); and
Table VII's vanilla lambdas (lambda_1 0.02, lambda_2 1e-5) beside larger lambda_1 and none, at a
longer budget, with the discriminators' final losses (chance: 2 ln 2 = 1.386) to show whether
they trained at all.

    python -m simulations.bench.sdar_digits [--steps 400] [--seeds 0 1] [--levels 1 2 3]
        [--tables levels defences ablation lambda] [--lambda-steps 2000] [--png-dir DIR]
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from collections.abc import Sequence
from pathlib import Path

from fedfields.privacy.attacks.sdar import SDARConfig
from fedfields.privacy.attacks.sdar_digits import (
    SPLIT_LEVELS,
    U_SHAPED_SDAR,
    DigitsAuditResult,
    DigitsSplitConfig,
    digits_audit,
    load_digits_split,
)
from simulations.bench.devices import add_cpu_only_device_argument

DEFENCES = (("dropout", 0.2), ("dropout", 0.5), ("l2", 1e-3), ("l2", 1e-2))
DEFENCE_LEVEL = 2
ABLATION_LEVELS = (2, 3)
# Table V's cases (paper numbering), plus naive SDA (no adversarial term and no labels)
ABLATION = {
    "1 full SDAR": SDARConfig(),
    "2 no d1": SDARConfig(lambda1=0.0),
    "3 no d2": SDARConfig(lambda2=0.0),
    "4 no d1, no d2": SDARConfig(lambda1=0.0, lambda2=0.0),
    "5 no label conditioning": SDARConfig(conditional=False),
    "naive SDA": SDARConfig.naive(),
}
LAMBDA1S = (0.0, 0.02, 0.2, 0.4)  # 0.02: Table VII's vanilla value; 0: no d1
CHANCE_BCE_PAIR = 1.386  # d1/d2 loss (two BCE terms) of a discriminator at chance


def cell(values: Sequence[float], digits: int = 4) -> str:
    """Mean of the seeds' values with their range in brackets."""
    mean = sum(values) / len(values)
    if len(values) == 1:
        return f"{mean:.{digits}f}"
    return f"{mean:.{digits}f} [{min(values):.{digits}f}-{max(values):.{digits}f}]"


def run(
    config: DigitsSplitConfig, attacks: dict[str, SDARConfig], png_dir: Path | None
) -> DigitsAuditResult:
    """One audit on the seed's digits split, its PNGs in a directory named after the run."""
    setting = "u" if config.u_shaped else "vanilla"
    name = f"{setting}-L{config.split_level}-dropout{config.dropout}-l2{config.l2}-s{config.seed}"
    return digits_audit(
        config, attacks, load_digits_split(config.seed), None if png_dir is None else png_dir / name
    )


def split_level_table(
    steps: int, seeds: Sequence[int], levels: Sequence[int], png_dir: Path | None
) -> list[str]:
    """SDAR vs naive SDA at every split level, vanilla then U-shaped."""
    lines = [
        "| setting | client blocks | test acc | SDAR MSE | naive SDA MSE | mean-digit MSE "
        "| class-mean MSE | SDAR label acc | naive label acc |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for u_shaped in (False, True):
        attacks = {"sdar": U_SHAPED_SDAR if u_shaped else SDARConfig(), "naive": SDARConfig.naive()}
        for level in levels:
            results = [
                run(DigitsSplitConfig(level, u_shaped, steps, seed=seed), attacks, png_dir)
                for seed in seeds
            ]
            labels = ["-", "-"]
            if u_shaped:
                labels = [
                    cell([r.scores[name].label_accuracy or 0.0 for r in results], 2)
                    for name in ("sdar", "naive")
                ]
            lines.append(
                f"| {'U-shaped' if u_shaped else 'vanilla'} | {level} "
                f"| {cell([r.test_accuracy for r in results], 3)} "
                f"| {cell([r.scores['sdar'].mse for r in results])} "
                f"| {cell([r.scores['naive'].mse for r in results])} "
                f"| {cell([r.mean_image_mse for r in results])} "
                f"| {cell([r.class_mean_mse for r in results])} | {labels[0]} | {labels[1]} |"
            )
            print(lines[-1], flush=True)
    return lines


def defence_table(steps: int, seeds: Sequence[int], png_dir: Path | None) -> list[str]:
    """SDAR in vanilla split learning at DEFENCE_LEVEL under dropout and l2 (paper Sec. VI)."""
    lines = [
        f"| defence (vanilla, {DEFENCE_LEVEL} client blocks) | test acc | SDAR MSE |",
        "|---|---|---|",
    ]
    for defence, strength in (("none", 0.0), *DEFENCES):
        results = []
        for seed in seeds:
            config = DigitsSplitConfig(DEFENCE_LEVEL, steps=steps, seed=seed)
            config = dataclasses.replace(
                config, **({} if defence == "none" else {defence: strength})
            )
            # the attacker mirrors an l2 penalty on its simulator (Sec. VI's argument)
            attack = SDARConfig(weight_decay=2 * config.l2)
            results.append(run(config, {"sdar": attack}, png_dir))
        label = "none" if defence == "none" else f"{defence} {strength:g}"
        lines.append(
            f"| {label} | {cell([r.test_accuracy for r in results], 3)} "
            f"| {cell([r.scores['sdar'].mse for r in results])} |"
        )
        print(lines[-1], flush=True)
    return lines


def final_loss(history: Sequence[dict[str, float]], key: str) -> float | None:
    """Mean of `key` over the last tenth of the attack's steps (None when it has no such term)."""
    values = [record[key] for record in history if key in record]
    if not values:
        return None
    tail = values[-max(1, len(values) // 10) :]
    return sum(tail) / len(tail)


def optional_cell(values: Sequence[float | None]) -> str:
    """`cell` of the values, or '-' when the attack has no such term."""
    present = [value for value in values if value is not None]
    return cell(present, 3) if present else "-"


def attack_rows(
    attacks: dict[str, SDARConfig], level: int, steps: int, seeds: Sequence[int],
    png_dir: Path | None,
) -> list[str]:  # fmt: skip
    """One vanilla training per seed at `level` watched by every attack; a row per attack."""
    results = [run(DigitsSplitConfig(level, steps=steps, seed=seed), attacks, png_dir)
               for seed in seeds]  # fmt: skip
    rows = []
    for name in attacks:
        scores = [r.scores[name] for r in results]
        rows.append(
            f"| {name} | {level} | {steps} | {cell([s.mse for s in scores])} "
            f"| {cell([r.class_mean_mse for r in results])} "
            f"| {optional_cell([final_loss(s.history, 'd1') for s in scores])} "
            f"| {optional_cell([final_loss(s.history, 'd2') for s in scores])} |"
        )
        print(rows[-1], flush=True)
    return rows


ATTACK_TABLE_HEADER = [
    "| attack (vanilla) | client blocks | steps | attack MSE | class-mean MSE | d1 loss (end) "
    "| d2 loss (end) |",
    "|---|---|---|---|---|---|---|",
]


def ablation_table(steps: int, seeds: Sequence[int], png_dir: Path | None) -> list[str]:
    """Paper 001 Table V: SDAR with each component removed, at ABLATION_LEVELS."""
    lines = list(ATTACK_TABLE_HEADER)
    for level in ABLATION_LEVELS:
        lines += attack_rows(ABLATION, level, steps, seeds, png_dir)
    return lines


def lambda_table(steps: int, seeds: Sequence[int], png_dir: Path | None) -> list[str]:
    """Table VII's vanilla lambda_1 beside larger ones and none, at DEFENCE_LEVEL."""
    attacks = {f"lambda_1 = {value:g}": SDARConfig(lambda1=value) for value in LAMBDA1S}
    return [*ATTACK_TABLE_HEADER, *attack_rows(attacks, DEFENCE_LEVEL, steps, seeds, png_dir)]


TABLES = ("levels", "defences", "ablation", "lambda")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400, help="split-learning steps per run")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--levels", type=int, nargs="+", default=list(SPLIT_LEVELS))
    parser.add_argument("--tables", nargs="+", choices=TABLES, default=list(TABLES))
    parser.add_argument(
        "--lambda-steps", type=int, default=2000, help="split-learning steps of the lambda table"
    )
    parser.add_argument("--png-dir", type=Path, help="write private/reconstructed digit PNGs")
    add_cpu_only_device_argument(parser, "the digits split CNN and its attacks train on the CPU")
    args = parser.parse_args()
    start = time.perf_counter()
    tables = []
    if "levels" in args.tables:
        tables.append(split_level_table(args.steps, args.seeds, args.levels, args.png_dir))
    if "defences" in args.tables:
        tables.append(defence_table(args.steps, args.seeds, args.png_dir))
    if "ablation" in args.tables:
        tables.append(ablation_table(args.steps, args.seeds, args.png_dir))
    if "lambda" in args.tables:
        tables.append(lambda_table(args.lambda_steps, args.seeds, args.png_dir))
    print(f"\n{args.steps} steps, batch 32, seeds {args.seeds}\n")
    for table in tables:
        print("\n".join(table) + "\n")
    print(f"{time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
