"""TRL's GRPOTrainer rolling out with tlt's engine: `GRPOTrainer(..., rollout_func=make_rollout_func(path))`.

The contract (TRL 1.16, `GRPOTrainer._generate`): the trainer calls `rollout_func(prompts, trainer)`
with this process's slice of the generation batch, in which its sampler already repeats every prompt
`num_generations` times in a row (`num_generations_eval` in evaluation); prompts are strings or lists
of chat messages, untemplated. It expects a dict of three lists aligned with `prompts`, one completion
per entry: `prompt_ids`, `completion_ids` and `logprobs` (one float per completion token, under the
distribution the token was drawn from, as vLLM's processed logprobs); any further key goes to the
reward functions. TRL then decodes, scores, computes advantages per group and updates the policy.

One call is
    sync -> render -> generate -> flatten
  - sync: when the optimizer has stepped since the engine's last load (`trainer.state.global_step`
    moved), a parameter was written in place, or the policy (`trainer.model`, unwrapped) or the run (`trainer.state`: a second `train()`,
    a resumed checkpoint, another trainer) is another object, the policy is copied into the engine's
    model with version = the global step, and the rollout asks the engine for exactly that version:
    every completion comes from the weights being trained (on-policy), whether TRL generates once per
    optimizer step, once per `steps_per_generation` or reuses a generation `num_iterations` times;
    speculation leaves the distribution unchanged (lossless). The step, not the tensors, tells a
    change, as fused optimizers update weights without bumping their in-place version counters; the
    counters and identities tell the changes made at the same step (`load_best_model_at_end` loading a
    checkpoint into the model, a user's `load_state_dict` between `train()` and `evaluate()`).
    tlt's parameter names are transformers' own, so the state dict needs no name map;
  - render: text is encoded as TRL encodes it, chat messages go through the trainer's tokenizer's
    chat template with `trainer.chat_template_kwargs` (tlt/chat.py);
  - generate: each run of identical consecutive prompts becomes one request with n = its length, so
    the n samples share one prefill; sampling follows `trainer.args` (temperature, top_p, top_k,
    max_completion_length) and stops on `trainer.eos_token_ids` and nothing else, the ids TRL counts
    as finished. Each call's request seeds come from the engine's seed (else `args.seed`), the process
    index, train or eval, the global step and the call's place in the step, so a run is reproducible, a
    resumed run draws from step N on what the uninterrupted one drew, evaluating leaves training's draws
    as they are, and the processes of one run, which may each hold part of a prompt's group, draw
    different samples (as TRL's `set_seed(device_specific=True)`);
  - flatten: the samples of each request, in order, give one entry per prompt of the slice.
What tlt cannot honour is refused with the setting named rather than ignored, since ignoring it would
train on a distribution the user did not ask for: sampling settings tlt does not implement (min_p,
repetition_penalty, generation_kwargs), tools (TRL would continue tool turns with its own generation
from prompts tlt rendered without the tools), vLLM (its weight syncs would be wasted and its
settings unused), and DeepSpeed ZeRO-3 and FSDP1 (their sharded parameters are placeholders outside
their own gathering contexts); FSDP2's are gathered. A PEFT LoRA policy (`GRPOTrainer(peft_config=...)`)
is served merged: the engine holds base weights plus the adapters' deltas, computed at each sync without
touching the trainer's weights (`lora_merged_state`); other adapter kinds are refused by name.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import random
import warnings
import weakref

import torch

from tlt.chat import render_prompt
from tlt.errors import ConfigError
from tlt.rollout import EngineConfig, RolloutEngine, SamplingParams


class TrlRollout:
    """The callable TRL's `GRPOTrainer(rollout_func=...)` calls; `engine` is the tlt engine it drives."""

    def __init__(self, engine: RolloutEngine) -> None:
        self.engine = engine
        # What the engine holds: (the policy module, the TrainerState of the train() call, its global
        # step, its weights_stamp) when it was loaded, the first two weakly so that a finished run's
        # model can be freed.
        self._loaded: tuple[weakref.ref, weakref.ref, int, tuple | None] | None = None
        self._calls: dict[tuple[str, int], int] = {}  # rollouts so far per (mode, global step)
        self._warned_rounding = False

    def __call__(self, prompts: list, trainer) -> dict[str, list]:
        params = self.sampling_params(trainer)
        version = self.sync(trainer)
        runs = [(prompt, len(list(same))) for prompt, same in itertools.groupby(prompts)]
        options = getattr(trainer, "chat_template_kwargs", None) or {}
        ids = [render_prompt(trainer.processing_class, prompt, **options) for prompt, _ in runs]
        seeds = self._request_seeds(trainer, version)
        requests = [dataclasses.replace(params, n=n, seed=seeds.getrandbits(63)) for _, n in runs]
        outputs = self.engine.generate(ids, requests, use_tqdm=False, weights_version=version)
        samples = [(out.prompt_token_ids, c) for out in outputs for c in out.outputs]
        return {
            "prompt_ids": [list(p) for p, _ in samples],
            "completion_ids": [list(c.token_ids) for _, c in samples],
            "logprobs": [list(c.logprobs) for _, c in samples],
        }

    def sync(self, trainer) -> int:
        """Load the trainer's current policy into the engine unless the engine already holds it, and
        return the version it holds (the trainer's global step)."""
        policy = trainer.accelerator.unwrap_model(trainer.model)
        run, step = trainer.state, int(trainer.state.global_step)
        versions = weights_stamp(policy)
        held = self._loaded
        if (held is None or held[0]() is not policy or held[1]() is not run or held[2] != step
                or versions is None or held[3] != versions):
            check_sharding(trainer)
            if hasattr(policy, "peft_config"):
                state = lora_merged_state(policy)
                self._warn_rounding()
            else:
                state = policy.state_dict()
            self.engine.load_weights({k: whole(v) for k, v in state.items()}, step)
            self._loaded = (weakref.ref(policy), weakref.ref(run), step, versions)
        return step

    def _warn_rounding(self) -> None:
        """Once: a merged LoRA policy held in less than float32 loses every weight change below the dtype's
        resolution (in bfloat16 about 1/256 of the weight), which early LoRA updates mostly are."""
        dtype = next(self.engine.model.parameters()).dtype
        if dtype in (torch.float32, torch.float64) or self._warned_rounding:
            return
        self._warned_rounding = True
        warnings.warn(f"tlt: the engine holds the merged LoRA policy in {dtype}, which rounds away each weight "
                      "change smaller than its resolution (in bfloat16 about 1/256 of the weight): the rollouts "
                      "then sample from nearer the base model than the trainer computes; give make_rollout_func "
                      "dtype='float32' to serve the adapters' changes whole", stacklevel=3)

    def sampling_params(self, trainer) -> SamplingParams:
        """The trainer's sampling settings as tlt's; a setting tlt cannot honour is a ConfigError naming it."""
        args = trainer.args
        unsupported = {
            "min_p": args.min_p not in (None, 0.0),
            "repetition_penalty": args.repetition_penalty != 1.0,
            f"generation_kwargs ({sorted(args.generation_kwargs or {})})": bool(args.generation_kwargs),
            "use_vllm": args.use_vllm,
            "tools (or environment_factory methods)": bool(getattr(trainer, "tools", None)),
        }
        refused = [name for name, set_ in unsupported.items() if set_]
        if refused:
            raise ConfigError(f"GRPOTrainer sets {', '.join(refused)}, which tlt's rollout_func does not "
                              "honour; unset them to roll out with tlt")
        limit = args.max_completion_length
        try:
            return SamplingParams(
                temperature=args.temperature, top_p=args.top_p, top_k=args.top_k or -1,
                max_tokens=self.engine.context_length if limit is None else limit,
                stop_token_ids=tuple(trainer.eos_token_ids), ignore_eos=True,
            )
        except ConfigError as exc:
            raise ConfigError(f"GRPOConfig's sampling settings as tlt's (max_tokens is max_completion_length, "
                              f"stop_token_ids the trainer's eos_token_ids): {exc}") from None

    def _request_seeds(self, trainer, step: int) -> random.Random:
        """The stream of this call's request seeds: a function of the seed, the process, train or eval, the
        global step and the call's place among that step's calls, so a resumed run (a new rollout_func at
        step N) draws what the uninterrupted run drew at step N, and evaluating does not move training's
        draws. `str` seeds hash the same in every process (SHA-512, not Python's salted hash)."""
        seed = self.engine.config.seed if self.engine.config.seed is not None else trainer.args.seed
        mode = "train" if trainer.model.training else "eval"
        n = self._calls.get((mode, step), 0)
        # this step's counts only (earlier steps' are never asked for again)
        self._calls = {**{k: v for k, v in self._calls.items() if k[1] == step}, (mode, step): n + 1}
        return random.Random(f"{seed}:{trainer.accelerator.process_index}:{mode}:{step}:{n}")


