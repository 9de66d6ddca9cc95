"""Reasoning output on /v1/chat/completions through the official openai client: message.reasoning_content
and content, delta.reasoning_content then delta.content chunks with no marker in either,
usage.completion_tokens_details.reasoning_tokens; the request's reasoning_format and
`quill serve --reasoning-format`. First against the fake engine with scripted outputs (one token
per character, so every marker is split across tokens and chunks), then a real `quill serve` on a
tiny random Qwen3 model whose output a regex constraint shapes."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from fake_engine import FakeEngine, FakeTokenizer
from quill.chat_template import render_chat_template
from quill.server.app import create_app
from server_utils import ThreadServer, serving

MODEL = "fake-model"

# Qwen3's switches: an empty think block after the generation prompt with enable_thinking=false;
# `opened` ends the prompt inside a think block, as DeepSeek-R1's templates do.
TEMPLATE = (
    "{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- elif opened is defined and opened %}{{- '<think>\\n' }}{%- endif %}"
    "{%- endif %}"
)
PLAIN_TEMPLATE = "{%- for m in messages %}{{- m.role + ': ' + m.content + '\\n' }}{%- endfor %}"

# The user's message picks what the fake model writes (greedy, then EOS).
SCRIPTS = {
    "Q-think": "<think>\nI add 2 and 2.\n</think>\n\nThe answer is 4.",
    "Q-opened": "I count to four.\n</think>\n\nFour.",
    "Q-long": "<think>\nstill thinking and thinking",
    "Q-plain": "Just the answer.",
}


def script(prompt: str) -> str:
    return next(text for key, text in SCRIPTS.items() if key in prompt)


class TemplateTokenizer(FakeTokenizer):
    """The fake engine's byte tokenizer, with prompts rendered by quill's renderer from `chat_template`."""

    def __init__(self, chat_template: str):
        self.chat_template = chat_template

    def apply_chat_template(self, messages, add_generation_prompt: bool = True, **kwargs) -> str:
        return render_chat_template(self.chat_template, messages, add_generation_prompt=add_generation_prompt, **kwargs)

    def encode_chat(self, messages, add_generation_prompt: bool = True, **kwargs) -> list[int]:
        return self.encode(self.apply_chat_template(messages, add_generation_prompt, **kwargs))


def fake_server(chat_template: str = TEMPLATE, **app_options) -> ThreadServer:
    engine = FakeEngine(max_num_seqs=8, token_delay=0.001, greedy_text=script)
    engine.tokenizer = TemplateTokenizer(chat_template)
    server = ThreadServer(create_app(engine, MODEL, static_dir=None, **app_options))
    server.client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    return server


@pytest.fixture(scope="module")
def live():
    with fake_server() as server:
        yield server


def ask(key: str) -> list[dict]:
    return [{"role": "user", "content": key}]


def reasoning_of(message) -> str | None:
    return getattr(message, "reasoning_content", None)


def prefix_tokens(text: str) -> int:
    """Byte tokens up to and including </think>."""
    return len(text[: text.index("</think>") + len("</think>")].encode())


# (user message, extra request fields, reasoning_content, content, reasoning_tokens, finish_reason)
CASES = {
    "model-opens": ("Q-think", {}, "I add 2 and 2.", "The answer is 4.", prefix_tokens(SCRIPTS["Q-think"]), "stop"),
    "prompt-opens": ("Q-opened", {"extra_body": {"chat_template_kwargs": {"opened": True}}}, "I count to four.", "Four.",
                     prefix_tokens(SCRIPTS["Q-opened"]), "stop"),
    "max-tokens-while-reasoning": ("Q-long", {"max_tokens": 15}, "still t", None, 15, "length"),
    "thinking-off": ("Q-plain", {"extra_body": {"chat_template_kwargs": {"enable_thinking": False}}}, None,
                     "Just the answer.", 0, "stop"),
}


@pytest.mark.parametrize("case", CASES)
def test_non_streamed_message_splits_reasoning_from_content(live, case):
    key, extra, reasoning, content, reasoning_tokens, finish = CASES[case]
    out = live.client.chat.completions.create(model=MODEL, messages=ask(key), temperature=0, **extra)
    choice = out.choices[0]
    assert (reasoning_of(choice.message), choice.message.content) == (reasoning, content)
    assert choice.finish_reason == finish
    assert out.usage.completion_tokens_details.reasoning_tokens == reasoning_tokens
    generated = min(len(SCRIPTS[key]) + 1, extra.get("max_tokens", 10**6))  # + EOS
    assert out.usage.completion_tokens == generated


@pytest.mark.parametrize("case", CASES)
def test_streamed_deltas_carry_reasoning_then_content_and_never_a_marker(live, case):
    key, extra, reasoning, content, reasoning_tokens, finish = CASES[case]
    stream = live.client.chat.completions.create(model=MODEL, messages=ask(key), temperature=0, n=2, stream=True,
                                                 stream_options={"include_usage": True}, **extra)
    kinds = {0: [], 1: []}
    texts = {0: {"r": "", "c": ""}, 1: {"r": "", "c": ""}}
    finishes, usage, chunks = {}, None, 0
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            chunks += 1
            delta = choice.delta
            r, c = reasoning_of(delta), delta.content
            assert not (r and c), "one kind per chunk"
            for kind, text in (("r", r), ("c", c)):
                if text:
                    assert "<" not in text and ">" not in text, (kind, text)  # not a marker, nor part of one
                    kinds[choice.index].append(kind)
                    texts[choice.index][kind] += text
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
    for index in (0, 1):
        assert texts[index] == {"r": reasoning or "", "c": content or ""}
        order = "".join(kinds[index])
        assert order == "r" * order.count("r") + "c" * order.count("c"), order  # reasoning, then content
        assert finishes[index] == finish
    if reasoning:
        assert kinds[0].count("r") > 1  # streamed as it came, not in one piece at the end
    assert usage.completion_tokens_details.reasoning_tokens == 2 * reasoning_tokens


def test_reasoning_format_none_leaves_the_text_whole(live):
    raw = SCRIPTS["Q-think"]
    out = live.client.chat.completions.create(model=MODEL, messages=ask("Q-think"), temperature=0,
                                              extra_body={"reasoning_format": "none"})
    assert out.choices[0].message.content == raw
    assert reasoning_of(out.choices[0].message) is None and "reasoning_content" not in out.choices[0].message.model_extra
    assert out.usage.completion_tokens_details is None
    stream = live.client.chat.completions.create(model=MODEL, messages=ask("Q-think"), temperature=0, stream=True,
                                                 extra_body={"reasoning_format": "none"})
    assert "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices) == raw
    # the raw JSON: no reasoning_content key at all, and "deepseek" named explicitly splits as the default does
    body = {"model": MODEL, "messages": ask("Q-think"), "temperature": 0}
    plain = httpx.post(live.url + "/v1/chat/completions", json={**body, "reasoning_format": "none"}).json()
    assert "reasoning_content" not in plain["choices"][0]["message"]
    split = httpx.post(live.url + "/v1/chat/completions", json={**body, "reasoning_format": "deepseek"}).json()
    assert split["choices"][0]["message"] == {"role": "assistant", "content": "The answer is 4.", "reasoning_content": "I add 2 and 2."}


def test_text_completions_are_never_split(live):
    out = live.client.completions.create(model=MODEL, prompt="Q-think", temperature=0, max_tokens=64)
    assert out.choices[0].text == SCRIPTS["Q-think"]


def test_server_flag_and_the_template_default():
    body = {"model": MODEL, "messages": ask("Q-think"), "temperature": 0}

    def message(server, **fields):
        response = httpx.post(server.url + "/v1/chat/completions", json={**body, **fields}, timeout=30)
        assert response.status_code == 200, response.text
        return response.json()["choices"][0]["message"]

    split = {"role": "assistant", "content": "The answer is 4.", "reasoning_content": "I add 2 and 2."}
    whole = {"role": "assistant", "content": SCRIPTS["Q-think"]}
    with fake_server(reasoning_format="none") as server:  # --reasoning-format none
        assert message(server) == whole
        assert message(server, reasoning_format="deepseek") == split
    with fake_server(PLAIN_TEMPLATE) as server:  # no think marker in the template: none by default
        assert message(server) == whole
        assert message(server, reasoning_format="deepseek") == split
    with fake_server(PLAIN_TEMPLATE, reasoning_format="deepseek") as server:
        assert message(server) == split
        assert message(server, reasoning_format="none") == whole
    with pytest.raises(ValueError, match="reasoning_format must be one of none, deepseek; got 'auto'"):
        create_app(FakeEngine(), MODEL, static_dir=None, reasoning_format="auto")


@pytest.mark.parametrize("value", ["auto", "DeepSeek", "", 1, True])
def test_unknown_reasoning_format_is_a_400_naming_the_field(live, value):
    with pytest.raises(openai.BadRequestError) as info:
        live.client.chat.completions.create(model=MODEL, messages=ask("Q-think"), extra_body={"reasoning_format": value})
    assert info.value.body["param"] == "reasoning_format", info.value.body


def test_serve_flag_is_parsed():
    import argparse

    from quill.server.serve_cmd import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert parser.parse_args([]).reasoning_format is None
    assert parser.parse_args(["--reasoning-format", "none"]).reasoning_format == "none"
    with pytest.raises(SystemExit):
        parser.parse_args(["--reasoning-format", "auto"])


# ---------------------------------------------------------------- a real `quill serve` on a tiny Qwen3


def tiny_qwen3_folder(path, chat_template: str, added: tuple[str, ...] = (), max_positions: int = 512):
    """A random Qwen3 with a byte-level tokenizer (<|im_start|> / <|im_end|> special, EOS <|im_end|>)
    in which <think> and </think> are plain bytes, so the model writes each marker over 7 or 8
    tokens. (Qwen3's own vocabulary has them as single added, non-special tokens; with one here,
    the regex constraint that shapes the output allows only that token for a regex's "<think>" and
    then its matcher refuses it, a 500 GuidedError: a guided-output bug of its own, not this one.)
    `added`: texts made one added, non-special token each, as Qwen's <tool_call> and </tool_call>
    (the tool grammars name such markers as tokens)."""
    import torch
    import transformers as tf
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    for name in ("<|im_start|>", "<|im_end|>"):
        vocab[name] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    for name in added:  # one token each, kept on decode (as Qwen's <tool_call>, </tool_call>, <think>)
        vocab[name] = len(vocab)
    tokenizer.add_tokens([AddedToken(name, special=False, normalized=False) for name in added])
    tokenizer.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>", "chat_template": chat_template}))
    torch.manual_seed(0)
    config = tf.Qwen3Config(vocab_size=len(vocab), hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=max_positions,
                            tie_word_embeddings=True, eos_token_id=vocab["<|im_end|>"])
    tf.Qwen3ForCausalLM(config).float().save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="module")
def qwen3_folder(tmp_path_factory):
    from test_chat_template_families import QWEN3

    return tiny_qwen3_folder(tmp_path_factory.mktemp("tiny-qwen3"), QWEN3)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory, qwen3_folder):
    """`quill serve --reasoning-format none` (the template alone would say deepseek): a request
    that names reasoning_format "deepseek" is split, one that names none is not."""
    with serving(tmp_path_factory.mktemp("serve"), "--model", str(qwen3_folder), "--kv-cache-memory", "16MiB",
                 "--max-model-len", "512", "--reasoning-format", "none", model_name="tiny-qwen3",
                 client_timeout=120) as proc:
        yield proc


SPLIT = {"reasoning_format": "deepseek"}
THINK_REGEX = "<think>\n[a-z]{3,6}( [a-z]{2,5}){1,2}\n</think>\n\n[a-z]{2,6}"


def test_real_server_splits_what_the_model_writes(qwen3):
    """The model's own tokens, forced into a think block then an answer by a regex: the split
    parts are exactly the raw text's, stream and non-stream alike, and reasoning_tokens is the
    count of tokens up to and including </think> read off the raw request's logprobs."""
    client = qwen3.client
    common = dict(model="tiny-qwen3", messages=[{"role": "user", "content": "Add 2 and 2."}], temperature=0, max_tokens=40)
    raw_out = client.chat.completions.create(**common, extra_body={"guided_regex": THINK_REGEX}, logprobs=True)  # the flag: none
    raw = raw_out.choices[0].message.content
    assert reasoning_of(raw_out.choices[0].message) is None and raw_out.usage.completion_tokens_details is None
    assert raw.startswith("<think>\n") and "\n</think>\n\n" in raw, raw
    thought, _, answer = raw[len("<think>\n"):].partition("\n</think>\n\n")
    seen, expected_tokens = "", None
    for position, entry in enumerate(raw_out.choices[0].logprobs.content, 1):
        seen += entry.token
        if "</think>" in seen:
            expected_tokens = position
            break
    assert expected_tokens is not None

    out = client.chat.completions.create(**common, extra_body={"guided_regex": THINK_REGEX, **SPLIT})
    assert (reasoning_of(out.choices[0].message), out.choices[0].message.content) == (thought, answer)
    assert out.usage.completion_tokens == raw_out.usage.completion_tokens
    assert out.usage.completion_tokens_details.reasoning_tokens == expected_tokens

    reasoning, content, order, usage = "", "", "", None
    for chunk in client.chat.completions.create(**common, extra_body={"guided_regex": THINK_REGEX, **SPLIT}, stream=True,
                                                stream_options={"include_usage": True}):
        usage = chunk.usage or usage
        for choice in chunk.choices:
            r, c = reasoning_of(choice.delta) or "", choice.delta.content or ""
            for text in (r, c):
                assert "<" not in text and ">" not in text, text  # no marker, nor a piece of one
            reasoning, content = reasoning + r, content + c
            order += "r" * bool(r) + "c" * bool(c)
    assert (reasoning, content) == (thought, answer)
    assert order == "r" * order.count("r") + "c" * order.count("c") and order.count("r") > 1
    assert usage.completion_tokens_details.reasoning_tokens == expected_tokens


