"""Client-level DP of a strategy's rounds: what each sum clips and noises, and the accountant.

Plaintext sums clip each reply's update and the server adds N(0, (z C)^2) (central DP,
`central`); under secure aggregation the clients clip and add their share of that noise
before masking (distributed DP, `client_config`), calibrated to t, the fewest holders a sum
of the round is unmasked from (`RoundLedger.min_holders`), so every unmasked sum carries at
least z, more with more holders (`effective_noise_multiplier`), and each is charged.
Weights are uniform. One `DPAccountant` per run is
charged once a round with q = sampled / connected and the multiplier combined over the round's
noised sums ("dp-epsilon" after it); a plan beyond dp-target-epsilon is refused
(`check_plan`) and a round whose worst-case charge would exceed it is not run
(`check_budget`, `PrivacyBudgetSpent`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from logging import INFO, WARNING
from typing import Any

import torch
from flwr.common.logger import log

from fedfields.flower.protocol import (
    ARRAYS,
    DP_CLIP_NORM,
    DP_COUNT_STDDEV,
    DP_GRADIENT_CLIP_NORM,
    DP_NOISE_MULTIPLIER,
    DP_UNCLIPPED,
    SECURE_DELTA_SCALE,
    WEIGHT_KEY,
)
from fedfields.flower.round_ledger import RoundLedger
from fedfields.flower.sum_replies import (
    CentralPrivacy,
    DistributedPrivacy,
    RoundSum,
    with_reference,
)
from fedfields.privacy.accountant import EPSILON_METRIC, DPAccountant, RoundCharge, check_plan
from fedfields.privacy.adaptive_clipping import next_clip_norm, update_noise_multiplier
from fedfields.privacy.dp import (
    CLIP_NORM_KEY,
    MAX_NOISE_RATIO_KEY,
    NOISE_TAIL,
    DPConfig,
    central_noise_std,
    combined_noise_multiplier,
    distributed_noise_range,
    effective_noise_multiplier,
    noise_generator,
    noise_ratio,
)
from fedfields.privacy.secagg_plan import SecureAggregationConfig

DP_EPSILON = EPSILON_METRIC
"""Train metric: epsilon at dp-delta spent by the run so far (DP runs only)."""
DP_ROUND_MULTIPLIER = "dp-round-noise-multiplier"
"""Train metric: the noise multiplier the accountant charged this round (DP runs only)."""
DP_NEXT_CLIP_NORM = "dp-next-clip-norm"
"""Train metric under adaptive clipping: the clip norm C the next round will use."""


class PrivacyBudgetSpent(RuntimeError):
    """The next round's charge would take epsilon above dp-target-epsilon: the run ends
    before it, cleanly (nothing of that round was sent; the rounds before it stand)."""


class RoundPrivacy:
    """The DP state of one strategy's run: its settings, accountant and noise generator.

    `sums_per_round(round)` is the strategy's count of noised sums a round makes over its
    sampled clients; `delta_scale` names the key s of a record sent as x - s g (DecentNeRF's
    alpha_k), "" for x - g.
    """

    def __init__(
        self,
        config: DPConfig,
        secure_aggregation: SecureAggregationConfig | None,
        sums_per_round: Callable[[int], int],
        delta_scale: str = "",
    ) -> None:
        self.config = config
        self.secure_aggregation = secure_aggregation
        self.sums_per_round = sums_per_round
        self.delta_scale = delta_scale
        self.accountant = DPAccountant(config.delta)
        self.stop = ""
        """Why the run stopped before its last round to stay within dp-target-epsilon."""
        self.noise: torch.Generator | None = None
        """The central DP noise's generator, secret-seeded at first use (`noise_generator`);
        tests may set a seeded one. Never seeded from run-config: the server could subtract."""
        self.clip_norm = config.clip_norm
        """C of the next sum: dp-clip-norm, moved after each round under adaptive clipping."""
        self.count_std = 0.0 if config.adaptive is None else config.adaptive.count_stddev
        """Adaptive clipping's sigma_b: as set, else fixed at the first round (`start`)."""
        self.payload_noise_std = 0.0
        """Std of the noise on each entry of the latest payload sum (at least; more holders
        add more), z C at the C it was clipped to."""

    def before_round(
        self, server_round: int, num_sampled: int, connected: int, num_params: int, first: bool
    ) -> None:
        """Before anything of a round is sent: at the run's `first` round adaptive clipping's
        sigma_b (`start`) and the pre-flight noise check (`check_noise`), then the round's
        budget (`check_budget`: PrivacyBudgetSpent)."""
        if first:
            self.start(num_sampled)
            self.check_noise(num_sampled, num_params)
        self.check_budget(server_round, num_sampled, connected)

    def start(self, num_sampled: int) -> None:
        """Fix adaptive clipping's sigma_b from the first round's sample (unless set or
        resumed); ValueError naming the keys when it is too small for z."""
        adaptive = self.config.adaptive
        if adaptive is None:
            return
        if self.count_std == 0:
            self.count_std = adaptive.count_noise_std(num_sampled)
        update_noise_multiplier(self.config.noise_multiplier, self.count_std)

    @property
    def update_multiplier(self) -> float:
        """The multiplier of a payload sum's noise: z, or under adaptive clipping z_Delta, which
        with the count's sigma_b composes to z (`update_noise_multiplier`); z while sigma_b
        waits for the first round's sample (`start`)."""
        if self.config.adaptive is None or self.count_std == 0:
            return self.config.noise_multiplier
        return update_noise_multiplier(self.config.noise_multiplier, self.count_std)

    @property
    def gradient_clip_norm(self) -> float:
        """C of DecentNeRF's gradient query: dp-gradient-clip-norm, else the payload's C."""
        return self.config.gradient_clip_norm or self.clip_norm

    @classmethod
    def of_strategy(
        cls,
        config: DPConfig | None,
        secure_aggregation: SecureAggregationConfig | None,
        sums_per_round: Callable[[int], int],
        delta_scale: str,
        checks: tuple[str, int],
    ) -> RoundPrivacy | None:
        """A strategy's DP state, its settings checked against `checks`, the strategy's
        (weight metric, min-train-nodes) (`check_settings`); None without DP."""
        if config is None or not config.enabled:
            return None
        privacy = cls(config, secure_aggregation, sums_per_round, delta_scale)
        privacy.check_settings(*checks)
        return privacy

    def check_settings(self, weight_metric: str, min_train_nodes: int) -> None:
        """Log the uniform weights DP needs instead of `weight_metric`; refuse a fixed SecAgg+
        clipping range without room for the noise shares of `min_train_nodes` clients."""
        if weight_metric:
            reason = "the sum's sensitivity to one client is then the clip norm C"
            message = "differential privacy: replies weigh 1 each, not %r: %s"
            log(INFO, message, weight_metric, reason)
        secure, dp = self.secure_aggregation, self.config
        if secure is not None and secure.clipping_range > 0:
            holders = secure.min_holders(max(min_train_nodes, 2))
            needed = distributed_noise_range(dp.noise_multiplier, dp.clip_norm, holders)
            if secure.clipping_range < needed:
                raise ValueError(
                    f"secagg-clipping-range = {secure.clipping_range:g} leaves no room for the DP "
                    f"noise: a clipped value ({CLIP_NORM_KEY} = {dp.clip_norm:g}) plus "
                    f"{NOISE_TAIL:g} noise-share stds needs >= {needed:.4g}; raise it, or set it "
                    "to 0 (the range then follows from C, z and the round's holders)"
                )

    def distributed(self, ledger: RoundLedger, payload: bool) -> DistributedPrivacy:
        """A secure DP sum of `ledger`: the records' SecAgg+ range (a fixed
        secagg-clipping-range as set, else C plus the noise tail for its t holders,
        `distributed_noise_range`), the metrics' (the weight, 1 a client, and under adaptive
        clipping the noised bits) and the metrics asked for; `payload` False for DecentNeRF's
        gradient query (no bits)."""
        holders = ledger.min_holders
        adaptive = payload and self.config.adaptive is not None
        if payload:
            self.payload_noise_std = central_noise_std(self.update_multiplier, self.clip_norm)
        secure = self.secure_aggregation
        if secure is not None and secure.clipping_range > 0:
            record_range = secure.clipping_range
        else:
            clip_norm = max(self.clip_norm, self.gradient_clip_norm)
            record_range = distributed_noise_range(self.update_multiplier, clip_norm, holders)
        metric_range = 1.0
        if adaptive:
            metric_range += NOISE_TAIL * self.count_std / math.sqrt(holders)
        keys = (WEIGHT_KEY, DP_UNCLIPPED) if adaptive else (WEIGHT_KEY,)
        return DistributedPrivacy(record_range, metric_range, keys)

    def client_config(self) -> dict[str, float | str]:
        """Train-config entries a secure client needs to clip and add its noise share (and
        under adaptive clipping its noised bit; DecentNeRF's own G_k clip norm when set)."""
        entries: dict[str, float | str] = {
            DP_CLIP_NORM: self.clip_norm,
            DP_NOISE_MULTIPLIER: self.update_multiplier,
        }
        if self.config.adaptive is not None:
            entries[DP_COUNT_STDDEV] = self.count_std
        if self.config.gradient_clip_norm:
            entries[DP_GRADIENT_CLIP_NORM] = self.config.gradient_clip_norm
        if self.delta_scale:
            entries[SECURE_DELTA_SCALE] = self.delta_scale
        return entries

    # The accountant: the plan, each round's budget and its charge.

    def planned_multiplier(self, server_round: int) -> float:
        """The noise multiplier a round is charged at worst: z per sum (a secure sum is never
        unmasked from fewer than the t holders its noise shares are calibrated to), combined
        over its sums."""
        sums = self.sums_per_round(server_round)
        return combined_noise_multiplier([self.config.noise_multiplier] * sums)

    def check_plan(self, first_round: int, num_rounds: int, fraction_train: float) -> float:
        """The epsilon rounds `first_round`..`num_rounds` would spend at sampling rate
        `fraction_train` (on top of what the accountant holds), logged; ValueError naming
        dp-target-epsilon when it exceeds the target, or the adaptive-clipping keys when a set
        dp-clipped-count-stddev is too small for z."""
        adaptive = self.config.adaptive
        if adaptive is not None and adaptive.count_stddev > 0:  # before anything is written
            update_noise_multiplier(self.config.noise_multiplier, adaptive.count_stddev)
        planned = [
            RoundCharge(min(fraction_train, 1.0), self.planned_multiplier(server_round))
            for server_round in range(first_round, num_rounds + 1)
        ]
        epsilon = check_plan(self.config, [*self.accountant.charges, *planned])
        plan = f"q = fraction-train {fraction_train:g}, no dropouts"
        log(INFO, "differential privacy: the plan (%s) spends epsilon %.4g at delta %g", plan,
            epsilon, self.config.delta)  # fmt: skip
        return epsilon

    def check_noise(self, num_sampled: int, num_params: int) -> float:
        """The pre-flight z sqrt(d) / n of a round of `num_sampled` clients on a model of
        `num_params` entries (`noise_ratio`): logged as a WARNING above 1, refused with a
        ValueError naming dp-max-noise-ratio above it (0: no limit)."""
        ratio = noise_ratio(self.config.noise_multiplier, num_params, num_sampled)
        limit = self.config.max_noise_ratio
        what = (
            f"the DP noise on the mean update is z sqrt(d) / n = {ratio:.3g} times the largest "
            f"update a client may send (z = {self.config.noise_multiplier:g}, d = {num_params} "
            f"entries, n = {num_sampled} clients a round)"
        )
        if limit and ratio > limit:
            raise ValueError(
                f"differential privacy: {what}, above {MAX_NOISE_RATIO_KEY} = {limit:g}: the "
                "rounds would move the model by noise. Sample more clients a round, lower z or "
                f"use a smaller model; set {MAX_NOISE_RATIO_KEY}=0 to run anyway"
            )
        if ratio > 1:
            log(WARNING, "differential privacy: %s; above 1 a round moves the model by more "
                "noise than signal", what)  # fmt: skip
        return ratio

    def check_budget(self, server_round: int, num_sampled: int, connected: int) -> None:
        """Raise PrivacyBudgetSpent when this round's worst-case charge would take epsilon
        above dp-target-epsilon (before anything of the round is sent)."""
        target = self.config.target_epsilon
        if target == 0:
            return
        sampling_rate = num_sampled / connected
        z = self.planned_multiplier(server_round)
        after = self.accountant.epsilon_after(sampling_rate, z)
        if after > target:
            self.stop = (
                f"round {server_round} not run: its charge (q = {sampling_rate:.4g}, z = {z:.4g}) "
                f"would take epsilon from {self.accountant.epsilon():.4g} to {after:.4g}, above "
                f"dp-target-epsilon = {target:g}; the run stops after round {server_round - 1}"
            )
            raise PrivacyBudgetSpent(self.stop)

    def charge(self, ledger: RoundLedger) -> dict[str, float]:
        """Charge the round's noised sums once (q = sampled / connected, z combined over its
        sums: each plaintext sum released, each secure sum unmasked, used or not, at
        z sqrt(h / t) for its h holders); the DP train metrics (epsilon three ways,
        `DPAccountant.report`). A round that unmasked and released no sum is not charged."""
        metrics: dict[str, float] = {}
        if self.config.adaptive is not None:
            metrics[DP_NEXT_CLIP_NORM] = self.clip_norm
        multipliers = list(ledger.dp_multipliers)
        if self.secure_aggregation is not None:
            z, holders = self.config.noise_multiplier, ledger.min_holders
            multipliers += [
                effective_noise_multiplier(z, holders, summed) for summed in ledger.unmasked_holders
            ]
        if not ledger.dp_charged and multipliers:
            ledger.dp_charged = True
            z = combined_noise_multiplier(multipliers)
            sampled, connected = len(ledger.node_ids), ledger.num_nodes_total
            self.accountant.charge(sampled / connected, z, sampled, connected)
            metrics[DP_ROUND_MULTIPLIER] = z
        return {**metrics, **self.accountant.report()}

    # The sums.

    def central(self, payload: bool = True) -> CentralPrivacy:
        """The plaintext sum's clip and noise: std z C on the sum (z_Delta C under adaptive
        clipping); DecentNeRF's gradient query (`payload` False) at its own clip norm."""
        if self.noise is None:
            self.noise = noise_generator()
        if not payload:
            clip_norm = self.gradient_clip_norm
            std = central_noise_std(self.config.noise_multiplier, clip_norm)
            return CentralPrivacy(clip_norm, std, self.noise)
        std = central_noise_std(self.update_multiplier, self.clip_norm)
        self.payload_noise_std = std
        return CentralPrivacy(self.clip_norm, std, self.noise, self.delta_scale)

    def released(
        self,
        summed: RoundSum,
        ledger: RoundLedger,
        deltas: Sequence[str],
        delta_records: tuple[str, ...],
    ) -> RoundSum:
        """Note a plaintext sum's multiplier z (a secure sum's is noted when unmasked,
        `charge`), then its ARRAYS back in the form the strategy sums (`delta_records` stays as
        differences): sum_k (x_k - s_k g) + (sum_k s_k) g, with the summed s (DecentNeRF's
        noised alpha sum) or the number summed."""
        if self.secure_aggregation is None:
            ledger.dp_multipliers.append(self.config.noise_multiplier)
        if self.config.adaptive is not None and ARRAYS in summed.sums:
            self.adapt(summed)
        restored = [name for name in deltas if name not in delta_records]
        return with_reference(summed, ledger.reference, restored, self.delta_scale)

    def adapt(self, summed: RoundSum) -> None:
        """Move C by the geometric update from the noised count of unclipped updates (the
        secure sum of the clients' noised bits, or the exact count plus N(0, sigma_b^2))."""
        adaptive = self.config.adaptive
        assert adaptive is not None and summed.unclipped is not None
        noised = summed.unclipped
        if self.secure_aggregation is None:
            assert self.noise is not None
            noised += float(torch.randn((), generator=self.noise, dtype=torch.float64)) * (
                self.count_std
            )
        self.clip_norm = next_clip_norm(self.clip_norm, noised, len(summed.node_ids), adaptive)

    # Resume.

    def resumable_state(self) -> dict[str, Any]:
        """The accountant's charges, so a resumed run continues its epsilon, and the clip norm
        and sigma_b adaptive clipping reached."""
        return {
            "dp-accountant": self.accountant.state_dict(),
            "dp-clip-norm": self.clip_norm,
            "dp-count-stddev": self.count_std,
        }

    def restore(self, state: Mapping[str, Any]) -> None:
        """Take back what `resumable_state` returned; ValueError without it (epsilon would
        restart at 0)."""
        if "dp-accountant" not in state:
            raise ValueError("the checkpoint holds no DP accountant: epsilon would restart")
        self.accountant = DPAccountant.from_state_dict(state["dp-accountant"])
        self.clip_norm = float(state.get("dp-clip-norm", self.config.clip_norm))
        self.count_std = float(state.get("dp-count-stddev", 0.0))
