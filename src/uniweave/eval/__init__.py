"""`uniweave eval`: rollouts + verifiers/scorers on any dataset split (`uniweave.eval.runner`)."""

from uniweave.eval.runner import evaluate, run_eval

__all__ = ["evaluate", "run_eval"]
