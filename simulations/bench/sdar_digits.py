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
weights, mirrored on the attacker's simulators) in vanilla split learning.

    python -m simulations.bench.sdar_digits [--steps 400] [--seeds 0 1] [--levels 1 2 3]
        [--no-defences] [--png-dir DIR]
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

DEFENCES = (("dropout", 0.2), ("dropout", 0.5), ("l2", 1e-3), ("l2", 1e-2))
DEFENCE_LEVEL = 2


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400, help="split-learning steps per run")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--levels", type=int, nargs="+", default=list(SPLIT_LEVELS))
    parser.add_argument("--no-defences", action="store_true", help="skip the Sec. VI table")
    parser.add_argument("--png-dir", type=Path, help="write private/reconstructed digit PNGs")
    args = parser.parse_args()
    start = time.perf_counter()
    tables = [split_level_table(args.steps, args.seeds, args.levels, args.png_dir)]
    if not args.no_defences:
        tables.append(defence_table(args.steps, args.seeds, args.png_dir))
    print(f"\n{args.steps} steps, batch 32, seeds {args.seeds}\n")
    for table in tables:
        print("\n".join(table) + "\n")
    print(f"{time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
