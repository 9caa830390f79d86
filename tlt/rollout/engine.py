"""The rollout engine: batched generation whose batch shrinks as sequences finish.

`generate(prompts, params)` queues every request and runs `step()` until all are done. A step is
    admit -> prefill the admitted -> decode -> postprocess
  - admit: the scheduler picks waiting groups that fit the batch and the KV budget (continuous
    batching: requests join as soon as others leave);
  - prefill: the admitted prompts run in one right-padded forward into a fresh KV cache, which is then
    forked n times per group (n samples share one prefill) and joined to the live batch;
  - decode: the decoder turns the live batch into new tokens per row (one for plain decoding, several
    for speculative decoding), leaving the cache holding everything but each row's newest token;
  - postprocess: tokens are appended up to a stop token or the length limit; finished sequences leave
    the batch at once and their cache rows are freed.
Randomness is counter-based per sequence (rng.py), so a request's output depends only on its seed
and inputs, never on what else shares the batch. The live batch size of every step is recorded: it is
the long-tail profile the adaptive engine and the benchmarks read.
"""

from __future__ import annotations

import numbers
import random
import time
from dataclasses import dataclass, field
from typing import Sequence as Seq

import torch

from tlt.errors import ConfigError, StaleWeightsError
from tlt.progress import Progress
from tlt.rollout import rng
from tlt.rollout.batch import LiveBatch
from tlt.rollout.params import SamplingParams
from tlt.rollout.sampling import sample_tokens
from tlt.rollout.scheduler import Group, Scheduler
from tlt.rollout.sequence import RequestOutput, Sequence


@dataclass(frozen=True)
class EngineConfig:
    """max_batch_size: live sequences at most; kv_budget_tokens: worst-case cached tokens at most
    (None: unlimited); cache_block: KV cache capacity granularity; seed: draws seeds for requests
    without one (None: fresh entropy); progress: None shows a bar when stderr is a terminal.
    speculative: "off", "on" (every step uses `strategy`, a Strategy or its name such as
    "tree-d6-k4-v24"; None: Strategy()'s tree-d6-k4-v24) or "adaptive" (a tuner picks each step's
    strategy by live batch size; tuner: a TunerConfig, max_draft_tokens: the memory guard on draft
    tokens x live rows); drafter: a Drafter, a drafter folder or "default" (needed by chain and tree
    strategies). `strategy` is read only with "on" and `tuner` only with "adaptive". A request for more
    samples than max_batch_size runs in parts (scheduler.py). catch_up_window: a drafting
    step after plain ones feeds the drafter at most this many of the pairs each row queued meanwhile,
    the newest (None: all); see SpeculativeDecoder."""

    max_batch_size: int = 256
    kv_budget_tokens: int | None = None
    cache_block: int = 64
    seed: int | None = None
    progress: bool | None = None
    speculative: str = "off"
    strategy: object | None = None
    drafter: object | None = None
    tuner: object | None = None
    max_draft_tokens: int = 8192
    catch_up_window: int | None = 16

    def __post_init__(self) -> None:
        if self.speculative not in ("off", "on", "adaptive"):
            raise ConfigError(f"EngineConfig field 'speculative' must be off, on or adaptive, got {self.speculative!r}")
        for name in ("max_batch_size", "kv_budget_tokens", "cache_block", "max_draft_tokens"):
            value = getattr(self, name)
            if not (name == "kv_budget_tokens" and value is None) and (not _integer(value) or value < 1):
                none = " or None" if name == "kv_budget_tokens" else ""
                raise ConfigError(f"EngineConfig field {name!r} must be an integer >= 1{none}, got {value!r}")
        if self.seed is not None and not _integer(self.seed):
            raise ConfigError(f"EngineConfig field 'seed' must be an integer or None, got {self.seed!r}")
        if self.progress is not None and not isinstance(self.progress, bool):
            raise ConfigError(f"EngineConfig field 'progress' must be true, false or None, got {self.progress!r}")
        if self.speculative == "on" and self.drafter is None:
            from tlt.speculative.strategy import Strategy

            strategy = self.strategy or Strategy()
            strategy = Strategy.parse(strategy) if isinstance(strategy, str) else strategy
            if strategy.uses_drafter:
                raise ConfigError(f"EngineConfig field 'strategy' {strategy.name!r} needs a drafter (chain and tree "
                                  "strategies draft with a learned one): give drafter= (a Drafter, a folder or "
                                  "'default'), or a model-free strategy such as ngram-d4")
        window = self.catch_up_window
        if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
            raise ConfigError(f"EngineConfig field 'catch_up_window' must be an int >= 1 or None, "
                              f"got {self.catch_up_window!r}")

    @classmethod
    def named(cls, system: str, drafter: object | None = None, **fields) -> "EngineConfig":
        """The engine a system name stands for in benchmarks and audits: "off" (plain
        decoding), "adaptive" (the tuner picks per step, with `drafter`) or a strategy name such as
        "tree-d4-k2-v8" (speculation on with that one strategy). Other `fields` are passed through."""
        if system == "off":
            return cls(**fields)
        if system == "adaptive":
            return cls(speculative="adaptive", drafter=drafter, **fields)
        return cls(speculative="on", strategy=system, drafter=drafter, **fields)


