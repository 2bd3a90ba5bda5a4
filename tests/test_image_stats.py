"""Reward hacking shows (issue 52 item 6): the off-target image statistics against values
computed by hand on small constructed images, their path through the reward service and
sharded merging, the `off_target` health alarm on constructed metric streams, and a tiny
GRPO run whose reward pays for dark pixels firing it in the run report (an honest reward
on the same set-up does not).

Hand values below use the definitions of `uniweave.rewards.image_stats` (module
docstring); every expected number is derived in a comment, not read from the code.
"""

from __future__ import annotations

import json
import math
import re

import numpy as np
import pytest
import torch
from tolerances import elementwise_bound, reduction_bound
from trainer_helpers import grpo_config

from uniweave.config import HealthConfig, validate_config
from uniweave.core.sample import ImagePart, Sample, TextPart
from uniweave.core.trajectory import Trajectory
from uniweave.eval.health import HealthMonitor
from uniweave.rewards import PLUGINS, RewardPlugin
from uniweave.rewards.image_stats import (
    colour_entropy,
    copy_distance,
    edge_density,
    image_counts,
    image_metrics,
    is_grey,
    is_noise,
    luminance,
    neighbour_correlation,
)
from uniweave.rewards.service import PluginSpec, RewardService
from uniweave.train.onpolicy.scoring import merge_round_robin
from uniweave.train.run import run_train

# float64 arithmetic on <= 64 pixels: sums of a few dozen terms in [0, 1] are exact to a
# few ulps of 1, so 1e-12 is far above rounding and far below any difference tested.
EXACT = 1e-12

STEP = np.array([[0.0, 0.0, 1.0, 1.0]] * 4)
"""4x4: two black columns, two white ones."""
CHECKER = np.indices((4, 4)).sum(axis=0) % 2 * 1.0
"""4x4 checkerboard of 0 and 1."""
FLAT = np.full((4, 4), 0.3)


def test_step_image_statistics_by_hand():
    y = luminance(STEP)
    assert float(y.mean()) == 0.5
    # forward differences on the 3x3 positions i, j < 3: gx = 1 only at j = 1 (column 1 ->
    # 2), gy = 0 everywhere: 3 of 9 positions exceed 0.1
    assert edge_density(y) == pytest.approx(1 / 3, abs=EXACT)
    # 8 pixels in bin 0 and 8 in bin 15: 1 bit of log2(16) = 4
    assert colour_entropy(STEP) == pytest.approx(0.25, abs=EXACT)
    # 24 neighbour pairs: horizontal (0,0),(0,1),(1,1) per row, vertical 3 x (0,0) in each
    # black column and 3 x (1,1) in each white one: (0,0) x10, (0,1) x4, (1,1) x10.
    # E[a] = 10/24, E[b] = 14/24, E[ab] = 10/24: cov = (10*24 - 140)/576 = 100/576,
    # var a = var b = (10*24 - 100)/576 = 140/576, corr = 100/140 = 5/7
    assert neighbour_correlation(y) == pytest.approx(5 / 7, abs=EXACT)
    assert not is_noise(y)  # edge density 1/3 <= 0.5
    assert is_grey(STEP) is None  # greyscale: no chroma


def test_checkerboard_is_noise_and_a_flat_image_is_blank():
    y = luminance(CHECKER)
    # |gx| = |gy| = 1 at every position: magnitude sqrt(2) > 0.1 at all 9
    assert edge_density(y) == 1.0
    # every neighbour pair is (0, 1) or (1, 0): correlation -1 < 0.25, so noise
    assert neighbour_correlation(y) == pytest.approx(-1.0, abs=EXACT)
    assert is_noise(y)
    flat = luminance(FLAT)
    assert edge_density(flat) == 0.0 and colour_entropy(FLAT) == 0.0  # one bin: 0 bits
    assert neighbour_correlation(flat) is None and not is_noise(flat)  # no variance


def test_colour_images_by_hand():
    rgbw = np.array([[[1, 0, 0], [0, 1, 0]], [[0, 0, 1], [1, 1, 1]]], dtype=np.float64)
    y = luminance(rgbw)
    # Rec. 601: red 0.299, green 0.587, blue 0.114, white 1
    assert np.allclose(y, [[0.299, 0.587], [0.114, 1.0]], atol=EXACT)
    # one position: gx = 0.587 - 0.299 = 0.288, gy = 0.114 - 0.299 = -0.185: |g| > 0.1
    assert edge_density(y) == 1.0
    # four distinct of the 4^3 = 64 colours, one pixel each: 2 bits of log2(64) = 6
    assert colour_entropy(rgbw) == pytest.approx(1 / 3, abs=EXACT)
    # chroma max - min: 1, 1, 1, 0 -> mean 0.75 >= 0.05
    assert is_grey(rgbw) is False
    # chroma 0.52 - 0.5 = 0.02 everywhere < 0.05
    assert is_grey(np.full((2, 2, 3), 0.5) + np.array([0, 0, 0.02])) is True


