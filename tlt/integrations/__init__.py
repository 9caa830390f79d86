"""Adapters that plug tlt's engine into trainers people already run. Each lives in its own module and
needs nothing of the trainer's package at import time: `tlt.integrations.trl` for TRL's GRPOTrainer."""

from tlt.integrations.trl import TrlRollout, make_rollout_func

__all__ = ["TrlRollout", "make_rollout_func"]
