"""Tiny unified model: mixed-task forward, heads at scored positions only, KV-cache parity,
bitwise save/load."""

from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file
from tolerances import assert_within, reduction_bound, tiny_decoder_reductions

from uniweave.codecs import load_codec
from uniweave.core.trajectory import TrajectoryBatch
from uniweave.core.types import Modality
from uniweave.data.digits import make_task_samples
from uniweave.data.digits_images import load_split
from uniweave.data.template import serialize
from uniweave.data.tokenizer import SpecialIds, build_tokenizer
from uniweave.forward import forward_interleaved, scored_indices
from uniweave.models import load_model
from uniweave.models.base import image_positions
from uniweave.models.tiny import TinyArchitecture, TinyUnifiedModel
from uniweave.train.state import checkpoint as ckpt

TASKS = ("t2i", "i2t_mc", "jigsaw_mc", "draw_then_answer")


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


@pytest.fixture(scope="module")
def codecs(vq32_codec, small_bsq_dir):
    return {"vq": vq32_codec, "bsq": load_codec(small_bsq_dir)}


def _model(kind, tokenizer, codecs, init=0.02):
    torch.manual_seed(0)
    cfg = TinyArchitecture(
        visual_head=kind,
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        intermediate_size=128,
        initializer_range=init,
    )
    return TinyUnifiedModel(cfg, tokenizer, codecs[kind]).eval()


def _mixed_batch(tokenizer, codec):
    samples = [s for task in TASKS for s in make_task_samples(task, "val", 2, seed=1)]
    trajs = [serialize(s, tokenizer, encode_image=codec.encode) for s in samples]
    return TrajectoryBatch.collate(trajs, SpecialIds.from_tokenizer(tokenizer).pad)


@pytest.mark.parametrize("kind", ["vq", "bsq"])
def test_forward_applies_heads_only_at_scored_positions(kind, tokenizer, codecs):
    model = _model(kind, tokenizer, codecs)
    batch = _mixed_batch(tokenizer, codecs[kind])
    seen = {}

    def record(name):
        def hook(module, inputs, output):
            seen[name] = tuple(inputs[0].shape)

        return hook

    model.text_head.register_forward_hook(record("text"))
    model.visual_head_proj.register_forward_hook(record("visual"))
    out = forward_interleaved(model, batch)
    text_idx, visual_idx = scored_indices(batch)
    n_scored = int(batch.policy_mask[:, 1:].sum())
    assert len(text_idx) + len(visual_idx) == n_scored
    assert seen["text"] == (len(text_idx), 64) and seen["visual"] == (len(visual_idx), 64)
    assert len(text_idx) < batch.token_ids.numel() and len(visual_idx) > 0
    assert out.text_logits.shape == (len(text_idx), len(tokenizer))
    assert out.visual_logits.shape == (len(visual_idx), model.n_visual_outputs)
    loss = out.text_logits.logsumexp(-1).mean() + out.visual_logits.square().mean()
    loss.backward()
    assert model.visual_embed.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("kind", ["vq", "bsq"])
def test_kv_cached_decoding_matches_full_forward(kind, tokenizer, codecs):
    model = _model(kind, tokenizer, codecs, init=0.1)  # logit std ~0.8: not uniform
    batch = _mixed_batch(tokenizer, codecs[kind])
    with torch.no_grad():
        inputs = model.prepare(batch)
        embeds = model.embed(inputs)
        full = model.body(embeds, batch.attention_mask, inputs.position_ids).hidden
        cache = model.new_cache()
        split = 5
        steps = [
            model.body(
                embeds[:, :split],
                batch.attention_mask[:, :split],
                inputs.position_ids[:, :split],
                cache,
            )
        ]
        for t in range(split, batch.token_ids.shape[1]):
            steps.append(
                model.body(
                    embeds[:, t : t + 1],
                    batch.attention_mask[:, : t + 1],
                    inputs.position_ids[:, t : t + 1],
                    steps[-1].cache,
                )
            )
        incremental = torch.cat([s.hidden for s in steps], dim=1)
    mask = batch.attention_mask
    text_full = model.text_logits(full[mask])
    text_inc = model.text_logits(incremental[mask])
    vis_full = model.visual_logits(full[mask])
    vis_inc = model.visual_logits(incremental[mask])
    # cached decoding vs the full forward: two fp32 paths through the decoder and a head
    n = tiny_decoder_reductions(model.config, batch.token_ids.shape[1])
    for full_z, inc_z, what in ((text_full, text_inc, "text"), (vis_full, vis_inc, "visual")):
        tol = reduction_bound(float(full_z.abs().max()), n)
        assert_within((full_z - inc_z).abs(), tol, what)


