"""Reward service and plugins on real digits samples and hand-built responses."""

from __future__ import annotations

import dataclasses
import logging
import warnings
from collections.abc import Sequence

import numpy as np
import pytest
import torch

from uniweave.codecs import VQCodec
from uniweave.config.errors import ConfigError
from uniweave.config.schema import RewardConfig, RewardPluginConfig
from uniweave.core.sample import ImagePart, Sample, TextPart
from uniweave.core.trajectory import Trajectory, TrajectoryBatch
from uniweave.data.digits import LETTERS, make_task_samples, permute_quadrants
from uniweave.data.digits_images import load_split
from uniweave.data.template import serialize
from uniweave.data.tokenizer import build_tokenizer
from uniweave.rewards import (
    AllRewardsOverwrittenWarning,
    DigitClassifierReward,
    ExactAnswer,
    JigsawVerifier,
    MultipleChoiceExact,
    PluginSpec,
    RewardError,
    RewardPlugin,
    RewardService,
    TextExact,
    build_responses,
    build_reward_service,
    parse_response,
)
from uniweave.rewards.digit_classifier import DigitClassifier


@pytest.fixture(scope="module")
def train():
    return load_split("train")


@pytest.fixture(scope="module")
def classifier(train):
    return DigitClassifier(channels=4, hidden=16, epochs=1).fit(
        train.images[:128], train.labels[:128], seed=0
    )


@pytest.fixture(scope="module")
def codec(train):
    return VQCodec(codebook_size=16, n_init=1, max_iter=10).fit(train.images[:32], seed=0)


def text(t: str) -> list:
    return [TextPart(t, "assistant")]


def image(pixels: np.ndarray | None = None, codes: torch.Tensor | None = None) -> ImagePart:
    return ImagePart(pixels=pixels, codes=codes, role="assistant")


def run_plugin(plugin: RewardPlugin, samples, responses, decode=None):
    rows, _ = build_responses(responses, decode)
    return list(map(float, plugin.score(samples, rows))), plugin.invalid_format(samples, rows)


def traj(sample_id: str, reason: str | None = "eos", semantics: str | None = "cap") -> Trajectory:
    return Trajectory(
        token_ids=torch.tensor([3, 4]),
        modality=torch.zeros(2, dtype=torch.long),
        owner=torch.tensor([0, 1]),
        visual_codes=torch.full((2,), -1),
        image_grids=[],
        sample_id=sample_id,
        finish_reason=reason,
        length_semantics=semantics,
    )


# ---------------------------------------------------------------- plugins


def test_mc_exact_strict_letters() -> None:
    s = make_task_samples("i2t_mc", "val", 1)[0]
    wrong = next(c for c in LETTERS if c != s.answer)
    cases = [
        (text(s.answer), 1.0, False),
        (text(f" {s.answer}\n"), 1.0, False),
        (text(wrong), 0.0, False),
        (text(f"{s.answer})"), 0.0, True),
        (text(s.answer.lower()), 0.0, True),
        (text(s.answer + wrong), 0.0, True),
        (text("E"), 0.0, True),
        (text(""), 0.0, True),
        ([image(np.zeros((8, 8), np.float32))] + text(s.answer), 0.0, True),
        (None, 0.0, True),  # the row did not parse
    ]
    scores, invalid = run_plugin(MultipleChoiceExact(), [s] * len(cases), [c[0] for c in cases])
    assert scores == [c[1] for c in cases]
    assert invalid == [c[2] for c in cases]
    t2i = make_task_samples("t2i", "val", 1)[0]
    with pytest.raises(ValueError, match="not a letter"):
        run_plugin(MultipleChoiceExact(), [t2i], [text("A")])


def test_text_exact_open_answer() -> None:
    s = make_task_samples("i2t_open", "val", 1)[0]
    wrong = str((int(s.answer) + 1) % 10)
    cases = [
        (text(s.answer), 1.0, False),
        (text(f" {s.answer} "), 1.0, False),
        (text(wrong), 0.0, False),
        (text(s.answer + wrong), 0.0, False),
        (text("  "), 0.0, True),
        ([image(np.zeros((8, 8), np.float32))] + text(s.answer), 0.0, True),
        (None, 0.0, True),
    ]
    scores, invalid = run_plugin(TextExact(), [s] * len(cases), [c[0] for c in cases])
    assert scores == [c[1] for c in cases]
    assert invalid == [c[2] for c in cases]


