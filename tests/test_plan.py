"""`uniweave plan` (uniweave.plan): parameter counts of the meta-device build against real tiny
models, the byte accounting against a hand computation and against the measured state of a
real model after an Adam step, DDP vs FSDP2 sharding, and the CLI's exit codes."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from uniweave import cli
from uniweave.config.trainer import LoRAConfig
from uniweave.plan import (
    GIB,
    GLIBC_RETENTION,
    KV_RESERVE,
    Setup,
    Shapes,
    account,
    kv_capacity,
    layer_activation_bytes,
    path_shapes,
)

pytestmark = pytest.mark.usefixtures("one_thread")

LORA = LoRAConfig(enabled=True, r=4, target_modules=r".*\.(q_proj|v_proj|gate_proj)$")
JANUS_RECIPE = "recipes/janus_pro/grpo_t2i_pickscore_lora.yaml"


@pytest.fixture(scope="module")
def janus_dir(tmp_path_factory):
    from uniweave.models.janus_pro.tiny import TinyJanusSpec, write_tiny_checkpoint

    return write_tiny_checkpoint(tmp_path_factory.mktemp("janus") / "ckpt", TinyJanusSpec())


def _unique(params):
    seen, out = set(), []
    for p in params:
        if id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


def _state_bytes(model) -> tuple[int, int, int]:
    """Measured (parameter, gradient, Adam state) bytes after one AdamW step in which every
    trainable parameter got a gradient (loss: the sum of their squares); Adam's scalar
    `step` counters are left out (a few bytes per tensor, not a per-element cost)."""
    params = _unique(model.parameters())
    trainable = [p for p in params if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=1e-3)
    sum(p.square().sum() for p in trainable).backward()
    opt.step()
    grads = sum(p.grad.nbytes for p in trainable)
    state = sum(t.nbytes for s in opt.state.values() for k, t in s.items() if k != "step")
    return sum(p.nbytes for p in params), grads, state


@pytest.mark.parametrize("lora", [False, True])
def test_janus_counts_and_state_bytes_equal_a_real_model(janus_dir, lora):
    from uniweave.models.janus_pro import JanusProModel
    from uniweave.train.engine.lora import apply_lora

    shapes = path_shapes("janus_pro", str(janus_dir), LORA)
    model = JanusProModel.from_pretrained(janus_dir)
    params = _unique(model.parameters())
    assert shapes.total_params == sum(p.numel() for p in params)
    assert shapes.trainable_params == sum(p.numel() for p in params if p.requires_grad)
    assert shapes.layers == 2 and shapes.hidden == 32 and shapes.visual_outputs == 64
    if lora:
        apply_lora(model, SimpleNamespace(trainer=SimpleNamespace(lora=LORA)))
        trainable = [p for p in model.parameters() if p.requires_grad]
        assert shapes.lora_params == sum(p.numel() for p in trainable)
    plan = account(shapes, Setup(precision="fp32"), "ddp", lora)
    assert (plan["params"], plan["grads"], plan["optim"]) == _state_bytes(model)


def test_uniar_counts_equal_a_real_model(tmp_path):
    from model_fixtures import UNIAR_SIZES, random_bsq_codec

    from uniweave.models.uniar import build_tiny_uniar

    model = build_tiny_uniar(random_bsq_codec(16, 2, 1), UNIAR_SIZES)
    model.save_pretrained(tmp_path / "m")
    shapes = path_shapes("uniar", str(tmp_path / "m"), LORA)
    params = _unique(model.parameters())
    assert shapes.total_params == sum(p.numel() for p in params)
    assert shapes.trainable_params == sum(p.numel() for p in params if p.requires_grad)
    assert (shapes.visual_outputs, shapes.image_tokens) == (16, 16)
    assert shapes.kv_heads == UNIAR_SIZES.num_kv_heads


SHAPES = Shapes("x", hidden=64, layers=3, heads=4, kv_heads=2, head_dim=16, intermediate=160,
                vocab=1000, visual_outputs=300, image_tokens=16, total_params=10_000,
                trainable_params=8_000, layer_params=1_000, lora_params=400)  # fmt: skip


def test_accounting_equals_a_hand_computation():
    """Every line of one plan, written out by hand from docs/plan.md's formulas."""
    st = Setup(gpus=1, precision="bf16", checkpointing=True, micro_batch=2, rollout_rows=5,
               rollout_bf16=True, cfg=True, prompt_tokens=10, new_tokens=6, chunk=8)  # fmt: skip
    a = account(SHAPES, st, "ddp", lora=False)
    assert a["params"] == 10_000 * 4 and a["grads"] == 8_000 * 4 and a["optim"] == 8_000 * 8
    tokens = 2 * 16 * 2  # micro-batch x (prompt + new) x CFG rows
    # per token: two norms x (input, normalised, 1/rms) fp32; 5 autocast projection-input
    # copies, q, k, v, attention output and 4 MLP tensors in bf16; log-sum-exp fp32 per head
    per_token = 2 * (64 + 64 + 1) * 4 + (5 * 64 + 64 + 32 + 32 + 64 + 4 * 160) * 2 + 4 * 4
    assert layer_activation_bytes(SHAPES, tokens, 4, 2, True) == tokens * per_token
    # fp32: the norm's output saved once per norm, not once per projection (2h, not 5h)
    fp32 = 2 * (64 + 64 + 1) * 4 + (2 * 64 + 64 + 32 + 32 + 64 + 4 * 160) * 4 + 4 * 4
    assert layer_activation_bytes(SHAPES, tokens, 4, 4, False) == tokens * fp32
    # + bf16 weight copies of each kept layer (2 B x 1,000), + backward workspace 3I in bf16
    workspace = 3 * tokens * 160 * 2
    assert a["act_full"] == 3 * (tokens * per_token + 2 * 1_000) + workspace
    assert a["act_ckpt"] == 3 * tokens * 64 * 4 + tokens * per_token + 2 * 1_000 + workspace
    assert a["logits"] == 2 * 8 * 1000 * (2 + 8)
    # rows x buffer positions x layers x kv heads x head dim x (fp32 key + bf16 value); the
    # buffer holds max(2 x 10, 10 + 64) = 74 positions after the prefill, enough for 16
    assert a["kv"] == 10 * 74 * 3 * 2 * 16 * (4 + 2)
    static = a["params"] + a["optim"]  # gradients exist only in the update, not the rollout
    update = a["grads"] + a["act_ckpt"] + a["logits"]
    assert a["peak"] == static + max(update, a["kv"] + 10 * 1000 * 4)
    assert a["reference"] == 0
    kl = account(SHAPES, Setup(precision="fp32", kl_copy=True), "ddp", lora=False)
    assert kl["reference"] == 10_000 * 4  # a frozen copy of every parameter
    assert account(SHAPES, Setup(kl_copy=True), "ddp", lora=True)["reference"] == 0
    adapter = Setup(kl_copy=True, ref_copy_with_lora=True)
    assert account(SHAPES, adapter, "ddp", lora=True)["reference"] == 10_400 * 4
    lora = account(SHAPES, st, "ddp", lora=True)
    assert (lora["params"], lora["grads"], lora["optim"]) == (10_400 * 4, 400 * 4, 400 * 8)


