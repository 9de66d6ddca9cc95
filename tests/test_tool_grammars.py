"""quill.tools grammars, compiled by llguidance against two tiny byte-level tokenizers: one with no
added tokens (every marker is text) and one where the markers are added tokens, as in Qwen's,
Llama's and Mistral's tokenizers. Outputs are fed token by token through LLMatcher.consume_token;
well-formed ones must end accepting, and wrong names, malformed or schema-breaking arguments must be
refused. Which arguments a grammar takes is checked against jsonschema's verdict on the same schema.
The grammars get what the server passes: each added token's id (Tokenizer.added_token_id).
"""

from __future__ import annotations

import itertools
import json

import jsonschema
import llguidance
import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from quill.tools import ToolChoice, check_tools, parser_class

EOS = "<|im_end|>"
# Non-special added tokens, as Qwen2.5/3 ship <tool_call> and <think>; Llama's <|python_tag|> and
# Mistral's [TOOL_CALLS] are special tokens of theirs.
ADDED = ("<tool_call>", "</tool_call>", "<think>", "</think>")
SPECIAL = (EOS, "<|python_tag|>", "[TOOL_CALLS]")


def byte_tokenizer(added: tuple[str, ...], special: tuple[str, ...]):
    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in added])
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    ll = llguidance.LLTokenizer(tokenizer.to_str(), n_vocab=size, eos_token=[tokenizer.token_to_id(EOS)])
    return tokenizer, ll


class Vocab:
    """A tokenizer with its llguidance twin, and added_token as the server passes it."""

    def __init__(self, added: tuple[str, ...], special: tuple[str, ...]):
        self.tokenizer, self.ll = byte_tokenizer(added, special)
        self.added = set(added) | set(special)

    def added_id(self, text: str) -> int | None:
        return self.tokenizer.token_to_id(text) if text in self.added else None

    def matcher(self, grammar: str) -> llguidance.LLMatcher:
        matcher = llguidance.LLMatcher(self.ll, grammar, log_level=0)
        assert not matcher.is_error(), matcher.get_error() + "\n" + grammar
        return matcher

    def accepts(self, matcher: llguidance.LLMatcher, text: str) -> bool:
        """Every token of text consumed and the grammar complete at its end (then EOS allowed)."""
        matcher = matcher.deep_copy()
        for token in self.tokenizer.encode(text, add_special_tokens=False).ids:
            if not matcher.consume_token(token):
                return False
        return matcher.is_accepting()


PLAIN = Vocab((), (EOS,))
MARKED = Vocab(ADDED, SPECIAL)
UNMARKED = Vocab(ADDED + SPECIAL[1:], (EOS,))  # every marker an added token, none marked special

WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                   "days": {"type": "integer", "minimum": 1}},
    "required": ["city"],
    "additionalProperties": False,
}
TOOLS = check_tools([
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER_PARAMETERS}},
    {"type": "function", "function": {"name": "get_time"}},
])
GOOD_ARGS = ['{"city": "Paris"}', '{"city": "Paris", "unit": "celsius", "days": 3}',
             '{\n  "city": "Z\u00fcrich",\n  "days": 2\n}']
BAD_ARGS = ['{"city": 5}', '{"unit": "celsius"}', '{"city": "Paris", "unit": "kelvin"}', '{"city": "Paris", "days": 0}',
            '{"city": "Paris", "mood": "good"}', '{"city": "Paris"', '"Paris"']


# How each family writes calls (name, arguments text): one output, and separators between calls.
def hermes(calls, text="", tail=""):
    body = "\n".join(f'<tool_call>\n{{"name": "{n}", "arguments": {a}}}\n</tool_call>' for n, a in calls)
    return text + body + tail


def llama3(calls, text="", tail=""):
    return text + "; ".join(f'{{"name": "{n}", "parameters": {a}}}' for n, a in calls) + tail


def mistral(calls, text="", tail=""):
    items = ", ".join(f'{{"name": "{n}", "arguments": {a}}}' for n, a in calls)
    return f"{text}[TOOL_CALLS] [{items}]{tail}"


def generic(calls, text="", tail=""):
    items = ", ".join(f'{{"name": "{n}", "arguments": {a}}}' for n, a in calls)
    return f'{{"tool_calls": [{items}]}}'


