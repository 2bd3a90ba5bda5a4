"""The error that stops a training run: the loop, its checkpoints and its retention raise
it when training cannot go on (a non-finite loss or gradient norm, a refused resume, a
best-checkpoint metric the evaluation does not produce, ...)."""

from __future__ import annotations


class TrainingError(RuntimeError):
    """Training cannot continue (non-finite loss, refused resume, ...)."""