@pytest.mark.parametrize("lora", [False, True])
def test_fsdp2_shards_params_grads_and_adam_by_n_ddp_replicates(lora):
    one, eight = Setup(gpus=1, precision="fp32"), Setup(gpus=8, precision="fp32")
    ddp1, ddp8 = account(SHAPES, one, "ddp", lora), account(SHAPES, eight, "ddp", lora)
    fsdp1, fsdp8 = account(SHAPES, one, "fsdp2", lora), account(SHAPES, eight, "fsdp2", lora)
    assert ddp1 == ddp8 == fsdp1  # replicated, or one shard
    for key in ("grads", "optim"):
        assert fsdp8[key] == ddp8[key] // 8
    # params: a 1/8 shard, plus gathered copies: the root unit (all but the 3 layers) and
    # two decoder layers in flight; all 3 layers without reshard_after_forward
    total = 10_000 + (400 if lora else 0)
    root = total - 3 * 1_000
    assert fsdp8["params"] == total * 4 // 8 + (root + 2 * 1_000) * 4
    keep = account(SHAPES, Setup(gpus=8, precision="fp32", reshard=False, gather_bytes=2),
                   "fsdp2", lora)  # fmt: skip
    assert keep["params"] == total * 4 // 8 + (root + 3 * 1_000) * 2
    for key in ("act_full", "act_ckpt", "logits", "kv"):
        assert fsdp8[key] == ddp8[key]  # per-rank data: not sharded


