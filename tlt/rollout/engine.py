"""The rollout engine: batched generation whose batch shrinks as sequences finish.

`generate(prompts, params)` queues every request and runs `step()` until all are done. A step is
    admit -> prefill the admitted -> decode -> postprocess
  - admit: the scheduler picks waiting groups that fit the batch and the KV budget (continuous
    batching: requests join as soon as others leave);
  - prefill: the admitted prompts run in right-padded forwards, one per chunk of similar lengths, into
    fresh KV caches, which are then forked n times per group (n samples share one prefill) and joined
    to the live batch;
  - decode: the decoder turns the live batch into new tokens per row (one for plain decoding, several
    for speculative decoding), leaving the cache holding everything but each row's newest token. The
    engine knows its decoder only as a decoding.Decoder, picked by `make_decoder` from the config, and
    carries the decoder's per-row state without reading it;
  - postprocess: tokens are appended up to a stop token or the length limit; finished sequences leave
    the batch at once and their cache rows are freed.
Randomness is counter-based per sequence (rng.py), so a request's output depends only on its seed
and inputs, never on what else shares the batch. The live batch size of every step is recorded
(stats.RolloutStats): it is the long-tail profile the adaptive engine and the benchmarks read.
"""

from __future__ import annotations

import random
import time
from typing import Sequence as Seq

import torch

from tlt.errors import ConfigError, StaleWeightsError
from tlt.progress import Progress
from tlt.rollout import rng
from tlt.rollout.batch import LiveBatch, fill_from_tail, prefill_chunks
from tlt.rollout.config import EngineConfig
from tlt.rollout.decoding import DecodeResult, Decoder, make_decoder, sample_next
from tlt.rollout.params import SamplingParams, integral
from tlt.rollout.scheduler import Group, Scheduler
from tlt.rollout.sequence import RequestOutput, Sequence
from tlt.rollout.stats import RolloutStats


