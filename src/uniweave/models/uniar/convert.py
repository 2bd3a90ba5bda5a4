"""Make a UniAR directory from a local Qwen3-VL checkpoint and a BSQ codec (a digits
`BSQCodec` or a real-scale `BSQTokenizer` directory).

    python -m uniweave.models.uniar.convert QWEN3_VL_DIR CODEC_DIR OUT_DIR [--decoder-layers 4]

The Qwen3-VL weights, tokenizer and image processor are loaded with transformers' own
classes (a checkpoint asking for remote code, `auto_map`, is refused); UniAR's tokens
(`<image_gen>`, and `<pad>` when missing) are added to the tokenizer with the next free
ids (the embedding grows only if they do not fit in the existing rows); the bit embedding
and the visual decoder are initialised from `--seed`; `save_pretrained` then writes the
directory, recording the special ids and the codec geometry its loader checks.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch
from transformers import AutoTokenizer, Qwen2VLImageProcessorPil, Qwen3VLForConditionalGeneration

from uniweave.codecs import BSQ_KINDS, codec_config_file, load_codec
from uniweave.models.registry import read_json
from uniweave.models.uniar.model import UniARModel, UniARSpec
from uniweave.models.uniar.template import add_special_tokens


def from_qwen3_vl(
    qwen_dir: str | Path, codec_dir: str | Path, spec: UniARSpec | None = None, seed: int = 0
) -> UniARModel:
    """A UniAR model over the Qwen3-VL checkpoint `qwen_dir` writing with the BSQ codec in
    `codec_dir` (module docstring)."""
    qwen_dir = Path(qwen_dir)
    for name in ("config.json", "tokenizer_config.json", "preprocessor_config.json"):
        file = qwen_dir / name
        if file.is_file() and "auto_map" in read_json(file):
            raise ValueError(f"{file}: field auto_map asks for remote code; refused")
    config = read_json(qwen_dir / "config.json")
    if config.get("model_type") != "qwen3_vl":
        raise ValueError(
            f"{qwen_dir / 'config.json'}: field model_type is {config.get('model_type')!r}, "
            "not 'qwen3_vl'"
        )
    codec = load_codec(codec_dir)
    if codec.kind not in BSQ_KINDS:
        file = codec_config_file(codec_dir)
        raise ValueError(f"{file}: field kind is {codec.kind!r}, not one of {BSQ_KINDS}")
    tokenizer = AutoTokenizer.from_pretrained(str(qwen_dir), trust_remote_code=False)
    add_special_tokens(tokenizer)
    processor = Qwen2VLImageProcessorPil.from_pretrained(str(qwen_dir))
    hf = Qwen3VLForConditionalGeneration.from_pretrained(str(qwen_dir), dtype=torch.float32)
    text: Any = hf.config.text_config  # transformers types sub-configs as dict | config | None
    if len(tokenizer) > text.vocab_size:
        hf.resize_token_embeddings(len(tokenizer))
    torch.manual_seed(seed)
    return UniARModel(hf.eval(), tokenizer, processor, codec, spec).eval()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("qwen_dir")
    parser.add_argument("codec_dir")
    parser.add_argument("out_dir")
    parser.add_argument("--decoder-layers", type=int, default=4)
    parser.add_argument("--decoder-width", type=int, default=0, help="0 = the LM width")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    spec = UniARSpec(decoder_layers=args.decoder_layers, decoder_width=args.decoder_width)
    model = from_qwen3_vl(args.qwen_dir, args.codec_dir, spec, args.seed)
    model.save_pretrained(args.out_dir)
    print(f"wrote {args.out_dir}: {model.image_grid} grid, {model.n_visual_outputs} bits")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
