"""Everything `tlt train` needs to run on your own model, data and reward, made locally (nothing to download):
a random 2-layer Llama folder with a byte-level chat tokenizer, one dataset in TRL's layout (JSONL) and one
in verl's (Parquet), and a reward module with TRL's signature. The README's "Bring your own" commands train
on them.

    python examples/byo.py [OUT_DIR]      # default: byo
"""

import json
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Tokenizer
from transformers.convert_slow_tokenizer import bytes_to_unicode

SPECIALS = ["<pad>", "<s>", "</s>", "<unk>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
PROBLEMS = [(a, b) for a in range(1, 9) for b in range(1, 9)]


def save_model(folder: Path) -> None:
    """A byte-level tokenizer (one token per byte, so any text encodes) with a chat template, beside a random
    2-layer Llama; any Llama / Qwen2 / Qwen3 folder saved by transformers loads the same way."""
    vocab = {t: i for i, t in enumerate(SPECIALS + list(bytes_to_unicode().values()))}
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=[], unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                               pad_token="<pad>", additional_special_tokens=SPECIALS[4:])
    tokenizer.chat_template = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
                               "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(vocab), hidden_size=64, intermediate_size=128,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                         max_position_embeddings=512, bos_token_id=1, eos_token_id=2, pad_token_id=0))
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def write_datasets(out: Path) -> None:
    # TRL layout: a `prompt` (text or chat messages); every other column reaches the reward as a keyword.
    with open(out / "train.jsonl", "w") as f:
        for a, b in PROBLEMS:
            f.write(json.dumps({"prompt": f"{a}+{b}=", "answer": str(a + b), "weight": 1.0 if a < b else 0.5}) + "\n")
    # verl layout: chat-message prompts, the reference under reward_model.ground_truth, plus data_source.
    pq.write_table(pa.Table.from_pylist([
        {"data_source": "toy", "prompt": [{"role": "user", "content": f"What is {a}+{b}?"}],
         "reward_model": {"style": "rule", "ground_truth": str(a + b)}, "extra_info": {"index": i}}
        for i, (a, b) in enumerate(PROBLEMS)]), out / "train.parquet")


REWARD = '''
def weighted_answer(prompts, completions, answer, weight, **columns):
    """TRL's signature: one float per completion; `answer` and `weight` are dataset columns."""
    return [w * float(a in c) for c, a, w in zip(completions, answer, weight)]
'''


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    save_model(out / "model")
    write_datasets(out)
    (out / "my_reward.py").write_text(REWARD)
    print(f"wrote {out}/model, {out}/train.jsonl, {out}/train.parquet, {out}/my_reward.py")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "byo"))
