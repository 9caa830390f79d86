"""Lossless speculative decoding: drafters, draft trees, exact verification, engine integration."""

from tlt.speculative.decoder import SpeculativeDecoder
from tlt.speculative.drafter import Drafter, DrafterConfig
from tlt.speculative.strategy import Strategy

__all__ = ["Drafter", "DrafterConfig", "SpeculativeDecoder", "Strategy"]