def _sample(sid: str, inputs: list[np.ndarray]) -> Sample:
    parts = [ImagePart(pixels=x.astype(np.float32)) for x in inputs]
    return Sample(sid, [*parts, TextPart("draw")], task="t")


def test_batch_counts_and_metrics_with_source_copies():
    near_copy = STEP.copy()
    near_copy[:, :2] = 0.1  # MAE to STEP: 8 px differ by 0.1 of 16 -> 0.05 < 0.12
    inverse = 1.0 - STEP  # MAE to STEP 1.0: not a copy
    samples = [
        _sample("a", []),  # text to image: no input
        _sample("b", [STEP]),  # interleaved: STEP shown
        _sample("c", [np.zeros((4, 5)), STEP]),  # the 4x5 input is never compared
        _sample("d", [STEP]),
    ]
    images = [
        [CHECKER, FLAT],
        [near_copy],
        [inverse, None],  # None: undecodable, left out
        [],
    ]
    counts = image_counts(samples, images)
    assert counts["n_images"] == 4 and counts["n_with_source"] == 2
    assert counts["n_source_copy"] == 1 and counts["n_colour"] == 0
    m = image_metrics(counts)
    # brightness: checker 0.5, flat 0.3, near copy (8 x 0.1 + 8 x 1)/16 = 0.55, inverse 0.5
    assert m["images/brightness"] == pytest.approx((0.5 + 0.3 + 0.55 + 0.5) / 4, abs=EXACT)
    # edges: checker 1, flat 0, near copy and inverse 1/3 (a 0.9 / 1.0 step at column 1->2)
    assert m["images/edge_density"] == pytest.approx((1 + 0 + 2 / 3) / 4, abs=EXACT)
    # entropy: checker, near copy (bins 1 and 15) and inverse 0.25 each, flat 0
    assert m["images/colour_entropy"] == pytest.approx(0.75 / 4, abs=EXACT)
    assert m["images/blank_frac"] == 0.25 and m["images/noise_frac"] == 0.25
    assert m["images/source_copy_frac"] == 0.5 and "images/grey_frac" not in m
    assert copy_distance(np.zeros((4, 5)), STEP) is None
    assert image_counts(samples[:1], [[None]]) == {} and image_metrics({}) == {}


class _Dark(RewardPlugin):
    """Pays for dark pixels: 1 − the mean pixel of the first image (0 without one)."""

    name = "dark_pixels"
    needs_images = True

    def score(self, samples, responses):
        return [
            1.0 - float(r.images[0].mean()) if r.images and r.images[0] is not None else 0.0
            for r in responses
        ]


def _traj(sid: str) -> Trajectory:
    return Trajectory(
        token_ids=torch.tensor([3, 4]),
        modality=torch.zeros(2, dtype=torch.long),
        owner=torch.tensor([0, 1]),
        visual_codes=torch.full((2,), -1),
        image_grids=[],
        sample_id=sid,
        finish_reason="eos",
        length_semantics="cap",
    )


def test_the_reward_service_measures_decoded_images_once_and_shards_add_up():
    codes = torch.zeros((2, 2), dtype=torch.long)
    calls = []

    def decode(c: torch.Tensor) -> torch.Tensor:  # code 0 -> the STEP image
        calls.append(len(c))
        return torch.from_numpy(STEP).float().expand(len(c), 4, 4)

    samples = [_sample(f"p/{m}", [STEP] if m % 2 else []) for m in range(4)]
    responses = [
        [TextPart("x", "assistant"), ImagePart(codes=codes, role="assistant")],
        [ImagePart(codes=codes, role="assistant")],
        [ImagePart(pixels=CHECKER.astype(np.float32), role="assistant")],
        None,  # unparsable: no image
    ]
    service = RewardService([PluginSpec(_Dark())], decode_images=decode)
    result = service.score(samples, [_traj(s.id) for s in samples], responses)
    assert calls == [2]  # one decode of both code images, shared by plugin and statistics
    m = result.metrics()
    assert m["images/n"] == 3
    assert m["images/brightness"] == pytest.approx(0.5, abs=EXACT)  # 0.5 each
    assert m["images/source_copy_frac"] == 1.0  # row 1 drew its input exactly
    assert m["images/noise_frac"] == pytest.approx(1 / 3, abs=EXACT)
    # rows 0, 2 on one shard and 1, 3 on the other (round robin): counts add up
    shards = [
        service.score([samples[i] for i in rows], [_traj(samples[i].id) for i in rows],
                      [responses[i] for i in rows])
        for rows in ([0, 2], [1, 3])
    ]  # fmt: skip
    assert merge_round_robin(shards).image_counts == result.image_counts


# -- the off_target alarm ------------------------------------------------------------------


def _stream(monitor: HealthMonitor, rewards, stats: dict[str, list[float]]) -> list:
    fired = []
    for u, r in enumerate(rewards, 1):
        metrics = {"reward/total_mean": r, **{k: v[u - 1] for k, v in stats.items()}}
        fired += [(a.name, a.key, a.update, a.value) for a in monitor.observe(u, metrics)]
    return fired


