"""`uniweave models write-full-shape`: the hub's file layout, the published sizes' key set at
tiny widths (`--shape small`), the loaders reading exactly that layout, and `uniweave
inspect` / `uniweave plan` accepting the directory.

The hub lists below are written from knowledge of the two repositories (no copy is
reachable from here); `NOT_WRITTEN` names each hub file the writer leaves out and why.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from uniweave import cli
from uniweave.models.full_shape import write_full_shape
from uniweave.models.hub_layout import INDEX, iter_hub_files, meta_state_shapes
from uniweave.models.janus_pro.full_shape import (
    JANUS_IDS,
    JANUS_TOKENS,
    janus_config,
    janus_tokenizer,
)
from uniweave.models.uniar.full_shape import QWEN_ADDED, QWEN_BASE

pytestmark = pytest.mark.usefixtures("one_thread")

SHARD = re.compile(r"model-(\d{5})-of-(\d{5})\.safetensors")
HUB_FILES = {
    "deepseek-community/Janus-Pro-1B": {
        "config.json", "generation_config.json", "preprocessor_config.json",
        "processor_config.json", "special_tokens_map.json", "tokenizer.json",
        "tokenizer_config.json", "chat_template.jinja",
    },
    "Qwen/Qwen3-VL-2B-Instruct": {
        "config.json", "generation_config.json", "preprocessor_config.json",
        "tokenizer.json", "tokenizer_config.json", "chat_template.json", "merges.txt",
        "vocab.json", "video_preprocessor_config.json",
    },
}  # fmt: skip
NOT_WRITTEN = {
    # uniweave renders its own chat templates (janus_pro.template, uniar.template)
    "chat_template.jinja",
    "chat_template.json",
    # the BPE's slow-tokenizer files: the writer's tokenizer is WordLevel (no merges)
    "merges.txt",
    "vocab.json",
    # video input is not built in uniweave
    "video_preprocessor_config.json",
}
CONFIG_KEYS = {
    "deepseek-community/Janus-Pro-1B": {
        "": {"architectures", "model_type", "image_token_id", "text_config",
             "vision_config", "vq_config"},
        "text_config": {"hidden_size", "intermediate_size", "num_hidden_layers",
                        "num_attention_heads", "num_key_value_heads", "vocab_size",
                        "max_position_embeddings", "rms_norm_eps", "bos_token_id",
                        "eos_token_id", "pad_token_id", "model_type"},
        "vision_config": {"hidden_size", "num_hidden_layers", "num_attention_heads",
                          "image_size", "patch_size", "num_image_tokens", "projection_dim"},
        "vq_config": {"num_embeddings", "embed_dim", "num_patches", "channel_multiplier",
                      "projection_dim", "image_token_embed_dim"},
    },
    "Qwen/Qwen3-VL-2B-Instruct": {
        "": {"architectures", "model_type", "image_token_id", "video_token_id",
             "vision_start_token_id", "vision_end_token_id", "text_config", "vision_config",
             "tie_word_embeddings"},
        "text_config": {"hidden_size", "intermediate_size", "num_hidden_layers",
                        "num_attention_heads", "num_key_value_heads", "head_dim",
                        "vocab_size", "max_position_embeddings", "rms_norm_eps"},
        "vision_config": {"depth", "hidden_size", "intermediate_size", "num_heads",
                          "patch_size", "spatial_merge_size", "temporal_patch_size",
                          "out_hidden_size", "deepstack_visual_indexes",
                          "num_position_embeddings"},
    },
}  # fmt: skip
REPO = {
    "janus-pro-1b": "deepseek-community/Janus-Pro-1B",
    "qwen3-vl-2b": "Qwen/Qwen3-VL-2B-Instruct",
}
RECIPE = {
    "janus-pro-1b": "recipes/janus_pro/grpo_t2i_pickscore_lora.yaml",
    "qwen3-vl-2b": "recipes/uniar/grpo_lora.yaml",
}


@pytest.fixture(scope="module", params=["janus-pro-1b", "qwen3-vl-2b"])
def small(request, tmp_path_factory) -> tuple[str, Path]:
    out = tmp_path_factory.mktemp(request.param) / "model"
    write_full_shape(request.param, out, "small")
    return request.param, out


def _layers(names) -> set[str]:
    """Key names with layer indices collapsed: the key set modulo depth."""
    return {re.sub(r"\.\d+\.", ".N.", n) for n in names}


def test_layout_matches_the_hub_repository(small):
    name, out = small
    files = set(iter_hub_files(out))
    expected = HUB_FILES[REPO[name]] - NOT_WRITTEN
    assert expected <= files, f"missing {sorted(expected - files)}"
    shards = sorted(f for f in files if SHARD.fullmatch(f))
    assert len(shards) >= 2  # sharded, as the index says
    assert all(SHARD.fullmatch(f).group(2) == f"{len(shards):05d}" for f in shards)
    assert [int(SHARD.fullmatch(f).group(1)) for f in shards] == list(range(1, len(shards) + 1))
    assert "model.safetensors" not in files
    index = json.loads((out / INDEX).read_text())
    assert set(index["weight_map"].values()) == set(shards)
    stored = {}
    for shard in shards:
        part = load_file(str(out / shard))
        assert all(t.dtype == torch.bfloat16 for t in part.values())
        assert {k for k, v in index["weight_map"].items() if v == shard} == set(part)
        stored.update(part)
    assert index["metadata"]["total_size"] == sum(t.numel() * 2 for t in stored.values())
    config = json.loads((out / "config.json").read_text())
    for section, keys in CONFIG_KEYS[REPO[name]].items():
        have = set(config[section] if section else config)
        assert keys <= have, f"config.json {section or 'top level'} lacks {sorted(keys - have)}"


def test_small_shape_has_the_full_shape_key_set(small):
    """The full shape's keys come from its config built on the meta device (no weights)."""
    name, out = small
    keys = json.loads((out / INDEX).read_text())["weight_map"]
    if name == "janus-pro-1b":
        from transformers import JanusForConditionalGeneration

        config = janus_config(name, False, janus_tokenizer(True))
        full = meta_state_shapes(lambda: JanusForConditionalGeneration(config))
        assert full["model.language_model.embed_tokens.weight"] == (102400, 2048)
        assert full["model.generation_head.vision_head.weight"] == (16384, 2048)
    else:
        from transformers import Qwen3VLForConditionalGeneration

        from uniweave.models.uniar.full_shape import codec, qwen_config, qwen_tokenizer
        from uniweave.models.uniar.model import UniARModel

        tok = qwen_tokenizer(True)  # the small tokenizer: only the shapes differ
        config = qwen_config(False, tok)
        bsq = codec(True, 0)
        full = meta_state_shapes(
            lambda: UniARModel(Qwen3VLForConditionalGeneration(config), tok, None, bsq)
        )
        assert full["model.language_model.embed_tokens.weight"][1] == 2048
        assert "lm_head.weight" not in full  # tied, stored once as the embedding
    # deepstack mergers are numbered by position, not by depth: compare modulo numbering
    assert _layers(full) == _layers(keys)


