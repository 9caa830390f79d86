"""The rollout engine: continuous batching, group fan-out from one prefill, exact sampling."""

from tlt.rollout.engine import EngineConfig, RolloutEngine
from tlt.rollout.params import SamplingParams
from tlt.rollout.sequence import Completion, RequestOutput

__all__ = ["Completion", "EngineConfig", "RequestOutput", "RolloutEngine", "SamplingParams"]
