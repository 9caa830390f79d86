"""A tiny word-level Hugging Face tokenizer with a chat template, built in the test (no model hub)."""

from __future__ import annotations

SPECIALS = ["<pad>", "<s>", "</s>", "<unk>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} <|end|> {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def build_chat_tokenizer(folder, vocab_size: int, chat_template: str | None = TEMPLATE):
    """Save a tokenizer of exactly `vocab_size` ids (specials, then words w0, w1, ...) to `folder`:
    ids 0, 1, 2 are pad, bos, eos as in the tiny test models; "<|end|>" (id 7) ends a turn."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    words = SPECIALS + [f"w{i}" for i in range(vocab_size - len(SPECIALS))]
    core = Tokenizer(WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    core.pre_tokenizer = WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", bos_token="<s>",
                                        eos_token="</s>", unk_token="<unk>",
                                        additional_special_tokens=SPECIALS[4:])
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(folder)
    return tokenizer
