"""The token stream (docs/architecture.md §2): a `Trajectory` per sample, `TrajectoryBatch` padded.

Convention: position t holds token t. Scored positions are those with owner == POLICY
(never position 0); the log-prob stored at position t is log pi(token t | tokens < t),
computed from the model's hidden state at t-1. `visual_codes` is VQ long [T] (-1 where
not visual) or BSQ float32 [T, L] with values {0, 1} (0 where not visual). Visual
positions hold the placeholder token id (`<|image_pad|>`).

`images` are the trajectory's *understanding-image inputs*, in order of appearance: what
the model reads that its token stream only points at (Janus-Pro: the pixels of each
``<begin_of_image>`` + placeholder block, float [S, S, 3] in [0, 1]). They travel with the
trajectory — in a batch, across processes, on disk — so any model built from the same
checkpoint (a frozen reference, a teacher, a resumed run, a worker) can replay it with no
state hidden in the model. Models that encode input images into visual positions (the
tiny model) carry none.

A batch is right-padded: row i's real positions are 0..lengths[i]-1. Padding values:
token_ids = pad_id, modality = TEXT, owner = PROMPT, visual_codes = -1 (VQ) / 0 (BSQ),
rollout log-probs = 0. `collate` then `unbatch` returns equal trajectories.
`to_state` / `from_state` turn a trajectory into plain tensors, strings and numbers (what
`torch.load(..., weights_only=True)` accepts) and back; `save_trajectories` /
`load_trajectories` write and read a list of them atomically.

Per-row training data (one separated block of fields): what a batch source attaches to a
row for the objective that trains on it, so that a micro-batch is self-describing —
`advantage` (a float; collated to float32 [B]), the ratio's anchor `old_logp` /
`old_logp_factors` (laid out like the rollout log-probs, 0 off the policy positions),
the row's stateless `seed`, and `sampling` (how the row was produced; opaque to core, the
rollout layer's `SamplingRecord`). Each is optional; a batch has a tensor field only when
every row has it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import torch
from torch.nn.utils.rnn import pad_sequence

from unirl.core.atomic import atomic_write
from unirl.core.types import (
    FINISH_REASONS,
    LENGTH_SEMANTICS,
    TRUNCATED_REASONS,
    FinishReason,
    LengthSemantics,
    Modality,
    Owner,
)

VQ_PAD = -1
BITS_PAD = 0.0
_OPTIONAL_PER_ROW = (
    "rollout_logp",
    "rollout_logp_factors",
    "advantage",
    "old_logp",
    "old_logp_factors",
)
_LOGP_FIELDS = ("rollout_logp", "old_logp", "rollout_logp_factors", "old_logp_factors")


def _fail(name: str, what: str) -> None:
    raise ValueError(f"{name}: {what}")


def _check_grids(name: str, grids: Sequence[Any]) -> list[int]:
    sizes = []
    for k, g in enumerate(grids):
        ok = isinstance(g, tuple) and len(g) == 2
        ok = ok and all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in g)
        if not ok:
            _fail(f"{name}[{k}]", f"expected a tuple (H, W) of positive ints, got {g!r}")
        sizes.append(g[0] * g[1])
    return sizes


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
            _fail("sampling", "opaque to core: save it through the subclass that owns it")
        state: dict[str, Any] = {}
        for f in fields(self):
            v = getattr(self, f.name)
            state[f.name] = [list(g) for g in v] if f.name == "image_grids" else v
        return state

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> Trajectory:
        """The trajectory `to_state` gave (validated); ValueError naming a bad field."""
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(state) - names)
        if unknown:
            raise ValueError(f"{cls.__name__}.from_state: unknown fields {unknown}")
        kw = dict(state)
        kw["image_grids"] = [tuple(int(v) for v in g) for g in state.get("image_grids", [])]
        kw["images"] = list(state.get("images", []))
        return cls(**kw).validate()

    def validate(self) -> Trajectory:
        """Check shapes, dtypes and the conventions; ValueError naming the field. Returns self.

        Checks: 1-D long token_ids/modality/owner of one length T >= 1; modality and owner
        values in their enums; position 0 not POLICY; VQ codes -1 exactly off visual
        positions (>= 0 on them), BSQ codes in {0, 1} and 0 off visual positions; the
        visual position count equals sum(H*W) of `image_grids` (a truncated row, finish
        reason cap/context/cycle, may stop inside its last image); rollout log-probs float
        of shape [T] / [T, L] and 0 at non-policy positions; finish/length labels valid.
        The layout (types, shapes, labels) is checked before the values.
        `validate_all` runs the same checks over many trajectories at once.
        """
        sizes = self._validate_layout()
        visual = self.modality == Modality.VISUAL
        if not ((self.modality == Modality.TEXT) | visual).all():
            _fail("modality", "values must be Modality.TEXT (0) or Modality.VISUAL (1)")
        if not ((self.owner >= Owner.PROMPT) & (self.owner <= Owner.CONTROLLER)).all():
            _fail("owner", "values must be Owner.PROMPT/POLICY/CONTROLLER (0/1/2)")
        if int(self.owner[0]) == Owner.POLICY:
            _fail("owner", "position 0 cannot be POLICY (it has no preceding state)")
        _check_code_values(self.visual_codes, visual)
        self._check_visual_count(int(visual.sum()), sizes)
        non_policy = self.owner != Owner.POLICY
        for name in _LOGP_FIELDS:
            lp = getattr(self, name)
            if lp is not None and (lp[non_policy] != 0).any():
                _fail(name, "must be 0 at non-policy positions")
        return self

    def _validate_layout(self) -> list[int]:
        """The checks that read no tensor values: types, dtypes, shapes, grids and labels.
        Returns H*W of each image grid."""
        for name in ("token_ids", "modality", "owner"):
            t = getattr(self, name)
            if not isinstance(t, torch.Tensor) or t.dtype != torch.long or t.dim() != 1:
                _fail(name, f"expected a long tensor [T], got {_describe(t)}")
        T = len(self)
        if T == 0:
            _fail("token_ids", "a trajectory needs at least one position")
        for name in ("modality", "owner"):
            if getattr(self, name).shape[0] != T:
                _fail(name, f"length {getattr(self, name).shape[0]} != len(token_ids) {T}")
        c = self.visual_codes
        if not isinstance(c, torch.Tensor):
            _fail("visual_codes", f"expected a tensor, got {type(c).__name__}")
        if c.dim() == 1:
            if c.dtype != torch.long or c.shape[0] != T:
                _fail("visual_codes", f"VQ codes must be long [{T}], got {_describe(c)}")
        elif c.dim() == 2:
            if not c.is_floating_point() or c.shape[0] != T or c.shape[1] == 0:
                _fail("visual_codes", f"BSQ codes must be float [{T}, L], got {_describe(c)}")
        else:
            _fail("visual_codes", f"expected VQ [T] or BSQ [T, L], got {_describe(c)}")
        sizes = _check_grids("image_grids", self.image_grids)
        for name in ("rollout_logp", "old_logp"):
            lp = getattr(self, name)
            if lp is not None and (
                not isinstance(lp, torch.Tensor) or not lp.is_floating_point() or lp.shape != (T,)
            ):
                _fail(name, f"expected a float tensor [{T}], got {_describe(lp)}")
        for name in ("rollout_logp_factors", "old_logp_factors"):
            lf = getattr(self, name)
            if lf is None:
                continue
            if not self.is_bits:
                _fail(name, "only BSQ trajectories have per-factor log-probs")
            shape = tuple(c.shape)
            if not isinstance(lf, torch.Tensor) or not lf.is_floating_point() or lf.shape != shape:
                _fail(name, f"expected a float tensor {shape}, got {_describe(lf)}")
        self._validate_training_data()
        if self.finish_reason is not None and self.finish_reason not in FINISH_REASONS:
            _fail(
                "finish_reason",
                f"expected one of {sorted(FINISH_REASONS)}, got {self.finish_reason!r}",
            )
        if self.length_semantics is not None and self.length_semantics not in LENGTH_SEMANTICS:
            _fail("length_semantics", f"expected 'cap' or 'exact', got {self.length_semantics!r}")
        if not isinstance(self.sample_id, str):
            _fail("sample_id", f"expected a str, got {type(self.sample_id).__name__}")
        if not isinstance(self.images, list) or not all(
            isinstance(x, torch.Tensor) and x.is_floating_point() for x in self.images
        ):
            _fail("images", "expected a list of float tensors (understanding-image inputs)")
        return sizes

    def _check_visual_count(self, n_visual: int, sizes: list[int]) -> None:
        expected = sum(sizes)
        truncated_inside_last = (
            self.finish_reason in TRUNCATED_REASONS
            and bool(sizes)
            and expected - sizes[-1] < n_visual < expected
        )
        if n_visual != expected and not truncated_inside_last:
            _fail(
                "image_grids",
                f"grids {self.image_grids} give {expected} visual positions, "
                f"modality has {n_visual}",
            )

    def _validate_training_data(self) -> None:
        a = self.advantage
        if a is not None and (
            isinstance(a, bool) or not isinstance(a, (int, float)) or not math.isfinite(a)
        ):
            _fail("advantage", f"expected a finite float, got {a!r}")
        s = self.seed
        if s is not None and (isinstance(s, bool) or not isinstance(s, int) or s < 0):
            _fail("seed", f"expected a non-negative int, got {s!r}")


def _check_code_values(c: torch.Tensor, visual: torch.Tensor) -> None:
    """VQ codes -1 exactly off visual positions and >= 0 on them; BSQ bits in {0, 1} and
    0 off visual positions (`c` of a valid layout)."""
    if c.dim() == 1:
        if (c[~visual] != VQ_PAD).any():
            _fail("visual_codes", "VQ codes must be -1 at non-visual positions")
        if (c[visual] < 0).any():
            _fail("visual_codes", "VQ codes must be >= 0 at visual positions")
    else:
        if not ((c == 0) | (c == 1)).all():
            _fail("visual_codes", "BSQ codes must have values in {0, 1}")
        if (c[~visual] != BITS_PAD).any():
            _fail("visual_codes", "BSQ codes must be 0 at non-visual positions")


def validate_all(trajs: Sequence[Trajectory]) -> None:
    """`Trajectory.validate` of every trajectory, with the value checks run once over the
    positions of all of them concatenated (a fixed handful of tensor ops instead of about
    twenty per trajectory). Each trajectory's layout is checked on its own; when any value
    check fails, the trajectories are validated one by one, so the ValueError is
    `validate`'s own, prefixed 'trajectory k (id)'."""
    sizes = []
    for k, t in enumerate(trajs):
        try:
            sizes.append(t._validate_layout())
        except ValueError as err:
            raise ValueError(f"trajectory {k} ({t.sample_id!r}): {err}") from None
    if not trajs or not _values_ok(trajs, sizes):
        for k, t in enumerate(trajs):
            try:
                t.validate()
            except ValueError as err:
                raise ValueError(f"trajectory {k} ({t.sample_id!r}): {err}") from None


