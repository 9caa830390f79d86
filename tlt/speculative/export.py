"""`tlt export-drafter`: a tlt drafter as the EAGLE-1/2 draft head SGLang and vLLM load.

Written layout (`LlamaForCausalLMEagle`):
    OUT/config.json        a Llama config of the target's shape (hidden_size, heads, kv heads, head_dim,
                           intermediate_size, rms_norm_eps, rope_theta/rope_scaling, vocab_size,
                           max_position_embeddings, ...) with num_hidden_layers = 1, attention_bias and
                           mlp_bias false, and architectures ["LlamaForCausalLMEagle"]
    OUT/model.safetensors  fc.weight [H, 2H], fc.bias [H], layers.0.self_attn.{q,k,v,o}_proj.weight,
                           layers.0.post_attention_layernorm.weight, layers.0.mlp.{gate,up,down}_proj.weight
No embedding and no LM head: the serving engine gives the draft head the target's, as tlt does.
SGLang loads the folder by that class name; vLLM's method="eagle" derives its class by prefixing
"Eagle" to the config's architectures, so it wants ["LlamaForCausalLM"] there instead.

That head (SGLang and vLLM `llama_eagle.py`, EAGLE's `cnets1.py`) computes
    f_hat = layers.0(fc(cat(embed(x[t+1]), f[t])))    input_layernorm the identity, no output norm
    logits = lm_head(f_hat)                           f_hat is also the next step's feature
which is tlt's drafter (drafter.py) exactly, so the export is a renaming: `fc.*` -> `fc.*`,
`layer.<name>` -> `layers.0.<name>`, checked first against the tensors a drafter for the target has.
A drafter of another layout is refused with the tensors that differ, never written with some dropped.

The EAGLE-3 variant (`feature_layers`) is refused: `LlamaForCausalLMEagle3` feeds `midlayer` q/k/v a
2H input cat(input_layernorm(embed), hidden_norm(h)) with h alone as the residual, takes logits from
norm(output) with its own LM head over a draft vocabulary (d2t) and feeds the un-normalised output
back; tlt fuses kH -> H, then applies fc 2H -> H and the same H-input layer as EAGLE-1. No assignment
of weights makes the two equal.

Input: a drafter folder as `Drafter.save` writes it (drafter_config.json, drafter.safetensors), or a
run directory holding `drafter/` (a drafter, or the online drafter checkpoints: the newest) or
`checkpoints/step_*/drafter/` (the highest step). The target's
shape comes from `target` (a model folder or built-in name), else from the checkpoint's `policy/`
beside the drafter, else from the drafter's `target_name`. The output folder is built beside its
destination and renamed into place, so it is complete or absent.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

from tlt.errors import CheckpointError, ConfigError, TltError
from tlt.model.config import ModelConfig
from tlt.speculative.drafter import Drafter, DrafterConfig, check_tensors

ARCHITECTURE = "LlamaForCausalLMEagle"


def find_drafter(path: str | os.PathLike) -> Path:
    """The drafter folder `path` names: itself, its `drafter/`, the newest drafter the run trained online
    (`drafter/latest.json`: aligned with the final policy), or its highest `checkpoints/step_*/drafter/`."""
    folder = Path(path)
    if not folder.is_dir():
        raise CheckpointError(f"{folder}: no such folder (expected a drafter folder or a run directory)")
    if (folder / "drafter_config.json").is_file():
        return folder
    if (folder / "drafter" / "drafter_config.json").is_file():
        return folder / "drafter"
    if (folder / "drafter" / "latest.json").is_file():
        from tlt.spot.checkpoint import latest_drafter_checkpoint

        return latest_drafter_checkpoint(folder / "drafter")
    steps = [p for p in (folder / "checkpoints").glob("step_*/drafter") if p.is_dir() and p.parent.name[5:].isdigit()]
    if steps:
        return max(steps, key=lambda p: int(p.parent.name[5:]))
    why = _why_no_drafter(folder) if (folder / "config.json").is_file() else ""
    raise CheckpointError(f"{folder}: holds no drafter (expected drafter_config.json, drafter/ or "
                          f"checkpoints/step_*/drafter/){why}")


def _why_no_drafter(run: Path) -> str:
    """Why a GRPO run directory holds no trained drafter, from its config.json and metrics.jsonl, and what
    to change; "" when the run's files do not say."""
    from tlt.config import upgrade
    from tlt.rl.config import TrainConfig
    from tlt.rl.metrics import read_metrics

    try:
        config = upgrade(TrainConfig, json.loads((run / "config.json").read_text()))
        rows = read_metrics(run / "metrics.jsonl")
    except (OSError, ValueError, TltError):
        return ""
    get = config.get
    if get("speculative") == "off":
        return "; the run did not speculate (speculative=off), so it used no drafter"
    drafter = get("drafter.model")
    if drafter == "auto" and get("model") != "default":
        drafter = None
    if drafter in (None, "none"):
        return (f"; the run drafted with n-gram drafts only (drafter.model={get('drafter.model')!r}): give it a "
                "drafter to train online (drafter.model=random, or a folder from tlt train-drafter)")
    if get("drafter.train") == "off":
        return (f"; the run did not train its drafter (drafter.train=off): the drafter it used is {drafter!r}, "
                "export that")
    pairs = max((r.get("drafter_buffer_pairs") or 0 for r in rows), default=0)
    if pairs < (get("drafter.min_pairs") or 0):
        return (f"; its drafter never trained: the online buffer held at most {pairs} pairs, fewer than "
                f"drafter.min_pairs={get('drafter.min_pairs')} (lower it, or train for more steps or longer "
                "responses)")
    steps = sum(r.get("drafter_phase_steps") or 0 for r in rows)
    if steps == 0:
        return (f"; its drafter never trained: no drafter phase ran in {len(rows)} steps (drafter.train="
                f"{get('drafter.train')!r}; try drafter.train=every)")
    if all(r.get("drafter_phase_kept") == 0 for r in rows if r.get("drafter_phase_steps")):
        return (f"; its drafter phases took {steps} optimizer steps, but none scored above the drafter it started "
                f"from on the held-out responses (drafter.holdout={get('drafter.holdout')}), so the run kept "
                f"drafting with the drafter it started from ({drafter!r}); drafter.holdout=0 publishes every phase")
    return ""