WRITERS = {"hermes": hermes, "llama3_json": llama3, "mistral": mistral, "generic": generic}
ONE = [("get_weather", '{"city": "Paris"}')]
TWO = [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")]
THINKS = {None: "", "optional": "<think>\nShall I call get_weather? {maybe}\n</think>\n\n",
          "opened": "Hmm.\n</think>\n\n"}


def grammar(family, vocab, mode, parallel, reasoning, name=None):
    return parser_class(family).grammar(TOOLS, ToolChoice(mode, name), parallel, vocab.added_id, reasoning)


MATRIX = list(itertools.product(WRITERS, ("auto", "required", "named"), (False, True), (None, "optional", "opened"),
                                (PLAIN, MARKED, UNMARKED)))


@pytest.mark.parametrize("family, mode, parallel, reasoning, vocab", MATRIX)
def test_grammar_matrix(family, mode, parallel, reasoning, vocab):
    name = "get_weather" if mode == "named" else None
    text = grammar(family, vocab, mode, parallel, reasoning, name=name)
    matcher = vocab.matcher(text)
    write = WRITERS[family]
    think = THINKS[reasoning]
    accepts = lambda output: vocab.accepts(matcher, think + output)  # noqa: E731
    assert accepts(write(ONE))
    assert accepts(write(TWO)) is (parallel and mode != "named")
    assert accepts(write([("get_time", "{}")])) is (mode != "named")
    assert not accepts(write([("send_email", "{}")]))
    assert not accepts(write([("get_weather", '{"city": 5}')]))
    free = mode == "auto" and family != "generic"
    assert accepts("The weather is fine.") is free
    if family in ("hermes", "mistral"):
        assert accepts(write(ONE, text="Let me check.\n")) is free
        assert accepts(write(ONE, tail="\nDone.")) is free
    if family == "generic":
        assert accepts('{"response": "The weather is fine."}') is (mode == "auto")
    if reasoning == "opened":
        assert not vocab.accepts(matcher, write(ONE))  # the block the prompt opened is never closed
    if reasoning is not None:
        # Markers inside the think block are reasoning, not calls (a special token cannot be there).
        inner = "Maybe <tool_call> or [TOOL_CALLS] or <|python_tag|> {" if vocab is PLAIN else "Maybe {"
        thought = f"<think>{inner}</think>\n\n" if reasoning == "optional" else f"{inner}</think>\n\n"
        assert vocab.accepts(matcher, thought + write(ONE))
        assert vocab.accepts(matcher, thought + "Fine.") is free


@pytest.mark.parametrize("family", WRITERS)
@pytest.mark.parametrize("vocab", [PLAIN, MARKED, UNMARKED])
def test_arguments_follow_the_schema_as_jsonschema_does(family, vocab):
    for mode in ("auto", "required"):
        matcher = vocab.matcher(grammar(family, vocab, mode, True, None))
        for args in GOOD_ARGS + BAD_ARGS:
            try:
                jsonschema.validate(json.loads(args), WEATHER_PARAMETERS)
                valid = True
            except (ValueError, jsonschema.ValidationError):
                valid = False
            output = WRITERS[family]([("get_weather", args)])
            assert vocab.accepts(matcher, output) is valid, (mode, args)


WRITTEN = {"hermes": ("<tool_call>", "</tool_call>"), "llama3_json": ("<|python_tag|>",), "mistral": ("[TOOL_CALLS]",),
           "generic": ()}


def test_markers_that_are_added_tokens_are_written_by_id():
    """Every marker that is an added token, special or not, whatever its name ([TOOL_CALLS] is
    not <...>), is written <[id]>, so a required or named request always keeps its grammar."""
    for family, mode, vocab in itertools.product(WRITERS, ("auto", "required", "named"), (PLAIN, MARKED, UNMARKED)):
        text = grammar(family, vocab, mode, True, "optional", name="get_time" if mode == "named" else None)
        for marker in WRITTEN[family] + ("<think>", "</think>"):
            token_id = vocab.added_id(marker)
            spelled = json.dumps(marker) if token_id is None else f"<[{token_id}]>"
            assert spelled in text and (token_id is None or json.dumps(marker) not in text), (marker, text)
    with pytest.raises(ValueError, match="reasoning must be"):
        grammar("hermes", PLAIN, "auto", True, "always")


def test_llguidance_marker_facts():
    """What the grammars rely on, measured on llguidance: an added <...> token is special even when
    not marked special, and an added [TOOL_CALLS] when marked so; a quoted marker never matches a
    special token, while <[id]> matches any added token, special or not."""
    tool_call = MARKED.tokenizer.token_to_id("<tool_call>")
    tool_calls = MARKED.tokenizer.token_to_id("[TOOL_CALLS]")
    assert MARKED.ll.is_special_token(tool_call) and MARKED.ll.is_special_token(tool_calls)
    assert not MARKED.accepts(MARKED.matcher('start: "a" "<tool_call>"'), "a<tool_call>")
    assert MARKED.accepts(MARKED.matcher(f'start: "a" <[{tool_call}]>'), "a<tool_call>")
    assert not MARKED.accepts(MARKED.matcher('start: "a" "[TOOL_CALLS]"'), "a[TOOL_CALLS]")
    assert MARKED.accepts(MARKED.matcher(f'start: "a" <[{tool_calls}]>'), "a[TOOL_CALLS]")
    unmarked = UNMARKED.tokenizer.token_to_id("[TOOL_CALLS]")
    assert not UNMARKED.ll.is_special_token(unmarked)
    assert UNMARKED.accepts(UNMARKED.matcher(f'start: "a" <[{unmarked}]>'), "a[TOOL_CALLS]")


@pytest.mark.parametrize("family, vocab", [("hermes", MARKED), ("mistral", MARKED), ("mistral", UNMARKED)])
def test_free_text_cannot_spell_a_marker_token(family, vocab):
    """With the marker a token, the same characters spelled as text would be a call the grammar
    never checked: free text may not hold them."""
    marker = WRITTEN[family][0]
    matcher = vocab.matcher(grammar(family, vocab, "auto", True, None)).deep_copy()
    spelled = [vocab.tokenizer.token_to_id(char) for char in "Hi" + marker]
    assert all(matcher.consume_token(token) for token in spelled[:-1])
    assert not matcher.consume_token(spelled[-1])


def test_json_options_lenient_and_bounded_whitespace():
    odd = check_tools([{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "string", "format": "no-such-format"}}}}}])
    strict = llguidance.LLMatcher(PLAIN.ll, 'start: %json {"type": "string", "format": "no-such-format"}', log_level=0)
    assert strict.is_error() and "no-such-format" in strict.get_error()  # without lenient it fails
    text = parser_class("hermes").grammar(odd, ToolChoice("required"), False, PLAIN.added_id, None)
    matcher = PLAIN.matcher(text)
    assert PLAIN.accepts(matcher, '<tool_call>\n{"name": "f", "arguments": {"a": "x"}}\n</tool_call>')
    # quill's DEFAULT_JSON_WHITESPACE: up to two spaces, or one newline and indentation.
    assert PLAIN.accepts(matcher, '<tool_call>\n{"name": "f", "arguments": {\n    "a":  "x"\n}}\n</tool_call>')
    assert not PLAIN.accepts(matcher, '<tool_call>\n{"name": "f", "arguments": {"a":     "x"}}\n</tool_call>')
    assert not PLAIN.accepts(matcher, '<tool_call>\n{"name": "f", "arguments": {\n\n"a": "x"}}\n</tool_call>')


