"""The adaptive drafter: an online buffer of rollout features, a spot trainer on idle rollout workers,
and the worker pool that runs rollout on Ray (see rollout.py for how they fit together)."""

from tlt.spot.buffer import OnlineBuffer, favour_long, keep_recent
from tlt.spot.coordinator import Coordinator, WorkerState
from tlt.spot.config import SpotConfig
from tlt.spot.checkpoint import DrafterCheckpointer
from tlt.spot.schedule import Schedule
from tlt.spot.trainer import SpotTrainer

__all__ = ["OnlineBuffer", "favour_long", "keep_recent", "Coordinator", "WorkerState", "DrafterCheckpointer",
           "Schedule", "SpotConfig", "SpotTrainer"]
