"""Self-describing batches: a row carries everything its replay needs (docs/architecture.md §2).

Rollouts of the tiny model and of a tiny random Janus-Pro (image -> text rows with input
pixels, guided text -> image rows) are written to disk, loaded in a *fresh process* on a
model built from the same checkpoint, and replayed there: the log-probs equal the
in-process replay to 1e-6. A deep copy of the model (the frozen GRPO reference) scores
image -> text rows the same way, with no state registered in it.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from rollout_fixtures import batch_logp_bounds, mixed_requests, mixed_samples, tiny_model
from tolerances import assert_within, decoder_reductions

from uniweave.codecs.base import single_thread
from uniweave.core.sample import GenerationRequest, ImagePart, Sample, TextPart
from uniweave.core.trajectory import TrajectoryBatch, load_trajectories, save_trajectories
from uniweave.models.base import DecodePositions, rope_positions
from uniweave.models.janus_pro import JanusProModel
from uniweave.models.janus_pro.tiny import TinyJanusSpec, write_tiny_checkpoint
from uniweave.replay import replay_logprobs
from uniweave.rollout import (
    RolloutEngine,
    RolloutRequest,
    RolloutTrajectory,
    SamplingParams,
    sampling_records,
)

REPLAY_SCRIPT = """
import sys, torch
from uniweave.core.trajectory import TrajectoryBatch, load_trajectories
from uniweave.models import load_model
from uniweave.replay import replay_logprobs
from uniweave.rollout import RolloutTrajectory, sampling_records

model = load_model(sys.argv[1]).eval()
trajs = load_trajectories(sys.argv[2], kinds=[RolloutTrajectory])
batch = TrajectoryBatch.collate(trajs, model.special_ids.pad)
with torch.no_grad():
    out = replay_logprobs(model, batch, sampling_records(trajs))
torch.save({"logp": out.logp, "ids": batch.sample_ids}, sys.argv[3])
"""


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    with single_thread():
        yield


def _replay_in_fresh_process(model_dir: Path, trajs, tmp_path: Path) -> torch.Tensor:
    batch_file, out_file = tmp_path / "batch.pt", tmp_path / "replayed.pt"
    save_trajectories(batch_file, trajs)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", REPLAY_SCRIPT, str(model_dir), str(batch_file), str(out_file)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = torch.load(out_file, weights_only=True)
    assert result["ids"] == [t.sample_id for t in trajs]
    return result["logp"]


def _in_process(model, trajs) -> TrajectoryBatch:
    batch = TrajectoryBatch.collate(trajs, model.special_ids.pad)
    with torch.no_grad():
        return batch, replay_logprobs(model, batch, sampling_records(trajs)).logp


@pytest.mark.parametrize("kind", ["vq", "bsq"])
def test_tiny_batch_replays_in_a_fresh_process(kind, tmp_path):
    model = tiny_model(kind)
    model.save_pretrained(tmp_path / "model")
    text = SamplingParams(temperature=1.0, max_new_tokens=12)
    image = SamplingParams(temperature=1.0, max_new_tokens=16, length_semantics="exact")
    trajs = RolloutEngine(model).generate(mixed_requests(mixed_samples(2), text, image))
    batch, here = _in_process(model, trajs)
    # rollout vs replay: two fp32 paths (tests/tolerances.py)
    tol = batch_logp_bounds(model, trajs, here.shape)
    assert_within((here - batch.rollout_logp).abs(), tol, "rollout vs replay")
    there = _replay_in_fresh_process(tmp_path / "model", trajs, tmp_path)
    assert batch.n_scored() > 20
    # the same weights, kernels and shapes in another process: the same bits
    assert torch.equal(there, here)


def _janus_reductions(model: JanusProModel, keys: int) -> int:
    """tests/tolerances.py's N for a head output of a tiny Janus-Pro over `keys` keys (as
    tests/test_janus_pro.py: the final norm and the generation head's two layers)."""
    c = model.model.language_model.config
    d = c.hidden_size
    return decoder_reductions(
        d, c.intermediate_size, c.num_hidden_layers, keys, d // c.num_attention_heads, head=3 * d
    )


def _pixels(seed: int, size: int = 16) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, (size, size, 3)).astype(np.float32) / np.float32(255.0)


@pytest.fixture(scope="module")
def janus_dir(tmp_path_factory) -> Path:
    texts = ["what is in this picture ? A B C D", "draw a red cat", "a dog"]
    root = tmp_path_factory.mktemp("janus")
    return write_tiny_checkpoint(root, TinyJanusSpec(initializer_range=0.2), texts)


