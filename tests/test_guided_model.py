"""Structured output on the real default model: schemas validate, choices and regexes match, truncation is 'length'."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from quill.engine.guided import GuidedError
from quill.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

SEEDS = (0, 1, 2)

# (task for the prompt, schema): nested objects, arrays with min/max items, enums, bounded
# numbers, required and optional fields, string patterns.
CASES = [
    ("a person", {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 40}, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
        "required": ["name", "age"], "additionalProperties": False,
    }),
    ("a customer with a postal address", {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 40},
            "address": {
                "type": "object",
                "properties": {
                    "street": {"type": "string", "maxLength": 60},
                    "city": {"type": "string", "maxLength": 30},
                    "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                },
                "required": ["street", "city", "zip"], "additionalProperties": False,
            },
        },
        "required": ["name", "address"], "additionalProperties": False,
    }),
    ("a blog post with tags", {
        "type": "object",
        "properties": {
            "title": {"type": "string", "maxLength": 80},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 20}, "minItems": 1, "maxItems": 3},
        },
        "required": ["title", "tags"], "additionalProperties": False,
    }),
    ("the sentiment of 'I love this phone'", {
        "type": "object",
        "properties": {
            "sentiment": {"enum": ["positive", "negative", "neutral"]},
            "confidence": {"type": "number", "minimum": 0, "maximum": 1},
        },
        "required": ["sentiment", "confidence"], "additionalProperties": False,
    }),
    ("today's weather", {
        "type": "object",
        "properties": {
            "temperature_c": {"type": "integer", "minimum": -50, "maximum": 60},
            "humidity": {"type": "integer", "minimum": 0, "maximum": 100},
            "sky": {"enum": ["clear", "cloudy", "rain", "snow"]},
        },
        "required": ["temperature_c", "humidity", "sky"], "additionalProperties": False,
    }),
    ("a movie, with optional subtitle and year", {
        "type": "object",
        "properties": {
            "title": {"type": "string", "maxLength": 60},
            "subtitle": {"type": "string", "maxLength": 60},
            "year": {"type": "integer", "minimum": 1900, "maximum": 2030},
        },
        "required": ["title"], "additionalProperties": False,
    }),
    ("a flight booking", {
        "type": "object",
        "properties": {
            "date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
            "flight": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{3,4}$"},
            "seats": {"type": "integer", "minimum": 1, "maximum": 9},
        },
        "required": ["date", "flight", "seats"], "additionalProperties": False,
    }),
    ("a shopping list", {
        "type": "object",
        "properties": {
            "items": {
                "type": "array", "minItems": 2, "maxItems": 4,
                "items": {
                    "type": "object",
                    "properties": {"name": {"type": "string", "maxLength": 20}, "qty": {"type": "integer", "minimum": 1, "maximum": 10}},
                    "required": ["name", "qty"], "additionalProperties": False,
                },
            },
        },
        "required": ["items"], "additionalProperties": False,
    }),
    ("a to-do entry", {
        "type": "object",
        "properties": {"task": {"type": "string", "maxLength": 50}, "done": {"type": "boolean"}, "note": {"type": ["string", "null"], "maxLength": 30}},
        "required": ["task", "done", "note"], "additionalProperties": False,
    }),
    ("three to five lottery digits", {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 3, "maxItems": 5}),
    ("a game account", {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {
                    "profile": {
                        "type": "object",
                        "properties": {"handle": {"type": "string", "pattern": "^[a-z0-9_]{3,12}$"}, "level": {"type": "integer", "minimum": 1, "maximum": 5}},
                        "required": ["handle", "level"], "additionalProperties": False,
                    },
                },
                "required": ["profile"], "additionalProperties": False,
            },
        },
        "required": ["user"], "additionalProperties": False,
    }),
    ("a retry policy", {
        "type": "object",
        "properties": {
            "version": {"const": 2},
            "mode": {"enum": ["fast", "safe"]},
            "retries": {"type": "integer", "minimum": 0, "maximum": 3},
            "backoff_ms": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 5000}, {"type": "null"}]},
        },
        "required": ["version", "mode", "retries"], "additionalProperties": False,
    }),
]


def conversation(task: str, schema: dict) -> list[dict]:
    return [{"role": "user", "content": f"Describe {task} as JSON matching this schema: {json.dumps(schema)}"}]


@pytest.fixture(scope="module")
def llm(make_llm):
    return make_llm()


def test_twelve_schemas_three_seeds_validate(llm):
    assert len(CASES) >= 12
    conversations, params, schemas = [], [], []
    for task, schema in CASES:
        for seed in SEEDS:
            conversations.append(conversation(task, schema))
            params.append(SamplingParams(json_schema=schema, temperature=0.8, seed=seed, max_tokens=256))
            schemas.append(schema)
    outs = llm.chat(conversations, params)
    for out, schema in zip(outs, schemas):
        completion = out.outputs[0]
        assert completion.finish_reason == "stop", (completion.finish_reason, completion.text)
        jsonschema.validate(json.loads(completion.text), schema)


def test_json_object_n_greater_than_one(llm):
    conv = [{"role": "user", "content": "Give a JSON object describing a cat."}]
    out = llm.chat(conv, SamplingParams(json_object=True, n=3, temperature=0.8, seed=5, max_tokens=40))[0]
    assert len(out.outputs) == 3
    for completion in out.outputs:
        if completion.finish_reason == "stop":
            assert isinstance(json.loads(completion.text), dict)
        else:  # free-form objects may run long; what there is must still start like one
            assert completion.finish_reason == "length" and completion.text.lstrip().startswith("{")


def test_choice_and_regex_always_match(llm):
    choices = ["Paris", "London", "Berlin", "Madrid"]
    pattern = r"[0-9]{3}-[0-9]{3}-[0-9]{4}"
    prompts, params = [], []
    for seed in range(4):
        prompts += ["The capital of France is", "Call us at"]
        params += [
            SamplingParams(choice=choices, temperature=1.0, seed=seed),
            SamplingParams(regex=pattern, temperature=1.0, seed=seed, max_tokens=32),
        ]
    outs = llm.generate(prompts, params)
    for out, p in zip(outs, params):
        completion = out.outputs[0]
        assert completion.finish_reason == "stop", completion
        if p.choice:
            assert completion.text in choices
        else:
            assert re.fullmatch(pattern, completion.text), completion.text


def test_max_tokens_mid_object_is_length(llm):
    schema = CASES[1][1]
    out = llm.chat(conversation(*CASES[1]), SamplingParams(json_schema=schema, temperature=0.8, seed=0, max_tokens=6))[0]
    completion = out.outputs[0]
    assert completion.finish_reason == "length" and len(completion.token_ids) == 6
    with pytest.raises(json.JSONDecodeError):
        json.loads(completion.text)  # truncated: incomplete JSON, as documented


def test_invalid_schema_is_rejected_before_running(llm):
    with pytest.raises(GuidedError) as info:
        llm.generate("x", SamplingParams(json_schema={"type": "integer", "minimum": 9, "maximum": 1}))
    assert info.value.param == "response_format" and "minimum" in str(info.value)
    assert not llm.engine.requests  # nothing was admitted


def test_unconstrained_neighbour_is_unchanged(llm):
    plain = SamplingParams(temperature=0.7, seed=42, max_tokens=24)
    alone = llm.generate("Once upon a time", plain)[0].outputs[0].text
    mixed = llm.generate(
        ["Once upon a time", "Reply in JSON:"],
        [plain, SamplingParams(json_schema=CASES[0][1], temperature=0.8, seed=1, max_tokens=64)],
    )
    assert mixed[0].outputs[0].text == alone
    jsonschema.validate(json.loads(mixed[1].outputs[0].text), CASES[0][1])
