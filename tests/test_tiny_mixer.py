"""The tiny model's sequence-mixing prior: the formula against torch's grouped conv1d,
padding invariance, cached decoding with row compaction, and the off switch."""

import pytest
import torch
from tolerances import assert_within, reduction_bound, tiny_decoder_reductions

from uniweave.core.trajectory import TrajectoryBatch
from uniweave.data.digits import make_task_samples
from uniweave.data.template import serialize
from uniweave.data.tokenizer import SpecialIds, build_tokenizer
from uniweave.models.base import ModelInputs, image_positions
from uniweave.models.tiny import TinyArchitecture, TinyUnifiedModel
from uniweave.models.tiny.mixer import CausalMixer, MixCache, MixContext


@pytest.fixture(scope="module")
def setup(vq32_codec):
    tokenizer = build_tokenizer()
    codec = vq32_codec
    samples = [
        s for t in ("i2t_mc", "t2i", "draw_then_answer") for s in make_task_samples(t, "val", 2)
    ]
    trajs = [serialize(s, tokenizer, encode_image=codec.encode) for s in samples]
    batch = TrajectoryBatch.collate(trajs, SpecialIds.from_tokenizer(tokenizer).pad)
    return tokenizer, codec, batch


def _model(tokenizer, codec, kernel=4):
    torch.manual_seed(0)
    cfg = TinyArchitecture(
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        intermediate_size=128,
        initializer_range=0.1,
        mixer_kernel=kernel,
    )
    model = TinyUnifiedModel(cfg, tokenizer, codec).eval()
    with torch.no_grad():  # mixers far from identity, so every check below bites
        for name, p in model.named_parameters():
            if name.endswith("mixer.weight"):
                p.normal_(0.0, 0.5)
    return model


def test_mixer_equals_grouped_causal_conv1d():
    torch.manual_seed(1)
    b, t, d, k = 3, 9, 8, 4
    mixer = CausalMixer(d, k, index=0, init_std=0.7)
    x = torch.randn(b, t, d)
    valid = torch.rand(b, t) > 0.3
    y = mixer(x, MixContext(valid=valid))
    xm = (x * valid[..., None]).transpose(1, 2)  # [B, d, T]
    kernel = mixer.weight.detach().flip(0).T.unsqueeze(1)  # [d, 1, k]: tap k-1 is lag 0
    conv = torch.nn.functional.conv1d(torch.nn.functional.pad(xm, (k - 1, 0)), kernel, groups=d)
    # k taps and the residual add, summed in another order by conv1d: two fp32 paths over
    # k + 1 terms, at the scale of the terms
    # (|x| + sum_j |w_j| |x|, Hoelder)
    scale = float(x.abs().max() * (1 + mixer.weight.detach().abs().sum(0).max()))
    assert_within((y - x - conv.transpose(1, 2)).abs(), reduction_bound(scale, k + 1), "conv")


def test_left_padding_does_not_leak_into_the_row(setup):
    tokenizer, codec, batch = setup
    model = _model(tokenizer, codec)
    n = int(batch.lengths[0])
    ids, mod, codes = batch.token_ids[:1, :n], batch.modality[:1, :n], batch.visual_codes[:1, :n]
    pad = 5
    ids_p = torch.cat([torch.full((1, pad), 7), ids], dim=1)
    mod_p = torch.cat([torch.zeros(1, pad, dtype=mod.dtype), mod], dim=1)
    codes_p = torch.cat([torch.zeros(1, pad, dtype=codes.dtype), codes], dim=1)
    mask_p = torch.arange(n + pad)[None] >= pad
    pos_p = (torch.arange(n + pad)[None] - pad).clamp(min=0)
    ones = torch.ones(1, n, dtype=torch.bool)
    plain_in = ModelInputs(ids, mod, codes, ones, torch.arange(n)[None], image_positions(mod), [[]])
    padded_in = ModelInputs(ids_p, mod_p, codes_p, mask_p, pos_p, image_positions(mod_p), [[]])
    with torch.no_grad():
        plain = model.hidden(plain_in)
        padded = model.hidden(padded_in)
    # the padded row runs other attention shapes (n + pad keys): two fp32 paths through the
    # decoder and its final norm, at the scale of the hidden states
    n_red = tiny_decoder_reductions(model.config, n + pad, head=model.config.hidden_size)
    tol = reduction_bound(float(plain.hidden.abs().max()), n_red)
    assert_within((plain.hidden[0] - padded.hidden[0, pad:]).abs(), tol, "left padding")


def test_cached_decoding_with_row_compaction_matches_full_forward(setup):
    tokenizer, codec, batch = setup
    model = _model(tokenizer, codec)
    keep = torch.tensor([4, 0, 2])
    with torch.no_grad():
        inputs = model.prepare(batch)
        embeds, position_ids = model.embed(inputs), inputs.position_ids
        full = model.body(embeds, batch.attention_mask, position_ids).hidden
        cache = model.new_cache()
        assert isinstance(cache, MixCache)
        split, cut = 4, 9
        mask = batch.attention_mask
        out = model.body(embeds[:, :split], mask[:, :split], position_ids[:, :split], cache)
        hidden = [out.hidden]
        rows = torch.arange(len(batch))
        for t in range(split, batch.token_ids.shape[1]):
            if t == cut:
                cache.batch_select_indices(keep)
                rows, hidden = keep, [h[keep] for h in hidden]
            step = model.body(
                embeds[rows, t : t + 1],
                mask[rows, : t + 1],
                position_ids[rows, t : t + 1],
                cache,
            )
            hidden.append(step.hidden)
        inc = torch.cat(hidden, dim=1)
    valid = mask[keep]
    # cached decoding vs the full forward: two fp32 paths through the decoder and its norm
    n_red = tiny_decoder_reductions(model.config, mask.shape[1], head=model.config.hidden_size)
    tol = reduction_bound(float(full.abs().max()), n_red)
    assert_within((full[keep][valid] - inc[valid]).abs(), tol, "row compaction")


def test_kernel_zero_turns_the_prior_off_and_the_prior_acts(setup):
    tokenizer, codec, batch = setup
    off, on = _model(tokenizer, codec, kernel=0), _model(tokenizer, codec, kernel=3)
    assert not any("mixer" in n for n, _ in off.named_parameters())
    assert sum("mixer" in n for n, _ in on.named_parameters()) == 4  # 2 layers x 2 mixers
    assert type(off.new_cache()) is not MixCache
    with pytest.raises(TypeError, match="MixCache"):
        on.body(
            torch.zeros(1, 1, 64),
            torch.ones(1, 1),
            torch.zeros(1, 1, dtype=torch.long),
            off.new_cache(),
        )
    with torch.no_grad():
        inputs = on.prepare(batch)
        embeds, position_ids = on.embed(inputs), inputs.position_ids
        a = on.body(embeds, batch.attention_mask, position_ids).hidden
        for name, p in on.named_parameters():
            if name.endswith("mixer.weight"):
                p.zero_()
        b = on.body(embeds, batch.attention_mask, position_ids).hidden
    assert (a - b).abs().max() > 1e-2
