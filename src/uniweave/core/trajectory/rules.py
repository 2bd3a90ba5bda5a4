"""What a valid `Trajectory` is: every rule written once (`uniweave.core.trajectory`).

The layout rules read no tensor values (types, dtypes, shapes, grids, labels, training
data): `check_layout`, one trajectory at a time. The value rules (`value_rules`) are
written over `Positions`, the positions of one or more trajectories laid end to end, so
the same expressions serve both callers: `validate` (`Trajectory.validate`) evaluates them
on the positions of its one trajectory and raises the first that fails; `validate_all`
evaluates all of them over the positions of many trajectories at once (a fixed handful of
tensor ops and one host sync instead of about twenty per trajectory) and only when one
fails validates trajectory by trajectory, so its error is `validate`'s own, prefixed
'trajectory k (id)'.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from uniweave.core.types import FINISH_REASONS, LENGTH_SEMANTICS, TRUNCATED_REASONS, Modality, Owner

VQ_PAD = -1
BITS_PAD = 0.0
# plain ints: a tensor compares with an int faster than with an IntEnum member
TEXT, VISUAL = int(Modality.TEXT), int(Modality.VISUAL)
PROMPT, POLICY, CONTROLLER = int(Owner.PROMPT), int(Owner.POLICY), int(Owner.CONTROLLER)
LOGP_FIELDS = ("rollout_logp", "old_logp", "rollout_logp_factors", "old_logp_factors")
"""The log-prob fields, 0 off the policy positions, in the order they are checked."""


def fail(name: str, what: str) -> None:
    raise ValueError(f"{name}: {what}")


def describe(t: Any) -> str:
    if isinstance(t, torch.Tensor):
        return f"{t.dtype} {tuple(t.shape)}"
    return type(t).__name__


# -- layout ----------------------------------------------------------------------------


def check_grids(name: str, grids: Sequence[Any]) -> list[int]:
    """H*W of each grid; ValueError unless each is a tuple (H, W) of positive ints."""
    sizes = []
    for k, g in enumerate(grids):
        ok = isinstance(g, tuple) and len(g) == 2
        ok = ok and all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in g)
        if not ok:
            fail(f"{name}[{k}]", f"expected a tuple (H, W) of positive ints, got {g!r}")
        sizes.append(g[0] * g[1])
    return sizes


def check_layout(t: Any) -> list[int]:
    """The rules of trajectory `t` that read no tensor values: types, dtypes, shapes,
    grids, labels and training data. Returns H*W of each image grid."""
    for name in ("token_ids", "modality", "owner"):
        x = getattr(t, name)
        if not isinstance(x, torch.Tensor) or x.dtype != torch.long or x.dim() != 1:
            fail(name, f"expected a long tensor [T], got {describe(x)}")
    T = int(t.token_ids.shape[0])
    if T == 0:
        fail("token_ids", "a trajectory needs at least one position")
    for name in ("modality", "owner"):
        if getattr(t, name).shape[0] != T:
            fail(name, f"length {getattr(t, name).shape[0]} != len(token_ids) {T}")
    c = t.visual_codes
    if not isinstance(c, torch.Tensor):
        fail("visual_codes", f"expected a tensor, got {type(c).__name__}")
    if c.dim() == 1:
        if c.dtype != torch.long or c.shape[0] != T:
            fail("visual_codes", f"VQ codes must be long [{T}], got {describe(c)}")
    elif c.dim() == 2:
        if not c.is_floating_point() or c.shape[0] != T or c.shape[1] == 0:
            fail("visual_codes", f"BSQ codes must be float [{T}, L], got {describe(c)}")
    else:
        fail("visual_codes", f"expected VQ [T] or BSQ [T, L], got {describe(c)}")
    sizes = check_grids("image_grids", t.image_grids)
    for name in ("rollout_logp", "old_logp"):
        lp = getattr(t, name)
        if lp is not None and (
            not isinstance(lp, torch.Tensor) or not lp.is_floating_point() or lp.shape != (T,)
        ):
            fail(name, f"expected a float tensor [{T}], got {describe(lp)}")
    for name in ("rollout_logp_factors", "old_logp_factors"):
        lf = getattr(t, name)
        if lf is None:
            continue
        if c.dim() != 2:
            fail(name, "only BSQ trajectories have per-factor log-probs")
        shape = tuple(c.shape)
        if not isinstance(lf, torch.Tensor) or not lf.is_floating_point() or lf.shape != shape:
            fail(name, f"expected a float tensor {shape}, got {describe(lf)}")
    check_training_data(t)
    if t.finish_reason is not None and t.finish_reason not in FINISH_REASONS:
        fail("finish_reason", f"expected one of {sorted(FINISH_REASONS)}, got {t.finish_reason!r}")
    if t.length_semantics is not None and t.length_semantics not in LENGTH_SEMANTICS:
        fail("length_semantics", f"expected 'cap' or 'exact', got {t.length_semantics!r}")
    if not isinstance(t.sample_id, str):
        fail("sample_id", f"expected a str, got {type(t.sample_id).__name__}")
    if not isinstance(t.images, list) or not all(
        isinstance(x, torch.Tensor) and x.is_floating_point() for x in t.images
    ):
        fail("images", "expected a list of float tensors (understanding-image inputs)")
    return sizes


def check_training_data(t: Any) -> None:
    a = t.advantage
    if a is not None and (
        isinstance(a, bool) or not isinstance(a, (int, float)) or not math.isfinite(a)
    ):
        fail("advantage", f"expected a finite float, got {a!r}")
    s = t.seed
    if s is not None and (isinstance(s, bool) or not isinstance(s, int) or s < 0):
        fail("seed", f"expected a non-negative int, got {s!r}")


# -- values ----------------------------------------------------------------------------


@dataclass
class Positions:
    """The positions of trajectories with valid layouts, laid end to end (`of`)."""

    modality: torch.Tensor  # long [N]
    owner: torch.Tensor  # long [N]
    codes: torch.Tensor  # VQ long [N] / BSQ float [N, L]
    starts: torch.Tensor  # long [n]: where each trajectory's position 0 is
    ends: torch.Tensor  # long [n]: one past each trajectory's last position
    expected: torch.Tensor  # long [n]: sum(H*W) of each trajectory's grids
    floor: torch.Tensor  # long [n]: fewer visual positions than expected allowed above it
    logps: dict[str, tuple[torch.Tensor, torch.Tensor]]  # name -> (values, policy mask)
    grids: list[list[tuple[int, int]]]

    @classmethod
    def of(cls, trajs: Sequence[Any], sizes: Sequence[list[int]]) -> Positions:
        """The positions of `trajs` (layouts checked, `sizes` from `check_layout`; one
        code kind and device: `mixed`)."""
        device = trajs[0].owner.device

        def cat(xs: list[torch.Tensor]) -> torch.Tensor:
            return xs[0] if len(xs) == 1 else torch.cat(xs)

        floors = [
            sum(s) - s[-1] if s and t.finish_reason in TRUNCATED_REASONS else sum(s)
            for t, s in zip(trajs, sizes)
        ]
        per_row = [[len(t.token_ids) for t in trajs], [sum(s) for s in sizes], floors]
        lengths, expected, floor = torch.tensor(per_row, device=device)
        ends = lengths.cumsum(0)
        owner = cat([t.owner for t in trajs])
        logps = {}
        for name in LOGP_FIELDS:
            have = [t for t in trajs if getattr(t, name) is not None]
            if have:
                mask = owner if len(have) == len(trajs) else cat([t.owner for t in have])
                logps[name] = (cat([getattr(t, name) for t in have]), mask == POLICY)
        return cls(
            modality=cat([t.modality for t in trajs]),
            owner=owner,
            codes=cat([t.visual_codes for t in trajs]),
            starts=ends - lengths,
            ends=ends,
            expected=expected,
            floor=floor,
            logps=logps,
            grids=[t.image_grids for t in trajs],
        )


def mixed(trajs: Sequence[Any]) -> bool:
    """Whether `trajs` mix code kinds (VQ, BSQ of different L) or devices."""
    first = trajs[0].visual_codes
    return any(
        t.visual_codes.shape[1:] != first.shape[1:] or t.visual_codes.device != first.device
        for t in trajs
    )


Rule = tuple[str, torch.Tensor, "str | Callable[[], str]"]


def value_rules(p: Positions) -> Iterator[Rule]:
    """Every value rule as (field, holds, message): `holds` a bool scalar tensor, True
    when the rule holds on every position of `p`; `message` the error (for `p` of one
    trajectory; a function where it reads values). In the order `validate` checks them
    (the first that fails is its error).

    Modality and owner values in their enums; position 0 not POLICY; VQ codes -1 exactly
    off visual positions (>= 0 on them), BSQ codes in {0, 1} and 0 off visual positions;
    the visual position count equals sum(H*W) of the grids (a truncated row, finish reason
    cap/context/cycle, may stop inside its last image); log-probs 0 at non-policy
    positions."""
    visual = p.modality == VISUAL
    yield (
        "modality",
        ((p.modality == TEXT) | visual).all(),
        "values must be Modality.TEXT (0) or Modality.VISUAL (1)",
    )
    yield (
        "owner",
        ((p.owner >= PROMPT) & (p.owner <= CONTROLLER)).all(),
        "values must be Owner.PROMPT/POLICY/CONTROLLER (0/1/2)",
    )
    yield (
        "owner",
        (p.owner[p.starts] != POLICY).all(),
        "position 0 cannot be POLICY (it has no preceding state)",
    )
    c = p.codes
    if c.dim() == 1:
        yield (
            "visual_codes",
            (visual | (c == VQ_PAD)).all(),
            "VQ codes must be -1 at non-visual positions",
        )
        yield (
            "visual_codes",
            (~visual | (c >= 0)).all(),
            "VQ codes must be >= 0 at visual positions",
        )
    else:
        yield (
            "visual_codes",
            ((c == 0) | (c == 1)).all(),
            "BSQ codes must have values in {0, 1}",
        )
        yield (
            "visual_codes",
            (visual[:, None] | (c == BITS_PAD)).all(),
            "BSQ codes must be 0 at non-visual positions",
        )
    before = torch.nn.functional.pad(visual.long().cumsum(0), (1, 0))  # visual before k
    n_visual = before[p.ends] - before[p.starts]
    yield (
        "image_grids",
        ((n_visual == p.expected) | ((p.floor < n_visual) & (n_visual < p.expected))).all(),
        lambda: (
            f"grids {p.grids[0]} give {int(p.expected[0])} visual positions, "
            f"modality has {int(n_visual[0])}"
        ),
    )
    for name, (values, policy) in p.logps.items():
        on_policy = policy if values.dim() == 1 else policy[:, None]
        yield (
            name,
            (on_policy | (values == 0)).all(),
            "must be 0 at non-policy positions",
        )


def all_hold(rules: Sequence[Rule]) -> bool:
    """Whether every rule holds (one host sync)."""
    return bool(torch.stack([holds for _, holds, _ in rules]).all())


def validate(t: Any) -> None:
    """Every rule on trajectory `t`: the layout first, then the values; ValueError naming
    the field of the first rule that fails."""
    rules = list(value_rules(Positions.of([t], [check_layout(t)])))
    if all_hold(rules):
        return
    for name, holds, message in rules:
        if not bool(holds):
            fail(name, message if isinstance(message, str) else message())


def validate_all(trajs: Sequence[Any]) -> None:
    """`validate` of every trajectory, with the value rules evaluated once over the
    positions of all of them (module docstring). Each trajectory's layout is checked on
    its own; when a value rule fails (or the trajectories mix code kinds or devices), they
    are validated one by one, so the ValueError is `validate`'s own, prefixed
    'trajectory k (id)'."""
    sizes = []
    for k, t in enumerate(trajs):
        try:
            sizes.append(check_layout(t))
        except ValueError as err:
            raise ValueError(f"trajectory {k} ({t.sample_id!r}): {err}") from None
    if trajs and not mixed(trajs) and all_hold(list(value_rules(Positions.of(trajs, sizes)))):
        return
    for k, t in enumerate(trajs):
        try:
            validate(t)
        except ValueError as err:
            raise ValueError(f"trajectory {k} ({t.sample_id!r}): {err}") from None
