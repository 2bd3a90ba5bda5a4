"""The masked-drawn-image answer evaluation: where it cuts, that the mask removes every
path from the drawn image (codes changed -> same hidden state), that without mixers it
equals deleting those positions (positions kept), the per-row scores against answers
decoded here one row at a time (non-zero, and different with the image masked), and the
end-to-end metrics (the probe runs inside the one evaluator,
`uniweave.eval.runner.evaluate`, on its rollouts)."""

import dataclasses
import json

import pytest
import torch
from rollout_fixtures import tiny_model, tokenizer
from tolerances import assert_within, magnitude, reduction_bound, tiny_decoder_reductions

from uniweave.config import validate_config
from uniweave.core.types import Modality, Owner
from uniweave.data.digits import make_task_samples
from uniweave.data.template import serialize
from uniweave.eval import runner
from uniweave.eval.masked import (
    MAX_ANSWER_TOKENS,
    TASK,
    cut_after_drawn_image,
    evaluate_masked_answer,
    last_hidden,
    masked_answer_scores,
)
from uniweave.eval.runner import engine_rollout, eval_samples, evaluate, make_request
from uniweave.models.base import ModelInputs, image_positions
from uniweave.rewards.plugins import ExactAnswer, build_responses, parse_response
from uniweave.rollout import RolloutTrajectory


def _prefixes(model, n=3):
    samples = make_task_samples("draw_then_answer", "val", n, seed=2)
    trajs = [serialize(s, tokenizer(), encode_image=model.codec.encode) for s in samples]
    return [cut_after_drawn_image(t, model.special_ids.vision_end) for t in trajs]


def test_cut_ends_at_the_drawn_image_not_the_shown_one():
    model = tiny_model("vq")
    n_visual = model.codec.grid[0] * model.codec.grid[1]
    for prefix, first in _prefixes(model):
        assert int(prefix.token_ids[-1]) == model.special_ids.vision_end
        drawn = slice(first, first + n_visual)
        assert (prefix.modality[drawn] == Modality.VISUAL).all()
        assert (prefix.owner[drawn] == Owner.POLICY).all()
        shown = (prefix.modality == Modality.VISUAL) & (prefix.owner == Owner.PROMPT)
        assert int(shown.sum()) == n_visual and int(torch.nonzero(shown)[-1]) < first


@pytest.mark.parametrize("kind", ["vq", "bsq"])
def test_masked_answer_does_not_see_the_drawn_codes(kind):
    model = tiny_model(kind, init=0.3)
    n_visual = model.codec.grid[0] * model.codec.grid[1]
    cuts = _prefixes(model)
    rows, firsts = [c[0] for c in cuts], [c[1] for c in cuts]
    other = []
    for row, first in zip(rows, firsts):
        codes = row.visual_codes.clone()
        drawn = slice(first, first + n_visual)
        codes[drawn] = (codes[drawn] + 1) % 2 if kind == "bsq" else (codes[drawn] + 1) % 16
        other.append(dataclasses.replace(row, visual_codes=codes))
    masked = last_hidden(model, rows, firsts, n_visual, mask_image=True)
    # the masked positions enter as exp(-inf) = 0 weights (and the mixers' masked taps):
    # the same kernels on the same shapes, the same bits whatever their codes
    assert torch.equal(masked, last_hidden(model, other, firsts, n_visual, True))
    plain = last_hidden(model, rows, firsts, n_visual, mask_image=False)
    changed = last_hidden(model, other, firsts, n_visual, mask_image=False)
    assert (plain - changed).abs().max() > 1e-3  # unmasked, the codes do matter
    assert (plain - masked).abs().max() > 1e-3


def test_without_mixers_masking_equals_deleting_the_positions():
    model = tiny_model("vq", init=0.3)
    model = type(model)(
        model.config.model_copy(update={"mixer_kernel": 0}), model.tokenizer, model.codec
    ).eval()
    n_visual = model.codec.grid[0] * model.codec.grid[1]
    for row, first in _prefixes(model):
        masked = last_hidden(model, [row], [first], n_visual, mask_image=True)[0]
        keep = torch.ones(len(row), dtype=torch.bool)
        keep[first : first + n_visual] = False
        ids, mod, codes = row.token_ids[keep], row.modality[keep], row.visual_codes[keep]
        pos = torch.arange(len(row))[keep]
        inputs = ModelInputs(
            ids[None],
            mod[None],
            codes[None],
            torch.ones(1, len(ids), dtype=torch.bool),
            pos[None],
            image_positions(mod[None]),
            [[]],
        )
        with torch.no_grad():
            hidden = model.hidden(inputs).hidden[0, -1]
        # two fp32 forwards over other key lengths (tests/tolerances.py)
        n = tiny_decoder_reductions(model.config, len(row), head=model.config.hidden_size)
        assert_within((masked - hidden).abs(), reduction_bound(magnitude(hidden), n), "deleted")


