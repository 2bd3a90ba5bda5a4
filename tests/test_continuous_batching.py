"""Continuous batching (`uniweave.rollout.continuous`, `rollout.continuous_batching`): the same
trajectories as the static engine for the same seeds.

The reference is the static engine (`RolloutEngine` without slots), itself checked
against full recomputation and across batch sizes in tests/test_rollout.py. With slots,
a row is prefilled with other prompts than in the static batch and decoded next to other
rows, over a key window of another width: its numbers differ from the static engine's
only by float32 reassociation in the batched matmuls and the masked attention (the
"batch geometry"). The tokens and codes must be equal (a different draw would need two
candidates within that noise of a sampling threshold, at these sizes never observed);
the log-probs agree per position within `rollout_fixtures.logp_bounds` (tests/tolerances.py:
two float32 paths through the model's reductions, at the scale of the position's
log-prob and logits / temperature, x the guidance gain, BSQ bits summed), as
tests/test_rollout.py bounds the same change of batch geometry.

Cases: mixed text and guided image requests (VQ and BSQ; sampling with temperature,
top-k and top-p) in 2, 3 and 5 slots, where a guided pair must wait for two free slots,
with the lean step and with the model's own forward; a GRPO group's G members admitted
together share one prefill; tiny Janus-Pro t2i with CFG (the generic body forward);
refusals for models it is not built for; and a GRPO run and an OPD run with it on equal
the runs with it off, bit for bit (replay-anchored GRPO reads rollout log-probs only for a
metric, OPD drops them, and the tokens are equal, so the loss, gradients and weights are
the same).
"""

from __future__ import annotations

import copy

import pytest
import torch
from rollout_fixtures import logp_bounds, mixed_requests, mixed_samples, tiny_model
from tolerances import assert_within, decoder_reductions, tiny_decoder_reductions
from trainer_helpers import grpo_config, make_grpo_trainer, tiny_config

from uniweave.codecs.base import single_thread
from uniweave.config import validate_config
from uniweave.core.sample import GenerationRequest, Sample, TextPart
from uniweave.core.seeding import seed_for
from uniweave.models.build import build_model
from uniweave.rollout import RolloutEngine, RolloutRequest, SamplingParams
from uniweave.train.distributed.comm import DistInfo
from uniweave.train.engine.trainer import Trainer
from uniweave.train.methods.opd.job import build_opd_job


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    with single_thread():
        yield


def _same(ref, got, model, reductions=None) -> None:
    """`ref` and `got` hold the same streams, their log-probs within the batch-geometry
    bound (module docstring) of `model`, the one that sampled them; `reductions`: N of a
    trajectory (default: the tiny model's over its length)."""
    reductions = reductions or (lambda t: tiny_decoder_reductions(model.config, len(t)))
    assert len(ref) == len(got)
    for a, b in zip(ref, got):
        assert a.sample_id == b.sample_id
        assert torch.equal(a.token_ids, b.token_ids), a.sample_id
        assert torch.equal(a.visual_codes, b.visual_codes), a.sample_id
        assert torch.equal(a.owner, b.owner) and torch.equal(a.modality, b.modality)
        assert a.finish_reason == b.finish_reason and a.image_grids == b.image_grids
        if a.rollout_logp is None:  # OPD's rollouts keep no log-probs
            assert b.rollout_logp is None and b.rollout_logp_factors is None, a.sample_id
            continue
        n = reductions(a)
        tol = logp_bounds(model, a, a.sampling.params, n)
        assert_within((a.rollout_logp - b.rollout_logp).abs(), tol, a.sample_id)
        if a.rollout_logp_factors is not None:
            tol = logp_bounds(model, a, a.sampling.params, n, factors=True)[:, None]
            err = (a.rollout_logp_factors - b.rollout_logp_factors).abs()
            assert_within(err, tol, f"{a.sample_id} bits")


@pytest.mark.parametrize("kind", ["vq", "bsq"])
def test_slots_give_the_static_engines_trajectories(kind):
    model = tiny_model(kind, init=0.5, mixer_kernel=0)
    text = SamplingParams(max_new_tokens=24, temperature=1.3, top_k=40, top_p=0.9)
    image = SamplingParams(max_new_tokens=16, length_semantics="exact", guidance=2.0)
    requests = mixed_requests(mixed_samples(2), text, image)
    ref = RolloutEngine(model).generate(requests)
    assert len({len(t) for t in ref}) > 2  # rows of several lengths: slots are reused
    for slots, lean in ((2, True), (3, True), (5, False)):
        _same(ref, RolloutEngine(model, slots=slots, lean=lean).generate(requests), model)


def test_a_group_shares_one_prefill_on_admission():
    model = tiny_model("vq", init=0.5, mixer_kernel=0)
    text = SamplingParams(max_new_tokens=12, temperature=1.2)
    samples = [Sample(f"p{i}", [TextPart(t)], task="chat") for i, t in enumerate(["a b", "c d e"])]
    G = 4
    requests = [
        RolloutRequest(member, seed_for(5, 0, i, g), text)
        for i, s in enumerate(samples)
        for g, member in enumerate(s.fork(g) for g in range(G))
    ]
    prefill_rows: list[int] = []
    hook = model.decoder.register_forward_pre_hook(
        lambda mod, args, kw: (
            prefill_rows.append(kw["inputs_embeds"].shape[0])
            if kw["inputs_embeds"].shape[1] > 1
            else None
        ),
        with_kwargs=True,
    )
    try:
        got = RolloutEngine(model, slots=2 * G).generate(requests)
    finally:
        hook.remove()
    # all 8 rows fit the 8 slots at once: one prefill forward of the 2 distinct prompts
    assert prefill_rows == [2]
    _same(RolloutEngine(model).generate(requests), got, model)
    assert len({tuple(t.token_ids.tolist()) for t in got}) > 2  # members sampled apart


