"""TRL's GRPOTrainer rolling out with tlt's engine: `GRPOTrainer(..., rollout_func=make_rollout_func(path))`.

The contract (TRL 1.16, `GRPOTrainer._generate`): the trainer calls `rollout_func(prompts, trainer)`
with this process's slice of the generation batch, in which its sampler already repeats every prompt
`num_generations` times in a row; prompts are strings or lists of chat messages, untemplated. It
expects a dict of three lists aligned with `prompts`, one completion per entry: `prompt_ids`,
`completion_ids` and `logprobs` (one float per completion token); any further key goes to the reward
functions. TRL then decodes, scores, computes advantages per group and updates the policy.

One call is
    sync -> render -> generate -> flatten
  - sync: when the trainer's optimizer step moved on, its current policy (`trainer.model`, unwrapped)
    is copied into the engine's model with version = `trainer.state.global_step`, and the rollout
    asks the engine for exactly that version: every completion comes from the weights being trained
    (on-policy), and speculation leaves its distribution unchanged (lossless). tlt's parameter names
    are transformers' own, so the state dict needs no name map;
  - render: text is encoded as TRL encodes it, chat messages go through the trainer's tokenizer's
    chat template with `trainer.chat_template_kwargs` (tlt/chat.py);
  - generate: each run of identical consecutive prompts becomes one request with n = its length, so
    the n samples share one prefill; sampling follows `trainer.args` (temperature, top_p, top_k,
    max_completion_length) and stops on `trainer.eos_token_ids`, the ids TRL counts as finished;
  - flatten: the samples of each request, in order, give one entry per prompt of the slice.
Sampling settings tlt does not implement (min_p, repetition_penalty, generation_kwargs) are refused
rather than ignored, since ignoring them would train on a distribution the user did not ask for.
"""

from __future__ import annotations

import dataclasses
import itertools
import os

from tlt.chat import render_prompt
from tlt.errors import ConfigError
from tlt.rollout import EngineConfig, RolloutEngine, SamplingParams


class TrlRollout:
    """The callable TRL's `GRPOTrainer(rollout_func=...)` calls; `engine` is the tlt engine it drives."""

    def __init__(self, engine: RolloutEngine) -> None:
        self.engine = engine
        self._synced_step: int | None = None

    def __call__(self, prompts: list, trainer) -> dict[str, list]:
        params = self.sampling_params(trainer)
        self.sync(trainer)
        runs = [(prompt, len(list(same))) for prompt, same in itertools.groupby(prompts)]
        options = getattr(trainer, "chat_template_kwargs", None) or {}
        ids = [render_prompt(trainer.processing_class, prompt, **options) for prompt, _ in runs]
        outputs = self.engine.generate(ids, [dataclasses.replace(params, n=n) for _, n in runs], use_tqdm=False,
                                       weights_version=self._synced_step)
        samples = [(out.prompt_token_ids, c) for out in outputs for c in out.outputs]
        return {
            "prompt_ids": [list(p) for p, _ in samples],
            "completion_ids": [list(c.token_ids) for _, c in samples],
            "logprobs": [list(c.logprobs) for _, c in samples],
        }

    def sync(self, trainer) -> None:
        """Load the trainer's current policy into the engine unless it already holds this step's."""
        step = int(trainer.state.global_step)
        if step == self._synced_step:
            return
        policy = trainer.accelerator.unwrap_model(trainer.model)
        self.engine.load_weights(policy.state_dict(), step)
        self._synced_step = step

    def sampling_params(self, trainer) -> SamplingParams:
        args = trainer.args
        unsupported = {"min_p": args.min_p is not None, "repetition_penalty": args.repetition_penalty != 1.0,
                       "generation_kwargs": bool(args.generation_kwargs)}
        refused = [name for name, set_ in unsupported.items() if set_]
        if refused:
            raise ConfigError(f"GRPOConfig sets {refused}, which tlt's engine does not implement; "
                              "unset them to roll out with tlt")
        return SamplingParams(
            temperature=args.temperature, top_p=args.top_p, top_k=args.top_k or -1,
            max_tokens=args.max_completion_length or self.engine.context_length,
            stop_token_ids=tuple(trainer.eos_token_ids),
        )


def make_rollout_func(model_path_or_engine: str | os.PathLike | RolloutEngine, **engine_options) -> TrlRollout:
    """A rollout_func for TRL's GRPOTrainer. Given a model folder (the one the trainer trains), build
    the engine from it: `engine_options` are EngineConfig fields (speculative="on",
    strategy="ngram-d4", ...) plus `dtype` and `device` for `load_model`. Given an engine, use it."""
    if isinstance(model_path_or_engine, RolloutEngine):
        if engine_options:
            raise ConfigError(f"engine options {sorted(engine_options)} apply only when a model folder is given, "
                              "not an engine")
        return TrlRollout(model_path_or_engine)
    from tlt.model.checkpoint import load_model

    load = {k: engine_options.pop(k) for k in ("dtype", "device") if k in engine_options}
    try:
        config = EngineConfig(**engine_options)
    except TypeError as exc:
        raise ConfigError(f"make_rollout_func: {exc}; options are EngineConfig fields plus dtype and device") from None
    return TrlRollout(RolloutEngine(load_model(model_path_or_engine, **load), config=config))
