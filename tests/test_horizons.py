"""Rollout horizons (issue 33 item 5): `rollout.max_new_tokens: null` is the model's
context length with the cycle detector on (refused with the detector off or under exact
length), and a digits GRPO run with it runs to completion."""

from __future__ import annotations

import math

import pytest
import torch
from trainer_helpers import fit_small_codec, tiny_config

from uniweave.config import ConfigError, RolloutConfig, validate_config
from uniweave.rollout import SamplingParams
from uniweave.rollout.config import sampling_params

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: torch on 1 thread


def test_null_horizon_needs_the_cycle_detector_and_cap():
    cfg = RolloutConfig(max_new_tokens=None)
    assert cfg.cycle_max_period > 0 and sampling_params(cfg).max_new_tokens is None
    with pytest.raises(ConfigError, match="cycle detector on") as info:
        validate_config({"rollout": {"max_new_tokens": None, "cycle_max_period": 0}})
    assert info.value.key == "rollout.max_new_tokens"
    with pytest.raises(ConfigError, match="exact") as info:
        validate_config({"rollout": {"max_new_tokens": None, "length_semantics": "exact"}})
    assert info.value.key == "rollout.max_new_tokens"
    with pytest.raises(ValueError, match="cycle detector on"):
        SamplingParams(max_new_tokens=None, cycle_max_period=0)
    params = SamplingParams(max_new_tokens=None)
    assert not params.at_cap(10**9) and SamplingParams(max_new_tokens=3).at_cap(3)


def test_a_digits_grpo_run_with_a_null_horizon_runs_to_completion(tmp_path):
    from trainer_helpers import fit_metrics, make_grpo_trainer

    codec = fit_small_codec(tmp_path / "vq", "vq")
    cfg = tiny_config(
        tmp_path / "run",
        codec,
        model={"tiny": {"hidden_size": 32, "num_layers": 2, "num_heads": 2,
                        "intermediate_size": 64, "max_position_embeddings": 96}},
        data={"tasks": ["i2t_mc"], "train_size": 8, "val_size": 0, "test_size": 0},
        rollout={"max_new_tokens": None, "length_semantics": "cap", "temperature": 1.5},
        reward={"plugins": [{"name": "mc_exact"}]},
        algorithm={"name": "grpo", "group_size": 4},
        trainer={"total_updates": 2, "global_batch_size": 8, "micro_batch_size": 4},
    )  # fmt: skip
    config = validate_config(cfg)
    assert config.rollout.max_new_tokens is None
    trainer = make_grpo_trainer(config)
    trajs = trainer.source.global_batch(0)
    reasons = {t.finish_reason for t in trajs}
    assert "context" in reasons and reasons <= {"eos", "cycle", "context", "invalid"}
    assert max(len(t.token_ids) for t in trajs) <= 96
    history = fit_metrics(trainer)
    assert len(history) == 2 and all(math.isfinite(m["loss"]) for m in history)


def _sft_config(tmp_path, codec, **data):
    return validate_config(
        tiny_config(
            tmp_path / "sft",
            codec,
            data={"tasks": ["t2i", "i2t_mc"], "train_size": 4, "val_size": 0, "test_size": 0,
                  **data},
        )
    )  # fmt: skip


def test_sft_rows_over_the_sequence_limit_are_refused_or_dropped(tmp_path, caplog):
    """Digits rows serialise to 36 (t2i) and 52 (i2t_mc) positions on the tiny model."""
    from uniweave.models.build import build_model
    from uniweave.train.methods.sft.source import sft_trajectories

    codec = fit_small_codec(tmp_path / "vq", "vq")
    cfg = _sft_config(tmp_path, codec)
    model = build_model(cfg)
    lengths = sorted(len(t) for t in sft_trajectories(cfg, model, "train", 4))
    assert lengths == [36] * 4 + [52] * 4
    fits = _sft_config(tmp_path, codec, max_sequence_tokens=52)
    assert len(sft_trajectories(fits, model, "train", 4)) == 8
    refuse = _sft_config(tmp_path, codec, max_sequence_tokens=40)
    with pytest.raises(ConfigError, match="task 'i2t_mc' row .* 52 positions, more than 40") as e:
        sft_trajectories(refuse, model, "train", 4)
    assert e.value.key == "data.max_sequence_tokens"
    drop = _sft_config(tmp_path, codec, max_sequence_tokens=40, over_length="drop")
    with caplog.at_level("WARNING"):
        kept = sft_trajectories(drop, model, "train", 4)
    assert [len(t) for t in kept] == [36] * 4
    assert "dropped 4 of 8 train rows" in caplog.text
    with pytest.raises(ConfigError, match="every train row is longer than 8"):
        sft_trajectories(_sft_config(tmp_path, codec, max_sequence_tokens=8,
                                     over_length="drop"), model, "train", 4)  # fmt: skip