def test_the_loaders_read_the_layout_exactly(small):
    name, out = small
    index = json.loads((out / INDEX).read_text())["weight_map"]
    key = "model.language_model.embed_tokens.weight"
    stored = load_file(str(out / index[key]))[key].float()
    if name == "janus-pro-1b":
        from transformers import JanusForConditionalGeneration

        from uniweave.models.janus_pro.loading import load_parts

        _, info = JanusForConditionalGeneration.from_pretrained(str(out), output_loading_info=True)
        assert not any(info.values()), info  # no missing / unexpected / mismatched key
        model, tokenizer, _ = load_parts(out)
        loaded = model.model.language_model.embed_tokens.weight
    else:
        from uniweave.models.uniar.model import UniARModel

        model = UniARModel.from_pretrained(out)
        loaded = model.model.language_model.embed_tokens.weight
        assert model.lm_head.weight is loaded
    assert torch.equal(loaded.detach(), stored)  # bf16 -> fp32 is exact


def test_uniar_loader_refuses_a_missing_shard(tmp_path):
    out = tmp_path / "m"
    write_full_shape("qwen3-vl-2b", out, "small")
    last = sorted(set(json.loads((out / INDEX).read_text())["weight_map"].values()))[-1]
    (out / last).unlink()
    from uniweave.models.uniar.model import UniARModel

    with pytest.raises(ValueError, match=f"names shard {last}, which is missing"):
        UniARModel.from_pretrained(out)


def test_inspect_and_plan_accept_the_directory(small, capsys):
    name, out = small
    overrides = [f"model.path={out}"]
    assert cli.main(["inspect", RECIPE[name], *overrides]) == 0
    assert cli.main(["plan", RECIPE[name], *overrides]) == 0
    text = capsys.readouterr().out
    assert f"model {out}:" in text and "fits" in text


def test_full_shape_tokenizers_have_the_real_ids_and_sizes():
    tok = janus_tokenizer(False)
    assert len(tok) == JANUS_TOKENS
    assert {t: tok.convert_tokens_to_ids(t) for t in JANUS_IDS} == JANUS_IDS
    from uniweave.models.uniar.full_shape import qwen_tokenizer

    qwen = qwen_tokenizer(False)
    added = {t: qwen.convert_tokens_to_ids(t) for t in QWEN_ADDED}
    assert added == {t: QWEN_BASE + k for k, t in enumerate(QWEN_ADDED)}
    # UniAR's <image_gen> and <pad> follow, inside Qwen3-VL's 151,936 embedding rows
    assert len(qwen) == QWEN_BASE + len(QWEN_ADDED) + 2 <= 151936


def test_writer_refuses_a_non_empty_directory_before_writing(tmp_path):
    (tmp_path / "x").write_text("")
    with pytest.raises(ValueError, match="not an empty directory"):
        write_full_shape("janus-pro-1b", tmp_path, "small")
    assert cli.main(["models", "write-full-shape", "janus-pro-1b", str(tmp_path)]) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x"]


def test_cli_names_the_writer_list_and_refuses_unknown_names(tmp_path, capsys):
    """The parser does not import `uniweave.models` (so `--help` and `inspect` stay light):
    its help spells the names out, which must be the writer's list, and an unknown name or
    shape is refused by the writer with a one-line error listing the known ones."""
    from uniweave.models.full_shape import NAMES, SHAPES

    assert cli.main(["models", "write-full-shape", "--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert " | ".join(NAMES) in out
    out_dir = tmp_path / "x"
    assert cli.main(["models", "write-full-shape", "janus-pro-3b", str(out_dir)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and all(n in err for n in NAMES), err
    assert (
        cli.main(["models", "write-full-shape", "janus-pro-1b", str(out_dir), "--shape", "x"]) == 2
    )
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and all(s in err for s in SHAPES), err
    assert not out_dir.exists()
