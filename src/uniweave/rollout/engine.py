"""The rollout engine (docs/architecture.md §4): one batched, KV-cached decode loop over a
`UnifiedModel`.

Prompts (and the unconditional prompts of guided requests, one twin row per
conditional row) are left-padded and prefilled in one forward; then every step feeds
each live row the position it appended last and appends one more: a sampled text token,
a sampled visual code, or the controller's `<|vision_end|>` (`RowState`). Rows with
equal sampling parameters share one distribution object per step; each row draws only
from its own generator (seeded by its request's seed), so a trajectory does not depend
on the batch it was sampled in, its size or its order.

Finished rows stop costing compute: by default (`finished="compact"`) their rows are
removed from the KV cache and the batch in place (live rows from the end fill their
places, so only those move: `decode_cache.holes_filled`), once at least 1/8 of the batch has
finished (until then they are fed padding, outputs ignored); `finished="mask"` keeps
them in the batch, as transformers' `generate` does, for caches that cannot drop rows.

Per-step overhead: the decode loop runs under `torch.inference_mode`; KV appends write
in place into preallocated buffers (`uniweave.rollout.decode_cache`, no per-step `cat` of
the whole cache) and so does the attention mask. Shared work: each distinct prompt is
serialised once per forked sample and prefilled once, its cache copied to the rows that
hold it (`uniweave.rollout.decode_batch`: a GRPO group's G rows). `bench/rollout.py`
measures the engine against transformers' `generate` on the same body (identical tokens
checked).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import replace
from functools import lru_cache, partial
from typing import Any, Literal

import torch
from transformers import PreTrainedTokenizerBase

from uniweave.core.distributions import VisualBits
from uniweave.core.sample import GenerationRequest, Sample
from uniweave.core.trajectory import Trajectory, validate_all
from uniweave.core.types import Modality, Owner
from uniweave.data.template import image_generation_prefix, parse_image_header, serialize
from uniweave.data.tokenizer import SpecialIds
from uniweave.models.base import StreamIds, UnifiedModel
from uniweave.rollout.continuous import SlotBatch, check_supported, pad_input
from uniweave.rollout.decode_batch import DecodeBatch
from uniweave.rollout.decode_cache import holes_filled
from uniweave.rollout.guidance import unconditional_prompt
from uniweave.rollout.lean_step import lean_step
from uniweave.rollout.params import SamplingParams
from uniweave.rollout.policy import text_distribution, visual_distribution
from uniweave.rollout.request import RolloutRequest, RolloutTrajectory
from uniweave.rollout.state import RowState

Finished = Literal["compact", "mask"]
Precision = Literal["fp32", "bf16"]


def context_length(model: UnifiedModel) -> int | None:
    """The model's native context length: `model.max_positions`, else
    `model.config.max_position_embeddings`; None when the model declares neither."""
    value = getattr(model, "max_positions", None)
    if value is None:
        value = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    return None if value is None else int(value)


class RolloutEngine:
    """Batched sampler over a `UnifiedModel`: `generate(requests) -> trajectories`.

    `max_positions` overrides the model's context length (`context_length`). The chat
    format, the image announcement and the special ids come from the model's hooks
    (`UnifiedModel.prompt_trajectory`, `image_generation_prefix`, `parse_image_header`,
    `special_ids`); a `tokenizer` other than the model's serialises ChatML prompts with it.
    `share_prefill` prefills each distinct prompt once (`DecodeBatch.prefill`); False prefills
    every row. `lean` runs the decode steps of a plain Llama body through
    `uniweave.rollout.lean_step` (bit-identical); False runs the model's forward. Both False
    options are the A/B baselines of `bench/rollout.py`. `precision` "bf16" runs prefill
    and decode under `torch.autocast(<device>, bfloat16)` (weights unchanged; the
    recorded log-probs are float32 of bf16 logits): the `rollout.precision` setting,
    whose mismatch with an fp32 replay `bench/mismatch.py` measures. `slots` decodes all
    requests of a call in that many continuous-batching slots (`uniweave.rollout.continuous`;
    `rollout.continuous_batching`); None: one static batch.
    """

    def __init__(
        self,
        model: UnifiedModel,
        tokenizer: PreTrainedTokenizerBase | None = None,
        max_positions: int | None = None,
        finished: Finished = "compact",
        share_prefill: bool = True,
        lean: bool = True,
        precision: Precision = "fp32",
        slots: int | None = None,
    ) -> None:
        if slots is not None:
            if isinstance(slots, bool) or not isinstance(slots, int) or slots < 2:
                raise ValueError(
                    f"slots must be an int >= 2 (a guided pair needs two), got {slots!r}"
                )
            check_supported(model)
        self.slots = slots
        if finished not in ("compact", "mask"):
            raise ValueError(f"finished must be 'compact' or 'mask', got {finished!r}")
        if precision not in ("fp32", "bf16"):
            raise ValueError(f"precision must be 'fp32' or 'bf16', got {precision!r}")
        self.precision = precision
        self.model = model
        self.tokenizer = tokenizer if tokenizer is not None else model.tokenizer
        self.own_format = self.tokenizer is model.tokenizer
        self.special: StreamIds | SpecialIds
        if self.own_format:
            self.special = model.special_ids
            self.parse_header = model.parse_image_header
        else:
            self.special = SpecialIds.from_tokenizer(self.tokenizer)
            self.parse_header = partial(parse_image_header, tokenizer=self.tokenizer)
        # The model's own grid limit (UniAR: 1..30) bounds every image header: a sampled
        # header outside it is no valid header (the row ends "invalid", or the
        # vision-start stays text), so no image of such a grid is ever started.
        self.grid_limit = getattr(model, "max_grid_side", None)
        if self.grid_limit is not None:
            self.parse_header = partial(_bounded_header, self.parse_header, self.grid_limit)
        self.max_positions = max_positions if max_positions is not None else context_length(model)
        self.finished = finished
        self.share_prefill = share_prefill
        self.lean = lean
        self.bits = model.n_visual_outputs if model.visual_head == "bsq" else None

    # ---- prompts -------------------------------------------------------------------
    def prompt_trajectory(
        self, request: RolloutRequest, validated: bool = False
    ) -> tuple[Trajectory, tuple | None]:
        """The prompt positions of `request` and its forced image grid (or None).
        `validated`: a prompt `Trajectory` was already validated (`validate_all`)."""
        grid = request.image_grid
        if isinstance(request.prompt, Sample):
            sample = request.prompt
            first = next((k for k, p in enumerate(sample.parts) if p.role == "assistant"), None)
            parts = list(sample.parts if first is None else sample.parts[:first])
            asked = None if first is None else sample.parts[first]
            if isinstance(asked, GenerationRequest):
                if grid is not None and grid != (asked.height, asked.width):
                    raise ValueError(
                        f"request {request.id!r}: image_grid {grid} contradicts the sample's "
                        f"GenerationRequest {(asked.height, asked.width)}"
                    )
                grid = (asked.height, asked.width)
            if grid is not None:
                parts.append(GenerationRequest(*grid))
            prompt_sample = Sample(id=request.id, parts=parts)
            if self.own_format:
                traj = self.model.prompt_trajectory(prompt_sample, add_generation_prompt=True)
            else:
                traj = serialize(
                    prompt_sample,
                    self.tokenizer,
                    encode_image=self.model.codec.encode,
                    add_generation_prompt=True,
                    bits=self.bits,
                )
        else:
            traj = request.prompt if validated else request.prompt.validate()
            if (traj.owner != Owner.PROMPT).any():
                raise ValueError(f"request {request.id!r}: a prompt trajectory must be all PROMPT")
            if grid is not None:
                if self.own_format:
                    prefix = self.model.image_generation_prefix(*grid)
                else:
                    prefix = image_generation_prefix(*grid, self.tokenizer)
                traj = _append_prompt(traj, prefix)
            elif int(traj.token_ids[-1]) == self.special.vision_start:
                grid = self.parse_header(traj.token_ids[:-1].tolist())
                if grid is None:
                    raise ValueError(
                        f"request {request.id!r}: the prompt ends with the image-start token "
                        "without a valid image header (ChatML: 'generate image H W')"
                    )
        self._check_request(request, traj, grid)
        return traj, grid

    def _prompt(
        self, request: RolloutRequest, memo: dict[tuple, tuple[Trajectory, tuple | None]]
    ) -> tuple[Trajectory, tuple | None]:
        """`prompt_trajectory(request)`, serialised once per distinct sample: requests whose
        `Sample` holds the very same part objects (`Sample.fork`: a GRPO group's G members)
        and the same forced grid reuse the first one's positions (under their own id); each
        request is still checked against its own parameters."""
        if not isinstance(request.prompt, Sample):
            return self.prompt_trajectory(request, validated=True)
        key = (tuple(map(id, request.prompt.parts)), request.image_grid)
        if key not in memo:
            memo[key] = self.prompt_trajectory(request, validated=True)
            return memo[key]
        traj, grid = memo[key]
        self._check_request(request, traj, grid)
        return replace(traj, sample_id=request.id), grid

    def _check_request(self, request: RolloutRequest, prompt: Trajectory, grid: tuple | None):
        p, where = request.params, f"request {request.id!r}"
        if grid is not None and not p.grid_allowed(*grid):
            raise ValueError(
                f"{where}: forced image grid {grid} outside [{p.min_grid_side}, "
                f"{p.max_grid_side}] per side"
            )
        if grid is not None and self.grid_limit is not None and max(grid) > self.grid_limit:
            raise ValueError(
                f"{where}: forced image grid {grid} outside the model's own limit "
                f"1..{self.grid_limit} per side"
            )
        if p.length_semantics == "exact":
            if grid is None:
                raise ValueError(f"{where}: length_semantics 'exact' needs a forced image grid")
            if p.max_new_tokens != grid[0] * grid[1]:
                raise ValueError(
                    f"{where}: length_semantics 'exact' needs max_new_tokens == H*W = "
                    f"{grid[0] * grid[1]}, got {p.max_new_tokens}"
                )
        if p.max_new_tokens is None and self.max_positions is None:
            raise ValueError(
                f"{where}: max_new_tokens None bounds the row by the model's context length, "
                "but the model declares none (pass max_positions)"
            )
        need = len(prompt) + 1
        if p.length_semantics == "exact" and grid is not None:
            need += grid[0] * grid[1]
        if self.max_positions is not None and need > self.max_positions:
            raise ValueError(
                f"{where}: needs {need} positions (prompt {len(prompt)}), more than the "
                f"context length {self.max_positions}"
            )

    # ---- decoding ------------------------------------------------------------------
    @torch.no_grad()
    def generate(self, requests: Sequence[RolloutRequest]) -> list[RolloutTrajectory]:
        """Sample every request; returns one trajectory per request, in request order."""
        if len(requests) == 0:
            return []
        was_training = self.model.training
        self.model.eval()
        try:
            if self.precision == "bf16":
                with torch.autocast(self.model.device.type, dtype=torch.bfloat16):
                    return self._generate(list(requests))
            return self._generate(list(requests))
        finally:
            self.model.train(was_training)

    def _generate(self, requests: list[RolloutRequest]) -> list[RolloutTrajectory]:
        device = self.model.device
        states, prompts, twins = [], [], []
        memo: dict[tuple, tuple[Trajectory, tuple | None]] = {}
        given = {id(r.prompt): r.prompt for r in requests if isinstance(r.prompt, Trajectory)}
        validate_all(list(given.values()))
        for k, req in enumerate(requests):
            prompt, grid = self._prompt(req, memo)
            extra = 0
            if req.params.guided:
                twin = unconditional_prompt(self.model, prompt)
                twins.append((k, twin))
                extra = max(0, len(twin) - len(prompt))
            limit = None if self.max_positions is None else self.max_positions - extra
            states.append(
                RowState(
                    prompt,
                    req.params,
                    self.tokenizer,
                    limit,
                    grid,
                    self.special,
                    self.parse_header,
                )
            )
            prompts.append(prompt)
        gens = [torch.Generator(device=device).manual_seed(r.seed) for r in requests]
        # Batch rows: conditional row of each request, then the unconditional twins.
        rows = [(k, False) for k in range(len(requests))] + [(k, True) for k, _ in twins]
        # The decode loop runs in inference mode (no version counters or autograd
        # bookkeeping per op); the trajectories are built outside it, as ordinary tensors.
        with torch.inference_mode():
            keys = [_keys(r.params) for r in requests]
            if self.slots is None:
                self._decode(states, gens, rows, prompts + [t for _, t in twins], keys)
            else:
                self._decode_slots(states, gens, prompts, dict(twins), keys)
        out = [s.to_trajectory(r.id, r.seed, validate=False) for s, r in zip(states, requests)]
        validate_all(out)
        return out

    def _decode(
        self, states: list[RowState], gens, rows, prompts: list[Trajectory], keys: list[tuple]
    ) -> None:
        batch = DecodeBatch.prefill(
            self.model, prompts, self.special.pad, self.share_prefill, self.lean
        )
        while True:
            self._act(states, gens, rows, batch.hidden, keys)
            live = [b for b, (k, _) in enumerate(rows) if not states[k].done]
            if not live:
                break
            if self.finished == "compact" and _compact_now(len(rows) - len(live), len(rows)):
                order = holes_filled(live)
                batch.select(order)
                rows = [rows[b] for b in order]
            batch.step(self.model, self._inputs(states, rows))

    def _decode_slots(
        self,
        states: list[RowState],
        gens,
        prompts: list[Trajectory],
        twins: dict[int, Trajectory],
        keys: list[tuple],
    ) -> None:
        """Continuous batching (`uniweave.rollout.continuous`): `self.slots` decode slots;
        requests wait in order and each takes a free slot (two, for a guided pair) as soon
        as one frees up."""
        n_rows = len(states) + len(twins)
        margin = max(len(p) for p in [*prompts, *twins.values()])
        lean = lean_step(self.model) if self.lean else None
        assert self.slots is not None, "continuous batching without a slot count"
        batch = SlotBatch(self.model, min(self.slots, n_rows), margin, lean)
        slot_rows: list[tuple[int, bool] | None] = [None] * batch.S
        waiting = list(range(len(states)))[::-1]  # pop() takes the next in order
        pad = self.special.pad

        def admit() -> list[int]:
            free = [s for s, r in enumerate(slot_rows) if r is None]
            placed, taken = [], []
            while waiting:
                k = waiting[-1]
                need = 2 if k in twins else 1
                if need > len(free):
                    break
                waiting.pop()
                s = free.pop(0)
                slot_rows[s] = (k, False)
                placed.append((s, prompts[k]))
                taken.append(s)
                if k in twins:
                    s = free.pop(0)
                    slot_rows[s] = (k, True)
                    placed.append((s, twins[k]))
                    taken.append(s)
            if placed:
                batch.admit(placed, pad)
            return taken

        def act(taken: list[int]) -> None:
            rows = [slot_rows[s] for s in taken]
            self._act(states, gens, rows, _rows(batch.hidden, taken), keys)
            for s in taken:
                row = slot_rows[s]
                assert row is not None, "an acting slot holds a row"
                if states[row[0]].done:
                    slot_rows[s] = None
                    batch.free(s)

        act(admit())
        while True:
            while waiting and any(r is None for r in slot_rows):
                taken = admit()
                if not taken:
                    break
                act(taken)
            live = [s for s, r in enumerate(slot_rows) if r is not None]
            if not live:
                break
            if not waiting and _compact_now(len(slot_rows) - len(live), len(slot_rows)):
                batch.select(live)
                slot_rows = [slot_rows[s] for s in live]
            batch._window()
            inputs: list[tuple[int, int, Any, int]] = []
            for r in slot_rows:
                if r is None:
                    inputs.append(pad_input(pad))
                else:
                    s = states[r[0]]
                    inputs.append((*s.last_input(), s.last_image_position()))
            ids, mods, codes, where = map(list, zip(*inputs))
            batch.step((ids, mods, codes, where))
            act([s for s, r in enumerate(slot_rows) if r is not None])

    def _act(
        self, states: list[RowState], gens, rows, hidden: torch.Tensor, keys: list[tuple]
    ) -> None:
        """Append one position to every live row, sampling in groups of equal params
        (`keys[k]`: the group keys of request k, `_keys`)."""
        cond: dict[int, int] = {}
        uncond: dict[int, int] = {}
        for b, (k, is_twin) in enumerate(rows):
            (uncond if is_twin else cond)[k] = b
        text, visual = defaultdict(list), defaultdict(list)
        for k in cond:
            s = states[k]
            if s.done:
                continue
            action = s.action
            if action == "text":
                text[keys[k][0]].append(k)
            elif action == "visual":
                visual[keys[k][1]].append(k)
            else:
                s.push_controller()
        model = self.model
        for ks in text.values():
            params = states[ks[0]].params
            dist = text_distribution(
                model.text_logits(_rows(hidden, [cond[k] for k in ks])), params
            )
            tokens = dist.mode() if params.greedy else dist.sample([gens[k] for k in ks])
            logp = dist.log_prob(tokens)
            for k, t, lp in zip(ks, tokens.tolist(), logp.tolist()):
                states[k].push_text(t, lp)
        for ks in visual.values():
            params = states[ks[0]].params
            idx = [cond[k] for k in ks] + ([uncond[k] for k in ks] if params.guided else [])
            logits = model.visual_logits(_rows(hidden, idx))
            c, u = (logits[: len(ks)], logits[len(ks) :]) if params.guided else (logits, None)
            vdist = visual_distribution(model.visual_head, c, u, params)
            codes = vdist.mode() if params.greedy else vdist.sample([gens[k] for k in ks])
            if model.visual_head == "bsq":
                assert isinstance(vdist, VisualBits), "a BSQ head samples bits"
                factors = vdist.log_prob_factors(codes)
                for j, k in enumerate(ks):
                    states[k].push_visual(codes[j].cpu(), float(factors[j].sum()), factors[j].cpu())
            else:
                logp = vdist.log_prob(codes)
                for k, code, lp in zip(ks, codes.tolist(), logp.tolist()):
                    states[k].push_visual(code, lp)

    def _inputs(self, states: list[RowState], rows) -> tuple[list[int], list[int], list, list]:
        """Next input (token, modality, code, index within its image) of each batch row;
        padding for finished rows."""
        ids: list[int] = []
        modality: list[int] = []
        codes: list[Any] = []
        where: list[Any] = []
        for k, _ in rows:
            s = states[k]
            if s.done:
                ids.append(self.special.pad)
                modality.append(Modality.TEXT)
                codes.append(None)
                where.append(0)
            else:
                t, m, c = s.last_input()
                ids.append(t)
                modality.append(m)
                codes.append(c)
                where.append(s.last_image_position())
        return ids, modality, codes, where


def _bounded_header(parse, limit: int, token_ids: Sequence[int]) -> tuple[int, int] | None:
    """`parse(token_ids)`, or None when a side of the announced grid exceeds `limit`."""
    grid = parse(token_ids)
    return None if grid is None or max(grid) > limit else grid


def _compact_now(n_finished: int, n_rows: int) -> bool:
    """Compact once at least 1/8 of the batch rows (and at least one) have finished: a
    finished row left in the batch costs one padded position per step until then, and
    each compaction moves the cache of the live rows that fill the finished rows' places."""
    return n_finished > 0 and 8 * n_finished >= n_rows


@lru_cache(maxsize=256)
def _keys(params: SamplingParams) -> tuple[tuple, tuple]:
    """(text group key, visual group key) of `params`: rows with equal keys share one
    distribution per step (greedy rows apart)."""
    return (params.text_key(), params.greedy), (params.visual_key(), params.greedy)


def _rows(hidden: torch.Tensor, idx: list[int]) -> torch.Tensor:
    """hidden[idx], without a gather when idx is every row in order."""
    if len(idx) == hidden.shape[0] and idx == list(range(len(idx))):
        return hidden
    return hidden[idx]


def _append_prompt(traj: Trajectory, ids: list[int]) -> Trajectory:
    """`traj` followed by text positions `ids` owned by the prompt."""
    n = len(ids)
    codes = traj.visual_codes
    pad = torch.zeros(n, *codes.shape[1:], dtype=codes.dtype) if codes.dim() == 2 else None
    return Trajectory(
        token_ids=torch.cat([traj.token_ids, torch.tensor(ids, dtype=torch.long)]),
        modality=torch.cat([traj.modality, torch.full((n,), int(Modality.TEXT))]),
        owner=torch.cat([traj.owner, torch.full((n,), int(Owner.PROMPT))]),
        visual_codes=torch.cat([codes, pad if pad is not None else torch.full((n,), -1)]),
        image_grids=list(traj.image_grids),
        sample_id=traj.sample_id,
        images=list(traj.images),
    ).validate()
