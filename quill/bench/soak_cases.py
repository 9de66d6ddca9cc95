"""What `quill bench soak` sends: a fixed pool of healthy chat requests and a catalogue of bad ones."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Callable

from quill.bench.workloads import make_text

FAULT_HEADER = "X-Quill-Fault"
GUIDED_ITEM = "guided-choice"  # the pool item that reaches a server's grammar code


@dataclass(frozen=True)
class PoolItem:
    """One healthy request shape; its reply is fixed (greedy, or sampled under a fixed seed)."""

    name: str
    messages: tuple[dict, ...]
    temperature: float = 0.0
    top_p: float | None = None
    seed: int | None = None
    guided_choice: tuple[str, ...] | None = None  # optional: dropped from the pool if the server refuses it

    @property
    def optional(self) -> bool:
        return self.guided_choice is not None


def healthy_pool(seed: int = 0) -> list[PoolItem]:
    """Greedy prompts of a few lengths (one long enough to take several prefill chunks), two seeded
    samplers and one constrained choice; `seed` shifts the sampling seeds and the long prompt's text."""
    document = make_text(random.Random(seed), 900)  # ~220 tokens
    user = lambda text: ({"role": "user", "content": text},)  # noqa: E731
    return [
        PoolItem("greedy-colours", user("Name three colours.")),
        PoolItem("greedy-sea", user("Write one sentence about the sea.")),
        PoolItem("greedy-sum", user("What is 2 + 3? Answer briefly.")),
        PoolItem("greedy-system", ({"role": "system", "content": "You are a terse assistant."},
                                   {"role": "user", "content": "Describe a cat in a few words."})),
        PoolItem("greedy-long", user("Summarize this text in one sentence.\n\n" + document)),
        PoolItem("seeded-fox", user("Tell me a short story about a fox."), temperature=0.9, top_p=0.95, seed=seed + 7),
        PoolItem("seeded-boat", user("Invent a name for a boat and say why."), temperature=0.7, seed=seed + 42),
        PoolItem(GUIDED_ITEM, user("Is the sky blue? Answer yes or no."), guided_choice=("yes", "no", "maybe")),
    ]


def healthy_body(item: PoolItem, model: str, max_tokens: int, stream: bool, include_usage: bool = False) -> dict:
    body: dict = {"model": model, "messages": list(item.messages), "max_tokens": max_tokens,
                  "temperature": item.temperature, "stream": stream}
    if item.top_p is not None:
        body["top_p"] = item.top_p
    if item.seed is not None:
        body["seed"] = item.seed
    if item.guided_choice is not None:
        body["guided_choice"] = list(item.guided_choice)
    if stream and include_usage:
        body["stream_options"] = {"include_usage": True}
    return body


@dataclass(frozen=True)
class BadCase:
    """A request no server should run: `build(model, max_tokens, context)` gives the raw body."""

    name: str
    build: Callable[[str, int, int], bytes]
    can_stream: bool = True  # False: the body is not a JSON object, so it has no "stream" to set


def _dumps(body) -> bytes:
    # ensure_ascii keeps a lone surrogate as the escape \ud800 (it cannot be UTF-8 encoded).
    return json.dumps(body, ensure_ascii=True).encode()


def _chat(**fields) -> Callable[[str, int, int], bytes]:
    """A chat body with `fields` overriding a healthy one; a callable value gets (max_tokens, context)."""
    def build(model: str, max_tokens: int, context: int) -> bytes:
        body: dict = {"model": model, "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": max_tokens}
        for key, value in fields.items():
            body[key] = value(max_tokens, context) if callable(value) else value
        return _dumps(body)
    return build


def _raw(text: bytes) -> Callable[[str, int, int], bytes]:
    return lambda model, max_tokens, context: text


def _over_context(max_tokens: int, context: int) -> list[dict]:
    # " hello" is one token in common BPE vocabularies; twice the context leaves no doubt.
    return [{"role": "user", "content": " hello" * (2 * context)}]


BAD_CASES: tuple[BadCase, ...] = (
    BadCase("invalid-json", _raw(b'{"model": "x", "messages": [{"role": "user", "content": "hi"}'), can_stream=False),
    BadCase("not-utf8", _raw(b'\xff\xfe{"model": 1}'), can_stream=False),
    BadCase("json-array", _raw(b'[{"role": "user", "content": "hi"}]'), can_stream=False),
    BadCase("max-tokens-string", _chat(max_tokens="3")),
    BadCase("max-tokens-list", _chat(max_tokens=[3])),
    BadCase("max-tokens-negative", _chat(max_tokens=-5)),
    BadCase("max-tokens-zero", _chat(max_tokens=0)),
    BadCase("max-tokens-huge", _chat(max_tokens=10**12)),
    BadCase("max-tokens-beyond-int64", _chat(max_tokens=2**70)),
    BadCase("unknown-model", _chat(model="no-such-model-soak")),
    BadCase("empty-messages", _chat(messages=[])),
    BadCase("messages-string", _chat(messages="hello")),
    BadCase("missing-messages", lambda model, max_tokens, context: _dumps({"model": model, "max_tokens": max_tokens})),
    BadCase("unknown-role", _chat(messages=[{"role": "wizard", "content": "hi"}])),
    BadCase("content-number", _chat(messages=[{"role": "user", "content": 5}])),
    BadCase("lone-surrogate", _chat(messages=[{"role": "user", "content": "a\ud800b"}])),
    BadCase("prompt-over-context", _chat(messages=_over_context)),
    BadCase("temperature-negative", _chat(temperature=-1.0)),
    BadCase("temperature-nan", _raw(b'{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}'), can_stream=False),
    BadCase("top-p-above-one", _chat(top_p=5.0)),
    BadCase("seed-beyond-int64", _chat(seed=2**80)),
    BadCase("n-oversized", _chat(n=100000)),
    BadCase("min-tokens-above-max", _chat(min_tokens=lambda max_tokens, context: max_tokens + 10)),
    BadCase("stop-token-outside-vocab", _chat(stop_token_ids=[10**12])),
    BadCase("top-logprobs-oversized", _chat(logprobs=True, top_logprobs=100000)),
    BadCase("guided-regex-unclosed", _chat(guided_regex="(abc")),
    BadCase("guided-json-not-json", _chat(guided_json="{not json")),
    BadCase("guided-choice-empty", _chat(guided_choice=[])),
    BadCase("guided-grammar-broken", _chat(guided_grammar="start: ((( ")),
    BadCase("response-format-bad-schema", _chat(response_format={"type": "json_schema",
                                                                 "json_schema": {"name": "x", "schema": {"type": "nonsense"}}})),
    BadCase("stream-options-string", _chat(stream=True, stream_options="yes")),
)


def bad_body(case: BadCase, model: str, max_tokens: int, context: int, stream: bool) -> bytes:
    """The raw body of `case`, with "stream" set when it is a JSON object that lacks one."""
    raw = case.build(model, max_tokens, context)
    if not (stream and case.can_stream):
        return raw
    body = json.loads(raw)
    body.setdefault("stream", True)
    return _dumps(body)
