"""Prompt rendering (tlt/chat.py) with a real transformers tokenizer saved and loaded back."""

import pytest

import tlt
from chat_tokenizer import build_chat_tokenizer
from tlt.chat import render_prompt


@pytest.fixture
def chat_tokenizer(tmp_path):
    build_chat_tokenizer(tmp_path / "tok", 40)
    return tlt.load_tokenizer(tmp_path / "tok")


def test_text_is_encoded_as_is(chat_tokenizer):
    assert render_prompt(chat_tokenizer, "w1 w2 w3") == chat_tokenizer.encode("w1 w2 w3") == [9, 10, 11]


def test_messages_go_through_the_chat_template_with_a_generation_prompt(chat_tokenizer):
    messages = [{"role": "system", "content": "w0"}, {"role": "user", "content": "w1 w2"}]
    ids = render_prompt(chat_tokenizer, messages)
    assert chat_tokenizer.decode(ids) == "<|system|> w0 <|end|> <|user|> w1 w2 <|end|> <|assistant|>"
    assert ids[-1] == chat_tokenizer.convert_tokens_to_ids("<|assistant|>")


def test_template_options_reach_the_template(tmp_path):
    template = "{% if shout %}w9 {% endif %}{% for m in messages %}{{ m['content'] }} {% endfor %}"
    build_chat_tokenizer(tmp_path / "tok", 40, chat_template=template)
    tokenizer = tlt.load_tokenizer(tmp_path / "tok")
    messages = [{"role": "user", "content": "w1"}]
    assert render_prompt(tokenizer, messages) == [9]
    assert render_prompt(tokenizer, messages, shout=True) == [17, 9]


def test_messages_without_a_chat_template_are_a_clear_error(tmp_path):
    build_chat_tokenizer(tmp_path / "tok", 40, chat_template=None)
    tokenizer = tlt.load_tokenizer(tmp_path / "tok")
    with pytest.raises(tlt.ConfigError, match="no chat template"):
        render_prompt(tokenizer, [{"role": "user", "content": "w1"}])
    from tlt.tasks import CharTokenizer

    with pytest.raises(tlt.ConfigError, match="CharTokenizer.*no chat template"):
        render_prompt(CharTokenizer(), [{"role": "user", "content": "1+1"}])


@pytest.mark.parametrize("prompt", [[], [{"role": "user"}], ["w1"], 7])
def test_malformed_prompts_are_rejected(chat_tokenizer, prompt):
    with pytest.raises(tlt.ConfigError, match="prompt|chat message"):
        render_prompt(chat_tokenizer, prompt)


def test_content_parts_other_than_text_are_named(chat_tokenizer):
    """Regression: a multimodal row's image part reached the chat template, which dropped it (or wrote its
    placeholder), and the text-only policy was sampled without the image the reward assumed it saw."""
    image = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "w1 w2"}]}]
    with pytest.raises(tlt.ConfigError, match=r"^chat message 0 has a content part \{'type': 'image'\} that is not "
                                              r"text .*text only: give the message's text as a string$"):
        render_prompt(chat_tokenizer, image)
    for content, named in [(["w1"], r"part 'w1'"), ([{"type": "text"}], r"part \{'type': 'text'\}"),
                           ([{"type": "text", "text": 7}], r"part \{'type': 'text', 'text': 7\}"),
                           ([], r"has no content parts")]:
        with pytest.raises(tlt.ConfigError, match=f"^chat message 1 (has a content )?{named}"):
            render_prompt(chat_tokenizer, [{"role": "system", "content": "w0"}, {"role": "user", "content": content}])