def weights_stamp(policy) -> tuple | None:
    """What tells a change of the policy's weights between two calls at one step: each parameter's identity
    (`load_state_dict(assign=True)` puts new tensors in place) and version counter (every in-place write
    bumps it; writes through `.data` do not, and pass unseen). None for inference tensors, which keep no
    counter: the engine then loads the weights at every call."""
    try:
        stamp = tuple((id(p), p._version) for p in policy.parameters())
    except RuntimeError:
        return None
    if hasattr(policy, "peft_config"):  # which adapters compute: set_adapter, enable/disable and merge change it
        from peft.tuners.tuners_utils import BaseTunerLayer

        stamp += tuple((tuple(m.active_adapters), m.disable_adapters, tuple(m.merged_adapters))
                       for m in policy.modules() if isinstance(m, BaseTunerLayer))
    return stamp


def whole(tensor):
    """A tensor as a whole: under FSDP2 a parameter is a DTensor holding this process's shard, and
    `full_tensor` gathers it, a collective every process runs at the same calls (they sync at the same
    steps)."""
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def check_sharding(trainer) -> None:
    """Refuse the shardings whose weights cannot be copied: DeepSpeed ZeRO-3 and FSDP1 keep parameters
    behind placeholders that only their own gathering contexts fill, which copied would be empty tensors."""
    state = getattr(trainer.accelerator, "state", None)
    deepspeed = getattr(state, "deepspeed_plugin", None)
    fsdp = getattr(state, "fsdp_plugin", None)
    if deepspeed is not None and deepspeed.zero_stage == 3:
        raise ConfigError("the trainer shards the policy with DeepSpeed ZeRO-3, whose placeholders tlt's rollout_func "
                          "cannot copy; use ZeRO stage 2 or FSDP2 (fsdp_version: 2), whose weights it gathers")
    if fsdp is not None and getattr(fsdp, "fsdp_version", 1) == 1:
        raise ConfigError("the trainer shards the policy with FSDP1, whose flat parameters tlt's rollout_func cannot "
                          "copy; use FSDP2 (fsdp_version: 2), whose weights it gathers, or DeepSpeed ZeRO stage 2")


