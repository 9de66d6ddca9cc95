"""chat_template_kwargs on /v1/chat/completions and /tokenize (vLLM's field), through the official
openai client and raw HTTP, against the fake engine with a tokenizer that renders a real template."""

from __future__ import annotations

import httpx
import openai
import pytest

from fake_engine import FakeEngine, FakeTokenizer
from quill.chat_template import render_chat_template
from quill.server.app import create_app
from server_utils import ThreadServer

MODEL = "fake-model"
HELLO = [{"role": "user", "content": "Hello"}]
EMPTY_THINK = "<think>\n\n</think>\n\n"

# Qwen3's switch: an empty think block after the generation prompt when enable_thinking is false.
TEMPLATE = (
    "{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '" + EMPTY_THINK.replace("\n", "\\n") + "' }}{%- endif %}"
    "{%- endif %}"
    "{%- if style is defined %}{{- raise_exception('unknown style ' + style) if style not in ['plain'] else '' }}{%- endif %}"
)


class TemplateTokenizer(FakeTokenizer):
    """The fake engine's byte tokenizer, with prompts rendered by quill's chat template renderer."""

    def apply_chat_template(self, messages, add_generation_prompt: bool = True, **kwargs) -> str:
        return render_chat_template(TEMPLATE, messages, add_generation_prompt=add_generation_prompt, **kwargs)

    def encode_chat(self, messages, add_generation_prompt: bool = True, **kwargs) -> list[int]:
        return self.encode(self.apply_chat_template(messages, add_generation_prompt, **kwargs))


@pytest.fixture(scope="module")
def live():
    engine = FakeEngine(max_num_seqs=8)
    engine.tokenizer = TemplateTokenizer()
    with ThreadServer(create_app(engine, MODEL, static_dir=None)) as server:
        yield server


@pytest.fixture(scope="module")
def client(live):
    return openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0)


def rendered(live, **body) -> str:
    """The prompt the server built, read back through /tokenize (one token per byte)."""
    response = httpx.post(live.url + "/tokenize", json={"messages": HELLO, **body}, timeout=30)
    assert response.status_code == 200, response.text
    return bytes(response.json()["tokens"]).decode()


def test_enable_thinking_reaches_the_template_through_the_openai_client(live, client):
    def prompt_tokens(**extra):
        out = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=2, **extra)
        return out.usage.prompt_tokens

    default = prompt_tokens()
    thinking = prompt_tokens(extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    not_thinking = prompt_tokens(extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert default == thinking == len("<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n")
    assert not_thinking == thinking + len(EMPTY_THINK)
    assert prompt_tokens(extra_body={"chat_template_kwargs": {}}) == default
    assert prompt_tokens(extra_body={"chat_template_kwargs": None}) == default


def test_streamed_request_takes_the_kwargs_too(client):
    stream = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=2, stream=True,
                                            stream_options={"include_usage": True},
                                            extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    usage = [chunk.usage for chunk in stream if chunk.usage is not None]
    assert usage[-1].prompt_tokens == len("<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n" + EMPTY_THINK)


def test_tokenize_shows_the_rendered_prompt(live):
    on = rendered(live, chat_template_kwargs={"enable_thinking": True})
    off = rendered(live, chat_template_kwargs={"enable_thinking": False})
    assert on == "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n" == rendered(live)
    assert off == on + EMPTY_THINK
    # /tokenize's own add_generation_prompt field (vLLM's) reaches the template as well
    assert rendered(live, add_generation_prompt=False, chat_template_kwargs={"enable_thinking": False}) == \
        "<|im_start|>user\nHello<|im_end|>\n"


@pytest.mark.parametrize("value", ["enable_thinking=false", ["enable_thinking"], 0, True])
def test_a_value_that_is_not_an_object_is_a_400_naming_the_field(live, client, value):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=2, extra_body={"chat_template_kwargs": value})
    error = info.value.body
    assert error["param"] == "chat_template_kwargs"
    assert error["message"].startswith("chat_template_kwargs: must be a JSON object")
    response = httpx.post(live.url + "/tokenize", json={"messages": HELLO, "chat_template_kwargs": value}, timeout=30)
    assert response.status_code == 400 and response.json()["error"]["param"] == "chat_template_kwargs"


@pytest.mark.parametrize("key", ["messages", "add_generation_prompt", "tools", "documents", "chat_template", "tokenize"])
def test_reserved_names_are_a_400_not_an_override(live, client, key):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=2,
                                       extra_body={"chat_template_kwargs": {key: [] if key == "messages" else False}})
    assert info.value.body["param"] == "chat_template_kwargs"
    assert info.value.body["message"].startswith(f"chat_template_kwargs.{key}: may not be set here")
    response = httpx.post(live.url + "/tokenize", json={"messages": HELLO, "chat_template_kwargs": {key: False}}, timeout=30)
    assert response.status_code == 400 and f"chat_template_kwargs.{key}" in response.json()["error"]["message"]


def test_a_template_that_rejects_a_kwarg_is_a_400(client):
    with pytest.raises(openai.BadRequestError, match="unknown style fancy"):
        client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=2,
                                       extra_body={"chat_template_kwargs": {"style": "fancy"}})
    out = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=2,
                                         extra_body={"chat_template_kwargs": {"style": "plain"}})
    assert out.choices[0].finish_reason == "length"
