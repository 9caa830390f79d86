"""Tokenizer loading: one call for the built-in character tokenizer and Hugging Face tokenizers.

Both expose the same surface (encode, decode, batch_decode, eos/pad/bos ids, vocab size), so the rest
of tlt is written once for both."""

from __future__ import annotations

import os

from tlt.errors import CheckpointError
from tlt.model.checkpoint import resolve_model_path


def load_tokenizer(path_or_name: str | os.PathLike):
    from tlt.tasks import CharTokenizer

    folder = resolve_model_path(path_or_name)
    if (folder / "char_tokenizer.json").exists():
        return CharTokenizer.from_pretrained(folder)
    if (folder / "tokenizer.json").exists() or (folder / "tokenizer_config.json").exists():
        from transformers import AutoTokenizer

        from tlt.model.checkpoint import read_json

        # transformers reads config.json too, and a corrupt one would surface as its traceback
        for name in ("config.json", "tokenizer_config.json"):
            if (folder / name).exists():
                read_json(folder / name)
        try:
            return AutoTokenizer.from_pretrained(str(folder))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{folder}: cannot load its tokenizer ({type(exc).__name__}: {exc})") from None
    raise CheckpointError(f"{folder}: no tokenizer (expected char_tokenizer.json or tokenizer.json)")
