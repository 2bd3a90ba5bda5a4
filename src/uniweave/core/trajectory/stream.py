"""`Trajectory` and `TrajectoryBatch`, the token stream (conventions: `uniweave.core.trajectory`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any

import torch
from torch.nn.utils.rnn import pad_sequence

from uniweave.core.trajectory.rules import (
    BITS_PAD,
    VQ_PAD,
    describe,
    fail,
    validate,
    validate_all,
)
from uniweave.core.types import FinishReason, LengthSemantics, Modality, Owner

if TYPE_CHECKING:
    from typing_extensions import Self

_OPTIONAL_PER_ROW = (
    "rollout_logp",
    "rollout_logp_factors",
    "advantage",
    "old_logp",
    "old_logp_factors",
)


@dataclass
class Trajectory:
    """One sample's positions. See the module docstring for the conventions."""

    token_ids: torch.Tensor
    modality: torch.Tensor
    owner: torch.Tensor
    visual_codes: torch.Tensor
    image_grids: list[tuple[int, int]]
    sample_id: str = ""
    rollout_logp: torch.Tensor | None = None
    rollout_logp_factors: torch.Tensor | None = None
    finish_reason: FinishReason | None = None
    length_semantics: LengthSemantics | None = None
    images: list[torch.Tensor] = field(default_factory=list)
    # -- per-row training data (module docstring) ---------------------------------------
    advantage: float | None = None
    old_logp: torch.Tensor | None = None
    old_logp_factors: torch.Tensor | None = None
    seed: int | None = None
    sampling: Any = None

    def __len__(self) -> int:
        return int(self.token_ids.shape[0])

    @property
    def is_bits(self) -> bool:
        """True for BSQ codes (float [T, L])."""
        return self.visual_codes.dim() == 2

    def to(self, device: torch.device | str) -> Trajectory:
        """A copy with every tensor (images included) on `device`."""
        return replace(self, **_moved(self, device), images=[x.to(device) for x in self.images])

    def to_state(self) -> dict[str, Any]:
        """Plain tensors, strings and numbers (module docstring); `from_state` inverts it.
        `sampling` is opaque to core: the subclass that owns it (the rollout layer's
        `RolloutTrajectory`) writes it."""
        if self.sampling is not None and type(self).to_state is Trajectory.to_state:
            fail("sampling", "opaque to core: save it through the subclass that owns it")
        state: dict[str, Any] = {}
        for f in fields(self):
            v = getattr(self, f.name)
            state[f.name] = [list(g) for g in v] if f.name == "image_grids" else v
        return state

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> Self:
        """The trajectory `to_state` gave (validated); ValueError naming a bad field."""
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(state) - names)
        if unknown:
            raise ValueError(f"{cls.__name__}.from_state: unknown fields {unknown}")
        kw = dict(state)
        kw["image_grids"] = [tuple(int(v) for v in g) for g in state.get("image_grids", [])]
        kw["images"] = list(state.get("images", []))
        return cls(**kw).validate()

    def validate(self) -> Self:
        """Check every rule of `uniweave.core.trajectory.rules`: the layout (types, dtypes,
        shapes, grids, labels: `check_layout`), then the values (`value_rules`); ValueError
        naming the field of the first that fails. Returns self. `validate_all` checks the
        same rules over many trajectories at once."""
        validate(self)
        return self


