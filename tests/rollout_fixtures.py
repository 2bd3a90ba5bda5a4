"""Shared builders for the rollout and replay tests (not collected: no test_ prefix).

Codecs are fitted once per process on a small train subset; models are tiny
(hidden 64, 2 layers). `scripted_model` performs weight surgery on a real tiny model so
that its greedy text output follows a bigram script (attention and MLP outputs zeroed,
so the last hidden state is the normalised embedding of the current token, and the text
head maps each scripted token to its successor).
"""

from __future__ import annotations

from functools import cache

import torch
from tolerances import factor_sum_bound, guidance_gain, logprob_bound, tiny_decoder_reductions

from uniweave.codecs import build_codec
from uniweave.core.sample import Sample, TextPart
from uniweave.core.seeding import seed_for
from uniweave.core.trajectory import TrajectoryBatch
from uniweave.core.types import Modality, Owner
from uniweave.data.digits import make_task_samples
from uniweave.data.digits_images import load_split
from uniweave.data.tokenizer import build_tokenizer
from uniweave.models.tiny import TinyArchitecture, TinyUnifiedModel
from uniweave.rollout import RolloutRequest, SamplingParams

TASKS = ("t2i", "i2t_mc", "jigsaw_mc", "draw_then_answer")


@cache
def tokenizer():
    return build_tokenizer()


@cache
def codec(kind: str):
    images = load_split("train").images[:200]
    if kind == "vq":
        return build_codec("vq", codebook_size=16, n_init=1, max_iter=5).fit(images)
    return build_codec("bsq", latent_dim=4, entropy_group=4, hidden=16, epochs=1).fit(images)


def tiny_model(
    kind: str, init: float = 0.1, seed: int = 0, max_positions: int = 512, mixer_kernel: int = 4
):
    torch.manual_seed(seed)
    config = TinyArchitecture(
        visual_head=kind,
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        intermediate_size=128,
        max_position_embeddings=max_positions,
        initializer_range=init,
        mixer_kernel=mixer_kernel,
    )
    return TinyUnifiedModel(config, tokenizer(), codec(kind)).eval()


def mixed_samples(n_per_task: int = 2, seed: int = 1) -> list[Sample]:
    """Samples of all four digits tasks, interleaved by task."""
    per_task = [make_task_samples(t, "val", n_per_task, seed=seed) for t in TASKS]
    return [s for group in zip(*per_task) for s in group]


def mixed_requests(
    samples: list[Sample],
    text: SamplingParams,
    image: SamplingParams,
    grid: tuple[int, int] = (4, 4),
) -> list[RolloutRequest]:
    """t2i samples become forced-image requests with `image`; the others use `text`."""
    out = []
    for k, s in enumerate(samples):
        seed = seed_for(7, 0, k, 0)
        if s.task == "t2i":
            out.append(RolloutRequest(s, seed, image, image_grid=grid))
        else:
            out.append(RolloutRequest(s, seed, text))
    return out


def token_id(text: str) -> int:
    return int(tokenizer().convert_tokens_to_ids(text))


def scripted_model(kind: str, script: list[tuple[str, str]], alpha: float = 60.0):
    """A tiny model whose greedy next text token after token a is b for (a, b) in script."""
    model = tiny_model(kind, init=0.02, seed=3)
    with torch.no_grad():
        for layer in model.decoder.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.text_head.weight.zero_()
        for a, b in script:
            e = model.decoder.embed_tokens.weight[token_id(a)]
            h = e / e.pow(2).mean().add(model.decoder.config.rms_norm_eps).sqrt()
            model.text_head.weight[token_id(b)] += alpha * h / h.pow(2).sum()
    return model


def text_sample(text: str = "draw the digit 3", sample_id: str = "scripted") -> Sample:
    return Sample(id=sample_id, parts=[TextPart(text, "user")])


def logp_bounds(model, traj, params: SamplingParams, n: int, factors: bool = False) -> torch.Tensor:
    """Per-position bounds (tests/tolerances.py) on a trajectory's rollout log-probs
    computed by two fp32 paths (KV cache or not, other batch shapes, replay) through
    reductions of total length `n` (`tiny_decoder_reductions` for the tiny model). A
    log-prob z_a - logsumexp(z) carries the logits' error, relative to their scale: the
    magnitude is the larger of the trajectory's largest |log-prob| and its largest
    |logit| / temperature of its modality's head at the states that score policy positions
    (one full forward; at init 0.5 logits reach ~10 where greedy log-probs are ~ -1). A
    visual position: x the guidance gain where the guided log-prob
    is recorded, and a BSQ one sums its bits' log-probs (`factor_sum_bound`; `factors`:
    the bound of each bit)."""
    batch = TrajectoryBatch.collate([traj], 0)
    policy = traj.owner == Owner.POLICY
    text_at = (policy & (traj.modality == Modality.TEXT)).nonzero()[:, 0] - 1
    vis_at = (policy & (traj.modality == Modality.VISUAL)).nonzero()[:, 0] - 1
    with torch.no_grad():  # each head at the states that score the policy's positions
        h = model.hidden(model.prepare(batch)).hidden[0]
        z_text = float(model.text_logits(h[text_at]).abs().max()) if len(text_at) else 0.0
        z_vis = float(model.visual_logits(h[vis_at]).abs().max()) if len(vis_at) else 0.0
    if not params.greedy:
        z_text /= params.temperature
        z_vis /= min(params.temperature, params.bit_temperature)
    top = float(traj.rollout_logp.abs().max())
    text = logprob_bound(max(z_text, top), n)
    visual = logprob_bound(max(z_vis, top), n)
    if params.guided and params.guidance_logprob == "guided":
        visual *= guidance_gain(params.guidance)
    if getattr(model, "visual_head", "vq") == "bsq" and not factors:
        visual = factor_sum_bound(visual, model.codec.bits_per_position, top)
    out = torch.full((len(traj),), text)
    out[traj.modality == Modality.VISUAL] = visual
    return out


def batch_logp_bounds(model, trajs, shape, factors: bool = False, n: int | None = None):
    """`logp_bounds` of each trajectory (its `SamplingRecord`'s params; `n` default: the
    tiny model's `tiny_decoder_reductions` over the longest row), right-padded to `shape`
    (a collated batch's [B, T]) with 0 (padding compares exactly)."""
    if n is None:
        n = tiny_decoder_reductions(model.config, shape[1])
    out = torch.zeros(shape)
    for k, t in enumerate(trajs):
        out[k, : len(t)] = logp_bounds(model, t, t.sampling.params, n, factors)
    return out