def test_jigsaw_verifies_the_permutation() -> None:
    data = load_split("val")
    for s in make_task_samples("jigsaw_mc", "val", 3):
        shown = s.parts[0].pixels
        original = data.images[int(np.flatnonzero(data.indices == s.meta["image_index"])[0])]
        restores = [
            np.array_equal(permute_quadrants(shown, opt), original) for opt in s.meta["options"]
        ]
        blind = dataclasses.replace(s, answer=None)  # the verifier reads meta, not the answer
        scores, invalid = run_plugin(
            JigsawVerifier(), [blind] * 6, [text(c) for c in LETTERS] + [text("A B"), None]
        )
        assert scores == [float(r) for r in restores] + [0.0, 0.0]
        assert sum(scores) == 1.0 and LETTERS[scores.index(1.0)] == s.answer
        assert invalid == [False] * 4 + [True, True]


def test_digit_classifier_scores_decoded_images(classifier, codec) -> None:
    s = make_task_samples("t2i", "val", 2)
    real = [p.pixels for x in s for p in x.parts if isinstance(p, ImagePart)]
    codes = codec.encode(np.stack(real))
    digits = torch.tensor([x.meta["digit"] for x in s])
    responses = [
        [image(real[0])],
        [image(codes=codes[1])],
        text("no image"),
        [image(real[0]), image(real[0])],
        [image(codes=torch.zeros(3, 3, dtype=torch.long))],  # a grid the codec cannot decode
        None,
    ]
    samples = [s[0], s[1], s[0], s[0], s[0], s[0]]
    scores, invalid = run_plugin(
        DigitClassifierReward(classifier), samples, responses, codec.decode
    )
    expected0 = classifier.score(real[0][None], digits[:1])[0].item()
    expected1 = classifier.score(codec.decode(codes[1:2]), digits[1:])[0].item()
    assert scores[0] == pytest.approx(expected0) and scores[1] == pytest.approx(expected1)
    assert 0 < scores[0] < 1 and scores[2:] == [0.0] * 4
    assert invalid == [False, False, True, True, True, True]
    _, n_bad = build_responses(responses, codec.decode)
    assert n_bad == 1


def test_exact_answer_draw_then_answer(classifier) -> None:
    s = make_task_samples("draw_then_answer", "val", 1)[0]
    pixels = next(p.pixels for p in s.parts if isinstance(p, ImagePart))
    lead = TextPart("The answer is drawn below .", "assistant")
    wrong = str((int(s.answer) + 1) % 10)
    cases = [
        ([lead, image(pixels)] + text(s.answer), 1.0, False),
        ([image(pixels)] + text(f" {s.answer} "), 1.0, False),
        ([lead, image(pixels)] + text(wrong), 0.0, False),
        ([lead, image(pixels)] + text(s.answer + "."), 0.0, False),
        ([lead] + text(s.answer), 0.0, True),  # no image
        ([lead, image(pixels)], 0.0, True),  # nothing after the image
        ([image(pixels), TextPart("1", "assistant"), image(pixels)] + text(s.answer), 0.0, True),
    ]
    samples, responses = [s] * len(cases), [c[0] for c in cases]
    scores, invalid = run_plugin(ExactAnswer(), samples, responses)
    assert scores == [c[1] for c in cases] and invalid == [c[2] for c in cases]
    strict = ExactAnswer(require_image_class=True, classifier=classifier)
    assert strict.needs_images
    scores, _ = run_plugin(strict, samples[:2], responses[:2])
    predicted = int(classifier.predict(pixels[None])[0])
    assert scores == [float(predicted == s.meta["digit"])] * 2


# ---------------------------------------------------------------- service


def mixed_batch(classifier):
    i2t = make_task_samples("i2t_mc", "val", 2)
    t2i = make_task_samples("t2i", "val", 1)[0]
    pixels = t2i.parts[1].pixels
    samples = [i2t[0], i2t[1], t2i]
    wrong = next(c for c in LETTERS if c != i2t[1].answer)
    responses = [text(i2t[0].answer), text(wrong), [image(pixels)]]
    p_digit = classifier.score(pixels[None], torch.tensor([t2i.meta["digit"]]))[0].item()
    return samples, responses, p_digit