def test_a_dataset_row_over_the_limit_names_its_file_and_line(tmp_path):
    import json

    from uniweave.models.build import build_model
    from uniweave.train.methods.sft.source import sft_trajectories

    rows = tmp_path / "rows.jsonl"
    words = ["one", "two " * 30]
    rows.write_text("".join(json.dumps({"messages": [
        {"role": "user", "content": "say"}, {"role": "assistant", "content": w}]}) + "\n"
        for w in words))  # fmt: skip
    codec = fit_small_codec(tmp_path / "vq", "vq")
    cfg = _sft_config(tmp_path, codec, tasks=["colour"], path=str(rows), default_task="colour",
                      max_sequence_tokens=24, train_size=0)  # fmt: skip
    with pytest.raises(ConfigError, match=rf"{rows}:2: the train row serialises to"):
        sft_trajectories(cfg, build_model(cfg), "train", 0)


# ---- UniAR: image grids within the model's own 1..30 ------------------------------------


@pytest.fixture(scope="module")
def uniar():
    from model_fixtures import UNIAR_SIZES, random_bsq_codec

    from uniweave.codecs.base import single_thread
    from uniweave.models.uniar import build_tiny_uniar

    with single_thread():
        yield build_tiny_uniar(random_bsq_codec(16, 2, 1), UNIAR_SIZES, seed=0)


def _scripted(model, script: list[int]):
    """`model.text_logits` forced toward `script`, one token per call (one row)."""
    raw, step = model.text_logits, iter(range(len(script)))

    def forced(hidden):
        logits = raw(hidden)
        k = next(step, None)
        if k is not None:
            logits = torch.full_like(logits, -1e4)
            logits[:, script[k]] = 1e4
        return logits

    return forced


@pytest.mark.parametrize(("height", "width", "started"), [(31, 4, False), (4, 31, False),
                                                          (30, 1, True)])  # fmt: skip
def test_a_uniar_rollout_never_starts_an_image_outside_1_to_30(
    uniar, monkeypatch, height, width, started
):
    """Logits forced to write `<image_gen> generate image H W<|vision_start|>`: with
    rollout.max_grid_side 32 (the default) a side of 31 is still no valid header for
    UniAR (its serialisation allows 1..30): the row ends "invalid" and holds no image;
    30 starts one."""
    from uniweave.core.sample import Sample, TextPart
    from uniweave.data.template import image_generation_prefix
    from uniweave.rollout import RolloutEngine, RolloutRequest

    assert uniar.max_grid_side == 30
    script = image_generation_prefix(height, width, uniar.tokenizer)
    monkeypatch.setattr(uniar, "text_logits", _scripted(uniar, script), raising=False)
    params = SamplingParams(max_new_tokens=len(script) + 3, cycle_max_period=0)
    assert params.max_grid_side == 32 and params.grid_allowed(height, width)
    prompt = Sample("p", [TextPart("draw", role="user")])
    (out,) = RolloutEngine(uniar).generate([RolloutRequest(prompt, 0, params)])
    n = out.sampling.prompt_length
    assert out.token_ids[n : n + len(script)].tolist() == script
    if started:
        assert out.image_grids == [(height, width)] and out.finish_reason == "cap"
    else:
        assert out.image_grids == [] and out.finish_reason == "invalid"
    with pytest.raises(ValueError, match="outside the model's own limit 1..30"):
        RolloutEngine(uniar)._check_request(RolloutRequest(prompt, 0, params), out, (31, 2))


# ---- rollout.precision: bf16 rollouts (issue 33 item 1) ---------------------------------


