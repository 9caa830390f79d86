"""`Example`: one RL prompt with the columns its reward needs, whatever dataset it came from.

A prompt is either plain text or a list of chat messages (`{"role": ..., "content": ...}`), which the
trainer renders with the tokenizer's chat template. `columns` are passed to reward functions as
keyword lists aligned with the prompts (TRL's convention), e.g. `answer` for the built-in task or
`ground_truth` for verl-layout math data. `source` names where the example came from ("data.jsonl:17")
so a bad row or a failing reward can be reported precisely.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Example:
    prompt: str | list[dict]
    columns: dict[str, object] = field(default_factory=dict)
    source: str = ""


def task_examples(task, n: int, seed: int, split: str = "train") -> list[Example]:
    """`n` problems of a built-in task as examples; the reference answer travels as column `answer`."""
    return [
        Example(p.prompt, {"answer": p.answer, "num_steps": p.num_steps}, f"{type(task).__name__}:{split}:{seed}:{i}")
        for i, p in enumerate(task.sample(n, seed, split))
    ]