@dataclass
class DecodeResult:
    """Per live row: the new tokens, their log-probs and (when asked) the features that produced them:
    last-layer `hidden` [k, H] and, for a drafter reading intermediate layers, `layers` [k, L, H]."""

    tokens: list[list[int]]
    logprobs: list[list[float]]
    hidden: list[torch.Tensor] | None
    strategy: str = "off"  # the strategy of the step ("off": one plain token per row)
    layers: list[torch.Tensor] | None = None
    visited: list[list[int]] | None = None  # per row, the draft nodes on the accepted path (root first)
    sources: dict | None = None  # draft source -> [row-steps, tokens, accepted draft tokens] (suffix drafts)


@dataclass
class EngineStats:
    steps: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    step_times: list[float] = field(default_factory=list)
    batch_sizes: list[int] = field(default_factory=list)
    strategies: list[str] = field(default_factory=list)
    step_tokens: list[int] = field(default_factory=list)  # tokens emitted by each decode step
    wall_time: float = 0.0
    sources: dict[str, list[int]] = field(default_factory=dict)  # summed DecodeResult.sources

    def as_dict(self) -> dict:
        n = max(len(self.step_times), 1)
        return {
            "steps": self.steps,
            "prefill_tokens": self.prefill_tokens,
            "decode_tokens": self.decode_tokens,
            "wall_time_s": self.wall_time,
            "mean_step_time_s": sum(self.step_times) / n,
            "tokens_per_s": self.decode_tokens / self.wall_time if self.wall_time else 0.0,
            "step_times_s": list(self.step_times),
            "batch_sizes": list(self.batch_sizes),
            "strategies": list(self.strategies),
            "step_tokens": list(self.step_tokens),
            "acceptance_length": self.acceptance_length(),
            "draft_sources": {k: list(v) for k, v in self.sources.items()},
        }

    def acceptance_length(self) -> float | None:
        """Tokens per row per speculative step (accepted drafts + 1), over all speculative steps."""
        return acceptance_length(self.as_lists())

    def as_lists(self) -> dict:
        return {"step_tokens": self.step_tokens, "batch_sizes": self.batch_sizes, "strategies": self.strategies}


def acceptance_length(stats: dict, counted=lambda strategy: strategy != "off") -> float | None:
    """Tokens emitted per row per step over the steps of `stats` (step_tokens, batch_sizes, strategies
    lists) whose strategy `counted` accepts; None when there is none."""
    tokens = rows = 0
    for t, b, s in zip(stats.get("step_tokens", []), stats.get("batch_sizes", []), stats.get("strategies", [])):
        if counted(s):
            tokens, rows = tokens + t, rows + b
    return tokens / rows if rows else None


def _integer(value: object) -> bool:
    """An int (numpy's too), not a bool and not a whole float."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def stacked_layers(out, layers) -> torch.Tensor | None:
    """[B, T, L, H]: a forward's outputs of target layers `layers` (None when there are none)."""
    return torch.stack([out.layer_states[i] for i in layers], 2) if layers else None


def sample_next(batch: LiveBatch, logits: torch.Tensor, hidden: torch.Tensor,
                layers: torch.Tensor | None = None) -> DecodeResult:
    """One token per row from logits [B, V] with each row's counter-based uniform; hidden [B, H] (and
    layers [B, L, H]) are the features that produced them. Shared by the prefill's first token and
    every plain decode step."""
    u = rng.uniform(batch.keys, batch.counters)
    tokens, logprobs = sample_tokens(logits, batch.temperature, batch.top_k, batch.top_p, u)
    wants = batch.wants_hidden
    return DecodeResult([[t] for t in tokens.tolist()], [[lp] for lp in logprobs.tolist()],
                        [h[None] for h in hidden] if wants else None,
                        layers=[x[None] for x in layers] if wants and layers is not None else None)