def test_auto_without_parallel_allows_one_call_only():
    for vocab in (PLAIN, MARKED, UNMARKED):
        matcher = vocab.matcher(grammar("hermes", vocab, "auto", False, None))
        one = hermes(ONE, text="Checking. ", tail=" Done.")
        assert vocab.accepts(matcher, one)
        assert not vocab.accepts(matcher, one + " " + hermes(ONE))
        assert not vocab.accepts(matcher, hermes(ONE) + " later <tool_call>\nnot json")
        parallel = vocab.matcher(grammar("hermes", vocab, "auto", True, None))
        assert vocab.accepts(parallel, one + " " + hermes(ONE))
        assert not vocab.accepts(parallel, hermes(ONE) + " later <tool_call>\nnot json")


def test_llama3_auto_text_must_not_begin_like_a_call():
    for vocab in (PLAIN, MARKED, UNMARKED):
        matcher = vocab.matcher(grammar("llama3_json", vocab, "auto", True, None))
        assert vocab.accepts(matcher, '\n {"name": "get_time", "parameters": {}}')
        assert vocab.accepts(matcher, '<|python_tag|>{"name": "get_time", "parameters": {}}')
        assert vocab.accepts(matcher, "Use {braces} later.")
        assert not vocab.accepts(matcher, '{"answer": 42}')
        assert not vocab.accepts(matcher, '{"name": "get_time", "parameters": {}} and text')


# Outputs as the models write them: what the auto grammar lets through, the parser reads as calls.
AGREED = {
    "hermes": ["I'll check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>",
               '<tool_call>\n{"name": "get_weather", "arguments": {\n  "city": "Paris",\n  "days": 2\n}}\n</tool_call>\n'
               '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'],
    "llama3_json": ['{"name": "get_weather", "parameters": {"city": "Paris"}}',
                    '<|python_tag|>{"name": "get_time", "parameters": {}}; {"name": "get_weather", "parameters": '
                    '{"city": "Paris"}}'],
    "mistral": ['[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]',
                'Sure.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "a1B2c3D4e"}, '
                '{"name": "get_time", "arguments": {}, "id": "Zz9Yy8Xx7"}]'],
    "generic": ['{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}, '
                '{"name": "get_time", "arguments": {}}]}'],
}


@pytest.mark.parametrize("family", WRITERS)
@pytest.mark.parametrize("vocab", [PLAIN, MARKED, UNMARKED])
def test_grammar_and_parser_agree(family, vocab):
    matcher = vocab.matcher(grammar(family, vocab, "auto", True, None))
    for output in AGREED[family]:
        assert vocab.accepts(matcher, output), output
        parser = parser_class(family)(TOOLS)
        parser.feed(output)
        parser.finish()
        assert parser.calls and all(marker not in parser.content for marker in parser.markers)
        assert parser.content in ("", "I'll check.", "Sure.")
