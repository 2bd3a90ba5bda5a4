"""Random checkpoints for `bench/gpu_check.sh` (not part of CI): a tiny CLIP scorer and
Janus-Pro / UniAR models at (near) real 1B-2B language-model shapes, random weights.

    python bench/gpu_assets.py clip DIR
    python bench/gpu_assets.py janus DIR      # near Janus-Pro-1B's language model
    python bench/gpu_assets.py uniar DIR      # near Qwen3-VL-2B's text model
    python bench/gpu_assets.py janus DIR --dry   # the same code at small widths (CPU)

Each prints one `asset ...` line with what it wrote and how it differs from the real model.
Weights are initialised on the GPU when there is one (faster), then saved (fp32).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]

# Janus-Pro-1B's language model (deepseek-ai/Janus-Pro-1B config.json, Llama):
# hidden 2048, 24 layers, 16 heads (MHA), MLP 5632, vocab 102400, 16384 VQ codes,
# 384 px images of 24 x 24 = 576 tokens.
JANUS_1B = dict(hidden=2048, layers=24, heads=16, mlp=5632, vocab=102_400, codes=16_384)
JANUS_DRY = dict(hidden=64, layers=2, heads=4, mlp=176, vocab=102_400, codes=16_384)
# Qwen3-VL-2B's text model: hidden 2048, 28 layers, 16 heads / 8 KV heads, head_dim 128,
# MLP 6144, vocab 151936.
QWEN3_VL_2B = dict(hidden=2048, layers=28, heads=16, kv_heads=8, mlp=6144, vocab=151_936)
UNIAR_DRY = dict(hidden=64, layers=2, heads=4, kv_heads=2, mlp=192, vocab=151_936)


def _init_device():
    """Build modules on the GPU when there is one (random init of ~1.6 B parameters)."""
    return torch.device("cuda") if torch.cuda.is_available() else contextlib.nullcontext()


def write_clip(path: Path, dry: bool = False) -> None:
    sys.path.insert(0, str(ROOT / "tests"))
    from model_fixtures import write_tiny_clip

    write_tiny_clip(path)
    print(f"asset clip: tiny random CLIPModel (width 16, 16 px) -> {path}")


def write_janus(path: Path, dry: bool = False) -> None:
    """`TinyJanusSpec` at Janus-Pro-1B's language-model sizes. The spec has no MLP width
    (it uses 2 x hidden = 4096); `tiny_config` is wrapped to set Janus-Pro-1B's 5632."""
    import uniweave.models.janus_pro.tiny as tiny

    dims = JANUS_DRY if dry else JANUS_1B
    spec = tiny.TinyJanusSpec(
        grid=24,
        patch=16,
        hidden_size=dims["hidden"],
        num_layers=dims["layers"],
        num_heads=dims["heads"],
        codebook_size=dims["codes"],
        vocab_size=dims["vocab"],
        max_position_embeddings=16_384,
        initializer_range=0.02,
    )
    base = tiny.tiny_config

    def config(spec, tokenizer):
        cfg = base(spec, tokenizer)
        cfg.text_config.intermediate_size = dims["mlp"]
        return cfg

    tiny.tiny_config = config
    try:
        with _init_device():
            tiny.write_tiny_checkpoint(path, spec, ["a red apple on a wooden table"])
    finally:
        tiny.tiny_config = base
    print(
        f"asset janus: hidden {spec.hidden_size}, {spec.num_layers} layers, {spec.num_heads} "
        f"heads, MLP {dims['mlp']}, vocab {spec.vocab_size}, VQ codebook "
        f"{spec.codebook_size}, {spec.grid}x{spec.grid} image tokens of {spec.patch} px; "
        "differs from Janus-Pro-1B: SigLIP tower 1 layer of width "
        f"{spec.hidden_size} (real 24 x 1024), VQ encoder/decoder 32 channels (real 128-512), aligner/gen-head as tiny.py builds "
        f"them -> {path}"
    )


def write_uniar(path: Path, dry: bool = False) -> None:
    """`build_tiny_uniar` at Qwen3-VL-2B's text sizes with a 384 px `BSQTokenizer`
    (16 px cells grouped 4 x 4 x 64 bits: a 6 x 6 grid, as recipes/uniar/grpo_lora.yaml)."""
    from uniweave.codecs import BSQTokenizer, BSQTokenizerConfig
    from uniweave.models.uniar import TinyUniARSizes, build_tiny_uniar

    dims = UNIAR_DRY if dry else QWEN3_VL_2B
    sizes = TinyUniARSizes(
        hidden_size=dims["hidden"],
        num_layers=dims["layers"],
        num_heads=dims["heads"],
        num_kv_heads=dims["kv_heads"],
        intermediate_size=dims["mlp"],
        max_position_embeddings=4096,
    )
    torch.manual_seed(0)
    codec = BSQTokenizer(
        BSQTokenizerConfig(image_size=384, patch_size=16, embed_dim=64, spatial_group=4)
    )
    with _init_device():
        model = build_tiny_uniar(codec, sizes)
    model.save_pretrained(path)
    vocab = model.config.text_config.vocab_size
    print(
        f"asset uniar: hidden {sizes.hidden_size}, {sizes.num_layers} layers, "
        f"{sizes.num_heads} heads / {sizes.num_kv_heads} KV, MLP {sizes.intermediate_size}, "
        f"grid {model.image_grid}, {model.n_visual_outputs} bits/position; differs from "
        f"Qwen3-VL-2B: vocab {vocab} (the digits tokenizer; real 151936), vision tower 1 "
        f"block of width 32 on 32 px images (real 24 x 1024), random BSQ codec -> {path}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=["clip", "janus", "uniar"])
    parser.add_argument("path", type=Path)
    parser.add_argument("--dry", action="store_true", help="same code at small widths (CPU)")
    args = parser.parse_args()
    t0 = time.perf_counter()
    write = {"clip": write_clip, "janus": write_janus, "uniar": write_uniar}[args.what]
    write(args.path, args.dry)
    print(f"asset {args.what}: written in {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
