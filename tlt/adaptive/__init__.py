"""The adaptive rollout engine: a bucketed bandit picks each decode step's speculative strategy."""

from tlt.adaptive.decoder import AdaptiveDecoder
from tlt.adaptive.tuner import Tuner, TunerConfig

__all__ = ["AdaptiveDecoder", "Tuner", "TunerConfig"]
