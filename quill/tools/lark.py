"""The llguidance Lark pieces the families' grammars are built from: markers written as tokens or
text, JSON schemas of calls, free text that ends at a marker, and an optional think block first.

What llguidance 1.9.1 does with markers (measured in tests/test_tool_grammars.py): an added token
is a special token to it when tokenizer.json marks it special or when it is written <...>
(toktrie_hf_tokenizers: "we treat all added tokens of the form <...> as special tokens"). A quoted
"<tool_call>" then never matches the token, and no terminal, free text included, can contain one.
So a marker that is an added token is written as that token, by id (<[id]>, which reaches any
added token, special or not, whatever its name), and free text ends at it. A text marker ends
free text through a lazy rule, `trigger[lazy]: TEXT "marker"`.

`added_token(text)` is how the grammars learn which markers are tokens: the token's id when text is
one added token of the tokenizer (quill.tokenizer.Tokenizer.added_token_id), else None.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from quill.engine.guided_spec import DEFAULT_JSON_WHITESPACE
from quill.reasoning import THINK_END, THINK_START

if TYPE_CHECKING:
    from quill.tools.base import ToolSpec

AddedToken = Callable[[str], int | None]  # text -> its added token's id, or None

FREE_TEXT = "TEXT: /(.|\\n)*/"
JSON_OPTIONS = {
    "lenient": True,  # keywords llguidance cannot enforce are ignored instead of failing the request
    "whitespace_pattern": DEFAULT_JSON_WHITESPACE,  # bounded, so a sampled model cannot loop on spaces
}


@dataclass(frozen=True)
class GrammarBody:
    """A family's grammar for the output after any think block: `start` (a Lark expression),
    the rules it uses, and whether it begins with free text (which takes whitespace itself)."""

    start: str
    rules: tuple[str, ...] = ()
    free_start: bool = False


def lark_token(text: str, added_token: AddedToken) -> str:
    """How a grammar writes a marker: <[id]> when it is an added token, else "text"."""
    token_id = added_token(text)
    return json.dumps(text) if token_id is None else f"<[{token_id}]>"


def is_token(spelling: str) -> bool:
    """True when lark_token spelled a marker as a token (free text cannot contain it)."""
    return spelling.startswith("<")


def lark_json(schema: dict) -> str:
    return "%json " + json.dumps({**schema, "x-guidance": JSON_OPTIONS})


def call_schema(tools: list[ToolSpec], arguments_key: str, extra: dict | None = None) -> dict:
    """{"name": <one of the tools>, <arguments_key>: <its arguments>} in that order, plus the
    optional `extra` properties."""
    shapes = [{
        "type": "object",
        "properties": {"name": {"const": spec.name}, arguments_key: _arguments_schema(spec), **(extra or {})},
        "required": ["name", arguments_key],
        "additionalProperties": False,
    } for spec in tools]
    return shapes[0] if len(shapes) == 1 else {"anyOf": shapes}


def _arguments_schema(spec: ToolSpec) -> dict:
    return spec.parameters if spec.parameters.get("type") == "object" else {**spec.parameters, "type": "object"}


def marked_calls(marker: str, call: str, required: bool, parallel: bool, added_token: AddedToken,
                 separator: str = "", lead: str = "TEXT") -> GrammarBody:
    """Calls that each begin with `marker` and go on as `call` (Lark). required: calls only (one
    unless parallel, joined by `separator`); auto: free text with the calls among it (at most
    one unless parallel), each checked once its marker appears. Free text never holds the
    marker's text otherwise: the parser would read a call there."""
    opener = lark_token(marker, added_token)
    if required:
        more = f" ({separator} {opener} {call})*" if parallel else ""
        return GrammarBody(f"{opener} {call}{more}")
    no_marker = f"NO_MARKER: /(.|\\n)*/ & ~/(.|\\n)*{regex_text(marker)}(.|\\n)*/"
    if is_token(opener):  # free text cannot contain the token: it ends there
        start = (f"(NO_MARKER {opener} {call})* NO_MARKER" if parallel
                 else f"NO_MARKER ({opener} {call} NO_MARKER)?")
        return GrammarBody(start, (no_marker,), free_start=True)
    # A text marker ends free text through a lazy lexeme: the first place the marker appears.
    # The first one uses `lead`, so that a think block's text cannot be read as answer text.
    first = "trigger" if lead == "TEXT" else "first_trigger"
    rules = [f"trigger[lazy]: TEXT {opener}", FREE_TEXT]
    if first != "trigger":
        rules.append(f"first_trigger[lazy]: {lead} {opener}")
    if parallel:
        return GrammarBody(f"{first} {call} (trigger {call})* TEXT | {lead}", tuple(rules), free_start=True)
    # After the one call, text that never writes the marker again.
    return GrammarBody(f"{lead} | {first} {call} NO_MARKER", (*rules, no_marker), free_start=True)


def regex_text(text: str) -> str:
    """text as a literal inside a Lark /regex/ (Rust regex syntax; "/" ends the regex)."""
    return re.escape(text).replace("/", "\\/")


@dataclass(frozen=True)
class ThinkPrefix:
    """The grammar of a think block before the answer (`expr`, empty for none), its rules, and
    `lead`: the lexeme for free text at the answer's start (see reasoning_prefix)."""

    expr: str = ""
    rules: tuple[str, ...] = ()
    lead: str = "TEXT"


def reasoning_prefix(reasoning: str | None, added_token: AddedToken) -> ThinkPrefix:
    """None: no think block; "optional": the output may open one (<think> first thing);
    "opened": the prompt opened it, so the output starts inside and must close it. The text
    inside is free: a marker there is no call. When the output may open the block with a text
    <think>, answer text may not begin with one, else a lazy call marker inside the block
    could end the answer's first text first."""
    if reasoning is None:
        return ThinkPrefix()
    if reasoning not in ("optional", "opened"):
        raise ValueError(f"reasoning must be None, 'optional' or 'opened', got {reasoning!r}")
    closer = lark_token(THINK_END, added_token)
    rules = [FREE_TEXT]
    if is_token(closer):
        inside = f"TEXT {closer}"
    else:
        inside = "think_end"
        rules.append(f"think_end[lazy]: TEXT {closer}")
    if reasoning == "opened":
        return ThinkPrefix(inside, tuple(rules))
    opener = lark_token(THINK_START, added_token)
    if is_token(opener):
        return ThinkPrefix(f"({opener} {inside})?", tuple(rules))
    rules.append(f"LEAD_TEXT: /(.|\\n)*/ & ~/{regex_text(THINK_START)}(.|\\n)*/")
    return ThinkPrefix(f"({opener} {inside})?", tuple(rules), "LEAD_TEXT")


def assemble(prefix: ThinkPrefix, body: GrammarBody) -> str:
    start = f"({body.start})"
    rules = list(body.rules)
    if prefix.expr:
        # Whitespace between </think> and an answer that does not begin with free text.
        start = f"{prefix.expr} {start}" if body.free_start else f"{prefix.expr} THINK_WS? {start}"
        rules += [rule for rule in prefix.rules if rule not in rules]
        if not body.free_start:
            rules.append("THINK_WS: /[ \\t\\r\\n]{1,8}/")
    return "%llguidance {}\n" + f"start: {start}\n" + "".join(rule + "\n" for rule in rules)