def test_opd_teacher_is_a_frozen_whole_model_sharded_like_the_policy():
    """The teacher line: every teacher parameter in the weights' dtype, replicated under
    DDP; under FSDP2 a 1/N shard plus its gathered root unit and two layers in flight. It
    adds to the static part of the peak (it is resident for the whole run)."""
    teacher = Shapes("t", hidden=64, layers=4, heads=4, kv_heads=4, head_dim=16,
                     intermediate=160, vocab=1000, visual_outputs=300, image_tokens=16,
                     total_params=20_000, trainable_params=0, layer_params=3_000,
                     lora_params=0)  # fmt: skip
    plain = account(SHAPES, Setup(precision="fp32"), "ddp", lora=True)
    with_t = account(SHAPES, Setup(precision="fp32", teacher=teacher), "ddp", lora=True)
    assert plain["teacher"] == 0 and with_t["teacher"] == 20_000 * 4
    assert with_t["peak"] == plain["peak"] + 20_000 * 4
    bf16 = account(SHAPES, Setup(precision="bf16", teacher=teacher), "ddp", lora=True)
    assert bf16["teacher"] == 20_000 * 4  # autocast over fp32 weights: the teacher too
    fsdp = account(SHAPES, Setup(gpus=8, precision="fp32", teacher=teacher, gather_bytes=2),
                   "fsdp2", lora=True)  # fmt: skip
    assert fsdp["teacher"] == 20_000 * 4 // 8 + (20_000 - 4 * 3_000 + 2 * 3_000) * 2


def test_plan_cli_plans_the_opd_teacher_from_its_directory(janus_dir, capsys):
    recipe = "recipes/janus_pro/opd_i2t_mc_lora.yaml"
    base = ["plan", recipe, f"model.path={janus_dir}", "--host", "--gpu-mem", "4"]
    assert cli.main([*base, f"algorithm.teacher.path={janus_dir}"]) == 0
    row = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("host LoRA"))
    real = path_shapes("janus_pro", str(janus_dir), None).total_params * 4 / GIB
    # bound: not precision: printed to 2 decimals, half a unit in the last place
    assert float(row.split()[7]) == pytest.approx(real, abs=0.005)
    assert cli.main([*base, "algorithm.teacher.path=/nonexistent"]) == 2
    err = capsys.readouterr().err
    assert "algorithm.teacher.path" in err and "/nonexistent" in err