def _janus_requests() -> list[RolloutRequest]:
    text = SamplingParams(temperature=0.9, max_new_tokens=10)
    image = SamplingParams(guidance=3.0, max_new_tokens=16, length_semantics="exact")
    out = []
    for k, question in enumerate(["what is in this picture ?", "a dog ? A B C D"]):
        parts = [ImagePart(pixels=_pixels(k)), TextPart(question)]
        out.append(RolloutRequest(Sample(f"q{k}", parts, task="i2t_mc"), 20 + k, text))
        gen = Sample(f"t{k}", [TextPart("draw a red cat"), GenerationRequest(4, 4)], task="t2i")
        out.append(RolloutRequest(gen, 30 + k, image))
    return out


def test_janus_batch_with_input_images_replays_in_a_fresh_process(janus_dir, tmp_path):
    model = JanusProModel.from_pretrained(janus_dir).eval()
    trajs = RolloutEngine(model).generate(_janus_requests())
    assert [len(t.images) for t in trajs] == [1, 0, 1, 0]
    batch, here = _in_process(model, trajs)
    tol = batch_logp_bounds(model, trajs, here.shape, n=_janus_reductions(model, here.shape[1]))
    assert_within((here - batch.rollout_logp).abs(), tol, "rollout vs replay")
    there = _replay_in_fresh_process(janus_dir, trajs, tmp_path)
    assert torch.equal(there, here)
    # The images decide the answer's log-probs: other pixels give other numbers.
    swapped = [t for t in trajs]
    swapped[0] = copy.copy(trajs[0])
    swapped[0].images = [torch.from_numpy(_pixels(99))]
    _, other = _in_process(model, swapped)
    assert (other[0] - here[0]).abs().max() > 1e-4


def test_a_deep_copy_scores_image_rows_like_the_model(janus_dir):
    """The frozen GRPO reference (full fine-tuning) is a deep copy taken before any rollout:
    it holds no images of its own, yet scores image -> text rows exactly as the policy."""
    model = JanusProModel.from_pretrained(janus_dir).eval()
    reference = copy.deepcopy(model)
    trajs = RolloutEngine(model).generate(_janus_requests()[::2])
    _, policy = _in_process(model, trajs)
    _, ref = _in_process(reference, trajs)
    assert torch.equal(policy, ref)


def test_trajectory_files_round_trip_and_refuse_garbage(tmp_path):
    model = tiny_model("vq")
    text = SamplingParams(max_new_tokens=6)
    image = SamplingParams(max_new_tokens=16, length_semantics="exact")
    trajs = RolloutEngine(model).generate(mixed_requests(mixed_samples(1), text, image))
    path = tmp_path / "b.pt"
    save_trajectories(path, trajs)
    loaded = load_trajectories(path, kinds=[RolloutTrajectory])
    assert [type(t) for t in loaded] == [RolloutTrajectory] * len(trajs)
    for a, b in zip(trajs, loaded):
        assert a.sampling == b.sampling and a.image_grids == b.image_grids
        assert a.finish_reason == b.finish_reason and torch.equal(a.token_ids, b.token_ids)
        assert torch.equal(a.rollout_logp, b.rollout_logp)
    with pytest.raises(ValueError, match="unknown kind"):
        load_trajectories(path)  # RolloutTrajectory not admitted
    (tmp_path / "junk.pt").write_bytes(b"not a torch file")
    with pytest.raises(ValueError, match="junk.pt: not a readable trajectory file"):
        load_trajectories(tmp_path / "junk.pt")
    assert not list(tmp_path.glob(".*.tmp"))


def test_rope_positions_of_left_and_right_padded_rows():
    right = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]], dtype=torch.bool)
    left = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]], dtype=torch.bool)
    assert rope_positions(right).tolist() == [[0, 1, 2, 0], [0, 1, 0, 0]]
    assert rope_positions(left).tolist() == [[0, 0, 1, 2], [0, 1, 2, 3]]


class _Strided(DecodePositions):
    def next(self, modality, image_position, token_ids=None):
        pos = self.next_position[:, None]
        self.next_position = self.next_position + 2
        return pos


def test_rollout_and_replay_take_positions_from_the_adapter():
    """A model whose positions advance by 2: rollout (prefill + decode steps) and replay
    agree only if both ask the adapter; the log-probs differ from unit steps."""
    plain = tiny_model("vq", init=0.15)
    strided = copy.deepcopy(plain)

    class StridedTiny(type(plain)):
        def position_ids(self, attention_mask, modality):
            return 2 * rope_positions(attention_mask)

        def decode_positions(self, prefill):
            return _Strided(2 * prefill.attention_mask.long().sum(-1))

    strided.__class__ = StridedTiny
    text = SamplingParams(max_new_tokens=8)
    image = SamplingParams(max_new_tokens=16, length_semantics="exact")
    requests = mixed_requests(mixed_samples(1), text, image)
    trajs = RolloutEngine(strided).generate(requests)
    batch, replayed = _in_process(strided, trajs)
    tol = batch_logp_bounds(strided, trajs, replayed.shape)
    assert_within((replayed - batch.rollout_logp).abs(), tol, "strided rollout vs replay")
    _, unit = _in_process(plain, trajs)
    assert (unit - replayed).abs().max() > 1e-3
