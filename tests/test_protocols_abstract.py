"""The method and plug-in interfaces are abstract: a subclass that lacks a member every
implementation must provide fails at construction (TypeError naming the member), not
later inside the training loop; the optional members keep their do-nothing defaults."""

from __future__ import annotations

import inspect

import pytest

from uniweave.codecs.base import ImageCodec
from uniweave.models.base import UnifiedModel
from uniweave.rewards.base import RewardPlugin
from uniweave.train.engine.protocols import BatchSource, Objective
from uniweave.train.methods.grpo.objective import GRPOObjective
from uniweave.train.methods.grpo.source import GRPOSource
from uniweave.train.methods.opd.objective import OPDObjective
from uniweave.train.methods.opd.source import OPDSource
from uniweave.train.methods.sft.objective import SFTObjective
from uniweave.train.methods.sft.source import DatasetSource


class _Source(BatchSource):
    def global_batch(self, update: int) -> list:
        return []

    def batch_metrics(self, update: int) -> dict[str, float]:
        return {"update": float(update)}


class _Objective(Objective):
    def count(self, batch) -> int:
        return 1

    def loss(self, model, micro, n_global: int):
        raise AssertionError("not called here")

    def finalize(self, sums: dict[str, float], n_global: int) -> dict[str, float]:
        return dict(sums)


@pytest.mark.parametrize(
    ("base", "required"),
    [
        (BatchSource, {"global_batch", "batch_metrics"}),
        (Objective, {"count", "loss", "finalize"}),
    ],
)
def test_required_members_are_the_abstract_ones(base, required):
    assert set(base.__abstractmethods__) == required


@pytest.mark.parametrize("missing", ["global_batch", "batch_metrics"])
def test_source_missing_a_required_member_fails_at_construction(missing):
    members = {k: v for k, v in vars(_Source).items() if k != missing}
    partial = type("Partial", (BatchSource,), members)
    with pytest.raises(TypeError, match=missing):
        partial()


@pytest.mark.parametrize("missing", ["count", "loss", "finalize"])
def test_objective_missing_a_required_member_fails_at_construction(missing):
    members = {k: v for k, v in vars(_Objective).items() if k != missing}
    partial = type("Partial", (Objective,), members)
    with pytest.raises(TypeError, match=missing):
        partial()


def test_complete_subclasses_construct_with_the_optional_defaults():
    source, objective = _Source(), _Objective()
    assert source.batch_metrics(3) == {"update": 3.0}
    assert source.samples(0, 4) == [] and source.epochs_done(0) is None
    assert source.rollout_record(0) is None and source.close() is None
    assert objective.state_dict() is None and objective.frozen_models() == []
    assert objective.begin_update(0, [], None) is None and objective.after_step() is None
    objective.load_state_dict(None)
    with pytest.raises(ValueError, match="keeps no state"):
        objective.load_state_dict({"x": 1})


@pytest.mark.parametrize(
    "cls",
    [DatasetSource, GRPOSource, OPDSource, SFTObjective, GRPOObjective, OPDObjective],
)
def test_the_built_in_methods_implement_every_required_member(cls):
    assert not inspect.isabstract(cls), sorted(cls.__abstractmethods__)


@pytest.mark.parametrize(
    ("base", "member"),
    [(UnifiedModel, "body"), (ImageCodec, "encode"), (RewardPlugin, "score")],
)
def test_plugin_bases_refuse_a_subclass_without_a_required_member(base, member):
    assert member in base.__abstractmethods__
    members = {name: (lambda self, *a, **k: None) for name in base.__abstractmethods__}
    del members[member]
    partial = type("Partial", (base,), members)
    with pytest.raises(TypeError, match=member):
        partial()
