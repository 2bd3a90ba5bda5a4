"""The digits classifier used as a learned image reward."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from tolerances import assert_within, magnitude, reduction_bound, sum_bound

from uniweave.data.digits_images import load_split
from uniweave.rewards.digit_classifier import DigitClassifier


@pytest.fixture(scope="module")
def train():
    return load_split("train")


@pytest.fixture(scope="module")
def test_split():
    return load_split("test")


@pytest.fixture(scope="module")
def classifier(digits_classifier):
    return digits_classifier


def test_test_accuracy_at_least_95_percent(classifier, test_split):
    acc = classifier.accuracy(test_split.images, test_split.labels)
    pred = classifier.predict(test_split.images).numpy()
    print(f"digit classifier test accuracy {acc:.4f} on {len(test_split)} images")
    assert acc == pytest.approx(float(np.mean(pred == test_split.labels)))
    assert acc >= 0.95


def test_predict_proba_is_the_softmax_of_the_logits(classifier, test_split):
    proba = classifier.predict_proba(test_split.images)
    assert proba.shape == (len(test_split), 10) and proba.dtype == torch.float32
    logits = classifier.logits(test_split.images)
    ref = torch.distributions.Categorical(logits=logits).probs
    # two float32 paths to the logits (tests/tolerances.py: each layer's fan-in) and two
    # softmaxes (Categorical normalises by a logsumexp first): a probability moves by
    # p (dz_a - sum_b p_b dz_b) <= 2 max |dz|
    fan_in = sum(p[0].numel() for k, p in classifier.net.named_parameters() if k.endswith("weight"))
    tol = 2 * reduction_bound(magnitude(logits), fan_in + 2 * logits.shape[-1])
    assert_within((proba - ref).abs(), tol, "probabilities")
    # one softmax's rounding of its sum: 10 divisions and a 10-term sum (sum_bound)
    ones = torch.ones(len(test_split))
    assert_within((proba.sum(-1) - ones).abs(), sum_bound(1.0, 2 * logits.shape[-1]), "sum")


def test_score_is_p_of_the_target_digit_without_grad(classifier, test_split):
    classifier.net.train()
    digits = torch.arange(len(test_split)) % 10
    scores = classifier.score(test_split.images, digits)
    assert not classifier.net.training
    assert not scores.requires_grad and scores.shape == (len(test_split),)
    proba = classifier.predict_proba(test_split.images)
    assert torch.equal(scores, proba[torch.arange(len(test_split)), digits])
    true_scores = classifier.score(test_split.images, test_split.labels)
    assert (
        float(true_scores.mean()) > 0.9 > float(scores[digits.numpy() != test_split.labels].mean())
    )


def test_fit_is_deterministic_for_a_seed(train):
    a = DigitClassifier(epochs=2).fit(train.images[:200], train.labels[:200], seed=1)
    b = DigitClassifier(epochs=2).fit(train.images[:200], train.labels[:200], seed=1)
    for (key, va), vb in zip(a.net.state_dict().items(), b.net.state_dict().values()):
        assert torch.equal(va, vb), key


def test_save_and_load_round_trip(classifier, test_split, tmp_path):
    classifier.save_pretrained(tmp_path / "clf")
    assert json.loads((tmp_path / "clf" / "classifier.json").read_text())["kind"] == (
        "digit_classifier"
    )
    loaded = DigitClassifier.from_pretrained(tmp_path / "clf")
    assert loaded.config() == classifier.config()
    assert torch.equal(
        loaded.predict_proba(test_split.images), classifier.predict_proba(test_split.images)
    )


def test_bad_inputs_raise_clear_errors(classifier, test_split, tmp_path):
    x, y = test_split.images[:5], test_split.labels[:5]
    with pytest.raises(ValueError, match=r"shape \[N, 8, 8\]"):
        classifier.predict_proba(x.reshape(5, 64))
    with pytest.raises(ValueError, match=r"in \[0, 1\]"):
        classifier.predict_proba(x - 1.0)
    with pytest.raises(ValueError, match=r"digits must lie in \[0, 10\)"):
        classifier.score(x, np.array([0, 1, 2, 3, 10]))
    with pytest.raises(ValueError, match=r"labels must have shape \[5\]"):
        classifier.accuracy(x, y[:3])
    with pytest.raises(ValueError, match="integers"):
        classifier.accuracy(x, y.astype(np.float32))
    with pytest.raises(RuntimeError, match="not fitted"):
        DigitClassifier().predict(x)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        DigitClassifier.from_pretrained(tmp_path / "nowhere")
    classifier.save_pretrained(tmp_path / "clf")
    (tmp_path / "clf" / "classifier.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "clf" / "classifier.safetensors")):
        DigitClassifier.from_pretrained(tmp_path / "clf")
