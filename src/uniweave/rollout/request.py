"""What goes into the engine (`RolloutRequest`) and what comes out (`RolloutTrajectory`).

A `RolloutTrajectory` is a core `Trajectory` plus a `SamplingRecord`: the parameters it
was sampled with, its prompt length and seed. Replay reads the record to apply the same
policy (temperature, truncation, guidance) or to refuse a different one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from uniweave.core.sample import Sample
from uniweave.core.trajectory import Trajectory
from uniweave.core.types import Owner
from uniweave.rollout.params import SamplingParams


@dataclass(frozen=True)
class RolloutRequest:
    """One row to sample.

    `prompt`: a `Sample` (its parts before the first assistant part are serialised with
    the ChatML template and an open assistant turn; a `GenerationRequest` there forces an
    image) or a prompt `Trajectory` whose positions are all PROMPT-owned. `seed`: the
    row's 64-bit seed (`uniweave.core.seeding.seed_for`); every draw of the row comes from a
    generator seeded with it. `image_grid` (H, W): force text-to-image: the generation
    prefix `<image_gen> generate image H W<|vision_start|>` is appended to the prompt
    (PROMPT-owned) and the row starts in visual mode. `sample_id` defaults to the
    sample's / prompt trajectory's id.
    """

    prompt: Sample | Trajectory
    seed: int
    params: SamplingParams = field(default_factory=SamplingParams)
    image_grid: tuple[int, int] | None = None
    sample_id: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.prompt, (Sample, Trajectory)):
            raise TypeError(
                f"RolloutRequest.prompt must be a Sample or Trajectory, "
                f"got {type(self.prompt).__name__}"
            )
        s = self.seed
        if isinstance(s, bool) or not isinstance(s, int) or not 0 <= s < 2**64:
            raise ValueError(f"RolloutRequest.seed must be an int in [0, 2**64), got {s!r}")
        if not isinstance(self.params, SamplingParams):
            raise TypeError(
                f"RolloutRequest.params must be SamplingParams, got {type(self.params).__name__}"
            )
        g = self.image_grid
        if g is not None and not (
            isinstance(g, tuple)
            and len(g) == 2
            and all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in g)
        ):
            raise ValueError(f"RolloutRequest.image_grid must be (H, W) positive ints, got {g!r}")

    @property
    def id(self) -> str:
        """The id the trajectory will carry."""
        if self.sample_id is not None:
            return self.sample_id
        return self.prompt.id if isinstance(self.prompt, Sample) else self.prompt.sample_id


@dataclass(frozen=True)
class SamplingRecord:
    """How a trajectory was sampled: its parameters, prompt length (positions before the
    first sampled one; None = derive from the owners) and seed (None if unknown)."""

    params: SamplingParams
    prompt_length: int | None = None
    seed: int | None = None


@dataclass
class RolloutTrajectory(Trajectory):
    """A sampled `Trajectory` with the `SamplingRecord` it was drawn under."""

    sampling: SamplingRecord | None = None

    def to_state(self) -> dict:
        """`Trajectory.to_state` with the record as plain values."""
        state = super().to_state()
        rec = self.sampling
        state["sampling"] = (
            None
            if rec is None
            else {
                "params": rec.params.to_dict(),
                "prompt_length": rec.prompt_length,
                "seed": rec.seed,
            }
        )
        return state

    @classmethod
    def from_state(cls, state: dict) -> RolloutTrajectory:
        rec = state.get("sampling")
        if rec is not None:
            params = SamplingParams(**rec["params"])
            rec = SamplingRecord(params, rec["prompt_length"], rec["seed"])
        return super().from_state({**state, "sampling": rec})


def prompt_length_of(traj: Trajectory, record: SamplingRecord | None = None) -> int:
    """The record's prompt length, else the index of the first non-PROMPT position."""
    if record is not None and record.prompt_length is not None:
        return record.prompt_length
    generated = (traj.owner != Owner.PROMPT).nonzero()
    return int(generated[0]) if generated.numel() else len(traj)


def sampling_records(trajs: Sequence[Trajectory]) -> list[SamplingRecord]:
    """The `SamplingRecord` of each trajectory; ValueError naming one that has none."""
    out = []
    for k, t in enumerate(trajs):
        record = getattr(t, "sampling", None)
        if not isinstance(record, SamplingRecord):
            raise ValueError(
                f"trajectory {k} ({t.sample_id!r}) has no SamplingRecord; "
                "pass the records explicitly (SamplingRecord(params, prompt_length))"
            )
        out.append(record)
    return out
