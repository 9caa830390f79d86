"""`tlt sft`: the recipe that trains the default model on the built-in task.

The model is narrow but deep (8 layers by default) like real checkpoints, so that a one-layer drafter
costs a small fraction of a target forward. It learns by next-token prediction on solutions written by
`ArithmeticTask.solve` with a per-step `error_rate`: some solutions are deliberately imperfect, so the
model makes arithmetic slips at a rate RL can then drive down. Training data is drawn with a flatter
length law than evaluation (`train_zipf_exponent`) so the rare long problems are seen often enough.

Examples are packed into rows of `row_tokens` tokens; position ids restart at 0 for each example, which
the model turns into a block-diagonal causal mask (no attention across examples). Only solution tokens
and the end-of-sequence token carry loss. The folder it writes is a Hugging Face checkpoint plus the
character tokenizer and `recipe.json` (the exact config and command that reproduce it).

`--preset NAME` starts from a named set of fields (`PRESETS`); a config file and `key=value` overrides go
on top. `bench` is the bench policy: ~92 M parameters (184 MB in bf16, 12 layers), so that its decode
streams its weights from memory as a real policy's does. It starts from the default model grown to that
shape with its function preserved (`init`, tlt/model/grow.py) and trains on the `bench` task
(reasoning-length chains) with bf16 autocast: 15 minutes on 2 Xeon cores with AMX, 33 on the 2-core EPYC.
"""

from __future__ import annotations

import argparse
import math
import random
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

from tlt.config import to_dict


@dataclass(frozen=True)
class SFTConfig:
    hidden_size: int = 192
    num_hidden_layers: int = 8
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 48
    intermediate_size: int = 512
    vocab_size: int = 32
    max_position_embeddings: int = 1024
    task: str = "arithmetic"  # a task name of tlt.tasks (its length law is replaced by train_zipf_exponent)
    steps: int = 1500
    rows_per_step: int = 4
    row_tokens: int = 768
    lr: float = 2e-3
    warmup_steps: int = 100
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    error_rate: float = 0.03
    train_zipf_exponent: float = 1.1
    seed: int = 0
    threads: int = 0
    autocast: bool = False  # forward and loss under bf16 autocast (weights and optimizer stay float32)
    log_every: int = 50
    save_every: int = 250
    stop_at: int | None = None
    init: str | None = None  # a model folder or built-in name grown into this shape to start from (tlt/model/grow.py)

    # stop_at: end training after this many steps of the `steps`-long LR schedule. The default model is
    # such a mid-run checkpoint: accurate enough to be useful, imperfect enough for RL to improve it.

    def __post_init__(self) -> None:
        from tlt.errors import ConfigError

        if not 0 <= self.error_rate < 1:
            raise ConfigError(f"field 'error_rate' must be in [0, 1), got {self.error_rate}")
        if self.steps <= 0 or self.rows_per_step <= 0 or self.row_tokens < 64:
            raise ConfigError("fields 'steps' and 'rows_per_step' must be positive and 'row_tokens' >= 64")
        for name in ("lr", "grad_clip"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and 0 < value < math.inf):
                raise ConfigError(f"field {name!r} must be a finite number > 0, got {value!r}")
        if not (isinstance(self.weight_decay, (int, float)) and 0 <= self.weight_decay < math.inf):
            raise ConfigError(f"field 'weight_decay' must be a finite number >= 0, got {self.weight_decay!r}")
        if self.warmup_steps < 0:
            raise ConfigError(f"field 'warmup_steps' must be >= 0, got {self.warmup_steps}")
        if self.stop_at is not None and not 0 < self.stop_at <= self.steps:
            raise ConfigError(f"field 'stop_at' must be in 1..steps ({self.steps}), got {self.stop_at}")
        from tlt.tasks import task_names

        if self.task not in task_names():
            raise ConfigError(f"field 'task' must be one of {task_names()}, got {self.task!r}")
        task = self.task_config()
        # bos, "Q:", the start value, one op and digit per step, "\nA:"; then the solution and eos
        longest = 1 + 2 + task.width + 2 * task.max_steps + 3 + task.max_solution_tokens
        if longest > min(self.max_position_embeddings, self.row_tokens):
            raise ConfigError(f"fields 'max_position_embeddings' ({self.max_position_embeddings}) and 'row_tokens' "
                              f"({self.row_tokens}) must hold the longest example of task {self.task!r} ({longest} tokens)")

    def task_config(self):
        from tlt.tasks import get_task

        return get_task(self.task).config


