"""Health alarms (`health:`, docs/reports.md): silent failures a run's numbers show to
someone who reads the right curve, turned into one plain log line and a list at the top
of the run report.

Per logged update (the `metrics.jsonl` record, or the live metrics of the update), each
alarm reads the metric named in its `health.*` description; an alarm whose metric the
run does not log stays silent (SFT logs no rewards, OPD no KL to a reference):

- `zero_variance`: adv/frac_zero_std_groups >= `zero_variance_share`;
- `zero_advantages` / `zero_gradients`: adv/advantage_std == 0 / grad_norm == 0 for
  `zero_signal_updates` logged updates in a row;
- `truncation_overwrite`: reward/overwritten_frac >= `truncation_overwrite_share`;
- `reward_saturation`: reward/total_mean >= `reward_saturation`;
- `entropy_collapse`: policy/entropy_{text,visual} < `entropy_collapse_ratio` x its first
  positive logged value;
- `kl_to_reference`: policy/kl_ref_mean > `kl_max`;
- `invalid_rise`: reward/<plugin>/invalid_frac − its first logged value > `invalid_rise`.
- `off_target` (a hacked image reward): an off-target image statistic
  (`uniweave.rewards.image_stats.OFF_TARGET`: images/brightness, edge_density,
  colour_entropy, blank_frac, grey_frac, noise_frac, source_copy_frac) drifted by more
  than `off_target_drift` while the reward rises. Both are read on the updates logged so
  far with `uniweave.eval.drift` (least squares over the update index, as the report's
  curves): the statistic's drift (the fitted change from its first to its latest logged
  update) exceeds `off_target_drift` — in absolute value for the means (brightness, edge
  density, colour entropy), upwards for the shares (`*_frac`: fewer blank, grey, noise or
  copied images is no sign of hacking; a policy that learns to draw from noise lowers
  noise_frac) — and reward/total_mean's drift is at least `off_target_reward_ratio` times
  its residual noise. Each needs >= 3 logged values; the alarm's value is the drift.

Per evaluation against the baseline (update 0, `uniweave.eval.paired`):

- `heldout_drop`: a task's mean@n or pass@n "got worse" (`heldout_se` SE test);
- `heldout_invalid_rise`: a task's invalid_frac rose by more than `invalid_rise`.

An alarm fires when its condition turns true, and again each time it turns true after
clearing; `HealthMonitor.fired` keeps every firing. A run prints an alarm (one alarm: a
name and the metric it read) once, at its first firing (`HealthMonitor.first_time`,
`Alarm.line()` is the line printed to stderr); the report lists it once with the updates
it fired again at (`once_each`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

from uniweave.config import HealthConfig
from uniweave.eval.drift import drift_to_noise
from uniweave.eval.paired import WORSE, Paired
from uniweave.rewards.image_stats import OFF_TARGET

ENTROPIES = ("policy/entropy_text", "policy/entropy_visual")
REWARD = "reward/total_mean"


@dataclass(frozen=True)
class Alarm:
    """One firing: which alarm (`name`, and the metric `key` it read), when, the value
    seen, the threshold and the `health.` knob that set it."""

    name: str
    key: str
    update: int
    value: float
    threshold: float
    knob: str
    message: str

    def line(self) -> str:
        return (
            f"health alarm: {self.name} at update {self.update}: {self.message} "
            f"(health.{self.knob}={self.threshold:g})"
        )

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def ident(self) -> str:
        """Which alarm this is a firing of: its name and metric."""
        return f"{self.name}:{self.key}"


def once_each(fired: Iterable[Alarm]) -> list[tuple[Alarm, list[int]]]:
    """Each alarm of `fired` (in firing order) once: (its first firing, the updates it
    fired again at), in the order of first firings."""
    out: dict[str, tuple[Alarm, list[int]]] = {}
    for alarm in fired:
        if alarm.ident in out:
            out[alarm.ident][1].append(alarm.update)
        else:
            out[alarm.ident] = (alarm, [])
    return list(out.values())


def _num(metrics: dict[str, Any], key: str) -> float | None:
    v = metrics.get(key)
    if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
        return float(v)
    return None


class HealthMonitor:
    """The alarms of one run (module docstring), fed update by update."""

    def __init__(self, cfg: HealthConfig) -> None:
        self.cfg = cfg
        self.fired: list[Alarm] = []
        self._active: set[str] = set()
        self._streak: dict[str, int] = {}
        self._first: dict[str, float] = {}
        self._series: dict[str, list[float]] = {}

    def _check(self, on: bool, alarm: Alarm, new: list[Alarm]) -> None:
        ident = f"{alarm.name}:{alarm.key}"
        if on and ident not in self._active:
            self._active.add(ident)
            self.fired.append(alarm)
            new.append(alarm)
        elif not on:
            self._active.discard(ident)

    def first_time(self, alarms: Iterable[Alarm]) -> list[Alarm]:
        """Those of `alarms` (firings of this monitor) that are their alarm's first firing:
        what a run prints."""
        firsts = {a.ident: a for a in reversed(self.fired)}
        return [a for a in alarms if firsts.get(a.ident) is a]

    def observe(self, update: int, metrics: dict[str, Any]) -> list[Alarm]:
        """The alarms that fire at `update` given its metrics."""
        c, new = self.cfg, list[Alarm]()

        def at_least(name: str, key: str, knob: str, limit: float | None, what: str) -> None:
            v = _num(metrics, key)
            if limit is None or v is None:
                return
            msg = f"{key} = {v:.4g} >= {limit:g}: {what}"
            self._check(v >= limit, Alarm(name, key, update, v, limit, knob, msg), new)

        at_least(
            "zero_variance",
            "adv/frac_zero_std_groups",
            "zero_variance_share",
            c.zero_variance_share,
            "most groups have equal rewards and give no learning signal",
        )
        at_least(
            "truncation_overwrite",
            "reward/overwritten_frac",
            "truncation_overwrite_share",
            c.truncation_overwrite_share,
            "truncation shaping overwrote these rewards (reward.truncated_reward; "
            "rollout.max_new_tokens / length_semantics)",
        )
        at_least(
            "reward_saturation",
            "reward/total_mean",
            "reward_saturation",
            c.reward_saturation,
            "the training reward is saturated",
        )
        kl = _num(metrics, "policy/kl_ref_mean")
        if c.kl_max is not None and kl is not None:
            msg = f"policy/kl_ref_mean = {kl:.4g} > {c.kl_max:g}: the policy left its reference"
            alarm = Alarm(
                "kl_to_reference", "policy/kl_ref_mean", update, kl, c.kl_max, "kl_max", msg
            )
            self._check(kl > c.kl_max, alarm, new)
        if c.zero_signal_updates > 0:
            for name, key in (
                ("zero_advantages", "adv/advantage_std"),
                ("zero_gradients", "grad_norm"),
            ):
                v = _num(metrics, key)
                if v is None:
                    continue
                streak = self._streak.get(key, 0) + 1 if v == 0.0 else 0
                self._streak[key] = streak
                k = c.zero_signal_updates
                msg = f"{key} = 0 for {streak} updates in a row: the update trains on nothing"
                alarm = Alarm(
                    name, key, update, float(streak), float(k), "zero_signal_updates", msg
                )
                self._check(streak >= k, alarm, new)
        if c.entropy_collapse_ratio is not None:
            for key in ENTROPIES:
                v = _num(metrics, key)
                if v is None:
                    continue
                first = self._first.setdefault(key, v) if v > 0 or key in self._first else None
                if not first:
                    continue
                limit = c.entropy_collapse_ratio * first
                msg = f"{key} = {v:.4g} < {c.entropy_collapse_ratio:g} x its first {first:.4g}"
                alarm = Alarm(
                    "entropy_collapse", key, update, v, c.entropy_collapse_ratio,
                    "entropy_collapse_ratio", msg,
                )  # fmt: skip
                self._check(v < limit, alarm, new)
        if c.invalid_rise is not None:
            for key in sorted(
                k for k in metrics if k.startswith("reward/") and k.endswith("/invalid_frac")
            ):
                v = _num(metrics, key)
                if v is None:
                    continue
                first = self._first.setdefault(key, v)
                msg = f"{key} rose from {first:.4g} to {v:.4g} (> +{c.invalid_rise:g})"
                alarm = Alarm("invalid_rise", key, update, v, c.invalid_rise, "invalid_rise", msg)
                self._check(v - first > c.invalid_rise, alarm, new)
        if c.off_target_drift is not None:
            self._off_target(update, metrics, new)
        return new

    def _off_target(self, update: int, metrics: dict[str, Any], new: list[Alarm]) -> None:
        """The `off_target` alarm (module docstring): each statistic's and the reward's
        logged values so far, fitted by `drift_to_noise`."""
        limit = self.cfg.off_target_drift
        assert limit is not None, "observe calls this only with off_target_drift set"
        c = self.cfg
        for key in (REWARD, *OFF_TARGET):
            v = _num(metrics, key)
            if v is not None:
                self._series.setdefault(key, []).append(v)
        rewards = self._series.get(REWARD, [])
        if len(rewards) < 3:
            return
        reward = drift_to_noise(rewards)
        rising = reward.ratio >= c.off_target_reward_ratio
        for key in OFF_TARGET:
            series = self._series.get(key, [])
            if len(series) < 3 or _num(metrics, key) is None:
                continue
            fit = drift_to_noise(series)
            msg = (
                f"{key} drifted {fit.drift:+.3g} over {fit.n} updates (least squares; first "
                f"{series[0]:.3g}, latest {series[-1]:.3g}) while {REWARD} rose (drift/noise "
                f"{reward.ratio:.2f} >= health.off_target_reward_ratio="
                f"{c.off_target_reward_ratio:g}): the images changed in a way the reward does "
                "not ask for (a hacked reward?)"
            )
            alarm = Alarm("off_target", key, update, fit.drift, limit, "off_target_drift", msg)
            moved = fit.drift if key.endswith("_frac") else abs(fit.drift)
            self._check(rising and moved > limit, alarm, new)

    def heldout(self, update: int, split: str, comparisons: Iterable[Paired]) -> list[Alarm]:
        """The held-out alarms of the evaluation of `split` at `update` against its
        baseline (`comparisons`: `uniweave.eval.paired.compare`)."""
        c, new = self.cfg, list[Alarm]()
        for p in comparisons:
            key = f"{split}/{p.task}/{p.metric}"
            if p.metric == "invalid_frac":
                if c.invalid_rise is None:
                    continue
                msg = f"{key} rose from {p.before:.3f} at the start to {p.after:.3f}"
                alarm = Alarm(
                    "heldout_invalid_rise", key, update, p.diff, c.invalid_rise, "invalid_rise", msg
                )
                self._check(p.diff > c.invalid_rise, alarm, new)
            elif c.heldout_drop:
                msg = (
                    f"{key} fell from {p.before:.3f} at the start to {p.after:.3f} (paired diff "
                    f"{p.diff:+.3f} ± {p.se:.3f} SE over {p.n} prompts)"
                )
                alarm = Alarm("heldout_drop", key, update, p.diff, c.heldout_se, "heldout_se", msg)
                self._check(p.verdict == WORSE, alarm, new)
        return new
