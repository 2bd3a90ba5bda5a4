"""Losses as pure functions of log-probs, targets, advantages and references."""
