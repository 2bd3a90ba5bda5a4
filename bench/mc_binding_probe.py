"""Multiple-choice symbol binding on the tiny model's body, without images.

Each sequence is: a query digit q, filler tokens, "A ) d1 B ) d2 C ) d3 D ) d4 . ?", and
the target is the letter of the option equal to q (i2t_mc with recognition removed).
It trains a LlamaModel body of the tiny recipe's size from scratch and prints the
training loss and accuracy on 256 fresh sequences every 50 steps; chance is 0.25.
`--shift K` adds learned maps of the K previous positions to each input embedding,
`--layer-shift K` does so before every layer (a causal "token shift"; the probe that
measured how many examples binding needs, issue 4 note). `--conv K` installs the tiny
model's own prior instead (`uniweave.models.tiny.mixer`: a depthwise causal conv of kernel K
after each layer norm, issue 15).

    .venv/bin/python bench/mc_binding_probe.py [--steps 600] [--batch 128] [--lr 1e-3]
        [--shift 0] [--layer-shift 0] [--conv 0] [--distinct]
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn
from transformers import LlamaConfig, LlamaModel

from uniweave.models.tiny.mixer import install_mixers

DIGITS, QUERIES, LETTERS, PAREN, STOP, FILL, ASK = 0, 10, 20, 24, 25, 26, 27
VOCAB = 32


def make_batch(
    n: int, filler: int, distinct: bool, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    rows, targets = [], []
    for _ in range(n):
        q = int(torch.randint(10, (1,), generator=gen))
        others = [d for d in range(10) if d != q]
        pick = torch.randperm(9, generator=gen)[:3].tolist()
        options = [q] + [others[i] for i in pick]
        options = [options[i] for i in torch.randperm(4, generator=gen).tolist()]
        seq = [q + (QUERIES if distinct else DIGITS)] + [FILL] * filler
        for k, d in enumerate(options):
            seq += [LETTERS + k, PAREN, DIGITS + d]
        rows.append(seq + [STOP, ASK])
        targets.append(LETTERS + options.index(q))
    return torch.tensor(rows), torch.tensor(targets)


def shifted(x: torch.Tensor, maps: nn.ModuleList) -> torch.Tensor:
    """x_t + sum_j W_j x_{t-j} (zeros before the sequence start)."""
    k, t = len(maps), x.shape[1]
    padded = nn.functional.pad(x, (0, 0, k, 0))
    return x + sum(w(padded[:, k - j : k - j + t]) for j, w in enumerate(maps, start=1))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--shift", type=int, default=0)
    p.add_argument("--layer-shift", type=int, default=0)
    p.add_argument("--conv", type=int, default=0)
    p.add_argument("--filler", type=int, default=12)
    p.add_argument("--distinct", action="store_true", help="query tokens differ from options")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    d = 128
    body = LlamaModel(
        LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=d,
            intermediate_size=512,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=4,
            max_position_embeddings=128,
            tie_word_embeddings=False,
            attn_implementation="sdpa",
        )
    )
    head = nn.Linear(d, VOCAB, bias=False)
    mix = install_mixers(body, args.conv, 0.02) if args.conv else None
    input_maps = nn.ModuleList(nn.Linear(d, d, bias=False) for _ in range(args.shift))
    layer_maps = nn.ModuleList(
        nn.ModuleList(nn.Linear(d, d, bias=False) for _ in range(args.layer_shift))
        for _ in body.layers
    )
    for layer, maps in zip(body.layers, layer_maps, strict=True):
        if len(maps):

            def pre_hook(_mod, a, kw, maps=maps):
                if a:
                    return (shifted(a[0], maps), *a[1:]), kw
                return a, {**kw, "hidden_states": shifted(kw["hidden_states"], maps)}

            layer.register_forward_pre_hook(pre_hook, with_kwargs=True)
    extra = [*input_maps, *(w for maps in layer_maps for w in maps)]
    for module in (head, *extra):
        nn.init.normal_(module.weight, std=0.02)
    params = [*body.parameters(), *head.parameters(), *(q for m in extra for q in m.parameters())]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.01)

    def logits(x: torch.Tensor) -> torch.Tensor:
        e = body.embed_tokens(x)
        if mix is not None:
            mix.valid = torch.ones(x.shape, dtype=torch.bool)
        if len(input_maps):
            e = shifted(e, input_maps)
        return head(body(inputs_embeds=e).last_hidden_state[:, -1])

    t0 = time.perf_counter()
    for step in range(1, args.steps + 1):
        x, y = make_batch(args.batch, args.filler, args.distinct, gen)
        loss = nn.functional.cross_entropy(logits(x), y)
        opt.zero_grad()
        loss.backward()
        nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        if step % 50 == 0:
            with torch.no_grad():
                x, y = make_batch(256, args.filler, args.distinct, gen)
                acc = (logits(x).argmax(-1) == y).float().mean().item()
            print(f"step {step:5d}  loss {loss.item():.3f}  accuracy {acc:.3f}", flush=True)
    print(f"wall {time.perf_counter() - t0:.1f} s (chance accuracy 0.25)")


if __name__ == "__main__":
    main()