class PlainDecoder:
    """One target forward per step: feed each row's newest token, sample the next one."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def decode(self, batch: LiveBatch) -> DecodeResult:
        out = self.model(batch.last_tokens[:, None], cache=batch.cache)
        return sample_next(batch, out.logits[:, 0], out.hidden_states[:, 0])


class RolloutEngine:
    def __init__(self, model: torch.nn.Module, tokenizer=None, config: EngineConfig | None = None) -> None:
        self.model, self.tokenizer = model.eval(), tokenizer
        self.config = config or EngineConfig()
        self.scheduler = Scheduler(self.config.max_batch_size, self.config.kv_budget_tokens)
        self.log_lines: list[str] = []
        self.decoder = self._make_decoder()
        self.batch: LiveBatch | None = None
        self._stats = EngineStats()
        self._seeds = random.Random(self.config.seed)
        self._next_request = 0
        self._finished: list[Sequence] = []
        self.context_length = model.config.max_position_embeddings
        eos = list(model.config.eos_token_ids)
        if tokenizer is not None and getattr(tokenizer, "eos_token_id", None) is not None:
            eos.append(tokenizer.eos_token_id)
        self.eos_ids = frozenset(eos)
        self.weights_version = 0
        self.drafter_version = 0
        # Called after every engine step (with the engine): where a worker injects a drill fault or
        # checks its mailbox, without the engine knowing about workers.
        self.step_callback = None

    def _make_decoder(self):
        if self.config.speculative == "off":
            return PlainDecoder(self.model)
        from tlt.speculative import Drafter, SpeculativeDecoder, Strategy

        strategy = self.config.strategy or Strategy()
        if isinstance(strategy, str):
            strategy = Strategy.parse(strategy)
        drafter = self.config.drafter
        if drafter is not None and not isinstance(drafter, Drafter):
            drafter = Drafter.load(drafter, self.model)
        if self.config.speculative == "on":
            return SpeculativeDecoder(self.model, drafter, strategy, self.config.catch_up_window)
        from tlt.adaptive import AdaptiveDecoder, Tuner, TunerConfig

        tuner = Tuner(self.config.tuner or TunerConfig(), log=self._log)
        spec = SpeculativeDecoder(self.model, drafter, Strategy(kind="off"), self.config.catch_up_window)
        return AdaptiveDecoder(spec, tuner, self.config.max_draft_tokens)

    def _log(self, message: str) -> None:
        self.log_lines.append(message)

    @property
    def tuner(self):
        """The adaptive engine's tuner (None unless speculative="adaptive"); its state_dict() and
        load_state_dict() carry it across RL steps and runs."""
        return getattr(self.decoder, "tuner", None)

    @property
    def drafter(self):
        """The learned drafter chain and tree strategies draft with (None: n-gram and off only)."""
        spec = getattr(self.decoder, "spec", self.decoder)
        return getattr(spec, "drafter", None)

    # --- public API --------------------------------------------------------------------------------
    def load_drafter(self, state: dict[str, torch.Tensor], version: int) -> None:
        """Copy a drafter's trainable weights into the engine's drafter in place and record their version.
        The tuner lets arms that use the drafter compete again where it had pruned them (they were judged
        with the old one); their rewards fade by its decay. Verification does not depend on the drafter:
        any weights, swapped at any time, leave the output distribution exactly as it was."""
        from tlt.speculative.drafter import check_tensors

        drafter = self.drafter
        if drafter is None:
            raise ConfigError("load_drafter: the engine has no learned drafter (speculative off or n-gram only)")
        check_tensors(state, drafter.state_dict(), "load_drafter")
        with torch.no_grad():
            for name, tensor in drafter.state_dict().items():
                tensor.copy_(state[name])
        self.drafter_version = int(version)
        if self.tuner is not None:
            from tlt.speculative.strategy import Strategy

            self.tuner.unprune([a for a in self.tuner.config.arms if Strategy.parse(a).uses_drafter])

    def load_weights(self, state: dict[str, torch.Tensor], version: int) -> None:
        """Copy a policy's weights (a state dict with the model's parameter names) into the engine's
        model in place, so a drafter sharing its embedding and head follows, and record their version."""
        own = self.model.state_dict()
        missing, unexpected = sorted(set(own) - set(state)), sorted(set(state) - set(own))
        if missing or unexpected:
            raise ConfigError(f"load_weights: missing {missing[:5]}, unexpected {unexpected[:5]}")
        with torch.no_grad():
            for name, tensor in state.items():
                if tensor.shape != own[name].shape:
                    raise ConfigError(f"load_weights: {name} has shape {tuple(tensor.shape)}, "
                                      f"the engine's model has {tuple(own[name].shape)}")
                own[name].copy_(tensor)
        self.weights_version = int(version)

    def generate(
        self,
        prompts: Seq[list[int] | str],
        params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool | None = None,
        weights_version: int | None = None,
        history=None,
    ) -> list[RequestOutput]:
        """Generate for every prompt (token ids, or strings when a tokenizer was given). With
        `weights_version`, refuse to run unless the engine holds exactly that policy version: an RL
        step must never sample from stale weights. `history` (a speculative.history.HistoryDrafts) gives
        the suffix drafter each prompt's earlier responses and the run's recent ones."""
        if weights_version is not None and weights_version != self.weights_version:
            raise StaleWeightsError(f"rollout asked for policy version {weights_version}, "
                                    f"the engine holds version {self.weights_version}")
        if isinstance(prompts, (str, bytes)):
            raise ConfigError("prompts is one string; pass a list of prompts, e.g. [text]")
        prompts = list(prompts)
        if not prompts:
            return []
        if _integer(prompts[0]):
            raise ConfigError("prompts is a flat list of token ids; pass a list of prompts, e.g. [ids]")
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        elif len(params) != len(prompts):
            raise ConfigError(f"got {len(params)} SamplingParams for {len(prompts)} prompts")
        wrong = next((i for i, sp in enumerate(params) if not isinstance(sp, SamplingParams)), None)
        if wrong is not None:
            raise ConfigError(f"params[{wrong}] must be a SamplingParams, got {type(params[wrong]).__name__}")
        if history is not None and len(history.responses) != len(prompts):
            raise ConfigError(f"history has responses for {len(history.responses)} prompts, not {len(prompts)}")
        window = None
        if history is not None and history.window and self.config.speculative != "off":
            from tlt.speculative.suffix import SuffixAutomaton

            window = SuffixAutomaton.of(history.window)
        groups = [self._make_group(i, p, sp, history.responses[i] if history is not None else (), window)
                  for i, (p, sp) in enumerate(zip(prompts, params))]
        for g in groups:
            self.scheduler.add(g)
        total = sum(len(g.seqs) for g in groups)
        enabled = self.config.progress if use_tqdm is None else use_tqdm
        bar = Progress(total, "rollout", enabled)
        start, self._finished = time.perf_counter(), []
        with torch.inference_mode():
            while self.scheduler.waiting or (self.batch is not None and len(self.batch)):
                self.step()
                if self.step_callback is not None:
                    self.step_callback(self)
                bar.update(len(self._finished), f"live {len(self.batch) if self.batch else 0}")
        bar.close()
        self._stats.wall_time += time.perf_counter() - start
        return [
            RequestOutput(g.request_id, g.prompt, [s.completion(self.tokenizer) for s in g.seqs],
                          prompts[i] if isinstance(prompts[i], str) else None)
            for i, g in enumerate(groups)
        ]

    def stats(self) -> dict:
        out = self._stats.as_dict()
        if self.tuner is not None:
            out["tuner"] = self.tuner.stats()
        return out

    def reset_stats(self) -> None:
        self._stats = EngineStats()

    # --- one step ----------------------------------------------------------------------------------
    def step(self) -> None:
        start = time.perf_counter()
        admitted = self.scheduler.admit(self.batch.seqs if self.batch else [])
        if admitted:
            self._prefill(admitted)
        if self.batch is not None and len(self.batch):
            self._stats.batch_sizes.append(len(self.batch))
            result = self.decoder.decode(self.batch)
            self._stats.strategies.append(result.strategy)
            self._stats.step_tokens.append(sum(map(len, result.tokens)))
            for name, counts in (result.sources or {}).items():
                total = self._stats.sources.setdefault(name, [0] * len(counts))
                total[:] = [a + b for a, b in zip(total, counts)]
            self._postprocess(result)
        self._stats.steps += 1
        self._stats.step_times.append(time.perf_counter() - start)

    def _prefill(self, groups: list[Group]) -> None:
        device = self.model.device
        lengths = torch.tensor([len(g.prompt) for g in groups], device=device)
        T = int(lengths.max())
        ids = torch.zeros(len(groups), T, dtype=torch.long, device=device)
        for i, g in enumerate(groups):
            ids[i, : len(g.prompt)] = torch.tensor(g.prompt, device=device)
        valid = torch.arange(T, device=device)[None] < lengths[:, None]  # [G, T]
        cache = self.model.new_cache(len(groups), block=self.config.cache_block)
        output_layers = getattr(self.decoder, "output_layers", ())
        out = self.model(ids, attention_mask=valid, cache=cache, logit_index=(lengths - 1)[:, None],
                         output_layers=output_layers)
        rows = torch.arange(len(groups), device=device)
        hidden = out.hidden_states[rows, lengths - 1]  # [G, H]
        # Layer states at the last prompt position, only on request (the drafter reads `out` itself).
        wanted = bool(output_layers) and any(s.params.return_hidden_states for g in groups for s in g.seqs)
        layers = torch.stack([out.layer_states[i][rows, lengths - 1] for i in output_layers], 1) if wanted else None
        counts = torch.tensor([len(g.seqs) for g in groups], device=device)
        cache.fork(counts)
        logits = out.logits[:, 0].repeat_interleave(counts, 0)  # [N, V]
        hidden = hidden.repeat_interleave(counts, 0)  # [N, H]
        if layers is not None:
            layers = layers.repeat_interleave(counts, 0)  # [N, L, H]
        seqs = [s for g in groups for s in g.seqs]
        fresh = LiveBatch(seqs, cache, torch.zeros(len(seqs), dtype=torch.long, device=device))
        first = sample_next(fresh, logits, hidden, layers)
        fresh.last_tokens = torch.tensor([r[0] for r in first.tokens], dtype=torch.long, device=device)
        if hasattr(self.decoder, "prefill"):
            self.decoder.prefill(fresh, ids, lengths, out, counts)
        self._stats.prefill_tokens += int(lengths.sum())
        if self.batch is None or not len(self.batch):
            self.batch = fresh
            self._postprocess(first)
        else:
            self._append(fresh, first)
            self.batch.extend(fresh)
            self._drop_finished()

    def _postprocess(self, result: DecodeResult) -> None:
        self._append(self.batch, result)
        self._drop_finished()

    def _append(self, batch: LiveBatch, result: DecodeResult) -> None:
        for b, seq in enumerate(batch.seqs):
            hidden = result.hidden[b] if result.hidden is not None else None
            layers = result.layers[b] if result.layers is not None else None
            kept = seq.append(result.tokens[b], result.logprobs[b], hidden, layers)
            self._stats.decode_tokens += kept
        batch.last_tokens = torch.tensor([r[-1] for r in result.tokens], dtype=torch.long,
                                         device=batch.last_tokens.device)

    def _drop_finished(self) -> None:
        batch = self.batch
        keep = [b for b, s in enumerate(batch.seqs) if s.finish_reason is None]
        if len(keep) < len(batch):
            self._finished += [s for s in batch.seqs if s.finish_reason is not None]
            batch.select(keep)

    # --- requests ----------------------------------------------------------------------------------
    def _make_group(self, i: int, prompt: list[int] | str, params: SamplingParams, history=(),
                    window=None) -> Group:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ConfigError(f"prompt {i} is a string but the engine has no tokenizer; pass token ids")
            prompt = self.tokenizer.encode(prompt)
        if isinstance(prompt, torch.Tensor):
            if prompt.dim() != 1 or prompt.dtype.is_floating_point or prompt.dtype == torch.bool:
                raise ConfigError(f"prompt {i} must be a 1-D integer tensor of token ids, got {prompt.dtype} "
                                  f"of shape {tuple(prompt.shape)}")
            prompt = prompt.tolist()
        bad = next((t for t in prompt if not _integer(t)), None)
        if bad is not None:
            raise ConfigError(f"prompt {i} must hold integer token ids, got {bad!r}")
        prompt = [int(t) for t in prompt]
        if not prompt:
            raise ConfigError(f"prompt {i} is empty")
        vocab = self.model.config.vocab_size
        if min(prompt) < 0 or max(prompt) >= vocab:
            raise ConfigError(f"prompt {i} has token ids outside the vocabulary [0, {vocab})")
        if len(prompt) >= self.context_length:
            raise ConfigError(
                f"prompt {i} has {len(prompt)} tokens; the model's context (max_position_embeddings) is "
                f"{self.context_length}, leaving no room to generate"
            )
        request_id = self._next_request
        self._next_request += 1
        seed = params.seed if params.seed is not None else self._seeds.getrandbits(63)
        stop = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.eos_ids)
        max_new = min(params.max_tokens, self.context_length - len(prompt))
        ngram = None
        if self.config.speculative != "off":
            from tlt.speculative.suffix import SuffixIndex

            ngram = SuffixIndex(prompt, history, window)
        seqs = [Sequence(request_id, j, prompt, params, rng.sequence_key(seed, j), stop, max_new, ngram=ngram)
                for j in range(params.n)]
        return Group(request_id, prompt, seqs)