def test_bf16_rollouts_compute_the_visual_logits_in_bf16(monkeypatch):
    """`precision="bf16"`: the engine decodes under bf16 autocast (the visual logits come
    out bf16, weights untouched, the recorded log-probs stay float32 and differ from fp32's); the
    config knob reaches the GRPO rollout service and is refused where nothing reads it."""
    from rollout_fixtures import tiny_model

    from uniweave.rollout import RolloutEngine, RolloutRequest

    model = tiny_model("vq")
    seen = []
    raw = model.visual_logits

    def logits(hidden):
        out = raw(hidden)
        seen.append(out.dtype)
        return out

    monkeypatch.setattr(model, "visual_logits", logits, raising=False)
    params = SamplingParams(guidance=5.0, max_new_tokens=16, length_semantics="exact")
    from uniweave.data.digits import make_task_samples

    reqs = [RolloutRequest(s, k, params, image_grid=(4, 4))
            for k, s in enumerate(make_task_samples("t2i", "val", 4, seed=1))]  # fmt: skip
    fp32 = RolloutEngine(model).generate(reqs)
    assert set(seen) == {torch.float32}
    seen.clear()
    bf16 = RolloutEngine(model, precision="bf16").generate(reqs)
    assert set(seen) == {torch.bfloat16}
    assert all(t.rollout_logp.dtype == torch.float32 for t in bf16)
    assert any(not torch.equal(a.rollout_logp, b.rollout_logp) for a, b in zip(fp32, bf16))
    assert next(model.parameters()).dtype == torch.float32
    with pytest.raises(ValueError, match="precision must be"):
        RolloutEngine(model, precision="fp16")
    grpo = {"algorithm": {"name": "grpo"}, "reward": {"plugins": [{"name": "mc_exact"}]}}
    assert validate_config({**grpo, "rollout": {"precision": "bf16"}}).rollout.precision == "bf16"
    with pytest.raises(ConfigError, match="acts only with rollouts in training") as info:
        validate_config({"rollout": {"precision": "bf16"}})
    assert info.value.key == "rollout.precision"
    with pytest.raises(ConfigError, match="acts only with float32 weights"):
        validate_config({**grpo, "rollout": {"precision": "bf16"},
                         "trainer": {"precision": "fp64"}})  # fmt: skip
    with pytest.raises(ConfigError, match="acts only in-process"):
        validate_config({**grpo, "rollout": {"precision": "bf16", "workers": 1}})


def test_bf16_rollouts_open_a_gap_the_guards_see_in_a_grpo_run(tmp_path):
    """Two GRPO updates on digits t2i (4x4 images, CFG w = 3) with fp32 and with bf16
    rollouts, the percentile guard on: bf16 sampling opens a mismatch orders of magnitude
    above fp32's, and the guard masks about (100 - p)% of the actions."""
    from trainer_helpers import fit_metrics, make_grpo_trainer

    codec = fit_small_codec(tmp_path / "vq", "vq")

    def run(precision: str) -> dict:
        cfg = tiny_config(
            tmp_path / precision,
            codec,
            data={"tasks": ["t2i"], "train_size": 8, "val_size": 0, "test_size": 0},
            rollout={"max_new_tokens": 16, "length_semantics": "exact", "guidance": 3.0,
                     "precision": precision},
            reward={"plugins": [{"name": "digit_classifier"}]},
            algorithm={"name": "grpo", "group_size": 4, "mismatch": {"percentile": 90.0}},
            trainer={"total_updates": 2, "global_batch_size": 8, "micro_batch_size": 4},
        )  # fmt: skip
        return fit_metrics(make_grpo_trainer(validate_config(cfg)))[-1]

    fp32, bf16 = run("fp32"), run("bf16")
    # bound: k3 ~ d^2 / 2 of the fp32 rollout-replay gap d <= logprob_bound (~1e-5 at these sizes, tests/test_rollout.py): <= 5e-11; a contrast with bf16's, not a precision check
    assert fp32["mismatch/k3"] < 1e-9 and bf16["mismatch/k3"] > 1e3 * fp32["mismatch/k3"]
    assert bf16["mismatch/abs_dlogp_p90"] > 5e-4 > 1e3 * fp32["mismatch/abs_dlogp_p90"]
    assert 0.0 < bf16["mismatch/percentile_masked_share"] <= 0.1 + 1e-9
