"""Janus-Pro image -> text GRPO with full fine-tuning and a reference penalty.

Regression for the latent bug of the per-model image store: the frozen reference is a
deep copy of the policy taken before any rollout, so with images kept inside the model it
saw none. Now the pixels travel with the trajectories, and one update's loss, penalty sum
and gradient equal an independent computation: transformers' own
`JanusForConditionalGeneration.forward` (its image merging from `pixel_values`, full
text logits) for the policy and for the frozen reference, with the k3 estimator or the
full-distribution JSD written out here (docs/numerics.md §7).
"""

from __future__ import annotations

import pytest
import torch
from tolerances import (
    assert_within,
    decoder_reductions,
    gradient_reductions,
    logprob_bound,
    magnitude,
    reduction_bound,
)

from uniweave.codecs.base import single_thread
from uniweave.config import validate_config
from uniweave.core.trajectory import TrajectoryBatch
from uniweave.data.digits import vocabulary_texts
from uniweave.models.build import build_model
from uniweave.models.janus_pro.tiny import TinyJanusSpec, write_tiny_checkpoint
from uniweave.train.distributed.comm import DistInfo
from uniweave.train.methods.grpo.job import build_grpo_job
from uniweave.train.methods.grpo.objective import scored_mask

COEF = 0.5


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    with single_thread():
        yield


def _job(root, kl: str):
    ckpt = write_tiny_checkpoint(root / "ckpt", TinyJanusSpec(grid=2), vocabulary_texts())
    cfg = validate_config(
        {
            "run": {"name": "j", "seed": 0, "output_dir": str(root / "run"), "device": "cpu"},
            "model": {"kind": "janus_pro", "path": str(ckpt)},
            "data": {"tasks": ["i2t_mc"], "train_size": 8, "val_size": 0, "test_size": 0},
            "rollout": {"batch_size": 16, "max_new_tokens": 3},
            "reward": {"plugins": [{"name": "mc_exact"}], "truncated_reward": "keep"},
            "algorithm": {
                "name": "grpo",
                "group_size": 4,
                "scope": "group",
                "old_logp_source": "replay",
                "kl": {"type": kl, "coef": COEF},
            },
            "trainer": {"total_updates": 1, "global_batch_size": 8, "micro_batch_size": 8},
            "checkpoint": {"every_updates": 0},
            "logging": {"tensorboard": False, "progress_bar": False},
        }
    )
    model = build_model(cfg).train()
    source, objective = build_grpo_job(cfg, model, root / "run", DistInfo())
    return model, source, objective


def _janus_reductions(model, keys: int) -> int:
    """tests/tolerances.py's N for a text log-prob of a tiny Janus-Pro over `keys` keys
    (as tests/test_janus_pro.py: the final norm and a head of width hidden, bounded by the
    generation head's 3 x hidden)."""
    c = model.model.language_model.config
    d = c.hidden_size
    return decoder_reductions(
        d, c.intermediate_size, c.num_hidden_layers, keys, d // c.num_attention_heads, head=3 * d
    )


def _pixel_values(model, batch: TrajectoryBatch) -> torch.Tensor:
    """Normalised [n, 3, S, S] pixels of every input image, row-major (what transformers'
    Janus processor hands the model), from the image processor's mean and std."""
    proc = model.image_processor
    mean = torch.tensor(proc.image_mean).view(3, 1, 1)
    std = torch.tensor(proc.image_std).view(3, 1, 1)
    images = [img for row in batch.images for img in row]
    return torch.stack([(img.permute(2, 0, 1) - mean) / std for img in images])


def _full_logp(hf, batch: TrajectoryBatch, pixel_values: torch.Tensor) -> torch.Tensor:
    """log-softmax of transformers' text logits, float64, predicting positions 1..T-1."""
    out = hf(
        input_ids=batch.token_ids,
        attention_mask=batch.attention_mask.long(),
        pixel_values=pixel_values,
    )
    return torch.log_softmax(out.logits[:, :-1].double(), -1)


@pytest.mark.parametrize("kl", ["k3", "jsd"])
def test_full_finetuning_i2t_update_with_reference_matches_transformers(tmp_path, kl):
    model, source, objective = _job(tmp_path, kl)
    assert objective.reference is not None and not objective.reference.lora
    trajs = source.global_batch(0)
    assert all(len(t.images) == 1 for t in trajs)  # the prompts' digit images travel along
    batch = TrajectoryBatch.collate(trajs, model.special_ids.pad)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():  # move the policy away from the frozen initial reference
        for p in model.parameters():
            if p.requires_grad:
                p.add_(0.02 * torch.randn(p.shape, generator=gen))
    n = objective.count(batch)
    model.zero_grad()
    loss, stats = objective.loss(model, batch, n)
    loss.backward()
    got = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}

    model.zero_grad()
    pixels = _pixel_values(model, batch)
    policy = _full_logp(model._hf, batch, pixels)
    with torch.no_grad():
        ref = _full_logp(objective.reference.frozen._hf, batch, pixels)
    mask = scored_mask(batch)[:, 1:]
    targets = batch.token_ids[:, 1:]
    logp = policy.gather(-1, targets[..., None])[..., 0][mask]
    ref_logp = ref.gather(-1, targets[..., None])[..., 0][mask]
    adv = batch.advantages.double()[:, None].expand_as(mask)[mask]
    pg = (-adv * torch.exp(logp - logp.detach())).sum() / n  # ratio 1 (replay anchor)
    if kl == "k3":
        delta = ref_logp - logp
        penalty = torch.exp(delta) - delta - 1.0
    else:
        p, q = policy[mask].exp(), ref[mask].exp()
        m = 0.5 * (p + q)
        penalty = 0.5 * (p * (p.log() - m.log())).sum(-1) + 0.5 * (q * (q.log() - m.log())).sum(-1)
    expected = pg + COEF * penalty.sum() / n
    expected.backward()

    assert n == int(mask.sum()) > 8 and float(penalty.sum().detach()) > 1e-4
    # float32 forwards (the objective's, transformers' own): the policy-gradient term is
    # -A exp(0) on both sides; the penalty's slope in each side's log-probs is <= 1 (k3:
    # |1 - e^d| for the small d here; the JSD: probability-weighted log-ratios), so the
    # loss moves by COEF x 2 log-prob errors (tests/tolerances.py), plus the float32 sums
    n_red = _janus_reductions(model, batch.token_ids.shape[1])
    tol = COEF * 2 * logprob_bound(policy, n_red)
    tol += reduction_bound(float(expected.detach()), n + policy.shape[-1])
    assert_within(abs(float(loss.detach()) - float(expected.detach())), tol, "loss")
    assert stats["kl_sum"] == pytest.approx(float(penalty.sum().detach()), rel=1e-4)
    assert any(g.abs().max() > 1e-4 for g in got.values())
    for name, param in model.named_parameters():
        mine = got.get(name, torch.zeros_like(param)).double()
        theirs = torch.zeros_like(mine) if param.grad is None else param.grad.double()
        tol = reduction_bound(magnitude(theirs), gradient_reductions(n_red, n))
        assert_within((mine - theirs).abs(), tol, name)