def test_weighted_sum_and_task_filter(classifier, codec) -> None:
    cfg = RewardConfig(
        plugins=[
            RewardPluginConfig(name="mc_exact", weight=1.0, tasks=["i2t_mc"]),
            RewardPluginConfig(name="digit_classifier", weight=0.5, tasks=["t2i"]),
        ]
    )
    service = build_reward_service(
        cfg, decode_images=codec.decode, resources={"digit_classifier": classifier}
    )
    samples, responses, p_digit = mixed_batch(classifier)
    result = service.score(samples, [traj(s.id) for s in samples], responses)
    assert result.total.tolist() == pytest.approx([1.0, 0.0, 0.5 * p_digit])
    assert result.per_plugin["mc_exact"].tolist() == [1.0, 0.0, 0.0]
    assert result.applied["digit_classifier"].tolist() == [False, False, True]
    m = result.metrics()
    assert m["reward/mc_exact/mean"] == pytest.approx(0.5)  # over the rows it scored only
    assert m["reward/digit_classifier/mean"] == pytest.approx(p_digit)
    assert m["reward/task/i2t_mc/mean"] == pytest.approx(0.5)
    assert result.n_errors == 0 and result.invalid_format_counts == {
        "mc_exact": 0,
        "digit_classifier": 0,
    }


REASONS = ["eos", "cap", "context", "cycle", "length_exact", "invalid", None]


def constant_service(truncated_reward: str) -> tuple[RewardService, list[Sample], list]:
    s = make_task_samples("i2t_mc", "val", len(REASONS))
    service = RewardService([PluginSpec(MultipleChoiceExact())], truncated_reward=truncated_reward)
    return service, s, [text(x.answer) for x in s]


def test_truncation_shaping_zero_and_keep() -> None:
    service, samples, responses = constant_service("zero")
    trajs = [
        traj(s.id, r, "exact" if r == "length_exact" else "cap") for s, r in zip(samples, REASONS)
    ]
    result = service.score(samples, trajs, responses)
    assert result.total.tolist() == [1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0]
    assert result.raw_total.tolist() == [1.0] * 7
    assert result.overwritten_fraction == pytest.approx(3 / 7)
    assert result.metrics()["reward/overwritten_frac"] == pytest.approx(3 / 7)
    batch = TrajectoryBatch.collate(trajs, pad_id=0)
    assert service.score(samples, batch, responses).total.tolist() == result.total.tolist()
    keep, _, _ = constant_service("keep")
    kept = keep.score(samples, trajs, responses)
    assert kept.total.tolist() == [1.0] * 7 and kept.overwritten_fraction == 0.0
    assert kept.metrics()["reward/truncated_frac"] == pytest.approx(3 / 7)


def test_exact_count_rows_are_never_zeroed() -> None:
    """Regression: image-only rows end `length_exact` by construction; peers zeroed them."""
    service, samples, responses = constant_service("zero")
    trajs = [traj(s.id, "length_exact", "exact") for s in samples]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        result = service.score(samples, trajs, responses)
    assert result.total.tolist() == [1.0] * len(samples)
    assert result.overwritten_fraction == 0.0 and not result.truncated.any()
    with pytest.raises(ValueError, match="must end 'length_exact', not 'cap'"):
        service.score(samples, [traj(s.id, "cap", "exact") for s in samples], responses)


def test_all_rewards_overwritten_warns_loudly(caplog) -> None:
    service, samples, responses = constant_service("zero")
    trajs = [traj(s.id, "cap") for s in samples]
    with caplog.at_level(logging.WARNING, logger="uniweave.rewards.service"):
        with pytest.warns(AllRewardsOverwrittenWarning, match="100%"):
            result = service.score(samples, trajs, responses)
    assert result.overwritten_fraction == 1.0 and result.total.tolist() == [0.0] * len(samples)
    assert "100%" in caplog.text


def test_mismatched_rows_are_rejected() -> None:
    service, samples, responses = constant_service("zero")
    with pytest.raises(ValueError, match="paired with sample"):
        service.score(samples[:2], [traj(samples[1].id), traj(samples[0].id)], responses[:2])
    with pytest.raises(ValueError, match="2 samples, 1 trajectories"):
        service.score(samples[:2], [traj(samples[0].id)], responses[:2])


# ---------------------------------------------------------------- bad plugins


class Flaky(RewardPlugin):
    """Scores 1 per row; misbehaves on `bad_id` in the way `mode` says."""

    name = "flaky"

    def __init__(self, mode: str, bad_id: str) -> None:
        self.mode, self.bad_id = mode, bad_id

    def score(self, samples: Sequence[Sample], responses) -> list[float]:
        ids = [s.id for s in samples]
        if self.mode == "raise" and self.bad_id in ids:
            raise RuntimeError("scorer crashed")
        if self.mode == "wrong_length":
            return [1.0] * (len(ids) + 1)
        return [float("nan") if i == self.bad_id else 1.0 for i in ids]


