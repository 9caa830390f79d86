"""Prompts to token ids: plain text as it is, chat messages through the tokenizer's chat template.

A prompt is a string or a list of messages `{"role": ..., "content": ...}` (see data/example.py). A
string is encoded as it is, the way TRL and the engine encode text prompts. Messages are rendered by
the tokenizer's own chat template with `add_generation_prompt=True`, so the ids end where the
assistant's answer begins and the policy is sampled exactly as it will be served. A tokenizer without
a template (the built-in character tokenizer, a base model's) cannot render messages: that is an error
rather than a guessed format, since a made-up template would train the policy on text it never sees
in use.
"""

from __future__ import annotations

from typing import Any

from tlt.errors import ConfigError


def render_prompt(tokenizer, prompt: str | list[dict], **template_options: Any) -> list[int]:
    """Token ids of one prompt. `template_options` go to the chat template (e.g. enable_thinking)."""
    if isinstance(prompt, str):
        return list(tokenizer.encode(prompt))
    _check_messages(prompt)
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError(f"the prompt is a list of chat messages but the tokenizer ({type(tokenizer).__name__}) "
                          "has no chat template; give text prompts or a tokenizer with `chat_template`")
    rendered = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True, return_dict=True,
                                             **template_options)
    return list(rendered["input_ids"])


def _check_messages(prompt: Any) -> None:
    if not isinstance(prompt, list) or not prompt:
        raise ConfigError(f"a prompt must be a string or a non-empty list of chat messages, got {prompt!r:.80}")
    for i, message in enumerate(prompt):
        if not isinstance(message, dict) or "role" not in message or "content" not in message:
            raise ConfigError(f"chat message {i} must be an object with 'role' and 'content', got {message!r:.80}")
        content = message["content"]
        if isinstance(content, list):  # content parts, as multimodal datasets write them; the template gets them
            if not content:
                raise ConfigError(f"chat message {i} has no content parts; give its text as a string")
            for part in content:
                kind = part.get("type") if isinstance(part, dict) else None
                if kind != "text" or not isinstance(part.get("text"), str):
                    raise ConfigError(f"chat message {i} has a content part {part!r:.60} that is not text "
                                      "({'type': 'text', 'text': '...'}); tlt's policies read text only: give the "
                                      "message's text as a string")
