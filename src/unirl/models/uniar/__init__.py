"""UniAR: transformers' Qwen3-VL with a BSQ bit head (DESIGN.md §4). Declared, not built
yet: a config naming kind "uniar" is refused with "not implemented yet"."""

from unirl.models.registry import declare_planned_model

declare_planned_model("uniar", visual_heads=("bsq",), planned="Qwen3-VL + BSQ bit head")