# Named sets of SFTConfig fields (`tlt sft --preset NAME`).
PRESETS: dict[str, dict[str, object]] = {
    "bench": {
        # The default model grown to ~92 M parameters (its function preserved), then trained on the
        # reasoning-length task: from scratch, 220 steps of this size learned the format but not the
        # arithmetic. ~200 tokens/s on 2 cores (bf16 autocast, rows of 2048): ~35 min.
        "hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 16, "num_key_value_heads": 8,
        "head_dim": 48, "intermediate_size": 2560, "max_position_embeddings": 2048, "task": "bench",
        "init": "default", "steps": 200, "rows_per_step": 1, "row_tokens": 2048, "lr": 3e-4,
        "warmup_steps": 10, "error_rate": 0.01, "train_zipf_exponent": 0.9, "threads": 2, "autocast": True,
        "log_every": 5, "save_every": 10,
    },
}


def model_config(c: SFTConfig, tokenizer):
    from tlt.model import ModelConfig

    if c.vocab_size < tokenizer.vocab_size:
        from tlt.errors import ConfigError

        raise ConfigError(f"field 'vocab_size' ({c.vocab_size}) is smaller than the tokenizer's ({tokenizer.vocab_size})")
    return ModelConfig(
        architecture="Qwen3ForCausalLM", vocab_size=c.vocab_size, hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size, num_hidden_layers=c.num_hidden_layers,
        num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_key_value_heads,
        head_dim=c.head_dim, max_position_embeddings=c.max_position_embeddings, qk_norm=True,
        tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


def example_stream(c: SFTConfig, tokenizer):
    """Endless (tokens, loss_mask) examples: prompt tokens carry no loss, solution + eos do."""
    from tlt.tasks import get_task

    task = get_task(c.task, zipf_exponent=c.train_zipf_exponent)
    rng = random.Random(c.seed)
    chunk = 0
    while True:
        for p in task.sample(1024, seed=c.seed * 1_000_003 + chunk, split="train"):
            prompt = tokenizer.encode(p.prompt)
            solution = tokenizer.encode(task.solve(p.start, p.ops, c.error_rate, rng), add_special_tokens=False)
            yield prompt + solution + [tokenizer.eos_token_id], [0] * len(prompt) + [1] * (len(solution) + 1)
        chunk += 1


def packed_batches(c: SFTConfig, tokenizer):
    """Endless batches (input_ids, position_ids, loss_mask), each [rows_per_step, row_tokens]."""
    import torch

    stream = example_stream(c, tokenizer)
    pending = next(stream)
    while True:
        ids, pos, mask = [], [], []
        for _ in range(c.rows_per_step):
            row_ids, row_pos, row_mask = [], [], []
            while len(row_ids) + len(pending[0]) <= c.row_tokens:
                tokens, loss = pending
                row_ids += tokens
                row_pos += range(len(tokens))
                row_mask += loss
                pending = next(stream)
            if not row_ids:  # an example longer than a row is cut rather than stalling the stream
                tokens, loss = pending
                row_ids, row_pos, row_mask = tokens[: c.row_tokens], list(range(c.row_tokens)), loss[: c.row_tokens]
                pending = next(stream)
            pad = c.row_tokens - len(row_ids)
            # Padding continues the last example's positions so it forms no new sequence; its loss is 0.
            last = row_pos[-1]
            ids.append(row_ids + [tokenizer.pad_token_id] * pad)
            pos.append(row_pos + list(range(last + 1, last + 1 + pad)))
            mask.append(row_mask + [0] * pad)
        yield torch.tensor(ids), torch.tensor(pos), torch.tensor(mask)


def lr_at(step: int, c: SFTConfig) -> float:
    if step < c.warmup_steps:
        return c.lr * (step + 1) / c.warmup_steps
    progress = (step - c.warmup_steps) / max(1, c.steps - c.warmup_steps)
    return c.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def save(model, tokenizer, out: Path, c: SFTConfig, command: str, metrics: dict, preset: str | None = None) -> None:
    from tlt.io import atomic_write_json

    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    recipe = {"command": command, "config": to_dict(c), "metrics": metrics}
    if preset is not None:
        recipe["preset"] = {"name": preset, "fields": PRESETS[preset]}
    atomic_write_json(out / "recipe.json", recipe)


def train_sft(c: SFTConfig, out: Path, command: str = "tlt sft", log=print, preset: str | None = None):
    import torch
    import torch.nn.functional as F

    from tlt.device import slow_cpu_bf16
    from tlt.model import Transformer
    from tlt.tasks import CharTokenizer

    if c.threads:
        torch.set_num_threads(c.threads)
    if c.autocast and slow_cpu_bf16():
        log("sft: autocast=true asks for bf16 products, which this CPU runs through PyTorch's reference kernels "
            "(oneDNN has no bf16 products here), tens of times slower than float32 (44x on a Zen 3 EPYC); "
            "training in float32 (recipe.json records autocast=false)")
        c = replace(c, autocast=False)
    torch.manual_seed(c.seed)
    tokenizer = CharTokenizer()
    if c.init:
        from tlt.model.checkpoint import load_model
        from tlt.model.grow import grow

        model = grow(load_model(c.init), model_config(c, tokenizer), seed=c.seed).train()
    else:
        model = Transformer(model_config(c, tokenizer)).train()
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    other = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": c.weight_decay}, {"params": other, "weight_decay": 0}],
                            lr=c.lr, betas=(0.9, 0.95))
    batches = packed_batches(c, tokenizer)
    start, tokens_seen, metrics = time.time(), 0, {}
    last = c.stop_at or c.steps
    for step in range(last):
        ids, pos, mask = next(batches)
        for group in opt.param_groups:
            group["lr"] = lr_at(step, c)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=c.autocast):
            logits = model(ids, position_ids=pos).logits[:, :-1]  # [R, L-1, V]
        target_mask = mask[:, 1:].bool()  # [R, L-1]: position t predicts token t+1
        loss = F.cross_entropy(logits[target_mask].float(), ids[:, 1:][target_mask])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), c.grad_clip)
        opt.step()
        tokens_seen += ids.numel()
        if (step + 1) % c.log_every == 0 or step + 1 == last:
            elapsed = time.time() - start
            metrics = {"step": step + 1, "loss": round(loss.item(), 4), "tokens": tokens_seen,
                       "elapsed_s": round(elapsed, 1), "tokens_per_s": round(tokens_seen / elapsed)}
            left = elapsed / (step + 1) * (last - step - 1)
            log(f"step {step + 1:5d}/{last}  loss {loss.item():.4f}  lr {lr_at(step, c):.2e}  "
                f"{tokens_seen / elapsed:,.0f} tok/s  {elapsed:,.0f}s  ~{left / 60:,.0f} min left")
        if (step + 1) % c.save_every == 0 or step + 1 == last:
            save(model.eval(), tokenizer, out, c, command, metrics, preset)
            model.train()
    return model.eval(), tokenizer


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default="runs/sft", help="output model folder")
    parser.add_argument("--preset", choices=sorted(PRESETS), help="start from these SFTConfig fields (see PRESETS)")
    parser.add_argument("--config", help="YAML file of SFTConfig fields")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="SFTConfig fields")


def config_from(preset: str | None, file: str | None = None, overrides: list[str] = ()) -> SFTConfig:
    """The preset's fields, then the YAML file's, then the overrides; errors name each field's origin."""
    from tlt.config import compose, load_yaml, parse_overrides

    layers = [(PRESETS[preset], f"preset {preset!r}")] if preset else []
    layers += [(load_yaml(file), str(file))] if file else []
    return compose(SFTConfig, [*layers, (parse_overrides(list(overrides)), "command line")])


def run(args: argparse.Namespace) -> int:
    c = config_from(args.preset, args.config, args.overrides)
    command = "tlt sft " + " ".join(sys.argv[2:]) if sys.argv[1:2] == ["sft"] else "tlt sft"
    train_sft(c, Path(args.out), command=command, preset=args.preset)
    print(f"wrote {args.out}")
    return 0
