"""`uniweave plan`: per-rank GPU memory of a training config, from a model built on the meta
device (no weight allocated), for DDP and FSDP2, full fine-tuning and LoRA.

Sizes come from `model.path`'s config.json (Janus-Pro: transformers' `JanusConfig`;
UniAR: `Qwen3VLConfig` + its `uniweave_model.json` record for the BSQ head) or from a
preset of the published architectures (`PRESETS`). Parameters are counted from the
meta-built module (sum of `numel`), never from a formula; LoRA adapters are r*(in + out)
per targeted Linear (peft's lora_A [r, in] + lora_B [out, r]). The accounting of every
other line is in docs/plan.md; `account` is the one place it is written down.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from uniweave.config.methods import get_key, method
from uniweave.models.uniar.full_shape import QWEN3_VL_2B_TEXT, QWEN3_VL_2B_VISION

GIB = 1024**3
# Measured step peak / `plan --host` peak under glibc's dynamic mmap threshold
# (`run.host_mmap_threshold: null`, the default): the lowest and highest ratio over the
# Janus-Pro-1B rows of docs/plan.md, "On the host" (bench/full_shape.py
# --host-mmap-threshold none). glibc keeps a step's freed temporaries resident, by an
# amount that depends on the order of frees, so the planner states the range it allows.
GLIBC_RETENTION = (1.05, 1.61)
DEFAULT_PROMPT_TOKENS = 256
KV_RESERVE = 64  # uniweave.rollout.decode_cache.RESERVE (tests/test_plan.py checks they agree)

# Published sizes (docs/plan.md names the source and what could not be verified).
PRESETS: dict[str, dict[str, Any]] = {
    "janus-pro-1b": {
        "kind": "janus_pro",
        "text": dict(hidden_size=2048, num_hidden_layers=24, num_attention_heads=16,
                     num_key_value_heads=16, intermediate_size=5632, vocab_size=102400,
                     max_position_embeddings=16384),
    },
    "janus-pro-7b": {
        "kind": "janus_pro",
        "text": dict(hidden_size=4096, num_hidden_layers=30, num_attention_heads=32,
                     num_key_value_heads=32, intermediate_size=11008, vocab_size=102400,
                     max_position_embeddings=16384),
    },
    "qwen3-vl-2b": {"kind": "uniar", "text": QWEN3_VL_2B_TEXT, "vision": QWEN3_VL_2B_VISION},
    "qwen3-vl-8b": {
        "kind": "uniar",
        "text": dict(hidden_size=4096, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, intermediate_size=12288,
                     vocab_size=151936, tie_word_embeddings=False),
        "vision": dict(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16,
                       out_hidden_size=4096, deepstack_visual_indexes=[8, 16, 24]),
    },
}  # fmt: skip
# UniAR's BSQ head on a preset: the BSQ tokenizer's defaults (384 px /16, k = 4, L = 64:
# 1,024 bits per position on a 6x6 grid) and `UniARSpec`'s 4-layer visual decoder.
UNIAR_PRESET_BITS, UNIAR_PRESET_GRID, UNIAR_PRESET_DECODER = 1024, (6, 6), (4, 0)


@dataclass
class Shapes:
    """What the accounting reads: the decoder's shapes and the module's parameter counts."""

    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    visual_outputs: int  # VQ codes (softmax) or BSQ bits (one logit each)
    image_tokens: int
    total_params: int  # every parameter of the module (sum of numel)
    trainable_params: int  # full fine-tuning: all but the frozen towers
    layer_params: int  # one decoder layer (FSDP2's unit)
    lora_params: int  # adapters of trainer.lora.target_modules (0 without LoRA)
    lora_targets: int = 0


def _janus_config(text: dict, hidden: int):
    from transformers import JanusConfig

    return JanusConfig(
        text_config={"model_type": "llama", **text},
        vision_config={"projection_dim": hidden},
        vq_config={"projection_dim": hidden, "image_token_embed_dim": hidden},
        # JanusConfig ties by default; Janus-Pro's output head is its own matrix (DeepSeek-LLM
        # does not tie; the full-shape writer's 1B checkpoint has 2,076,636,811 parameters)
        tie_word_embeddings=False,
    )


def _qwen_config(text: dict, vision: dict):
    from transformers import Qwen3VLConfig

    tie = text.get("tie_word_embeddings", False)
    return Qwen3VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=tie)


class _UniARModules:
    """The modules UniARModel owns (hf.model, hf.lm_head, bit_embed, visual_decoder)."""


def meta_module(kind: str, config: Any, uniar: tuple[int, int, int] | None = None):
    """The model's module tree on the meta device: (module, names of frozen submodules).
    Module names equal those of the uniweave model (LoRA regexes match alike)."""
    import torch
    from torch import nn

    with torch.device("meta"):
        if kind == "janus_pro":
            from transformers import JanusForConditionalGeneration

            janus = JanusForConditionalGeneration(config)
            root = nn.Module()
            root.model, root.lm_head = janus.model, janus.lm_head
            return root, ("model.vision_model.", "model.vqmodel.")
        from transformers import Qwen3VLForConditionalGeneration

        from uniweave.models.uniar.heads import BitEmbedding, VisualDecoder

        assert uniar is not None, "a UniAR module tree needs its head sizes (bits, layers, width)"
        bits, layers, width = uniar
        hf = Qwen3VLForConditionalGeneration(config)
        text = config.text_config
        d = int(text.hidden_size)
        root = nn.Module()
        root.model, root.lm_head = hf.model, hf.lm_head
        root.bit_embed = BitEmbedding(bits, 1, d)
        root.visual_decoder = VisualDecoder(d, width or d, layers, bits, float(text.rms_norm_eps))
        return root, ("model.visual.",)


def count(module, frozen: tuple[str, ...], lora: Any = None) -> dict[str, int]:
    """Parameter counts of a (meta) module: unique tensors, so tied weights count once."""
    from torch import nn

    seen: set[int] = set()
    total = trainable = 0
    for name, p in module.named_parameters(remove_duplicate=True):
        if id(p) in seen:
            continue
        seen.add(id(p))
        total += p.numel()
        if not name.startswith(frozen):
            trainable += p.numel()
    layer = 0
    for m in module.modules():
        if type(m).__name__.endswith("DecoderLayer"):
            layer = max(layer, sum(p.numel() for p in m.parameters()))
    adapters = targets = 0
    if lora is not None and lora.enabled:
        pattern = re.compile(lora.target_modules)
        for name, m in module.named_modules():
            if isinstance(m, nn.Linear) and pattern.fullmatch(name):
                adapters += lora.r * (m.in_features + m.out_features)
                targets += 1
    return {"total": total, "trainable": trainable, "layer": layer, "lora": adapters,
            "targets": targets}  # fmt: skip


def shapes_for(kind: str, config: Any, name: str, lora: Any, uniar=None, grid=None) -> Shapes:
    module, frozen = meta_module(kind, config, uniar)
    c = count(module, frozen, lora)
    t = config.text_config
    heads = int(t.num_attention_heads)
    head_dim = int(getattr(t, "head_dim", None) or int(t.hidden_size) // heads)
    if kind == "janus_pro":
        visual, image_tokens = (
            int(config.vq_config.num_embeddings),
            int(config.vq_config.num_patches) ** 2,
        )
    else:
        visual, image_tokens = uniar[0], grid[0] * grid[1]
    return Shapes(
        name=name,
        hidden=int(t.hidden_size),
        layers=int(t.num_hidden_layers),
        heads=heads,
        kv_heads=int(getattr(t, "num_key_value_heads", None) or heads),
        head_dim=head_dim,
        intermediate=int(t.intermediate_size),
        vocab=int(t.vocab_size),
        visual_outputs=visual,
        image_tokens=image_tokens,
        total_params=c["total"],
        trainable_params=c["trainable"],
        layer_params=c["layer"],
        lora_params=c["lora"],
        lora_targets=c["targets"],
    )


def preset_shapes(preset: str, lora: Any) -> Shapes:
    p = PRESETS[preset]
    if p["kind"] == "janus_pro":
        return shapes_for("janus_pro", _janus_config(p["text"], p["text"]["hidden_size"]),
                          preset, lora)  # fmt: skip
    bits, (layers, width) = UNIAR_PRESET_BITS, UNIAR_PRESET_DECODER
    return shapes_for("uniar", _qwen_config(p["text"], p["vision"]), preset, lora,
                      (bits, layers, width), UNIAR_PRESET_GRID)  # fmt: skip


def path_shapes(kind: str, path: str, lora: Any) -> Shapes:
    """Sizes from a model directory's config.json (and UniAR's uniweave_model.json)."""
    where = Path(path)
    if kind == "janus_pro":
        from transformers import JanusConfig

        from uniweave.models.janus_pro.loading import check_checkpoint

        check_checkpoint(where)
        return shapes_for("janus_pro", JanusConfig.from_pretrained(str(where)), str(where), lora)
    from transformers import Qwen3VLConfig

    from uniweave.models.uniar.loading import check_directory

    record = check_directory(where)
    spec = record.get("uniar") or {}
    bits = int(record["bits_per_position"])
    uniar = (bits, int(spec.get("decoder_layers", 4)), int(spec.get("decoder_width", 0)))
    grid = tuple(record["image_grid"])
    return shapes_for("uniar", Qwen3VLConfig.from_pretrained(str(where)), str(where), lora,
                      uniar, grid)  # fmt: skip


# ---- the accounting -------------------------------------------------------------------


def layer_activation_bytes(
    s: Shapes, tokens: int, residual_bytes: int, compute_bytes: int, autocast: bool
) -> int:
    """Bytes one Llama-style decoder layer keeps for backward over `tokens` positions, as
    transformers' Llama/Qwen3 layers save them (docs/plan.md derives each term). Per token:
    each of the two RMSNorms keeps its input, its fp32 normalised value and the 1/rms
    scalar (2h + 1, residual dtype); the projections keep their input: the norm's output
    once in fp32 (q/k/v and gate/up share it), or one autocast copy per projection in bf16
    (q, k, v, gate, up: 5h); the attention (SDPA, flash or memory-efficient: no T^2 term)
    keeps q (h), k and v (kv heads x head_dim each), its output (h, also o_proj's input)
    and the fp32 log-sum-exp (one per head); the MLP keeps gate, up, silu(gate) and
    their product (down_proj's input): 4I."""
    h, kvd, inter = s.hidden, s.kv_heads * s.head_dim, s.intermediate
    res = 2 * (2 * h + 1) * residual_bytes
    inputs = (5 if autocast else 2) * h * compute_bytes
    attn = (2 * h + 2 * kvd) * compute_bytes + 4 * s.heads
    return tokens * (res + inputs + attn + 4 * inter * compute_bytes)


def kv_capacity(prompt: int, total: int, reserve: int = KV_RESERVE) -> int:
    """Positions each layer's key/value buffer holds when a rollout of `total` positions
    (after a prefill of `prompt`) ends: the decode loop's buffers (`GrowingLayer`,
    uniweave.rollout.decode_cache) start at max(2 prompt, prompt + reserve) and, when a step
    overflows them, grow to max(2 need, need + reserve) positions."""
    cap = max(2 * prompt, prompt + reserve)
    while cap < total:
        need = cap + 1
        cap = max(2 * need, need + reserve)
    return cap


def runtime_rss() -> int:
    """This process's resident bytes (Linux VmRSS; 0 elsewhere): `uniweave plan --host` reads
    it after importing torch and transformers, which a training process holds too."""
    try:
        status = Path("/proc/self/status").read_text()
    except OSError:
        return 0
    for line in status.splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


@dataclass
class Setup:
    """What the accounting reads from the config and the command line."""

    gpus: int = 1
    gpu_mem_gib: float = 80.0
    precision: str = "bf16"  # trainer.precision
    checkpointing: bool = True
    micro_batch: int = 4
    rollout_rows: int = 32
    rollout_bf16: bool = True
    cfg: bool = False  # rollout.guidance != 1: an unconditional row per row
    prompt_tokens: int = DEFAULT_PROMPT_TOKENS
    new_tokens: int = 576
    chunk: int = 128
    token_budget: int | None = None  # trainer.micro_token_budget
    kl_copy: bool = False  # GRPO with a KL term (algorithm.kl.type != none)
    ref_copy_with_lora: bool = False  # LoRA from model.initial_adapter: the copy is kept too
    teacher: Shapes | None = None  # OPD's frozen teacher (algorithm.teacher.path's sizes)
    gather_bytes: int = 4  # FSDP2's unsharded layers: trainer.fsdp.param_dtype
    reshard: bool = True  # trainer.fsdp.reshard_after_forward
    chosen: tuple[str, bool] | None = None  # the config's own (parallel, LoRA) row
    host: bool = False  # --host: one CPU process (docs/plan.md, "On the host")
    runtime_bytes: int = 0  # --host: the interpreter + libraries' resident size


def account(s: Shapes, st: Setup, parallel: str, lora: bool) -> dict[str, int]:
    """Per-rank bytes of each line of the plan (docs/plan.md)."""
    n = st.gpus if parallel == "fsdp2" else 1
    wbytes = 8 if st.precision == "fp64" else 4  # bf16 = autocast over fp32 weights
    cbytes = 2 if st.precision == "bf16" else wbytes
    trainable = s.lora_params if lora else s.trainable_params
    total = s.total_params + (s.lora_params if lora else 0)
    params = total * wbytes // n
    if parallel == "fsdp2" and n > 1:
        # gathered copies in trainer.fsdp.param_dtype: the root unit (embeddings, heads,
        # frozen towers) for the whole step; decoder layers two at a time (the running
        # one and the prefetched one), or all of them without reshard_after_forward
        root = total - s.layers * s.layer_params
        gathered = 2 if st.reshard else s.layers
        params += (root + gathered * s.layer_params) * st.gather_bytes
    grads = trainable * wbytes // n
    optim = 2 * trainable * wbytes // n  # Adam exp_avg + exp_avg_sq, fp32 (fp64)
    # the GRPO reference: a frozen copy of the policy (sharded with it under FSDP2), or,
    # for LoRA started from scratch, the same weights with the adapters off (no copy)
    ref = total * wbytes // n if st.kl_copy and (st.ref_copy_with_lora or not lora) else 0
    # OPD's teacher: a frozen whole model in the weights' dtype (sharded with the policy
    # under FSDP2, an objective.frozen_models entry; its root unit and two layers gathered
    # while it scores). Its no-grad forward keeps one layer's temporaries at a time.
    teacher = 0
    if st.teacher is not None:
        t = st.teacher
        teacher = t.total_params * wbytes // n
        if parallel == "fsdp2" and n > 1:
            root = t.total_params - t.layers * t.layer_params
            teacher += (root + (2 if st.reshard else t.layers) * t.layer_params) * st.gather_bytes
    tokens = st.micro_batch * (st.prompt_tokens + st.new_tokens)
    if st.token_budget is not None:  # trainer.micro_token_budget caps rows x longest row
        tokens = min(tokens, st.token_budget)
    tokens *= 2 if st.cfg else 1
    autocast = st.precision == "bf16"
    per_layer = layer_activation_bytes(s, tokens, wbytes, cbytes, autocast)
    boundary = tokens * s.hidden * wbytes * s.layers  # each layer's input (residual stream)
    # bf16 autocast: each Linear saves its bf16 weight copy for backward (all layers' when
    # every layer's activations are kept, one layer's when recomputed)
    copies = 2 * s.layer_params if autocast else 0
    # backward of one layer: the gradients of down_proj's input and of gate and up (3I)
    workspace = 3 * tokens * s.intermediate * cbytes
    full_act = s.layers * (per_layer + copies) + workspace
    ckpt_act = boundary + per_layer + copies + workspace
    width = max(s.vocab, s.visual_outputs)
    # logits in compute dtype, log-softmax and its gradient in fp32, per chunk row
    logits = (2 if st.cfg else 1) * st.chunk * width * (cbytes + 8)
    # under bf16 autocast the values are bf16 but the keys are not: RoPE multiplies the
    # bf16 projection by the fp32 cos/sin tables, and type promotion makes them fp32
    kv_bytes = (4 + 2) if st.rollout_bf16 else 2 * wbytes  # one key + one value element
    rows = st.rollout_rows * (2 if st.cfg else 1)
    positions = kv_capacity(st.prompt_tokens, st.prompt_tokens + st.new_tokens)
    kv = rows * positions * s.layers * s.kv_heads * s.head_dim * kv_bytes
    act = ckpt_act if st.checkpointing else full_act
    # gradients are freed after each update (zero_grad(set_to_none=True)): the rollout,
    # which holds the KV cache and one step's logits per row, never meets them
    runtime = st.runtime_bytes if st.host else 0
    static = params + optim + ref + teacher + runtime
    peak = static + max(grads + act + logits, kv + rows * width * 4)
    return {"params": params, "grads": grads, "optim": optim, "reference": ref,
            "teacher": teacher, "act_full": full_act, "act_ckpt": ckpt_act, "logits": logits, "kv": kv,
            "runtime": runtime, "peak": peak}  # fmt: skip


def table(s: Shapes, st: Setup) -> str:
    gib = lambda b: f"{b / GIB:8.2f}"  # noqa: E731
    lines = [
        f"model {s.name}: {s.total_params:,} parameters ({s.trainable_params:,} trainable "
        f"full FT; LoRA {s.lora_params:,} in {s.lora_targets} modules); {s.layers} layers, "
        f"width {s.hidden}, {s.heads} heads / {s.kv_heads} KV, vocab {s.vocab:,}",
        f"per rank, {st.gpus} GPU(s) of {st.gpu_mem_gib:g} GiB; micro-batch {st.micro_batch} x "
        f"{st.prompt_tokens}+{st.new_tokens} tokens{' x2 (CFG)' if st.cfg else ''}; "
        f"precision {st.precision}; checkpointing {'on' if st.checkpointing else 'off'}",
        f"{'GiB':<14}{'params':>8}{'grads':>8}{'Adam':>8}{'ref':>8}{'teacher':>8}{'act':>8}"
        f"{'act-ck':>8}"
        f"{'logits':>8}{'KV':>8}{'peak':>8}  fits",
    ]
    if st.host:
        lines[1] = lines[1].replace(
            f"per rank, {st.gpus} GPU(s) of {st.gpu_mem_gib:g} GiB",
            f"host: one CPU process, {st.gpu_mem_gib:g} GiB of memory; runtime (interpreter, "
            f"torch, transformers) {st.runtime_bytes / 2**20:.1f} MiB resident, in the peak",
        )
    for parallel in ("ddp",) if st.host else ("ddp", "fsdp2"):
        for lora in (False, True):
            a = account(s, st, parallel, lora)
            fits = "yes" if a["peak"] <= st.gpu_mem_gib * GIB else "NO"
            cells = "".join(
                gib(a[k])
                for k in (
                    "params",
                    "grads",
                    "optim",
                    "reference",
                    "teacher",
                    "act_full",
                    "act_ckpt",
                    "logits",
                    "kv",
                    "peak",
                )  # fmt: skip
            )
            mark = " *" if st.chosen == (parallel, lora) else ""
            where = "host" if st.host else parallel
            label = f"{where} {'LoRA' if lora else 'full'}{mark}"
            lines.append(f"{label:<14}{cells}  {fits}")
    if st.chosen is not None:
        lines.append("* the config's own row (trainer.parallel, trainer.lora.enabled)")
    return "\n".join(lines)


def glibc_range(peak: int) -> str:
    """The line `plan --host` prints under `run.host_mmap_threshold: null`: the range of
    step peaks glibc's retention allowed at Janus-Pro-1B (`GLIBC_RETENTION`) applied to
    the config's own planned peak."""
    lo, hi = GLIBC_RETENTION
    return (
        f"run.host_mmap_threshold is null (glibc's dynamic threshold): freed temporaries "
        f"stay resident, so expect the config's step to peak at {lo * peak / GIB:.2f}-"
        f"{hi * peak / GIB:.2f} GiB ({lo:g}-{hi:g}x the plan, measured on Janus-Pro-1B; "
        f"docs/plan.md, 'On the host'); run.host_mmap_threshold=1048576 holds the plan"
    )


def teacher_shapes(cfg: Any, s: Shapes) -> Shapes | None:
    """The frozen teacher's sizes of a method that has one (its spec's `teacher` key; OPD:
    `algorithm.teacher.path`): the student's when that directory is `model.path`, else
    read from the teacher directory's config.json (a Janus-Pro or UniAR checkpoint).
    None for the other methods. ValueError / OSError naming the directory otherwise."""
    key = method(cfg.algorithm.name).teacher
    if key is None:
        return None
    path = get_key(cfg.algorithm, key)
    if cfg.model.path is not None and Path(path).resolve() == Path(cfg.model.path).resolve():
        return s
    from uniweave.models.registry import model_kind

    kind = model_kind(path)
    if kind not in ("janus_pro", "uniar"):
        raise ValueError(f"{path}: a {kind} teacher; 'uniweave plan' plans janus_pro and uniar")
    return path_shapes(kind, path, None)


def setup_from_config(
    cfg: Any, gpus: int, gpu_mem: float, prompt_tokens: int, s: Shapes, host: bool = False
):
    """The `Setup` a config trains with (docs/plan.md lists the keys read). OPD: the
    teacher's sizes too (`teacher_shapes`)."""
    algo, rollout, trainer = cfg.algorithm, cfg.rollout, cfg.trainer
    spec = method(algo.name)
    samples = spec.rollouts
    new = rollout.max_new_tokens if rollout.max_new_tokens is not None else s.image_tokens
    if not samples:  # SFT rows are prompt + target: a whole image for text-to-image rows
        new = s.image_tokens if "t2i" in cfg.data.tasks else rollout.max_new_tokens
    own = {"chunk": 128, "kl_copy": False, **spec.plan_setup(algo)}  # the method's hooks
    return Setup(
        gpus=gpus,
        gpu_mem_gib=gpu_mem,
        precision=trainer.precision,
        checkpointing=trainer.gradient_checkpointing,
        micro_batch=trainer.micro_batch_size,
        token_budget=trainer.micro_token_budget,
        rollout_rows=rollout.batch_size if samples else 0,
        rollout_bf16=rollout.precision == "bf16",
        cfg=samples and rollout.guidance != 1.0,
        prompt_tokens=prompt_tokens,
        new_tokens=new,
        chunk=own["chunk"],
        kl_copy=own["kl_copy"],
        ref_copy_with_lora=cfg.model.initial_adapter is not None,
        gather_bytes={"fp32": 4, "bf16": 2, "fp64": 8}[trainer.fsdp.param_dtype],
        reshard=trainer.fsdp.reshard_after_forward,
        chosen=("fsdp2" if trainer.parallel == "fsdp2" else "ddp", trainer.lora.enabled),
        host=host,
        teacher=teacher_shapes(cfg, s),
    )


def run(args: Any) -> int:
    """`uniweave plan`: print the table (module docstring). Bad input: `ConfigError`, exit 2."""
    from uniweave.config import ConfigError, load_config
    from uniweave.config.hub import resolve_hub_ids
    from uniweave.config.trainer import LoRAConfig

    cfg = resolve_hub_ids(load_config(args.config, args.overrides))
    lora = cfg.trainer.lora if cfg.trainer.lora.enabled else LoRAConfig(enabled=True)
    if cfg.model.kind not in ("janus_pro", "uniar"):
        raise ConfigError(
            f"{cfg.model.kind}: 'uniweave plan' plans janus_pro and uniar models",
            key="model.kind",
            source=args.config,
        )
    if args.preset is not None:
        if cfg.model.path is not None:
            raise ConfigError(
                f"set, and --preset {args.preset} was given: plan either the checkpoint's "
                "sizes or the preset's (drop one)",
                key="model.path",
                source=args.config,
            )
        if PRESETS[args.preset]["kind"] != cfg.model.kind:
            raise ConfigError(
                f"--preset {args.preset} is a {PRESETS[args.preset]['kind']} model but the "
                f"config's model.kind is {cfg.model.kind}",
                key="model.kind",
                source=args.config,
            )
        s = preset_shapes(args.preset, lora)
    elif cfg.model.path is None:
        raise ConfigError(
            "not set: 'uniweave plan' reads the sizes from the model directory's config.json; "
            f"set it or pass --preset ({' | '.join(PRESETS)})",
            key="model.path",
            source=args.config,
        )
    else:
        try:
            s = path_shapes(cfg.model.kind, cfg.model.path, lora)
        except (OSError, ValueError) as err:
            raise ConfigError(str(err), key="model.path", source=args.config) from None
    host = bool(getattr(args, "host", False))
    if host and (args.gpus != 1 or cfg.trainer.parallel == "fsdp2"):
        raise ConfigError(
            "--host plans one CPU process: give no --gpus and plan trainer.parallel none/ddp",
            key="trainer.parallel",
            source=args.config,
        )
    try:
        st = setup_from_config(cfg, args.gpus, args.gpu_mem, args.prompt_tokens, s, host=host)
    except (OSError, ValueError) as err:  # the teacher's directory (the student's was read)
        key = f"algorithm.{method(cfg.algorithm.name).teacher}"
        raise ConfigError(str(err), key=key, source=args.config) from None
    if host:
        st.runtime_bytes = runtime_rss()
        st.chosen = ("ddp", st.chosen[1]) if st.chosen else None
    print(table(s, st))
    if host and cfg.run.host_mmap_threshold is None:
        print(glibc_range(account(s, st, "ddp", cfg.trainer.lora.enabled)["peak"]))
    if not cfg.trainer.lora.enabled:
        print(f"(LoRA rows: trainer.lora is off; planned with r={lora.r} on "
              f"{lora.target_modules!r})")  # fmt: skip
    return 0