def export_eagle(source: str | os.PathLike, out_dir: str | os.PathLike,
                 target: str | os.PathLike | None = None) -> Path:
    """Write the drafter `source` names (see find_drafter) to `out_dir` as a LlamaForCausalLMEagle
    draft head; `target` names the target model when the drafter folder does not. Returns out_dir."""
    from safetensors.torch import save

    from tlt.io import atomic_write_bytes, atomic_write_json

    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise CheckpointError(f"{out}: already exists and is not an empty folder; choose a new output folder")
    folder = find_drafter(source)
    config, state = _read_drafter(folder)
    weights = str(folder / "drafter.safetensors")
    if config.feature_layers:
        raise ConfigError(f"{weights}: an EAGLE-3 style drafter (feature_layers {list(config.feature_layers)}) does not "
                          "map onto LlamaForCausalLMEagle3: its fusion and decoder layer differ (see "
                          "tlt/speculative/export.py)")
    model = _target_config(folder, config, target)
    tensors = eagle_tensors(model, config, state, weights)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}."))
    try:
        atomic_write_json(tmp / "config.json", eagle_config(model, tensors))
        atomic_write_bytes(tmp / "model.safetensors", save(tensors, metadata={"format": "pt"}))
        tmp.chmod(0o755)  # mkdtemp makes it private; the export is an ordinary folder
        if out.is_dir():
            out.rmdir()
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def eagle_tensors(target: ModelConfig, config: DrafterConfig, state: dict[str, torch.Tensor],
                  where: str) -> dict[str, torch.Tensor]:
    """tlt drafter tensors under their EAGLE-1 names, once checked to be those of a drafter for `target`."""
    from tlt.model.transformer import Transformer

    with torch.device("meta"):  # the drafter's tensor names and shapes, without allocating the target
        check_tensors(state, Drafter(Transformer(target), config).state_dict(), where)
    return {name.replace("layer.", "layers.0.", 1): t.contiguous() for name, t in state.items()}


