"""What one speculative step does: a small, hashable description used by the engine and the tuner.

kind: "off" (plain decoding), "chain" (the learned drafter proposes `depth` tokens in a line, sampled
from its own distribution q; verified by min(1, p/q) speculative sampling), "tree" (EAGLE-2 dynamic
tree: expand the `topk` best children of the `topk` best nodes for `depth` levels, keep the
`verify_tokens` nodes of highest cumulative draft log-prob, and with `prune` P > 0 only those of them whose
path the drafter gives at least P% probability, so a row verifies from 0 to `verify_tokens` of them: where
a forward is bound by arithmetic, each verified token costs about as much as it may add; verified
target-only), "ngram" (the
model-free drafter: continuation of the longest suffix match in the prompt, the sequence itself and
its sibling samples, up to `depth` tokens; verified target-only), "suffix" (the suffix drafter,
suffix.py: a tree of up to `verify_tokens` nodes and `depth` levels from the longest suffix match over
the prompt, the sequence, its siblings and the prompt's earlier responses, and with `prune` P > 0 only
the nodes whose path the sources' counts give at least P%, so a row's draft grows with the sources'
agreement, and with `-pa` the nodes worth their verification by the measured cost of a verified token at the
live batch size (cost.py); verified target-only), "hybrid" (per row, the suffix tree where it is deeper than
`depth`, else the learned drafter's tree of `depth` / `topk` / `verify_tokens`, both rows in
one verification, `prune` applying to both; target-only). Suffix nodes are ranked and pruned by their
calibrated acceptance (suffix.Calibration, learned from the decoder's verifications) per count of the
continuation, count of the others and length of the matched context; `calibrated=1` (name suffix "-c1")
leaves the matched length out, `calibrated=0` ("-c0") ranks them by the sources' raw frequencies. Tuner states
and configs hold arms by name, so a suffix arm named without "-c" in an older run drafts by the matched length
when resumed (the samples are the same; what it drafts is not): "-c1" drafts as such a run did.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tlt.errors import ConfigError

KINDS = ("off", "chain", "tree", "ngram", "suffix", "hybrid")
# The deepest draft path a verification may hold: tlt's CPU attention keeps a tree node's result plain
# decoding's bit for bit while a row sees at most 64 keys from its first masked one on (csrc/cpu_bf16.cpp
# SPLIT_MARGIN), the node and its ancestors.
MAX_DEPTH = 63
AUTO = -1  # `prune` of a suffix draft cut where the measured cost of a verified token says ("-pa")


@dataclass(frozen=True)
class Strategy:
    kind: str = "tree"
    depth: int = 6
    topk: int = 4
    verify_tokens: int = 24
    # the least path probability (the drafter's, or the suffix sources'), in percent, a verified node needs;
    # AUTO (name "-pa", suffix drafts only): the measured cost of a verified token sets it (cost.py)
    prune: int = 0
    # suffix nodes by their calibrated acceptance per (count, others, matched length) (2), per (count, others)
    # (1), or by the sources' raw frequencies (0)
    calibrated: int = 2

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ConfigError(f"Strategy field 'kind' must be one of {KINDS}, got {self.kind!r}")
        if self.prune == AUTO:
            if self.kind != "suffix":
                raise ConfigError(f"Strategy field 'prune' is auto (-pa) for a suffix draft only, got it for {self.kind!r}")
        elif self.prune and (self.kind not in ("tree", "suffix", "hybrid") or not 0 < self.prune < 100):
            raise ConfigError(f"Strategy field 'prune' is a percent from 1 to 99 for a tree, suffix or hybrid draft "
                              f"(or auto, -pa, for a suffix draft), got {self.prune} for {self.kind!r}")
        if self.calibrated not in (0, 1, 2) or (self.calibrated != 2 and self.kind not in ("suffix", "hybrid")):
            raise ConfigError(f"Strategy field 'calibrated' is 2, or for a suffix or hybrid draft 1 (calibrated without "
                              f"the matched length) or 0 (raw frequencies), got {self.calibrated} for {self.kind!r}")
        for name in ("depth", "topk", "verify_tokens"):
            if getattr(self, name) < 1:
                raise ConfigError(f"Strategy field {name!r} must be >= 1, got {getattr(self, name)}")
        if self.kind in ("tree", "hybrid") and self.verify_tokens < self.depth:
            raise ConfigError(f"a tree of depth {self.depth} needs verify_tokens >= depth, got {self.verify_tokens}")
        deepest = max(self.depth, self.verify_tokens) if self.kind == "hybrid" else self.depth  # hybrid's suffix rows
        if deepest > MAX_DEPTH:
            field = "depth" if self.depth > MAX_DEPTH else "verify_tokens"
            raise ConfigError(f"Strategy field {field!r} must be <= {MAX_DEPTH} for a {self.kind} draft (its paths "
                              f"would reach {deepest} tokens deep), got {getattr(self, field)}")

    @property
    def floor(self) -> float:
        """The least path score (cumulative draft log-prob) a pruned tree verifies: log(prune / 100); -inf
        unpruned. A "-pa" floor has no fixed value: the decoder's measured step costs set it each step."""
        if self.auto_floor:
            raise ValueError(f"{self.name}: its floor is set each step by the measured step costs (cost.StepCosts)")
        return math.log(self.prune / 100) if self.prune else -math.inf

    @property
    def auto_floor(self) -> bool:
        """Cut where the measured cost of a verified token says (cost.StepCosts), not at a fixed percent."""
        return self.prune == AUTO

    @property
    def uses_drafter(self) -> bool:
        return self.kind in ("chain", "tree", "hybrid")

    @property
    def uses_history(self) -> bool:
        """Drafts from the suffix drafter's index, which earlier responses to the prompt extend."""
        return self.kind in ("suffix", "hybrid")

    @property
    def draft_tokens(self) -> int:
        """Tokens one row sends through verification (the root included)."""
        if self.kind == "off":
            return 1
        if self.kind in ("tree", "suffix", "hybrid"):
            return 1 + self.verify_tokens
        return 1 + self.depth

    @property
    def learned_tree(self) -> "Strategy":
        """The learned drafter's tree of the same depth, branching and size (what a hybrid row falls
        back to where its suffix match is short)."""
        return Strategy("tree", self.depth, self.topk, self.verify_tokens, self.prune)

    @property
    def target_only(self) -> bool:
        """Verified with plain sampling's own uniform at every position (verify.walk): the samples do not
        depend on the drafts, so runs with different drafters draw the same responses."""
        return self.kind in ("tree", "ngram", "suffix", "hybrid")

    @property
    def name(self) -> str:
        if self.kind == "off":
            return "off"
        pruned = ("-pa" if self.auto_floor else f"-p{self.prune}" if self.prune else "") + ("" if self.calibrated == 2 else f"-c{self.calibrated}")
        if self.kind in ("tree", "hybrid"):
            return f"{self.kind}-d{self.depth}-k{self.topk}-v{self.verify_tokens}{pruned}"
        if self.kind == "suffix":
            return f"suffix-d{self.depth}-v{self.verify_tokens}{pruned}"
        return f"{self.kind}-d{self.depth}"

    @classmethod
    def of(cls, value: "Strategy | str | None") -> "Strategy":
        """A Strategy given as such or by its name (None or empty: the default one), as configs hold it."""
        if not value:
            return cls()
        return cls.parse(value) if isinstance(value, str) else value

    @classmethod
    def parse(cls, text: str) -> "Strategy":
        """Inverse of `name`: "off", "chain-d4", "ngram-d6", "tree-d6-k4-v24", "tree-d4-k2-v8-p20",
        "suffix-d16-v32", "suffix-d16-v32-p20", "suffix-d16-v32-p20-c1", "suffix-d16-v32-pa-c1", "suffix-d16-v32-p20-c0", "hybrid-d4-k2-v16"."""
        parts = text.split("-")
        fields = {"d": "depth", "k": "topk", "v": "verify_tokens", "p": "prune", "c": "calibrated"}
        kwargs = {}
        try:
            for part in parts[1:]:
                kwargs[fields[part[0]]] = AUTO if part == "pa" else int(part[1:])
        except (KeyError, ValueError, IndexError):
            raise ConfigError(f"cannot parse strategy {text!r}; expected e.g. off, chain-d4, ngram-d6, tree-d6-k4-v24") from None
        return cls(kind=parts[0], **kwargs)