def _greedy_answer(model, prefix, first, n_visual, mask_image):
    """The answer decoded greedily after `prefix` (cut after its drawn image), one row
    alone, each step a full forward whose key mask drops the drawn image's positions when
    `mask_image`; the stripped text after the image (None: no text), as `ExactAnswer`
    reads it."""
    eos = model.special_ids.eos
    ids, modality, owner = prefix.token_ids, prefix.modality, prefix.owner
    codes = prefix.visual_codes
    for _ in range(MAX_ANSWER_TOKENS):
        T = len(ids)
        keys = torch.ones(1, T, dtype=torch.bool)
        if mask_image:
            keys[0, first : first + n_visual] = False
        mod = modality[None]
        inputs = ModelInputs(
            ids[None], mod, codes[None], keys, torch.arange(T)[None], image_positions(mod), [[]]
        )
        with torch.no_grad():
            hidden = model.hidden(inputs).hidden[:, -1]
        tok = int(model.text_logits(hidden).argmax(-1))
        pad = torch.full((1, *codes.shape[1:]), -1 if codes.dim() == 1 else 0, dtype=codes.dtype)
        ids = torch.cat([ids, torch.tensor([tok])])
        modality = torch.cat([modality, torch.tensor([int(Modality.TEXT)])])
        owner = torch.cat([owner, torch.tensor([int(Owner.POLICY)])])
        codes = torch.cat([codes, pad])
        if tok == eos:
            break
    row = dataclasses.replace(
        prefix, token_ids=ids, modality=modality, owner=owner, visual_codes=codes
    )
    (response,), _ = build_responses([parse_response(row, model.tokenizer)], None)
    return ExactAnswer.final_text(response)


def test_scores_match_answers_decoded_here_and_masking_changes_them():
    """Each row's answer is set to what this test decodes for it (unmasked for even rows,
    with the image masked for odd ones), so the probe must score 1 exactly where its own
    decode agrees: non-zero scores that differ between the two masks."""
    model = tiny_model("vq", init=0.3)
    n_visual = model.codec.grid[0] * model.codec.grid[1]
    samples = make_task_samples(TASK, "val", 6, seed=2)
    trajs = [serialize(s, tokenizer(), encode_image=model.codec.encode) for s in samples]
    vision_end = model.special_ids.vision_end
    plain, masked = [], []
    for traj in trajs:
        prefix, first = cut_after_drawn_image(traj, vision_end)
        plain.append(_greedy_answer(model, prefix, first, n_visual, False))
        masked.append(_greedy_answer(model, prefix, first, n_visual, True))
    # each row's answer: the text decoded for it (even rows: unmasked, odd: masked; the
    # other one where that decode ends without text)
    answers = []
    for i, (p, m) in enumerate(zip(plain, masked)):
        first, second = (p, m) if i % 2 == 0 else (m, p)
        answers.append(first if first is not None else second)
    assert all(a is not None for a in answers)
    rigged = [dataclasses.replace(s, answer=a) for s, a in zip(samples, answers)]
    scores = masked_answer_scores(model, rigged, trajs, batch_size=4)
    assert scores["unmasked"] == [float(a == p) for a, p in zip(answers, plain)]
    assert scores["masked_image"] == [float(a == m) for a, m in zip(answers, masked)]
    # non-zero under both masks, and the mask changes some row's answer
    assert 0 < sum(scores["unmasked"]) and 0 < sum(scores["masked_image"])
    assert scores["unmasked"] != scores["masked_image"]
    metrics = evaluate_masked_answer(model, rigged, trajs, batch_size=4)
    drop = metrics[f"{TASK}/exact_match_unmasked"] - metrics[f"{TASK}/exact_match_masked_image"]
    assert metrics[f"{TASK}/exact_match_unmasked"] == sum(scores["unmasked"]) / 6
    assert metrics[f"{TASK}/masked_drop"] == drop