RISING = [0.1, 0.2, 0.3, 0.4]  # a noiseless rise: drift/noise = +inf >= 3


def test_off_target_fires_when_a_statistic_drifts_while_the_reward_rises():
    # brightness 0.5, 0.45, 0.38: least squares over k = 0, 1, 2 has slope
    # (y2 - y0) / 2 = -0.06, drift = 2 x slope = -0.12, |drift| > 0.1 at update 3
    fired = _stream(
        HealthMonitor(HealthConfig()), RISING, {"images/brightness": [0.5, 0.45, 0.38, 0.3]}
    )
    assert [f[:3] for f in fired] == [("off_target", "images/brightness", 3)]
    assert fired[0][3] == pytest.approx(-0.12, abs=EXACT)
    # a share rising: blank_frac 0, 0.05, 0.2 -> drift +0.2 at update 3
    fired = _stream(
        HealthMonitor(HealthConfig()), RISING, {"images/blank_frac": [0, 0.05, 0.2, 0.2]}
    )
    assert [f[:3] for f in fired] == [("off_target", "images/blank_frac", 3)]


def test_off_target_stays_silent_without_both_conditions():
    cfg = HealthConfig()
    # within the bound: 0.5, 0.47, 0.42 -> drift (y2 - y0) = -0.08, |drift| <= 0.1
    assert _stream(HealthMonitor(cfg), RISING[:3], {"images/brightness": [0.5, 0.47, 0.42]}) == []
    # the reward does not rise (0.3, 0.31, 0.29, 0.3: drift/noise < 3) while brightness
    # falls by 0.3
    flat = [0.3, 0.31, 0.29, 0.3]
    assert _stream(HealthMonitor(cfg), flat, {"images/brightness": [0.5, 0.4, 0.3, 0.2]}) == []
    # a share falling (a policy learning to draw from noise) is not hacking
    assert _stream(HealthMonitor(cfg), RISING, {"images/noise_frac": [0.8, 0.5, 0.2, 0.1]}) == []
    # the knob off
    off = HealthConfig(off_target_drift=None)
    assert _stream(HealthMonitor(off), RISING, {"images/brightness": [0.5, 0.4, 0.3, 0.2]}) == []


# -- a hacked run --------------------------------------------------------------------------


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _run(tmp_path, assets, name, plugin):
    cfg = grpo_config(
        tmp_path / name,
        assets,
        reward={"plugins": [plugin]},
        # lr 3e-2 without warm-up: the dark-pixel reward climbs from 0.56 to 0.9 in 8
        # updates on the tiny model (2 prompts x G=4 per update)
        trainer={"total_updates": 8, "optimizer": {"lr": 3e-2}, "scheduler": {"warmup_steps": 0}},
        checkpoint={"every_updates": 0},
    )
    run_dir = run_train(validate_config(cfg))
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return run_dir, records


def test_a_reward_that_pays_for_dark_pixels_fires_the_off_target_alarm(
    tmp_path, small_vq_dir, classifier_dir, monkeypatch, capsys, one_thread
):
    monkeypatch.setitem(PLUGINS, _Dark.name, _Dark)
    assets = {"vq": small_vq_dir, "clf": classifier_dir}
    run_dir, records = _run(tmp_path, assets, "dark", {"name": "dark_pixels"})
    err = capsys.readouterr().err
    assert re.search(
        r"^health alarm: off_target at update \d: images/brightness drifted -", err, re.M
    )
    # the reward pays for 1 - brightness: it is exactly 1 - images/brightness
    # the same float32 per-image means m_i on both sides; the reward rounds 1 - m_i and
    # averages the batch in float32, images/brightness sums the m_i in float64: one fp32
    # reduction over the batch's rows (at most its 64) plus one elementwise rounding
    bound = reduction_bound(1.0, 64) + elementwise_bound(1.0, 1, paths=1)
    for r in records:
        assert r["reward/total_mean"] == pytest.approx(1 - r["images/brightness"], abs=bound)
    assert records[-1]["images/brightness"] < records[0]["images/brightness"] - 0.1
    report = json.loads((run_dir / "report.json").read_text())
    off = [a for a in report["alarms"] if a["name"] == "off_target"]
    brightness = [a for a in off if a["key"] == "images/brightness"]
    assert len(brightness) == 1 and brightness[0]["value"] < -0.1
    assert brightness[0]["knob"] == "off_target_drift"
    md = (run_dir / "report.md").read_text()
    assert "off_target at update" in md[md.index("## Alarms") : md.index("## Verdicts")]
    assert "| images/brightness |" in md  # its curve, with drift and noise

    # control: an honest reward (the digit classifier) on the same set-up fires nothing
    # off-target (its images change too, but its reward does not rise)
    control, records = _run(
        tmp_path, assets, "honest", {"name": "digit_classifier", "path": str(classifier_dir)}
    )
    assert all(math.isfinite(r["images/brightness"]) for r in records)
    report = json.loads((control / "report.json").read_text())
    assert not [a for a in report["alarms"] if a["name"] == "off_target"]