def test_janus_t2i_with_guidance_in_slots(tmp_path):
    from uniweave.models.janus_pro import JanusProModel
    from uniweave.models.janus_pro.tiny import TinyJanusSpec, write_tiny_checkpoint

    texts = ["draw a red cat on the mat", "a dog", "two birds"]
    ckpt = write_tiny_checkpoint(tmp_path, TinyJanusSpec(initializer_range=0.2), texts)
    model = JanusProModel.from_pretrained(ckpt).eval()
    params = SamplingParams(max_new_tokens=16, length_semantics="exact", guidance=5.0, top_k=50)
    requests = [
        RolloutRequest(
            Sample(f"s{k}", [TextPart(t), GenerationRequest(4, 4)], task="t2i"), k, params
        )
        for k, t in enumerate(texts * 2)
    ]
    ref = RolloutEngine(model).generate(requests)
    c = model.model.language_model.config
    d = c.hidden_size

    def janus(t) -> int:  # tests/test_janus_pro.py: the final norm and the generation head
        heads = c.num_attention_heads
        return decoder_reductions(
            d, c.intermediate_size, c.num_hidden_layers, len(t), d // heads, head=3 * d
        )

    _same(ref, RolloutEngine(model, slots=3).generate(requests), model, janus)


def test_models_it_is_not_built_for_are_refused():
    with pytest.raises(ValueError, match="MixCache"):
        RolloutEngine(tiny_model("vq", mixer_kernel=4), slots=4)
    with pytest.raises(ValueError, match="slots must be an int >= 2"):
        RolloutEngine(tiny_model("vq", mixer_kernel=0), slots=1)


def test_a_grpo_run_with_continuous_batching_equals_the_run_without(
    tmp_path, small_vq_dir, classifier_dir
):
    assets = {"vq": small_vq_dir, "clf": classifier_dir}
    runs = []
    for on in (False, True):
        cfg = grpo_config(
            tmp_path / str(on),
            assets,
            model={"tiny": {"mixer_kernel": 0, "hidden_size": 32, "num_layers": 2,
                            "num_heads": 2, "intermediate_size": 64}},
            rollout={"max_new_tokens": 16, "length_semantics": "exact", "guidance": 2.0,
                     "batch_size": 5, "continuous_batching": on},
        )  # fmt: skip
        trainer = make_grpo_trainer(cfg)
        assert trainer.source.service.engine.slots == (5 if on else None)
        initial = copy.deepcopy(trainer.model)  # the policy that samples update 0's batch
        trajs = trainer.source.global_batch(0)
        metrics = [m for _, m in trainer.fit()]
        runs.append((trajs, metrics, trainer.model.state_dict()))
    (t0, m0, w0), (t1, m1, w1) = runs
    _same(t0, t1, initial)
    for a, b in zip(m0, m1):
        assert a["loss"] == b["loss"]
    for name, w in w0.items():
        assert torch.equal(w, w1[name]), name


def test_an_opd_run_with_continuous_batching_equals_the_run_without(
    tmp_path, small_vq_dir, classifier_dir
):
    """OPD's source builds its engine from the same knob: its rollouts (text and images,
    varied lengths: `cap` semantics) are the static engine's, so the distillation loss,
    which reads the teacher and student on those tokens (not the rollout log-probs), and
    the weights after two updates are bitwise equal."""
    model = {"tiny": {"mixer_kernel": 0}, "visual_head": "vq"}

    def config(name: str, on: bool) -> dict:
        cfg = tiny_config(
            tmp_path / name,
            small_vq_dir,
            model={**model, "codec": {"path": str(small_vq_dir), "codebook_size": 16}},
            data={"tasks": ["t2i", "i2t_mc"], "train_size": 16},
            rollout={"max_new_tokens": 20, "length_semantics": "cap", "batch_size": 4,
                     "continuous_batching": on},
            reward={"plugins": [
                {"name": "digit_classifier", "path": str(classifier_dir), "tasks": ["t2i"]},
                {"name": "mc_exact", "tasks": ["i2t_mc"]}], "truncated_reward": "keep"},
            trainer={"total_updates": 2, "global_batch_size": 6, "micro_batch_size": 3},
        )  # fmt: skip
        cfg["algorithm"] = {"name": "opd", "teacher": {"path": str(tmp_path / "teacher")}}
        return cfg

    teacher = config("teacher_run", False)
    teacher["run"]["seed"] = 9  # other weights than the student's
    build_model(validate_config(teacher)).save_pretrained(tmp_path / "teacher")
    runs = []
    for on in (False, True):
        cfg = validate_config(config(str(on), on))
        student = build_model(cfg).train()
        source, objective = build_opd_job(cfg, student, tmp_path / str(on), DistInfo())
        trainer = Trainer(student, source, objective, cfg, tmp_path / str(on), DistInfo(),
                          student.special_ids.pad)  # fmt: skip
        assert trainer.source.service.engine.slots == (4 if on else None)
        initial = copy.deepcopy(trainer.model)  # the policy that samples update 0's batch
        trajs = trainer.source.global_batch(0)
        metrics = [m for _, m in trainer.fit()]
        runs.append((trajs, metrics, trainer.model.state_dict()))
    (t0, m0, w0), (t1, m1, w1) = runs
    assert len({len(t) for t in t0}) > 2  # varied lengths: slots were reused
    _same(t0, t1, initial)
    for a, b in zip(m0, m1):
        assert a["loss"] == b["loss"]
    for name, w in w0.items():
        assert torch.equal(w, w1[name]), name
