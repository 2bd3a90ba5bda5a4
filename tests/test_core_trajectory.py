from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from uniweave.core import Modality, Owner, Trajectory, TrajectoryBatch
from uniweave.core.trajectory import validate_all

PAD, IMG = 0, 9
P, POL, C = int(Owner.PROMPT), int(Owner.POLICY), int(Owner.CONTROLLER)


def _traj(
    n_prompt: int,
    grid: tuple[int, int] | None,
    n_text: int,
    bits: int = 0,
    seed: int = 0,
    sid: str = "",
    logp: bool = True,
) -> Trajectory:
    """prompt text, then an assistant image (policy; vision_end by controller), then text."""
    g = torch.Generator().manual_seed(seed)
    n_vis = grid[0] * grid[1] if grid else 0
    tok, mod, own = [], [], []
    tok += torch.randint(1, 9, (n_prompt,), generator=g).tolist()
    mod += [0] * n_prompt
    own += [P] * n_prompt
    if grid:
        tok += [3] + [IMG] * n_vis + [4]
        mod += [0] + [1] * n_vis + [0]
        own += [POL] * (n_vis + 1) + [C]
    tok += torch.randint(1, 9, (n_text,), generator=g).tolist()
    mod += [0] * n_text
    own += [POL] * n_text
    T = len(tok)
    modality = torch.tensor(mod)
    owner = torch.tensor(own)
    visual = modality == Modality.VISUAL
    if bits:
        codes = torch.randint(0, 2, (T, bits), generator=g).float() * visual[:, None]
    else:
        codes = torch.where(visual, torch.randint(0, 16, (T,), generator=g), -1)
    policy = owner == Owner.POLICY
    rl = (-torch.rand(T, generator=g)) * policy if logp else None
    rf = None
    if logp and bits:
        rf = -torch.rand(T, bits, generator=g) * policy[:, None]
    return Trajectory(
        token_ids=torch.tensor(tok),
        modality=modality,
        owner=owner,
        visual_codes=codes,
        image_grids=[grid] if grid else [],
        sample_id=sid,
        rollout_logp=rl,
        rollout_logp_factors=rf,
        finish_reason="eos",
        length_semantics="cap",
    )


def _trajs(bits: int = 0) -> list[Trajectory]:
    shapes = [(3, (2, 2), 2), (5, None, 4), (2, (1, 3), 0), (4, (2, 1), 6), (1, None, 1)]
    return [
        _traj(n, grid, t, bits=bits, seed=i, sid=f"p{i // 2}/{i % 2}")
        for i, (n, grid, t) in enumerate(shapes)
    ]


def _assert_traj_equal(a: Trajectory, b: Trajectory) -> None:
    for name in ("token_ids", "modality", "owner", "visual_codes"):
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype and torch.equal(x, y), name
    for name in ("rollout_logp", "rollout_logp_factors"):
        x, y = getattr(a, name), getattr(b, name)
        assert (x is None) == (y is None), name
        if x is not None:
            assert x.dtype == y.dtype and torch.equal(x, y), name
    assert a.image_grids == b.image_grids
    assert (a.sample_id, a.finish_reason, a.length_semantics) == (
        b.sample_id,
        b.finish_reason,
        b.length_semantics,
    )


@pytest.mark.parametrize("bits", [0, 5])
def test_collate_pads_and_unbatch_round_trips(bits):
    trajs = _trajs(bits)
    b = TrajectoryBatch.collate(trajs, pad_id=PAD)
    lengths = [len(t) for t in trajs]
    B, T = len(trajs), max(lengths)
    assert len(b) == B and b.max_length == T and b.is_bits == bool(bits)
    assert b.n_factors == (bits or 1)
    assert b.lengths.tolist() == lengths
    assert b.token_ids.shape == (B, T) and b.visual_codes.shape[:2] == (B, T)
    pad = ~b.attention_mask
    assert b.attention_mask.dtype == torch.bool
    assert b.attention_mask.sum(1).tolist() == lengths
    assert (b.token_ids[pad] == PAD).all()
    assert (b.owner[pad] == Owner.PROMPT).all() and (b.modality[pad] == Modality.TEXT).all()
    assert (b.visual_codes[pad] == (0 if bits else -1)).all()
    assert (b.rollout_logp[pad] == 0).all()
    for i, t in enumerate(trajs):
        assert b.policy_mask[i].sum() == (t.owner == Owner.POLICY).sum()
        assert b.visual_mask[i].sum() == (t.modality == Modality.VISUAL).sum()
    assert b.n_scored() == sum(int((t.owner == Owner.POLICY).sum()) for t in trajs)
    assert not (b.policy_mask & pad).any()
    out = b.unbatch()
    assert len(out) == B
    for a, c in zip(trajs, out):
        _assert_traj_equal(a, c)
        c.validate()
    b.validate()