def eagle_config(target: ModelConfig, tensors: dict[str, torch.Tensor]) -> dict:
    """The draft head's config.json: the target's shape as one Llama layer. rope is written in both the
    transformers 5 layout (rope_parameters) and the older one (rope_theta, rope_scaling) that serving
    engines pinned to transformers 4 read."""
    c = target
    rope = {"rope_theta": c.rope_theta, "rope_type": "default", **(c.rope_scaling or {})}
    return {
        "architectures": [ARCHITECTURE],
        "model_type": "llama",
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": 1,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": c.max_position_embeddings,
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta,
        "rope_scaling": c.rope_scaling,
        "rope_parameters": rope,
        "vocab_size": c.vocab_size,
        "tie_word_embeddings": c.tie_word_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": c.bos_token_id,
        "eos_token_id": c.eos_token_id,
        "pad_token_id": c.pad_token_id,
        "torch_dtype": str(tensors["fc.weight"].dtype).removeprefix("torch."),
    }


def _read_drafter(folder: Path) -> tuple[DrafterConfig, dict[str, torch.Tensor]]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    from tlt.model.checkpoint import read_json

    cfg_path = folder / "drafter_config.json"
    try:
        config = DrafterConfig(**read_json(cfg_path))
    except TypeError as exc:
        raise CheckpointError(f"{cfg_path}: {exc}") from None
    weights = folder / "drafter.safetensors"
    if not weights.is_file():
        raise CheckpointError(f"{weights}: weights file is missing")
    try:
        return config, load_file(str(weights))
    except (SafetensorError, OSError, RuntimeError, ValueError) as exc:
        raise CheckpointError(f"{weights}: cannot read safetensors weights ({exc})") from None


def _target_config(folder: Path, config: DrafterConfig, target: str | os.PathLike | None) -> ModelConfig:
    from tlt.model.checkpoint import load_config

    policy = folder.parent / "policy"
    name = target or (policy if (policy / "config.json").is_file() else config.target_name)
    if name is None:
        raise ConfigError(f"{folder}: the drafter does not name its target model; pass the target (--target MODEL)")
    model = load_config(name)
    for field, mine, theirs in (("target_architecture", config.target_architecture, model.architecture),
                                ("hidden_size", config.hidden_size, model.hidden_size),
                                ("vocab_size", config.vocab_size, model.vocab_size),
                                ("target_layers", config.target_layers, model.num_hidden_layers)):
        if mine != theirs:
            raise CheckpointError(f"{folder / 'drafter_config.json'}: field {field!r} is {mine!r} but the target "
                                  f"{name} has {theirs!r}")
    return model


def add_arguments(parser) -> None:
    parser.add_argument("source", metavar="RUN_DIR", help="a drafter folder, or a run directory holding drafter/ "
                        "or checkpoints/step_*/drafter/ (the highest step is exported)")
    parser.add_argument("out", metavar="OUT_DIR", help="new folder for the EAGLE draft head")
    parser.add_argument("--target", metavar="MODEL", default=None,
                        help="the target model folder or built-in name (default: the checkpoint's policy/, "
                        "else the drafter's target_name)")


def run(args) -> int:
    out = export_eagle(args.source, args.out, args.target)
    print(f"wrote {out} ({ARCHITECTURE}: config.json, model.safetensors)")
    return 0