@pytest.mark.parametrize(
    "mode, why",
    [("raise", "raised RuntimeError: scorer crashed"), ("nan", "returned a non-finite score nan")],
)
def test_bad_plugin_per_row(mode: str, why: str) -> None:
    samples = [s.fork(k) for s in make_task_samples("i2t_mc", "val", 2) for k in range(2)]
    bad = samples[2].id
    trajs, responses = [traj(s.id) for s in samples], [text(s.answer) for s in samples]
    specs = [PluginSpec(Flaky(mode, bad), 1.0), PluginSpec(MultipleChoiceExact(), 2.0)]
    with pytest.raises(RewardError, match=f"'flaky' failed on sample '{bad}': {why}") as info:
        RewardService(specs, on_error="raise").score(samples, trajs, responses)
    assert info.value.plugin == "flaky" and info.value.sample_ids == [bad]
    result = RewardService(specs, on_error="zero").score(samples, trajs, responses)
    assert result.per_plugin["flaky"].tolist() == [1.0, 1.0, 0.0, 1.0]
    assert result.total.tolist() == [3.0, 3.0, 2.0, 3.0]
    assert result.errors["flaky"].tolist() == [False, False, True, False]
    assert result.n_errors == 1 and result.metrics()["reward/flaky/n_errors"] == 1.0


def test_bad_plugin_wrong_length() -> None:
    samples = make_task_samples("i2t_mc", "val", 3)
    trajs, responses = [traj(s.id) for s in samples], [text(s.answer) for s in samples]
    specs = [PluginSpec(Flaky("wrong_length", ""), key="counter")]
    with pytest.raises(RewardError, match=r"'counter' failed on sample .*shape \[4\] for 3"):
        RewardService(specs).score(samples, trajs, responses)
    result = RewardService(specs, on_error="zero").score(samples, trajs, responses)
    assert result.total.tolist() == [0.0] * 3 and result.n_errors == 3


# ---------------------------------------------------------------- config and parsing


def test_build_from_config_errors(classifier, tmp_path) -> None:
    def build(**plugin):
        cfg = RewardConfig(
            plugins=[RewardPluginConfig(name="mc_exact"), RewardPluginConfig(**plugin)]
        )
        return build_reward_service(cfg, decode_images=lambda c: c)

    with pytest.raises(ConfigError, match=r"reward\.plugins\.1\.name.*did you mean 'jigsaw'"):
        build(name="jigsw")
    with pytest.raises(ConfigError, match=r"reward\.plugins\.1\.kwargs\.strict"):
        build(name="exact_answer", kwargs={"strict": True})
    with pytest.raises(ConfigError, match=r"reward\.plugins\.1\.path"):
        build(name="digit_classifier")
    with pytest.raises(ConfigError, match=r"reward\.plugins\.1\.path"):
        build(name="jigsaw", path=str(tmp_path))
    classifier.save_pretrained(tmp_path / "clf")
    service = build(name="digit_classifier", path=str(tmp_path / "clf"))
    loaded = service.plugins[1].plugin.classifier
    x = load_split("val").images[:4]
    assert torch.allclose(loaded.predict_proba(x), classifier.predict_proba(x))
    cfg = RewardConfig(plugins=[RewardPluginConfig(name="mc_exact")] * 2)
    assert [s.label for s in build_reward_service(cfg).plugins] == ["mc_exact_0", "mc_exact_1"]
    cfg = RewardConfig(
        plugins=[RewardPluginConfig(name="digit_classifier", path=str(tmp_path / "clf"))]
    )
    with pytest.raises(ConfigError, match="decode_images"):
        build_reward_service(cfg)


def test_parse_response_from_token_stream(codec) -> None:
    s = make_task_samples("draw_then_answer", "val", 1)[0]
    tok = build_tokenizer()
    full = serialize(s, tok, encode_image=codec.encode)
    parts = parse_response(full, tok)
    assert [type(p).__name__ for p in parts] == ["TextPart", "ImagePart", "TextPart"]
    assert parts[-1].text == s.answer and parts[1].codes.shape == codec.grid
    cut = int(torch.nonzero(full.modality).flatten()[3]) + 1  # stop inside the image
    truncated = dataclasses.replace(
        full,
        token_ids=full.token_ids[:cut],
        modality=full.modality[:cut],
        owner=full.owner[:cut],
        visual_codes=full.visual_codes[:cut],
        finish_reason="cap",
    )
    assert parse_response(truncated, tok) is None
    service = RewardService([PluginSpec(ExactAnswer())], truncated_reward="keep")
    samples = [s.fork(0), s.fork(1)]
    trajs = [dataclasses.replace(full, sample_id=x.id) for x in samples]
    result = service.score(samples, trajs, [parts, parse_response(truncated, tok)])
    assert result.total.tolist() == [1.0, 0.0]
    assert result.invalid["exact_answer"].tolist() == [False, True]