def test_policy_mask_excludes_padding_even_if_owner_says_policy():
    b = TrajectoryBatch.collate(_trajs(), pad_id=PAD)
    b.owner[~b.attention_mask] = Owner.POLICY
    expected = (b.owner == Owner.POLICY) & b.attention_mask
    assert torch.equal(b.policy_mask, expected)
    assert not b.policy_mask[~b.attention_mask].any()


@pytest.mark.parametrize("bits", [0, 3])
def test_getitem_selects_and_trims(bits):
    trajs = _trajs(bits)
    b = TrajectoryBatch.collate(trajs, pad_id=PAD)
    for index, rows in [
        (slice(1, 3), [1, 2]),
        ([4, 2], [4, 2]),
        (torch.tensor([0, 3]), [0, 3]),
        (torch.tensor([False, True, False, False, True]), [1, 4]),
        ([-1], [4]),
        (slice(None, None, 2), [0, 2, 4]),
    ]:
        sub = b[index]
        ref = TrajectoryBatch.collate([trajs[r] for r in rows], pad_id=PAD)
        assert sub.max_length == max(len(trajs[r]) for r in rows)
        assert sub.sample_ids == [trajs[r].sample_id for r in rows]
        for name in ("token_ids", "modality", "owner", "attention_mask", "visual_codes"):
            assert torch.equal(getattr(sub, name), getattr(ref, name)), name
        assert torch.equal(sub.rollout_logp, ref.rollout_logp)
        assert sub.image_grids == ref.image_grids and sub.pad_id == PAD
        for a, c in zip([trajs[r] for r in rows], sub.unbatch()):
            _assert_traj_equal(a, c)
    short = b[[2, 4]]
    assert short.max_length == max(len(trajs[2]), len(trajs[4])) < b.max_length
    with pytest.raises(TypeError):
        b[0]
    with pytest.raises(IndexError):
        b[[5]]
    with pytest.raises(IndexError):
        b[3:3]


def test_micro_batches_cover_batch_in_order():
    trajs = _trajs(4)
    b = TrajectoryBatch.collate(trajs, pad_id=PAD)
    mbs = b.micro_batches(2)
    assert [len(m) for m in mbs] == [2, 2, 1]
    assert [m.max_length for m in mbs] == [
        max(len(trajs[0]), len(trajs[1])),
        max(len(trajs[2]), len(trajs[3])),
        len(trajs[4]),
    ]
    assert sum(m.n_scored() for m in mbs) == b.n_scored()
    flat = [t for m in mbs for t in m.unbatch()]
    for a, c in zip(trajs, flat):
        _assert_traj_equal(a, c)
    assert len(b.micro_batches(10)) == 1
    with pytest.raises(ValueError, match="size"):
        b.micro_batches(0)