def test_real_server_thinking_off_and_cut_short(qwen3):
    client = qwen3.client
    messages = [{"role": "user", "content": "Add 2 and 2."}]
    off = client.chat.completions.create(model="tiny-qwen3", messages=messages, temperature=0, max_tokens=20,
                                         extra_body={"guided_regex": "[a-z]{2,6}", **SPLIT,
                                                     "chat_template_kwargs": {"enable_thinking": False}})
    assert reasoning_of(off.choices[0].message) is None
    assert 2 <= len(off.choices[0].message.content) <= 6 and off.choices[0].message.content.isalpha()
    assert off.usage.completion_tokens_details.reasoning_tokens == 0
    cut = client.chat.completions.create(model="tiny-qwen3", messages=messages, temperature=0, max_tokens=14,
                                         extra_body={"guided_regex": "<think>\n[a-z]{20,30}\n</think>\n\nx", **SPLIT})
    assert cut.choices[0].finish_reason == "length"
    assert cut.choices[0].message.content is None  # "<think>\n" and 6 letters, one byte token each
    reasoning = reasoning_of(cut.choices[0].message)
    assert reasoning.isalpha() and len(reasoning) == 6
    assert cut.usage.completion_tokens_details.reasoning_tokens == cut.usage.completion_tokens == 14


def test_python_api_output_splits_the_same_way(qwen3_folder):
    """LLM.chat keeps the raw text; quill.reasoning splits it as the server does, and the real
    tokenizer's template gives the default the server would pick."""
    from quill.llm import LLM
    from quill.reasoning import default_reasoning_format, prompt_opens_reasoning, split_reasoning
    from quill.sampling_params import SamplingParams

    llm = LLM(str(qwen3_folder), kv_cache_memory=8 << 20)
    assert default_reasoning_format(llm.tokenizer.chat_template) == "deepseek"
    out = llm.chat([{"role": "user", "content": "Add 2 and 2."}], SamplingParams(temperature=0, max_tokens=40, regex=THINK_REGEX))[0]
    assert not prompt_opens_reasoning(out.prompt)
    thought, _, answer = out.outputs[0].text[len("<think>\n"):].partition("\n</think>\n\n")
    assert split_reasoning(out.outputs[0].text, prompt_opens_reasoning(out.prompt)) == (thought, answer)