def _values_ok(trajs: Sequence[Trajectory], sizes: list[list[int]]) -> bool:
    """True when every value check of `Trajectory.validate` passes on `trajs` (layouts
    valid); False also when they mix code kinds or devices (then checked one by one)."""
    first = trajs[0].visual_codes
    if any(
        t.visual_codes.shape[1:] != first.shape[1:] or t.visual_codes.device != first.device
        for t in trajs
    ):
        return False
    lengths = [len(t) for t in trajs]
    modality = torch.cat([t.modality for t in trajs])
    owner = torch.cat([t.owner for t in trajs])
    codes = torch.cat([t.visual_codes for t in trajs])
    visual = modality == Modality.VISUAL
    n = torch.tensor(lengths, device=owner.device)
    ends = n.cumsum(0)
    checks = [
        ((modality == Modality.TEXT) | visual).all(),
        ((owner >= Owner.PROMPT) & (owner <= Owner.CONTROLLER)).all(),
        (owner[ends - n] != Owner.POLICY).all(),
    ]
    if codes.dim() == 1:
        checks.append(torch.where(visual, codes >= 0, codes == VQ_PAD).all())
    else:
        bits = ((codes == 0) | (codes == 1)).all(-1)
        checks.append((bits & (visual | (codes == BITS_PAD).all(-1))).all())
    non_policy = owner != Owner.POLICY
    for name in _LOGP_FIELDS:
        have = [getattr(t, name) is not None for t in trajs]
        if not any(have):
            continue
        lp = torch.cat([getattr(t, name) for t, h in zip(trajs, have) if h])
        if all(have):
            mask = non_policy
        else:
            mask = torch.cat([t.owner for t, h in zip(trajs, have) if h]) != Owner.POLICY
        checks.append((lp[mask] == 0).all())
    if not bool(torch.stack(checks).all()):
        return False
    counts = visual.long().cumsum(0)[ends - 1]
    counts = torch.cat([counts[:1], counts[1:] - counts[:-1]]).tolist()
    for t, n, s in zip(trajs, counts, sizes):
        try:
            t._check_visual_count(n, s)
        except ValueError:
            return False
    return True


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
    # -- sequence packing (`unirl.train.engine.batching`): long [B, T], 1.. = the packed sequence
    # of each position within its row, 0 = padding; None = one sequence per row ----------
    segment_ids: torch.Tensor | None = None

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
                _fail(
                    "visual_codes",
                    f"trajectory {k} has {_describe(t.visual_codes)}, trajectory 0 has "
                    f"{_describe(first.visual_codes)} (VQ and BSQ / different L cannot mix)",
                )
            for name in _OPTIONAL_PER_ROW:
                if (getattr(t, name) is None) != (getattr(first, name) is None):
                    _fail(name, f"present in some trajectories but not in trajectory {k}")
        lengths = torch.tensor([len(t) for t in trajs], dtype=torch.long)
        device = first.token_ids.device
        T = int(lengths.max())
        code_pad = BITS_PAD if first.is_bits else VQ_PAD

        def pad(name: str, value: float) -> torch.Tensor | None:
            seqs = [getattr(t, name) for t in trajs]
            if seqs[0] is None:
                return None
            return pad_sequence(seqs, batch_first=True, padding_value=value)

        return cls(
            token_ids=pad("token_ids", pad_id),
            modality=pad("modality", Modality.TEXT),
            owner=pad("owner", Owner.PROMPT),
            attention_mask=torch.arange(T, device=device) < lengths.to(device)[:, None],
            visual_codes=pad("visual_codes", code_pad),
            lengths=lengths.to(device),
            image_grids=[list(t.image_grids) for t in trajs],
            sample_ids=[t.sample_id for t in trajs],
            rollout_logp=pad("rollout_logp", 0.0),
            rollout_logp_factors=pad("rollout_logp_factors", 0.0),
            finish_reasons=[t.finish_reason for t in trajs],
            length_semantics=[t.length_semantics for t in trajs],
            pad_id=pad_id,
            images=[list(t.images) for t in trajs],
            advantages=None
            if first.advantage is None
            else torch.tensor([float(t.advantage) for t in trajs], device=device),
            old_logp=pad("old_logp", 0.0),
            old_logp_factors=pad("old_logp_factors", 0.0),
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
                raise TypeError(f"tensor index must be 1-D long or bool, got {_describe(index)}")
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
                _fail(name, f"expected shape ({B}, {T}), got {tuple(getattr(self, name).shape)}")
        if self.attention_mask.dtype != torch.bool:
            _fail("attention_mask", f"expected bool, got {self.attention_mask.dtype}")
        if self.lengths.shape != (B,) or self.lengths.dtype != torch.long:
            _fail("lengths", f"expected long [{B}], got {_describe(self.lengths)}")
        expected_mask = torch.arange(T, device=self.lengths.device) < self.lengths[:, None]
        if not torch.equal(self.attention_mask, expected_mask):
            _fail("attention_mask", "must be the right-padded prefix mask of `lengths`")
        if tuple(self.visual_codes.shape[:2]) != (B, T) or self.visual_codes.dim() not in (2, 3):
            _fail(
                "visual_codes",
                f"expected [{B}, {T}] or [{B}, {T}, L], got {_describe(self.visual_codes)}",
            )
        for name in ("rollout_logp", "old_logp"):
            lp = getattr(self, name)
            if lp is not None and tuple(lp.shape) != (B, T):
                _fail(name, f"expected shape ({B}, {T}), got {_describe(lp)}")
        for name in ("rollout_logp_factors", "old_logp_factors"):
            lf = getattr(self, name)
            if lf is not None and (lf.shape != self.visual_codes.shape or not self.is_bits):
                _fail(name, f"expected the BSQ codes' shape, got {_describe(lf)}")
        if self.advantages is not None and tuple(self.advantages.shape) != (B,):
            _fail("advantages", f"expected shape ({B},), got {_describe(self.advantages)}")
        for name in ("seeds", "sampling"):
            if getattr(self, name) is not None and len(getattr(self, name)) != B:
                _fail(name, f"expected {B} entries, got {len(getattr(self, name))}")
        for name in ("image_grids", "sample_ids", "finish_reasons", "length_semantics", "images"):
            if len(getattr(self, name)) != B:
                _fail(name, f"expected {B} entries, got {len(getattr(self, name))}")
        return self


def save_trajectories(path: str | Path, trajs: Sequence[Trajectory]) -> None:
    """Write `trajs` (their `to_state`, with the class name of each) to `path` atomically:
    a temporary file, fsynced, then renamed (`unirl.core.atomic`)."""
    path = Path(path)
    payload = [{"kind": type(t).__name__, "state": t.to_state()} for t in trajs]
    with atomic_write(path, "wb") as f:
        torch.save(payload, f)


def load_trajectories(path: str | Path, kinds: Sequence[type[Trajectory]] = ()) -> list[Trajectory]:
    """The trajectories `save_trajectories` wrote (loaded with ``weights_only=True``: no
    code runs). `kinds` are the Trajectory subclasses the file may hold besides
    `Trajectory` (e.g. `unirl.rollout.RolloutTrajectory`); ValueError naming the path for
    an unreadable file or an unknown kind."""
    path = Path(path)
    classes = {c.__name__: c for c in (Trajectory, *kinds)}
    try:
        payload = torch.load(path, weights_only=True)
    except Exception as err:  # any unreadable file gets the same one line
        raise ValueError(f"{path}: not a readable trajectory file ({err})") from None
    out = []
    for k, item in enumerate(payload):
        cls = classes.get(item.get("kind")) if isinstance(item, dict) else None
        if cls is None:
            raise ValueError(f"{path}: entry {k} has an unknown kind; known: {sorted(classes)}")
        try:
            out.append(cls.from_state(item["state"]))
        except (TypeError, ValueError) as err:
            raise ValueError(f"{path}: entry {k}: {err}") from None
    return out


def _describe(t: Any) -> str:
    if isinstance(t, torch.Tensor):
        return f"{t.dtype} {tuple(t.shape)}"
    return type(t).__name__


def _moved(obj: Any, device: torch.device | str, non_blocking: bool = False) -> dict[str, Any]:
    return {
        f.name: getattr(obj, f.name).to(device, non_blocking=non_blocking)
        for f in fields(obj)
        if isinstance(getattr(obj, f.name), torch.Tensor)
    }