def _devices() -> list[str]:
    return ["meta"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", _devices())
def test_to_moves_every_tensor(device):
    b = TrajectoryBatch.collate(_trajs(3), pad_id=PAD)
    moved = b.to(device)
    tensors = [n for n, v in vars(moved).items() if isinstance(v, torch.Tensor)]
    assert set(tensors) >= {"token_ids", "rollout_logp", "rollout_logp_factors", "lengths"}
    for name in tensors:
        assert getattr(moved, name).device.type == device, name
        assert getattr(b, name).device.type == "cpu", name
    assert moved.sample_ids == b.sample_ids and moved.image_grids == b.image_grids
    t = _trajs()[0].to(device)
    assert t.token_ids.device.type == device and t.rollout_logp.device.type == device


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_round_trip_and_slicing():
    trajs = _trajs(2)
    b = TrajectoryBatch.collate([t.to("cuda") for t in trajs], pad_id=PAD)
    assert b.attention_mask.is_cuda and b.lengths.is_cuda
    sub = b[torch.tensor([3, 1], device="cuda")]
    for a, c in zip([trajs[3], trajs[1]], sub.to("cpu").unbatch()):
        _assert_traj_equal(a, c)


def _bad(field: str, **changes) -> None:
    """`validate` names `field`; so does `validate_all` on a list where the bad trajectory
    sits between valid ones (its bulk value checks must catch what `validate` catches)."""
    bits = changes.pop("bits", 0)
    t = _traj(3, (2, 2), 2, bits=bits)
    for k, v in changes.items():
        setattr(t, k, v)
    with pytest.raises(ValueError, match=field):
        t.validate()
    good = [_traj(2 + k, (2, 2), k, bits=bits, seed=k, sid=f"ok{k}") for k in range(2)]
    with pytest.raises(ValueError, match=rf"trajectory 1 \(.*\): .*{field}"):
        validate_all([good[0], t, good[1]])


def test_validation_names_the_field():
    t = _traj(3, (2, 2), 2)
    T = len(t)
    _bad("modality", modality=torch.zeros(T - 1, dtype=torch.long))
    _bad("token_ids", token_ids=t.token_ids.float())
    _bad("owner", owner=torch.full((T,), 5))
    _bad("owner", owner=torch.ones(T, dtype=torch.long))  # position 0 is policy
    _bad("visual_codes", visual_codes=torch.zeros(T, dtype=torch.long))  # 0 off-visual
    _bad("visual_codes", visual_codes=torch.ones(T, 3))  # BSQ bits set off-visual
    _bad("visual_codes", visual_codes=torch.zeros(T, 3, 2))
    _bad("image_grids", image_grids=[(2, 3)])
    _bad("image_grids", image_grids=[[2, 2]])
    _bad("rollout_logp", rollout_logp=torch.full((T,), -1.0))
    _bad("rollout_logp", rollout_logp=torch.zeros(T + 1))
    _bad("rollout_logp_factors", rollout_logp_factors=torch.zeros(T, 2))  # VQ has no factors
    _bad("finish_reason", finish_reason="stopped")
    _bad("length_semantics", length_semantics="soft")
    _bad("visual_codes", bits=4, visual_codes=t.visual_codes.new_zeros(T, 4) + 2)
    _bad("visual_codes", visual_codes=torch.where(t.modality == 1, -2, -1))  # < 0 on visual
    _bad("rollout_logp_factors", bits=4, rollout_logp_factors=torch.full((T, 4), -1.0))
    _bad("old_logp", old_logp=torch.full((T,), -1.0))
    _bad("sample_id", sample_id=3)


def _cut_inside_image(t: Trajectory) -> Trajectory:
    """`t` (one 2x2 image last) cut 3 positions before its end, inside the image: a
    truncated row (finish reason cap) that keeps the image's grid."""
    return Trajectory(
        token_ids=t.token_ids[:-3],
        modality=t.modality[:-3],
        owner=t.owner[:-3],
        visual_codes=t.visual_codes[:-3],
        image_grids=[(2, 2)],
        finish_reason="cap",
    )


def test_validate_all_accepts_what_validate_accepts():
    """Mixed code kinds, rows with and without log-probs, truncated rows: no error."""
    vq = [_traj(3, (2, 2), k, seed=k) for k in range(3)] + [_traj(2, None, 4, logp=False)]
    cut = _cut_inside_image(_traj(3, (2, 2), 0))
    for trajs in (vq, vq + [cut], [_traj(3, (2, 2), 1, bits=4)] + vq[:1], []):
        for t in trajs:
            t.validate()
        validate_all(trajs)


def test_code_checks_accept_and_refuse_exactly_the_conventions():
    """Each single-entry change of a valid row is refused with the message of the rule it
    breaks; -0.0 is a valid BSQ zero."""
    vq = _traj(3, (2, 2), 2)
    at_visual = int(torch.nonzero(vq.modality == Modality.VISUAL)[0])
    off_visual = 0
    cases = [(off_visual, -5, "-1 at non-visual"), (off_visual, 0, "-1 at non-visual")]
    cases += [(at_visual, -1, ">= 0 at visual"), (at_visual, -7, ">= 0 at visual")]
    for pos, value, message in cases:
        t = dataclasses.replace(vq, visual_codes=vq.visual_codes.clone())
        t.visual_codes[pos] = value
        with pytest.raises(ValueError, match=message):
            t.validate()
        with pytest.raises(ValueError, match=message):
            validate_all([vq, t])
    bsq = _traj(3, (2, 2), 2, bits=3)
    cases = [(at_visual, v, "values in") for v in (0.5, -1.0, 2.0, math.inf, math.nan)]
    cases += [(off_visual, 1.0, "0 at non-visual"), (off_visual, math.inf, "values in")]
    for pos, value, message in cases:
        t = dataclasses.replace(bsq, visual_codes=bsq.visual_codes.clone())
        t.visual_codes[pos, 1] = value
        with pytest.raises(ValueError, match=message):
            t.validate()
        with pytest.raises(ValueError, match=message):
            validate_all([bsq, t])
    t = dataclasses.replace(bsq, visual_codes=bsq.visual_codes.clone())
    t.visual_codes[off_visual, 0] = -0.0
    t.visual_codes[at_visual] = torch.where(t.visual_codes[at_visual] == 0, -0.0, 1.0)
    t.validate()
    validate_all([bsq, t])


def test_truncated_row_may_stop_inside_last_image():
    t = _traj(3, (2, 2), 0, logp=False)
    cut = _cut_inside_image(t)
    cut.validate()
    cut.finish_reason = "eos"
    with pytest.raises(ValueError, match="image_grids"):
        cut.validate()


def test_collate_rejects_mixtures_naming_the_field():
    vq, bsq = _traj(2, (1, 2), 1), _traj(2, (1, 2), 1, bits=3)
    with pytest.raises(ValueError, match="visual_codes"):
        TrajectoryBatch.collate([vq, bsq], pad_id=PAD)
    with pytest.raises(ValueError, match="visual_codes"):
        TrajectoryBatch.collate([bsq, _traj(2, (1, 2), 1, bits=4)], pad_id=PAD)
    with pytest.raises(ValueError, match="rollout_logp"):
        TrajectoryBatch.collate([vq, _traj(2, (1, 2), 1, logp=False)], pad_id=PAD)
    bad = _traj(2, (1, 2), 1, sid="x/1")
    bad.image_grids = []
    with pytest.raises(ValueError, match=r"trajectory 1 \('x/1'\).*image_grids"):
        TrajectoryBatch.collate([vq, bad], pad_id=PAD)
    with pytest.raises(ValueError):
        TrajectoryBatch.collate([], pad_id=PAD)


def test_batch_validate_catches_inconsistent_batch():
    b = TrajectoryBatch.collate(_trajs(), pad_id=PAD)
    b.lengths = b.lengths + 1
    with pytest.raises(ValueError, match="attention_mask"):
        b.validate()
    b = TrajectoryBatch.collate(_trajs(), pad_id=PAD)
    b.sample_ids = b.sample_ids[:-1]
    with pytest.raises(ValueError, match="sample_ids"):
        b.validate()


def _with_training_data(trajs: list[Trajectory]) -> list[Trajectory]:
    """Attach per-row training data: advantage, anchor log-probs, seed and a record."""
    for i, t in enumerate(trajs):
        t.advantage = 0.5 - i
        t.old_logp = t.rollout_logp - 0.25 * (t.rollout_logp != 0)
        if t.rollout_logp_factors is not None:
            t.old_logp_factors = t.rollout_logp_factors * 2
        t.seed = 100 + i
        t.sampling = {"row": i}
    return trajs


@pytest.mark.parametrize("bits", [0, 3])
def test_per_row_training_data_travels_with_the_batch(bits):
    trajs = _with_training_data(_trajs(bits))
    b = TrajectoryBatch.collate(trajs, pad_id=PAD).validate()
    assert b.advantages.tolist() == [t.advantage for t in trajs]
    assert b.seeds == [t.seed for t in trajs] and b.sampling == [t.sampling for t in trajs]
    assert (b.old_logp[~b.attention_mask] == 0).all()
    assert (b.old_logp_factors is not None) == bool(bits)

    def same(a: Trajectory, c: Trajectory) -> None:
        _assert_traj_equal(a, c)
        assert (a.advantage, a.seed, a.sampling) == (c.advantage, c.seed, c.sampling)
        for name in ("old_logp", "old_logp_factors"):
            x, y = getattr(a, name), getattr(c, name)
            assert (x is None) == (y is None) and (x is None or torch.equal(x, y)), name

    for a, c in zip(trajs, b.unbatch()):
        same(a, c.validate())
    sub = b[[3, 1]].validate()
    assert sub.advantages.tolist() == [trajs[3].advantage, trajs[1].advantage]
    for a, c in zip([trajs[3], trajs[1]], sub.unbatch()):
        same(a, c)
    micro = b.micro_batches(2)
    assert [m.seeds for m in micro] == [[100, 101], [102, 103], [104]]
    assert torch.equal(torch.cat([m.advantages for m in micro]), b.advantages)


def test_per_row_training_data_is_validated():
    t = _with_training_data([_traj(3, (2, 2), 2)])[0]
    T = len(t)
    _bad("old_logp", old_logp=torch.full((T,), -1.0))
    _bad("old_logp_factors", old_logp_factors=torch.zeros(T, 2))
    _bad("advantage", advantage=float("nan"))
    _bad("seed", seed=-1)
    with pytest.raises(ValueError, match="advantage"):
        TrajectoryBatch.collate([t, _traj(3, (2, 2), 2)], pad_id=PAD)
    b = TrajectoryBatch.collate([t, _with_training_data([_traj(2, None, 3)])[0]], pad_id=PAD)
    b.advantages = b.advantages[:1]
    with pytest.raises(ValueError, match="advantages"):
        b.validate()