class RolloutEngine:
    def __init__(self, model: torch.nn.Module, tokenizer=None, config: EngineConfig | None = None) -> None:
        self.model, self.tokenizer = model.eval(), tokenizer
        self.config = config or EngineConfig()
        self.scheduler = Scheduler(self.config.max_batch_size, self.config.kv_budget_tokens)
        self.log_lines: list[str] = []
        self.decoder: Decoder = make_decoder(self.model, self.config, self._log)
        self.batch: LiveBatch | None = None
        self._stats = RolloutStats()
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
        # Called after every engine step (with the engine): where a worker takes a drafter offered
        # mid-rollout, without the engine knowing about workers.
        self.step_callback = None

    def _log(self, message: str) -> None:
        self.log_lines.append(message)

    @property
    def tuner(self):
        """The adaptive engine's tuner (None unless speculative="adaptive"); its state_dict() and
        load_state_dict() carry it across RL steps and runs."""
        return self.decoder.tuner

    def drafting_state(self) -> dict | None:
        """What the decoder has learned about drafting, for a run checkpoint (plain JSON types): the tuner's
        state and the suffix drafts' calibration; None where it learns nothing (plain decoding). Neither
        changes a sample, only which drafts are tried: a resumed run drafts as the uninterrupted one."""
        tuner, calibration = self.decoder.tuner, self.decoder.calibration
        if tuner is None and calibration is None:
            return None
        return {"tuner": tuner.state_dict() if tuner is not None else None,
                "calibration": calibration.state_dict() if calibration is not None else None}

    def load_drafting_state(self, state: dict | None) -> None:
        """Restore `drafting_state()` output; a bare tuner state (an entry of an older checkpoint's
        tuner.json) restores the tuner alone."""
        if state is None:
            return
        if "buckets" in state:
            state = {"tuner": state}
        if not {"tuner", "calibration"} & set(state):
            raise ValueError(f"a drafting state holds 'tuner' and 'calibration', got keys {sorted(state)}")
        tuner, calibration = self.decoder.tuner, self.decoder.calibration
        incoming = None
        if state.get("calibration") is not None and calibration is not None:
            incoming = type(calibration)()  # read whole before the tuner changes: a bad table leaves both as they were
            incoming.load_state_dict(state["calibration"])
        if state.get("tuner") is not None and tuner is not None:
            tuner.load_state_dict(state["tuner"])
        if incoming is not None:
            calibration.load_state_dict(state["calibration"])  # read whole above: it cannot fail now

    @property
    def drafter(self):
        """The learned drafter chain and tree strategies draft with (None: n-gram and off only)."""
        return self.decoder.drafter

    # --- public API --------------------------------------------------------------------------------
    def load_drafter(self, state: dict[str, torch.Tensor], version: int) -> None:
        """Copy a drafter's trainable weights into the engine's drafter in place and record their version.
        The tuner lets arms that use the drafter compete again where it had pruned them (they were judged
        with the old one); their rewards fade by its decay. Verification does not depend on the drafter:
        any weights, swapped at any time, leave the output distribution exactly as it was."""
        self.decoder.load_drafter(state)
        self.drafter_version = int(version)

    def load_weights(self, state: dict[str, torch.Tensor], version: int) -> None:
        """Copy a policy's weights (a state dict with the model's parameter names) into the engine's
        model in place, so a drafter sharing its embedding and head follows, and record their version."""
        own = self.model.state_dict()
        missing, unexpected = sorted(set(own) - set(state)), sorted(set(state) - set(own))
        if missing or unexpected:
            raise ConfigError(f"load_weights: missing {missing[:5]}, unexpected {unexpected[:5]}")
        for name, tensor in state.items():
            if tensor.shape != own[name].shape:
                raise ConfigError(f"load_weights: {name} has shape {tuple(tensor.shape)}, "
                                  f"the engine's model has {tuple(own[name].shape)}")
        check_tied(own, state)
        with torch.no_grad():
            for name, tensor in state.items():
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
        if integral(prompts[0]):
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
        ids = [self._prompt_ids(i, p) for i, p in enumerate(prompts)]
        states = self.decoder.start(ids, [sp.n for sp in params], history)
        groups = [self._make_group(p, sp, s) for p, sp, s in zip(ids, params, states)]
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
            RequestOutput(g.request_id, g.prompt,
                          [s.completion(self.tokenizer, self.decoder.acceptance_length(s)) for s in g.seqs],
                          prompts[i] if isinstance(prompts[i], str) else None)
            for i, g in enumerate(groups)
        ]

    @property
    def rollout_stats(self) -> RolloutStats:
        """What the rollouts since the last `reset_stats()` measured."""
        return self._stats

    def stats(self) -> dict:
        """`rollout_stats` as a dict (RolloutStats.as_dict), with the tuner's figures under "tuner" and the
        measured cost of a verified token per live-batch bucket under "step_costs" (with a "-pa" suffix arm)."""
        out = self._stats.as_dict()
        if self.tuner is not None:
            out["tuner"] = self.tuner.stats()
        if self.decoder.costs is not None and self.decoder.costs.fits:
            out["step_costs"] = self.decoder.costs.stats()
        return out

    def reset_stats(self) -> None:
        self._stats = RolloutStats()

    # --- one step ----------------------------------------------------------------------------------
    def step(self) -> None:
        start = time.perf_counter()
        admitted = self.scheduler.admit(self.batch.seqs if self.batch else [])
        if admitted:
            self._prefill(admitted)
        if self.batch is None or not len(self.batch):
            # Every admitted row finished at prefill (its first token ended it): nothing decoded, so no step
            # is recorded (per-step lists stay one entry a decode step); the time counts in the wall time.
            return
        size = len(self.batch)
        result = self.decoder.decode(self.batch)
        self._stats.record_step(size, result.strategy, sum(map(len, result.tokens)), result.sources, result.drafted)
        self._postprocess(result)
        self._stats.steps += 1
        self._stats.step_times.append(time.perf_counter() - start)

    def _prefill(self, groups: list[Group]) -> None:
        """Prefill the admitted groups in chunks of similar prompt lengths (`prefill_chunks`), then join
        their rows to the live batch."""
        parts = [self._prefill_chunk([groups[i] for i in chunk])
                 for chunk in prefill_chunks([len(g.prompt) for g in groups])]
        if self.batch is None or not len(self.batch):
            self.batch = parts.pop(0)
        if parts:
            self.batch.extend(*parts)
        self._drop_finished()

    def _prefill_chunk(self, groups: list[Group]) -> LiveBatch:
        """One right-padded forward over the groups' prompts into a fresh cache, forked to the groups'
        samples, their first tokens sampled and appended."""
        device = self.model.device
        lengths = torch.tensor([len(g.prompt) for g in groups], device=device)
        T = int(lengths.max())
        ids = torch.zeros(len(groups), T, dtype=torch.long, device=device)
        for i, g in enumerate(groups):
            ids[i, : len(g.prompt)] = torch.tensor(g.prompt, device=device)
        valid = torch.arange(T, device=device)[None] < lengths[:, None]  # [G, T]
        # the most slots a row may need: its prompt and new tokens, and a block for a draft's slots past them
        limit = max(len(g.prompt) + s.max_new for g in groups for s in g.seqs) + self.config.cache_block
        cache = self.model.new_cache(len(groups), block=self.config.cache_block, limit=limit)
        output_layers = self.decoder.output_layers
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
        self.decoder.prefill(fresh, ids, lengths, out, counts)
        self._stats.prefill_tokens += int(lengths.sum())
        self._append(fresh, first)
        return fresh

    def _postprocess(self, result: DecodeResult) -> None:
        self._append(self.batch, result)
        self._drop_finished()

    def _append(self, batch: LiveBatch, result: DecodeResult) -> None:
        kept = []
        for b, seq in enumerate(batch.seqs):
            hidden = result.hidden[b] if result.hidden is not None else None
            layers = result.layers[b] if result.layers is not None else None
            kept.append(seq.append(result.tokens[b], result.logprobs[b], hidden, layers))
        self._stats.decode_tokens += sum(kept)
        self.decoder.appended(batch.seqs, kept)
        batch.last_tokens = torch.tensor([r[-1] for r in result.tokens], dtype=torch.long,
                                         device=batch.last_tokens.device)

    def _drop_finished(self) -> None:
        batch = self.batch
        keep = fill_from_tail([s.finish_reason is None for s in batch.seqs])
        if len(keep) < len(batch):
            self._finished += [s for s in batch.seqs if s.finish_reason is not None]
            batch.select(keep)

    # --- requests ----------------------------------------------------------------------------------
    def _prompt_ids(self, i: int, prompt: list[int] | str) -> list[int]:
        """Prompt i as checked token ids (a string is encoded with the tokenizer)."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ConfigError(f"prompt {i} is a string but the engine has no tokenizer; pass token ids")
            prompt = self.tokenizer.encode(prompt)
        if isinstance(prompt, torch.Tensor):
            if prompt.dim() != 1 or prompt.dtype.is_floating_point or prompt.dtype == torch.bool:
                raise ConfigError(f"prompt {i} must be a 1-D integer tensor of token ids, got {prompt.dtype} "
                                  f"of shape {tuple(prompt.shape)}")
            prompt = prompt.tolist()
        bad = next((t for t in prompt if not integral(t)), None)
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
        return prompt

    def _make_group(self, prompt: list[int], params: SamplingParams, states: list[object | None]) -> Group:
        """A request's group of `params.n` sequences; `states` are their decoder states (Decoder.start)."""
        request_id = self._next_request
        self._next_request += 1
        seed = params.seed if params.seed is not None else self._seeds.getrandbits(63)
        stop = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.eos_ids)
        max_new = min(params.max_tokens, self.context_length - len(prompt))
        seqs = [Sequence(request_id, j, prompt, params, rng.sequence_key(seed, j), stop, max_new, state=states[j])
                for j in range(params.n)]
        return Group(request_id, prompt, seqs)


def check_tied(own: dict[str, torch.Tensor], state: dict[str, torch.Tensor]) -> None:
    """Names of the engine's model that share one tensor (tied embedding and head) must be given equal
    weights: copied one after the other, the last would silently win. A policy whose embedding carries a
    LoRA delta while its tied head does not is such a case."""
    names: dict[tuple, list[str]] = {}
    for name, tensor in own.items():
        names.setdefault((tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tensor.shape), []).append(name)
    for group in (g for g in names.values() if len(g) > 1):
        first = state[group[0]]
        for name in group[1:]:
            other = state[name]
            same = (other.data_ptr() == first.data_ptr() and other.stride() == first.stride()
                    and other.dtype == first.dtype)
            if not same and not torch.equal(other, first.to(other.dtype)):
                raise ConfigError(f"load_weights: the engine's model ties {group[0]} and {name} (one tensor), "
                                  "and the weights given for them differ")
