"""One rollout row as a small state machine (docs/architecture.md §4).

Modes: *text* samples text tokens; sampling `<|vision_start|>` right after a valid
`<image_gen> generate image H W` header switches to *visual* mode for exactly H*W
positions (the image's grid is recorded when it starts); then the *controller* appends
`<|vision_end|>` (owner CONTROLLER, not sampled) and the row is back in text mode. Each
call appends exactly one position; `action` says which kind comes next. Stop conditions
and their precedence are in `uniweave.rollout.stopping`.

The state knows nothing about batching or caches, so the engine (KV-cached, batched)
and a reference decoder (full recomputation) drive the same machine.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Literal

import torch
from transformers import PreTrainedTokenizerBase

from uniweave.core.trajectory import Trajectory
from uniweave.core.types import FinishReason, Modality, Owner
from uniweave.data.tokenizer import SpecialIds
from uniweave.models.base import StreamIds
from uniweave.rollout.params import SamplingParams
from uniweave.rollout.request import RolloutTrajectory, SamplingRecord
from uniweave.rollout.stopping import has_cycle, image_header

Action = Literal["text", "visual", "controller"]


class RowState:
    """Positions of one row: the prompt, then what was sampled or inserted.

    `limit` is the most positions the row may hold (the model's context length, minus
    any extra length of its unconditional twin); None means unbounded. `special` gives the
    ids of the stream (default: the tokenizer's ChatML ids) and `parse_header` reads the
    image announced by the text before a sampled `vision_start` (default: the ChatML
    header, `uniweave.data.template.parse_image_header`; `UnifiedModel.parse_image_header`).
    """

    def __init__(
        self,
        prompt: Trajectory,
        params: SamplingParams,
        tokenizer: PreTrainedTokenizerBase,
        limit: int | None = None,
        forced_grid: tuple[int, int] | None = None,
        special: SpecialIds | StreamIds | None = None,
        parse_header: Callable[[Sequence[int]], tuple[int, int] | None] | None = None,
    ) -> None:
        self.params = params
        self.tokenizer = tokenizer
        self.special = special if special is not None else SpecialIds.from_tokenizer(tokenizer)
        self.parse_header = parse_header
        self.stops = frozenset({self.special.eos, *params.stop_token_ids})
        self.prompt = prompt
        self.prompt_length = len(prompt)
        self.limit = limit if limit is not None else float("inf")
        self.ids: list[int] = prompt.token_ids.tolist()
        self.new_modality: list[int] = []
        self.new_owner: list[int] = []
        self.new_codes: list[int | torch.Tensor | None] = []
        self.new_logp: list[float] = []
        self.new_factors: list[torch.Tensor | None] = []
        self.grids: list[tuple[int, int]] = []
        self.n_policy = 0
        self.mode: Literal["text", "visual"] = "text"
        self.remaining = 0
        self.text_run: list[int] = []
        self.finish_reason: FinishReason | None = None
        if forced_grid is not None:
            self._start_image(forced_grid)

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def action(self) -> Action:
        """What the next position is: a sampled text token, a sampled visual code, or the
        controller's `<|vision_end|>`."""
        if self.mode == "visual":
            return "visual" if self.remaining > 0 else "controller"
        return "text"

    def last_input(self) -> tuple[int, int, int | torch.Tensor | None]:
        """(token id, modality, code or None) of the last position (the next model input)."""
        if not self.new_owner:
            raise RuntimeError("no position has been appended yet")
        return self.ids[-1], self.new_modality[-1], self.new_codes[-1]

    def last_image_position(self) -> int:
        """Raster index, within its image, of the last position if it is visual (else 0)."""
        if not self.new_modality or self.new_modality[-1] != Modality.VISUAL:
            return 0
        h, w = self.grids[-1]
        return h * w - self.remaining - 1

    def push_text(self, token: int, logp: float) -> None:
        """Append a sampled text token and apply the text-mode rules."""
        self._add(token, Modality.TEXT, Owner.POLICY, None, logp, None)
        self.n_policy += 1
        if token in self.stops:
            return self._finish("eos")
        if token == self.special.vision_start:
            grid = image_header(self.text_run, self.tokenizer, self.params, self.parse_header)
            if grid is not None:
                self._start_image(grid)
                return self._check_limits()
            if self.params.on_invalid_header == "invalid":
                return self._finish("invalid")
        self.text_run.append(token)
        if has_cycle(self.text_run, self.params.cycle_max_period, self.params.cycle_repeats):
            return self._finish("cycle")
        self._check_limits()

    def push_visual(
        self, code: int | torch.Tensor, logp: float, factors: torch.Tensor | None = None
    ) -> None:
        """Append a sampled visual code (VQ index, or BSQ bits [L] with per-factor log-probs)."""
        if self.action != "visual":
            raise RuntimeError(f"push_visual in {self.action} mode")
        self._add(self.special.image_pad, Modality.VISUAL, Owner.POLICY, code, logp, factors)
        self.n_policy += 1
        self.remaining -= 1
        if self.remaining > 0:
            return self._check_limits()
        if self.params.at_cap(self.n_policy):
            if len(self.ids) < self.limit:
                self._close_image()
            exact = self.params.length_semantics == "exact"
            return self._finish("length_exact" if exact else "cap")
        if len(self.ids) >= self.limit:
            self._finish("context")

    def push_controller(self) -> None:
        """Append `<|vision_end|>` after a complete image (owner CONTROLLER)."""
        if self.action != "controller":
            raise RuntimeError(f"push_controller in {self.action} mode")
        self._close_image()
        self._check_limits()

    def _add(
        self,
        token: int,
        modality: int,
        owner: int,
        code: int | torch.Tensor | None,
        logp: float,
        factors: torch.Tensor | None,
    ) -> None:
        if self.done:
            raise RuntimeError(f"row already finished ({self.finish_reason})")
        self.ids.append(token)
        self.new_modality.append(modality)
        self.new_owner.append(owner)
        self.new_codes.append(code)
        self.new_logp.append(logp)
        self.new_factors.append(factors)

    def _start_image(self, grid: tuple[int, int]) -> None:
        self.mode, self.remaining = "visual", grid[0] * grid[1]
        self.grids.append(grid)

    def _close_image(self) -> None:
        self._add(self.special.vision_end, Modality.TEXT, Owner.CONTROLLER, None, 0.0, None)
        self.mode, self.text_run = "text", []

    def _check_limits(self) -> None:
        if self.params.at_cap(self.n_policy):
            self._finish("cap")
        elif len(self.ids) >= self.limit:
            self._finish("context")

    def _finish(self, reason: FinishReason) -> None:
        self.finish_reason = reason

    def stream(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(token_ids, modality, owner, visual_codes) of every position so far."""
        p, n = self.prompt, len(self.new_owner)
        if p.is_bits:
            new_codes = torch.zeros(n, p.visual_codes.shape[1], dtype=p.visual_codes.dtype)
            for k, c in enumerate(self.new_codes):
                if c is not None:
                    new_codes[k] = c
        else:
            new_codes = torch.tensor([-1 if c is None else c for c in self.new_codes])
        return (
            torch.tensor(self.ids, dtype=torch.long),
            torch.cat([p.modality, torch.tensor(self.new_modality, dtype=torch.long)]),
            torch.cat([p.owner, torch.tensor(self.new_owner, dtype=torch.long)]),
            torch.cat([p.visual_codes, new_codes.to(p.visual_codes.dtype)]),
        )

    def to_trajectory(
        self, sample_id: str, seed: int | None = None, validate: bool = True
    ) -> RolloutTrajectory:
        """The row as a `RolloutTrajectory` (rollout log-probs 0 off policy), validated
        unless `validate` is False (the caller validates many at once: `validate_all`)."""
        token_ids, modality, owner, codes = self.stream()
        factors = None
        if self.prompt.is_bits:
            factors = torch.zeros(codes.shape)
            for k, f in enumerate(self.new_factors):
                if f is not None:
                    factors[self.prompt_length + k] = f
        logp = torch.cat([torch.zeros(self.prompt_length), torch.tensor(self.new_logp)])
        traj = RolloutTrajectory(
            token_ids=token_ids,
            modality=modality,
            owner=owner,
            visual_codes=codes,
            image_grids=[*self.prompt.image_grids, *self.grids],
            sample_id=sample_id,
            rollout_logp=logp,
            rollout_logp_factors=factors,
            finish_reason=self.finish_reason,
            length_semantics=self.params.length_semantics,
            sampling=SamplingRecord(self.params, self.prompt_length, seed),
            images=list(self.prompt.images),
        )
        return traj.validate() if validate else traj