@dataclass
class TrajectoryBatch:
    """Right-padded trajectories: tensors [B, T] ([B, T, L] for BSQ codes / factors)."""

    token_ids: torch.Tensor
    modality: torch.Tensor
    owner: torch.Tensor
    attention_mask: torch.Tensor
    visual_codes: torch.Tensor
    lengths: torch.Tensor
    image_grids: list[list[tuple[int, int]]]
    sample_ids: list[str]
    rollout_logp: torch.Tensor | None
    rollout_logp_factors: torch.Tensor | None
    finish_reasons: list[FinishReason | None]
    length_semantics: list[LengthSemantics | None]
    pad_id: int = 0
    images: list[list[torch.Tensor]] = field(default_factory=list)
    # -- per-row training data (module docstring): [B], [B, T], [B, T, L], lists of B ----
    advantages: torch.Tensor | None = None
    old_logp: torch.Tensor | None = None
    old_logp_factors: torch.Tensor | None = None
    seeds: list[int | None] | None = None
    sampling: list[Any] | None = None
    # -- sequence packing (`uniweave.train.engine.batching`): long [B, T], 1.. = the packed sequence
    # of each position within its row, 0 = padding; None = one sequence per row ----------
    segment_ids: torch.Tensor | None = None

    def need(self, name: str) -> torch.Tensor:
        """The optional per-row tensor `name` (`rollout_logp`, `old_logp`, their
        `_factors`, `advantages`, ...); ValueError naming it when the batch has none."""
        value = getattr(self, name)
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"TrajectoryBatch.{name}: rows {self.sample_ids[:3]} carry none")
        return value

    @classmethod
    def collate(
        cls, trajs: Sequence[Trajectory], pad_id: int, validate: bool = True
    ) -> TrajectoryBatch:
        """Right-pad `trajs` into one batch (padding values in the module docstring).

        All trajectories must agree on the code kind (VQ or BSQ with one L) and on
        whether rollout log-probs are present; with `validate` each is validated first.
        """
        if len(trajs) == 0:
            raise ValueError("collate: no trajectories")
        if validate:
            validate_all(trajs)
        first = trajs[0]
        for k, t in enumerate(trajs):
            if t.visual_codes.shape[1:] != first.visual_codes.shape[1:] or (
                t.visual_codes.dtype != first.visual_codes.dtype
            ):
                fail(
                    "visual_codes",
                    f"trajectory {k} has {describe(t.visual_codes)}, trajectory 0 has "
                    f"{describe(first.visual_codes)} (VQ and BSQ / different L cannot mix)",
                )
            for name in _OPTIONAL_PER_ROW:
                if (getattr(t, name) is None) != (getattr(first, name) is None):
                    fail(name, f"present in some trajectories but not in trajectory {k}")
        lengths = torch.tensor([len(t) for t in trajs], dtype=torch.long)
        device = first.token_ids.device
        T = int(lengths.max())
        code_pad = BITS_PAD if first.is_bits else VQ_PAD

        def pad(name: str, value: float) -> torch.Tensor:
            return pad_sequence(
                [getattr(t, name) for t in trajs], batch_first=True, padding_value=value
            )

        def pad_optional(name: str, value: float) -> torch.Tensor | None:
            return None if getattr(first, name) is None else pad(name, value)

        return cls(
            token_ids=pad("token_ids", pad_id),
            modality=pad("modality", Modality.TEXT),
            owner=pad("owner", Owner.PROMPT),
            attention_mask=torch.arange(T, device=device) < lengths.to(device)[:, None],
            visual_codes=pad("visual_codes", code_pad),
            lengths=lengths.to(device),
            image_grids=[list(t.image_grids) for t in trajs],
            sample_ids=[t.sample_id for t in trajs],
            rollout_logp=pad_optional("rollout_logp", 0.0),
            rollout_logp_factors=pad_optional("rollout_logp_factors", 0.0),
            finish_reasons=[t.finish_reason for t in trajs],
            length_semantics=[t.length_semantics for t in trajs],
            pad_id=pad_id,
            images=[list(t.images) for t in trajs],
            advantages=None
            if first.advantage is None
            else torch.tensor([float(t.advantage) for t in trajs], device=device),  # type: ignore[arg-type]  # all rows carry one (checked above)
            old_logp=pad_optional("old_logp", 0.0),
            old_logp_factors=pad_optional("old_logp_factors", 0.0),
            seeds=[t.seed for t in trajs],
            sampling=[t.sampling for t in trajs],
        )

    def __len__(self) -> int:
        return int(self.token_ids.shape[0])

    @property
    def max_length(self) -> int:
        """T, the padded length."""
        return int(self.token_ids.shape[1])

    @property
    def is_bits(self) -> bool:
        """True for BSQ codes ([B, T, L])."""
        return self.visual_codes.dim() == 3

    @property
    def n_factors(self) -> int:
        """L for BSQ codes, 1 for VQ."""
        return int(self.visual_codes.shape[2]) if self.is_bits else 1

    @property
    def policy_mask(self) -> torch.Tensor:
        """bool [B, T]: owner == POLICY on real positions (the scored positions)."""
        return (self.owner == Owner.POLICY) & self.attention_mask

    @property
    def visual_mask(self) -> torch.Tensor:
        """bool [B, T]: modality == VISUAL on real positions."""
        return (self.modality == Modality.VISUAL) & self.attention_mask

    def n_scored(self) -> int:
        """Number of scored (policy) positions in the batch."""
        return int(self.policy_mask.sum())

    def to(self, device: torch.device | str, non_blocking: bool = False) -> TrajectoryBatch:
        """A copy with every tensor (images included) on `device`."""
        images = [[x.to(device, non_blocking=non_blocking) for x in row] for row in self.images]
        return replace(self, **_moved(self, device, non_blocking), images=images)

    def __repr__(self) -> str:
        codes = "BSQ" if self.is_bits else "VQ"
        n_images = sum(len(r) for r in self.images)
        return (
            f"TrajectoryBatch(B={len(self)}, T={self.max_length}, codes={codes}, "
            f"scored={self.n_scored()}, visual={int(self.visual_mask.sum())}, "
            f"input_images={n_images}, ids={self.sample_ids[:4]}{'...' if len(self) > 4 else ''})"
        )

    def __getitem__(self, index: slice | Sequence[int] | torch.Tensor) -> TrajectoryBatch:
        """Rows selected by a slice, a list of ints, or a long (or bool [B]) tensor.

        The result is trimmed to its longest row (trailing all-padding columns dropped).
        A plain int is rejected: use `batch[i : i + 1]` or `unbatch()[i]`.
        """
        rows = self._rows(index)
        idx = torch.tensor(rows, dtype=torch.long, device=self.token_ids.device)
        T = int(self.lengths[idx].max()) if rows else 0
        out: dict[str, Any] = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name in ("lengths", "advantages") and v is not None:
                out[f.name] = v[idx]
            elif isinstance(v, torch.Tensor):
                out[f.name] = v[idx, :T]
            elif isinstance(v, list):
                out[f.name] = [v[r] for r in rows]
            else:
                out[f.name] = v
        return TrajectoryBatch(**out)

    def _rows(self, index: slice | Sequence[int] | torch.Tensor) -> list[int]:
        B = len(self)
        if isinstance(index, slice):
            index = list(range(B))[index]
        elif isinstance(index, int):
            raise TypeError(
                "TrajectoryBatch index must be a slice, list of ints or tensor; "
                "use batch[i : i + 1] for one row or unbatch() for trajectories"
            )
        elif isinstance(index, torch.Tensor):
            if index.dtype == torch.bool:
                if index.shape != (B,):
                    raise IndexError(f"bool index must have shape ({B},), got {tuple(index.shape)}")
                index = index.nonzero().flatten()
            elif index.dtype != torch.long or index.dim() != 1:
                raise TypeError(f"tensor index must be 1-D long or bool, got {describe(index)}")
            index = index.tolist()
        rows = []
        for r in index:
            if isinstance(r, bool) or not isinstance(r, int):
                raise TypeError(f"row index must be an int, got {r!r}")
            if not -B <= r < B:
                raise IndexError(f"row {r} out of range for a batch of {B}")
            rows.append(r % B)
        if not rows:
            raise IndexError("an index selecting no rows gives an empty batch")
        return rows

    def micro_batches(self, size: int) -> list[TrajectoryBatch]:
        """Consecutive chunks of `size` rows (the last may be smaller), each trimmed."""
        if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
            raise ValueError(f"micro-batch size must be a positive int, got {size!r}")
        return [self[s : s + size] for s in range(0, len(self), size)]

    def without_training_data(self) -> TrajectoryBatch:
        """The same rows without the per-row training tensors (advantages, anchors): what
        a scoring pass needs, and what it may mix with rows that never had them."""
        return replace(self, advantages=None, old_logp=None, old_logp_factors=None)

    def unbatch(self) -> list[Trajectory]:
        """The trajectories this batch was collated from (exact inverse of `collate`)."""
        out = []

        def row(name: str, i: int, n: int) -> torch.Tensor | None:
            v = getattr(self, name)
            return None if v is None else v[i, :n].clone()

        for i, n in enumerate(self.lengths.tolist()):
            out.append(
                Trajectory(
                    token_ids=self.token_ids[i, :n].clone(),
                    modality=self.modality[i, :n].clone(),
                    owner=self.owner[i, :n].clone(),
                    visual_codes=self.visual_codes[i, :n].clone(),
                    image_grids=list(self.image_grids[i]),
                    sample_id=self.sample_ids[i],
                    rollout_logp=row("rollout_logp", i, n),
                    rollout_logp_factors=row("rollout_logp_factors", i, n),
                    finish_reason=self.finish_reasons[i],
                    length_semantics=self.length_semantics[i],
                    images=list(self.images[i]),
                    advantage=None if self.advantages is None else float(self.advantages[i]),
                    old_logp=row("old_logp", i, n),
                    old_logp_factors=row("old_logp_factors", i, n),
                    seed=None if self.seeds is None else self.seeds[i],
                    sampling=None if self.sampling is None else self.sampling[i],
                )
            )
        return out

    def validate(self) -> TrajectoryBatch:
        """Check the batch's shapes and padding agree; ValueError naming the field."""
        B, T = len(self), self.max_length
        for name in ("token_ids", "modality", "owner", "attention_mask"):
            if tuple(getattr(self, name).shape) != (B, T):
                fail(name, f"expected shape ({B}, {T}), got {tuple(getattr(self, name).shape)}")
        if self.attention_mask.dtype != torch.bool:
            fail("attention_mask", f"expected bool, got {self.attention_mask.dtype}")
        if self.lengths.shape != (B,) or self.lengths.dtype != torch.long:
            fail("lengths", f"expected long [{B}], got {describe(self.lengths)}")
        expected_mask = torch.arange(T, device=self.lengths.device) < self.lengths[:, None]
        if not torch.equal(self.attention_mask, expected_mask):
            fail("attention_mask", "must be the right-padded prefix mask of `lengths`")
        if tuple(self.visual_codes.shape[:2]) != (B, T) or self.visual_codes.dim() not in (2, 3):
            fail(
                "visual_codes",
                f"expected [{B}, {T}] or [{B}, {T}, L], got {describe(self.visual_codes)}",
            )
        for name in ("rollout_logp", "old_logp"):
            lp = getattr(self, name)
            if lp is not None and tuple(lp.shape) != (B, T):
                fail(name, f"expected shape ({B}, {T}), got {describe(lp)}")
        for name in ("rollout_logp_factors", "old_logp_factors"):
            lf = getattr(self, name)
            if lf is not None and (lf.shape != self.visual_codes.shape or not self.is_bits):
                fail(name, f"expected the BSQ codes' shape, got {describe(lf)}")
        if self.advantages is not None and tuple(self.advantages.shape) != (B,):
            fail("advantages", f"expected shape ({B},), got {describe(self.advantages)}")
        for name in ("seeds", "sampling"):
            if getattr(self, name) is not None and len(getattr(self, name)) != B:
                fail(name, f"expected {B} entries, got {len(getattr(self, name))}")
        for name in ("image_grids", "sample_ids", "finish_reasons", "length_semantics", "images"):
            if len(getattr(self, name)) != B:
                fail(name, f"expected {B} entries, got {len(getattr(self, name))}")
        return self


def _moved(obj: Any, device: torch.device | str, non_blocking: bool = False) -> dict[str, Any]:
    return {
        f.name: getattr(obj, f.name).to(device, non_blocking=non_blocking)
        for f in fields(obj)
        if isinstance(getattr(obj, f.name), torch.Tensor)
    }
