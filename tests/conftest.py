"""Session-wide fixtures: the small fitted or random assets that many test modules use,
built once per pytest process instead of once per module or test.

Each is read-only for its users: a test that would write into one of the directories
copies it under its own tmp_path first; the in-memory objects (a fitted codec, the
digits classifier) are shared, so a test must not change their weights. Every fit is
seeded and runs on one thread (the codecs' and classifier's `fit`), and none touches the
global torch RNG, so the assets do not depend on which module builds them first.
The helpers are imported inside the fixtures: a run that needs none of them (the
layering or config tests alone) does not pay for torch models at collection.
"""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def small_vq_dir(tmp_path_factory) -> Path:
    """`trainer_helpers.fit_small_codec`'s VQ codec (16 codewords), saved."""
    from trainer_helpers import fit_small_codec

    return fit_small_codec(tmp_path_factory.mktemp("small_codec") / "vq", "vq")


@pytest.fixture(scope="session")
def small_bsq_dir(tmp_path_factory) -> Path:
    """`trainer_helpers.fit_small_codec`'s BSQ codec (8 latent bits), saved."""
    from trainer_helpers import fit_small_codec

    return fit_small_codec(tmp_path_factory.mktemp("small_codec") / "bsq", "bsq")


@pytest.fixture(scope="session")
def vq32_codec():
    """A fitted VQ codec of 32 codewords (10 k-means iterations on 300 train images)."""
    from uniweave.codecs import build_codec
    from uniweave.data.digits_images import load_split

    codec = build_codec("vq", codebook_size=32, n_init=1, max_iter=10)
    return codec.fit(load_split("train").images[:300])


@pytest.fixture(scope="session")
def classifier_dir(tmp_path_factory) -> Path:
    """A digits classifier fitted on the first 400 train images, saved: the `path` of a
    `digit_classifier` reward plugin."""
    from uniweave.data.digits_images import load_split
    from uniweave.rewards.digit_classifier import DigitClassifier

    train = load_split("train")
    path = tmp_path_factory.mktemp("classifier") / "clf"
    DigitClassifier().fit(train.images[:400], train.labels[:400]).save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def digits_classifier():
    """The digits classifier a run fits when it has none (`load_or_fit_classifier`: the
    whole train split, seed 0)."""
    from uniweave.rewards.digit_classifier import load_or_fit_classifier

    return load_or_fit_classifier(None)


@pytest.fixture(scope="session")
def tiny_clip_dir(tmp_path_factory) -> Path:
    """`model_fixtures.write_tiny_clip`: a tiny random CLIP model and processor, saved."""
    from model_fixtures import write_tiny_clip

    return write_tiny_clip(tmp_path_factory.mktemp("tiny_clip"))


@pytest.fixture(scope="session")
def uniar_codec_dir(tmp_path_factory) -> Path:
    """`model_fixtures.random_bsq_codec(16, 2, 1)` saved: 16-bit positions on a 4x4 grid,
    UniAR's codec in the tiny training configs."""
    from model_fixtures import random_bsq_codec

    path = tmp_path_factory.mktemp("uniar_codec") / "bsq"
    random_bsq_codec(16, 2, 1).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def one_thread():
    """torch on one thread for a module (`pytestmark = pytest.mark.usefixtures(...)`):
    its numbers do not depend on the machine's core count, and it leaves the other core to
    the next test process."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session", autouse=True)
def fingerprint_cache(tmp_path_factory):
    """Content hashes of run inputs (`uniweave.config.fingerprint`) cached in a session
    directory, not the user's ~/.cache (inherited by `uniweave` subprocesses)."""
    import os

    previous = os.environ.get("UNIWEAVE_CACHE_DIR")
    os.environ["UNIWEAVE_CACHE_DIR"] = str(tmp_path_factory.mktemp("uniweave_cache"))
    yield
    if previous is None:
        os.environ.pop("UNIWEAVE_CACHE_DIR", None)
    else:
        os.environ["UNIWEAVE_CACHE_DIR"] = previous


@pytest.fixture(scope="session")
def installed_uniweave(tmp_path_factory):
    """`installed.install_wheel`: this checkout's wheel, built once per session and
    installed by the README's install block into a fresh virtual environment outside the
    checkout (its `work` folder holds only `dist/`; a test runs its commands in a folder
    of its own, or in `work` when it checks what they leave there)."""
    from installed import install_wheel

    return install_wheel(tmp_path_factory.mktemp("wheel"))
