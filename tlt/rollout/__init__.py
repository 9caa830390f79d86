"""The rollout engine: continuous batching, group fan-out from one prefill, exact sampling."""

from tlt.rollout.config import EngineConfig
from tlt.rollout.engine import RolloutEngine
from tlt.rollout.params import SamplingParams
from tlt.rollout.sequence import Completion, RequestOutput

__all__ = ["Completion", "EngineConfig", "RequestOutput", "RolloutEngine", "SamplingParams"]
