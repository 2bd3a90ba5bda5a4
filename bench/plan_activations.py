"""`uniweave plan`'s activation formula against what autograd really keeps, on CPU.

    OMP_NUM_THREADS=1 PYTHONPATH=src .venv/bin/python bench/plan_activations.py

Builds a Llama decoder (the class Janus-Pro's language model is) at a small width, runs
one forward over B x T positions under `torch.autograd.graph.saved_tensors_hooks` and sums
the bytes of the distinct storages saved for backward, leaving out weights (a saved tensor
sharing a parameter's storage, or its autocast copy: a 1-D/2-D tensor of a parameter's
shape). Two depths L1 < L2: (saved(L2) - saved(L1)) / (L2 - L1) is one layer's cost,
exactly, whatever the embedding and final norm keep. With gradient checkpointing the same
difference is the per-layer boundary term. Prints measured, planned and their ratio, fp32
and bf16 autocast.

Second, the whole step: in a fresh process per case (glibc told to mmap every block of
64 KiB or more, `MALLOC_MMAP_THRESHOLD_`, so freed activations leave the resident set), a
4-layer decoder at width 512 runs one forward/backward over 4 x 1024 positions; the peak
resident set (`ru_maxrss`) minus the resident set before the forward (model, gradients
and input already allocated) is set against the plan's activation line (`account`'s
act_full / act_ckpt: layers, autocast weight copies, backward workspace).
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys

import torch
from transformers import LlamaConfig, LlamaModel

from uniweave.plan import Setup, Shapes, account, layer_activation_bytes

B, T = 2, 256
SIZES = dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=704, vocab_size=128)  # fmt: skip


def saved_bytes(layers: int, bf16: bool, checkpointing: bool) -> int:
    torch.manual_seed(0)
    model = LlamaModel(LlamaConfig(num_hidden_layers=layers, **SIZES)).train()
    if checkpointing:
        model.gradient_checkpointing_enable({"use_reentrant": False})
    storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    shapes = {tuple(p.shape) for p in model.parameters()}
    shapes |= {s[::-1] for s in shapes}  # a Linear saves its (autocast) weight transposed
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor):
        ptr = t.untyped_storage().data_ptr()
        weight = ptr in storages or (t.dim() <= 2 and tuple(t.shape) in shapes)
        if not weight and ptr:
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    x = torch.randn(B, T, SIZES["hidden_size"], requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            out = model(inputs_embeds=x).last_hidden_state
    out.float().sum().backward()
    return sum(seen.values())


STEP = dict(hidden_size=512, num_attention_heads=8, num_key_value_heads=4,
            intermediate_size=1408, vocab_size=128)  # fmt: skip
STEP_B, STEP_T, STEP_L = 4, 1024, 4


def child(bf16: bool, checkpointing: bool) -> None:
    """Print the peak-RSS delta of one forward/backward (module docstring)."""
    torch.manual_seed(0)
    model = LlamaModel(LlamaConfig(num_hidden_layers=STEP_L, **STEP)).train()
    if checkpointing:
        model.gradient_checkpointing_enable({"use_reentrant": False})
    x = torch.randn(STEP_B, STEP_T, STEP["hidden_size"], requires_grad=True)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    with torch.no_grad():  # first-call allocations (kernels, rotary tables) out of the delta
        model(inputs_embeds=x[:1, :8])
    base = int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        out = model(inputs_embeds=x).last_hidden_state
    out.float().sum().backward()
    print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base)


def step_rows() -> None:
    h, heads = STEP["hidden_size"], STEP["num_attention_heads"]
    model = LlamaModel(LlamaConfig(num_hidden_layers=1, **STEP))
    layer = sum(p.numel() for p in model.layers[0].parameters())
    shapes = Shapes("step", h, STEP_L, heads, STEP["num_key_value_heads"], h // heads,
                    STEP["intermediate_size"], STEP["vocab_size"], 0, 0, 0, 0, layer, 0)  # fmt: skip
    print(f"whole step: {STEP_L} layers h={h} I={STEP['intermediate_size']}, "
          f"{STEP_B} x {STEP_T} positions")  # fmt: skip
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    for bf16 in (False, True):
        for ck in (False, True):
            st = Setup(precision="bf16" if bf16 else "fp32", micro_batch=STEP_B,
                       prompt_tokens=STEP_T, new_tokens=0)  # fmt: skip
            planned = account(shapes, st, "ddp", False)["act_ckpt" if ck else "act_full"]
            cmd = [sys.executable, __file__, "--child", str(int(bf16)), str(int(ck))]
            run = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
            measured = int(run.stdout.split()[-1])
            name = f"{'bf16 autocast' if bf16 else 'fp32'}{' + ckpt' if ck else ''}"
            print(f"{name:20s} peak RSS delta {measured / 2**20:7.1f} MiB, planned "
                  f"{planned / 2**20:7.1f} MiB, planned/measured {planned / measured:.3f}")  # fmt: skip


def main() -> None:
    h, heads, kv = SIZES["hidden_size"], SIZES["num_attention_heads"], SIZES["num_key_value_heads"]
    shapes = Shapes("bench", h, 1, heads, kv, h // heads, SIZES["intermediate_size"],
                    SIZES["vocab_size"], 0, 0, 0, 0, 0, 0)  # fmt: skip
    print(f"Llama layer h={h} heads={heads}/{kv} I={SIZES['intermediate_size']}, B x T = {B} x {T}")
    for bf16 in (False, True):
        full = (saved_bytes(4, bf16, False) - saved_bytes(2, bf16, False)) / 2
        ckpt = (saved_bytes(4, bf16, True) - saved_bytes(2, bf16, True)) / 2
        cbytes = 2 if bf16 else 4
        planned = layer_activation_bytes(shapes, B * T, 4, cbytes, bf16)
        boundary = B * T * h * 4
        name = "bf16 autocast" if bf16 else "fp32"
        print(f"{name:14s} per layer: measured {full / 2**20:7.2f} MiB, planned "
              f"{planned / 2**20:7.2f} MiB, planned/measured {planned / full:.3f}")  # fmt: skip
        print(f"{name:14s} checkpointed boundary: measured {ckpt / 2**20:7.2f} MiB, planned "
              f"{boundary / 2**20:7.2f} MiB, planned/measured {boundary / ckpt:.3f}")  # fmt: skip


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        child(sys.argv[2] == "1", sys.argv[3] == "1")
    else:
        main()
        step_rows()