def _digits_config(tmp_path, **evaluation):
    return validate_config(
        {
            "run": {"output_dir": str(tmp_path / "run"), "device": "cpu"},
            "data": {"tasks": [TASK], "val_size": 6, "test_size": 0, "seed": 3},
            "rollout": {"batch_size": 4},
            "evaluation": {"split": "val", **evaluation},
        }
    )


def _decodes(model, samples):
    """{sample id: (unmasked answer, masked answer)} decoded here after each sample's own
    serialisation (its reference drawn image), cut after the image."""
    n_visual = model.codec.grid[0] * model.codec.grid[1]
    out = {}
    for s in samples:
        traj = serialize(s, model.tokenizer, encode_image=model.codec.encode)
        prefix, first = cut_after_drawn_image(traj, model.special_ids.vision_end)
        out[s.id] = tuple(_greedy_answer(model, prefix, first, n_visual, m) for m in (0, 1))
    return out


def test_end_to_end_records_hold_the_probe_of_each_rollout(tmp_path, monkeypatch):
    """The probe runs inside the evaluation, on its rollouts: rollouts that draw each
    row's reference image (its own serialisation), and answers set to this test's own
    decodes (even rows unmasked, odd rows masked): every record's two scores are those
    decodes', and the summary metrics their means (non-zero, and different)."""
    model = tiny_model("vq", init=0.3)
    cfg = _digits_config(tmp_path)
    decodes = _decodes(model, eval_samples(cfg, model))
    rigged = {}
    for k, (sid, (p, m)) in enumerate(sorted(decodes.items())):
        first, second = (p, m) if k % 2 == 0 else (m, p)
        rigged[sid] = first if first is not None else second
    original = runner.indexed_eval_samples
    monkeypatch.setattr(
        runner,
        "indexed_eval_samples",
        lambda *a, **kw: [
            (k, dataclasses.replace(s, answer=rigged[s.id])) for k, s in original(*a, **kw)
        ],
    )

    def reference(model):
        def rollout(requests):
            out = []
            for r in requests:
                t = serialize(r.prompt, model.tokenizer, encode_image=model.codec.encode)
                state = {f.name: getattr(t, f.name) for f in dataclasses.fields(t)}
                out.append(RolloutTrajectory(**{**state, "finish_reason": "eos"}))
            return out

        return rollout

    summary = evaluate(cfg, model, tmp_path / "eval", rollout=reference)
    records = [json.loads(line) for line in (tmp_path / "eval" / "results.jsonl").open()]
    assert len(records) == 6
    unmasked, masked = [], []
    for r in records:
        p, m = decodes[r["id"]]
        want = {
            "unmasked": float(rigged[r["id"]] == p),
            "masked_image": float(rigged[r["id"]] == m),
        }
        assert r["masked"] == want
        unmasked.append(want["unmasked"])
        masked.append(want["masked_image"])
    assert 0 < sum(unmasked) and 0 < sum(masked) and unmasked != masked
    stats = summary["tasks"][TASK]
    assert stats["exact_match_unmasked"] == sum(unmasked) / 6
    assert stats["exact_match_masked_image"] == sum(masked) / 6


def test_the_evaluation_rollouts_give_the_same_metrics(tmp_path):
    """The per-batch probe of the records (4 rows a batch) equals the probe of all the
    evaluation's rollouts at once."""
    model = tiny_model("vq")
    cfg = _digits_config(tmp_path)
    summary = evaluate(cfg, model, tmp_path / "eval")
    samples = eval_samples(cfg, model)
    grid = tuple(model.codec.grid)
    requests = [make_request(cfg, s, k, 0, grid) for k, s in enumerate(samples)]
    trajs = engine_rollout(model)(requests)
    alone = evaluate_masked_answer(model, samples, trajs)
    assert alone == {f"{TASK}/{k}": v for k, v in masked_metrics_of(summary).items()}
    with pytest.raises(ValueError, match="5 trajectories for 6 samples"):
        evaluate_masked_answer(model, samples, trajs[:5])


def masked_metrics_of(summary):
    keys = ("exact_match_unmasked", "exact_match_masked_image", "masked_drop")
    return {k: summary["tasks"][TASK][k] for k in keys}