def lora_merged_state(policy) -> dict:
    """The weights a PEFT LoRA policy computes with, by the base model's own names: each adapted layer's
    base weight plus its active adapters' deltas (B A times the scaling, as PEFT's merge adds them; with
    `lora_bias`, B's bias too), or its base weight alone where an adapter is merged into it already, and a
    module under `modules_to_save` as its active trained copy.
    Computed beside the trainer's weights, which stay as they are: merging in place and back would leave
    bf16 base weights rounded differently after every sync. What the merge cannot express is refused by
    name: prompt-learning and other non-LoRA adapters, LoRA variants (DoRA and others), adapters on
    quantized or non-Linear/Embedding layers, trainable-token wrappers."""
    from torch import nn
    from peft import PeftModel
    from peft.tuners.lora import LoraLayer
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils.other import AuxiliaryTrainingWrapper, ModulesToSaveWrapper

    if isinstance(policy, PeftModel):
        model, adapters = policy.get_base_model(), policy.active_adapters
    else:  # a transformers model holding adapters it added itself (add_adapter, load_adapter): its layers know
        model = policy  # which are active
        adapters = sorted({a for m in policy.modules() if isinstance(m, BaseTunerLayer) for a in m.active_adapters})
    kinds = {name: str(getattr(policy.peft_config[name].peft_type, "value", policy.peft_config[name].peft_type))
             for name in adapters}
    others = {name: kind for name, kind in kinds.items() if kind != "LORA"}
    if others:
        raise ConfigError(f"the trainer trains PEFT adapters {others}; tlt's rollout_func merges LoRA adapters only")
    state: dict = {}

    def adapted(module, path: str) -> None:
        base, where = module.get_base_layer(), path.rstrip(".")
        if isinstance(module.base_layer, BaseTunerLayer):
            raise ConfigError(f"the LoRA adapter at {where} wraps another adapter layer; tlt's rollout_func merges "
                              "one adapter layer per module")
        if type(base) not in (nn.Linear, nn.Embedding):
            raise ConfigError(f"the LoRA adapter at {where} wraps a {type(base).__name__}; tlt's rollout_func "
                              "merges adapters on plain Linear and Embedding layers (not quantized ones)")
        weight, bias = whole(base.weight.detach()), getattr(base, "bias", None)
        bias = None if bias is None else whole(bias.detach())
        # A layer with any adapter merged computes with its base weight alone (PEFT's forward), unmerged
        # active adapters included: so is it served.
        if not module.disable_adapters and not module.merged:
            for name in module.active_adapters:
                if name not in module.scaling:
                    continue  # not an adapter of this layer
                variant = getattr(module, "lora_variant", {}).get(name)
                if variant is not None or getattr(module, "use_dora", {}).get(name):
                    kind = type(variant).__name__ if variant is not None else "DoRA"
                    raise ConfigError(f"the LoRA adapter {name!r} at {where} is a {kind}; tlt's rollout_func "
                                      "merges plain LoRA adapters only")
                weight = weight + whole(module.get_delta_weight(name).detach())
                if getattr(module, "lora_bias", {}).get(name):
                    if bias is None:
                        raise ConfigError(f"the LoRA adapter {name!r} at {where} adds a bias (lora_bias) to a layer "
                                          "without one, which the base model cannot hold; target layers with a bias")
                    bias = bias + whole(module.lora_B[name].bias.detach()) * module.scaling[name]
        state[f"{path}weight"] = weight
        if bias is not None:
            state[f"{path}bias"] = bias

    def walk(module, path: str) -> None:
        if isinstance(module, LoraLayer):
            return adapted(module, path)
        if isinstance(module, ModulesToSaveWrapper):
            active = [a for a in module.active_adapters if a in module.modules_to_save]
            trained = not module.disable_adapters and active
            return walk(module.modules_to_save[active[0]] if trained else module.original_module, path)
        if isinstance(module, (BaseTunerLayer, AuxiliaryTrainingWrapper)):
            raise ConfigError(f"the PEFT layer at {path.rstrip('.') or 'the model'} is a {type(module).__name__}; tlt's "
                              "rollout_func merges LoRA layers and modules_to_save only")
        skipped = getattr(module, "_non_persistent_buffers_set", set())
        for name, tensor in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]:
            if name not in skipped:
                state[path + name] = tensor.detach()
        for name, child in module.named_children():
            walk(child, f"{path}{name}.")

    walk(model, "")
    return state


def make_rollout_func(model_path_or_engine: str | os.PathLike | RolloutEngine, **engine_options) -> TrlRollout:
    """A rollout_func for TRL's GRPOTrainer. Given a model folder (the one the trainer trains), build
    the engine from it: `engine_options` are EngineConfig fields (speculative="on",
    strategy="ngram-d4", seed, ...) plus `dtype` and `device` for `load_model` (give the trainer's
    device, e.g. device="cuda"). Given an engine, use it."""
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