@pytest.mark.parametrize("kind", ["vq", "bsq"])
def test_save_and_load_round_trip_bitwise(kind, tokenizer, codecs, tmp_path):
    model = _model(kind, tokenizer, codecs)
    model.save_pretrained(tmp_path / "m")
    loaded = load_model(tmp_path / "m")
    a, b = model.state_dict(), loaded.state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    batch = _mixed_batch(tokenizer, codecs[kind])
    with torch.no_grad():
        assert torch.equal(
            forward_interleaved(model, batch).text_logits,
            forward_interleaved(loaded.eval(), batch).text_logits,
        )
    pixels = load_split("test").images[:4]
    assert torch.equal(model.codec.encode(pixels), loaded.codec.encode(pixels))


def test_default_size_and_head_mismatch(tokenizer, codecs):
    model = TinyUnifiedModel(TinyArchitecture(visual_head="vq"), tokenizer, codecs["vq"])
    n = sum(p.numel() for p in model.parameters())
    assert 1_000_000 <= n <= 3_000_000, n
    with pytest.raises(ValueError, match="needs a bsq codec"):
        TinyUnifiedModel(TinyArchitecture(visual_head="bsq"), tokenizer, codecs["vq"])


def test_incomplete_model_directory_is_named(tmp_path):
    (tmp_path / "m").mkdir()
    with pytest.raises(FileNotFoundError, match="missing uniweave_model.json"):
        load_model(tmp_path / "m")


def test_image_positions_count_within_each_image():
    T, V = int(Modality.TEXT), int(Modality.VISUAL)
    modality = torch.tensor([[T, V, V, V, T, T, V, V, T], [V, V, T, V, V, V, V, T, T]])
    expected = torch.tensor([[0, 0, 1, 2, 0, 0, 0, 1, 0], [0, 1, 0, 0, 1, 2, 3, 0, 0]])
    assert torch.equal(image_positions(modality), expected)


@pytest.mark.parametrize("kind", ["vq", "bsq"])
def test_visual_embedding_depends_on_the_image_position(kind, tokenizer, codecs):
    model = _model(kind, tokenizer, codecs, init=0.1)
    batch = _mixed_batch(tokenizer, codecs[kind])
    with torch.no_grad():
        model.visual_position.normal_()
        inputs = model.prepare(batch)
        full = model.embed(inputs)
        where = image_positions(batch.modality)
        one_by_one = torch.cat(
            [
                model.embed(
                    replace(
                        inputs,
                        token_ids=batch.token_ids[:, t : t + 1],
                        modality=batch.modality[:, t : t + 1],
                        visual_codes=batch.visual_codes[:, t : t + 1],
                        image_position=where[:, t : t + 1],
                    )
                )
                for t in range(batch.token_ids.shape[1])
            ],
            dim=1,
        )
        shifted = model.embed(replace(inputs, image_position=(where + 1) % 16))
    # the per-position patch map (a reduction over the code's features) on one column or
    # on all: two fp32 GEMM shapes, at the embeddings' scale
    tol = reduction_bound(float(full.abs().max()), model.code_features.shape[-1] + 1)
    assert_within((full - one_by_one).abs(), tol, "embedding")
    visual = batch.modality == 1
    assert visual.any() and (shifted[visual] - full[visual]).abs().amax(-1).min() > 1e-3


def test_tied_embeddings_share_one_matrix(tokenizer, codecs, tmp_path):
    """tie_embeddings: text logits are h @ E^T with E the input embedding; the shared
    matrix's gradient is the sum of the untied model's two gradients when both start from
    the same values; save/load and a checkpoint keep the tie."""
    untied = _model("vq", tokenizer, codecs)
    torch.manual_seed(0)
    tied_config = untied.config.model_copy(update={"tie_embeddings": True})
    tied = TinyUnifiedModel(tied_config, tokenizer, codecs["vq"])
    tied.load_state_dict(
        {**untied.state_dict(), "text_head.weight": untied.decoder.embed_tokens.weight}
    )
    E = tied.decoder.embed_tokens.weight
    assert tied.text_head.weight is E
    h = torch.randn(5, untied.config.hidden_size)
    torch.testing.assert_close(tied.text_logits(h), h @ E.T, rtol=0, atol=0)
    with torch.no_grad():
        untied.text_head.weight.copy_(untied.decoder.embed_tokens.weight)
    batch = _mixed_batch(tokenizer, codecs["vq"])
    for model in (tied, untied):
        forward_interleaved(model, batch).text_logits.logsumexp(-1).sum().backward()
    expected = untied.decoder.embed_tokens.weight.grad + untied.text_head.weight.grad
    # the same forward kernels on the same weights and shapes; autograd adds the two
    # gradients of the shared matrix once (a + b == b + a in floating point): exact
    assert torch.equal(E.grad, expected)
    tied.save_pretrained(tmp_path / "m")
    loaded = load_model(tmp_path / "m")
    assert loaded.text_head.weight is loaded.decoder.embed_tokens.weight
    assert torch.equal(loaded.text_head.weight, E)
    saved = ckpt.commit_checkpoint(tmp_path / "run", 1, tied.state_dict(), {}, {"step": 1}, 1)
    state = load_file(str(saved / ckpt.MODEL))
    assert torch.equal(state["text_head.weight"], E) and torch.equal(
        state["decoder.embed_tokens.weight"], E
    )
