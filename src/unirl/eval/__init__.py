"""`unirl eval`: rollouts + verifiers/scorers on any dataset split (`unirl.eval.runner`)."""

from unirl.eval.runner import evaluate, run_eval

__all__ = ["evaluate", "run_eval"]