def test_plan_cli_reads_a_checkpoint_and_refuses_bad_input(janus_dir, capsys):
    argv = ["plan", JANUS_RECIPE, f"model.path={janus_dir}", "--gpus", "8", "--gpu-mem", "1"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "8 GPU(s) of 1 GiB" in out and "fsdp2 LoRA" in out and "yes" in out
    assert cli.main(["plan", JANUS_RECIPE, "--preset", "janus-pro-3b"]) == 2
    assert "invalid choice" in capsys.readouterr().err
    assert cli.main(["plan", JANUS_RECIPE, "--preset", "qwen3-vl-2b"]) == 2
    assert "model.kind" in capsys.readouterr().err
    assert cli.main(["plan", JANUS_RECIPE]) == 2  # no model.path and no preset
    assert "model.path" in capsys.readouterr().err
    assert cli.main(["plan", JANUS_RECIPE, "model.path=/nonexistent"]) == 2
    assert "/nonexistent" in capsys.readouterr().err
    both = ["plan", JANUS_RECIPE, f"model.path={janus_dir}", "--preset", "janus-pro-1b"]
    assert cli.main(both) == 2
    assert "model.path" in capsys.readouterr().err
    assert cli.main(["plan", "recipes/examples/sft_tiny.yaml", "--preset", "janus-pro-1b"]) == 2
    assert "model.kind" in capsys.readouterr().err


def test_micro_token_budget_caps_the_activation_tokens():
    free = account(SHAPES, Setup(micro_batch=4, prompt_tokens=10, new_tokens=6), "ddp", False)
    capped = Setup(micro_batch=4, prompt_tokens=10, new_tokens=6, token_budget=32)
    half = account(SHAPES, Setup(micro_batch=2, prompt_tokens=10, new_tokens=6), "ddp", False)
    assert account(SHAPES, capped, "ddp", False)["act_full"] == half["act_full"]
    assert half["act_full"] < free["act_full"]
    assert GIB == 2**30


@pytest.mark.parametrize("bf16", [False, True])
def test_kv_line_equals_the_bytes_of_a_real_decode_cache(janus_dir, bf16):
    """The KV line against the cache a real decode leaves: the tiny Janus-Pro's language
    model run as the rollout runs it (`preallocate`d growing buffers, a prefill then one
    position per step, under bf16 autocast for `rollout.precision: bf16`), its buffers'
    bytes summed. Under autocast the values are bf16 but the keys fp32 (RoPE promotes)."""
    from transformers.cache_utils import DynamicCache

    from uniweave.models.build import load_model
    from uniweave.rollout.decode_cache import RESERVE, preallocate

    assert KV_RESERVE == RESERVE
    model = load_model(str(janus_dir)).eval()
    lm = model.plain_decoder()
    rows, prompt, new = 3, 9, 150  # 159 positions: the buffer grows twice (74 -> 150 -> 302)
    cache = preallocate(DynamicCache())
    ids = torch.randint(0, 50, (rows, prompt))
    ctx = (
        torch.autocast("cpu", dtype=torch.bfloat16)
        if bf16
        else torch.autocast("cpu", enabled=False)
    )
    with torch.no_grad(), ctx:
        lm(input_ids=ids, past_key_values=cache, use_cache=True)
        for _ in range(new):
            lm(input_ids=ids[:, :1], past_key_values=cache, use_cache=True)
    measured = sum(layer._keys.nbytes + layer._values.nbytes for layer in cache.layers)
    dtypes = {(layer._keys.dtype, layer._values.dtype) for layer in cache.layers}
    assert dtypes == {(torch.float32, torch.bfloat16 if bf16 else torch.float32)}
    s = path_shapes("janus_pro", str(janus_dir), LORA)
    st = Setup(rollout_rows=rows, rollout_bf16=bf16, prompt_tokens=prompt, new_tokens=new)
    assert account(s, st, "ddp", True)["kv"] == measured


def test_kv_capacity_follows_the_growth_rule():
    """max(2p, p + 64) after the prefill, then max(2 need, need + 64) at each overflow."""
    assert kv_capacity(10, 16) == 74 and kv_capacity(10, 75) == 150  # 75 > 74: need 75
    assert kv_capacity(20, 596) == 686  # 84 -> 170 -> 342 -> 686 (the bench's T2I row)
    assert kv_capacity(300, 400) == 600 and kv_capacity(300, 601) == 1202


def test_plan_cli_host_mode(janus_dir, capsys):
    argv = ["plan", JANUS_RECIPE, f"model.path={janus_dir}", "--host", "--gpu-mem", "4"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "host: one CPU process" in out and "host LoRA *" in out and "fsdp2" not in out
    runtime = float(out.split("torch, transformers) ")[1].split(" MiB")[0])
    assert runtime > 50  # this process has torch and transformers imported
    # the default (null: glibc's dynamic threshold) prints the range its retention allows
    # around the config's own row: GLIBC_RETENTION times that row's planned peak
    row = next(line for line in out.splitlines() if line.startswith("host LoRA *"))
    peak = float(row.split()[-2])  # the peak column, GiB to 2 decimals
    line = next(line for line in out.splitlines() if "host_mmap_threshold is null" in line)
    lo, hi = (float(x) for x in line.split("peak at ")[1].split(" GiB")[0].split("-"))
    # the printed peak is rounded to 0.005 GiB: the products carry that times the ratio
    assert abs(lo - GLIBC_RETENTION[0] * peak) <= 0.005 * GLIBC_RETENTION[0] + 0.005
    assert abs(hi - GLIBC_RETENTION[1] * peak) <= 0.005 * GLIBC_RETENTION[1] + 0.005
    assert cli.main([*argv, "run.host_mmap_threshold=1048576"]) == 0
    assert "host_mmap_threshold" not in capsys.readouterr().out  # a fixed threshold: the plan holds
    assert cli.main([*argv, "--gpus", "2"]) == 2
    assert "--host" in capsys.readouterr().err
