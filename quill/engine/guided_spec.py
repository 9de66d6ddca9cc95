"""Structured-output requests → llguidance grammar strings (no tokenizer needed)."""

from __future__ import annotations

import json
from typing import Any

from quill.sampling_params import ParamError, SamplingParams

# Whitespace allowed between JSON tokens: up to two spaces/tabs, or one newline plus
# indentation. llguidance's default is unbounded, and small models sampled at high
# temperature can loop on whitespace until max_tokens; pretty-printed JSON still fits.
DEFAULT_JSON_WHITESPACE = r"(?:[ \t]{0,2}|\n[ \t]{0,24})"

# The request field a 400 names, per SamplingParams field (OpenAI / vLLM spelling).
API_PARAM = {
    "json_schema": "response_format",
    "json_object": "response_format",
    "regex": "guided_regex",
    "choice": "guided_choice",
    "grammar": "guided_grammar",
}
# Keys of OpenAI's {"type": "json_schema", "json_schema": {...}} wrapper object.
_OPENAI_WRAPPER_KEYS = {"name", "schema", "strict", "description"}
_MAX_MESSAGE_CHARS = 400


class GuidedError(ParamError):
    """A constraint cannot be compiled or a token breaks it; `param` names the request field.

    A ParamError (so a ValueError): the server answers it with a 400 naming `param`.
    """


def constraint_kind(params: SamplingParams) -> str | None:
    """The SamplingParams field that carries the constraint, or None."""
    if params.json_object:
        return "json_object"
    for kind in ("json_schema", "regex", "choice", "grammar"):
        if getattr(params, kind) is not None:
            return kind
    return None


def api_param(params: SamplingParams, kind: str) -> str:
    """The request field to blame; constraint_kwargs() records where it came from."""
    return params.extra.get("guided_param") or API_PARAM[kind]


def clean_message(message: str) -> str:
    """First part of an llguidance error, without its parser-state dump."""
    for marker in ("\n<state>", "<non-verbose/>", "\n<grammar>"):
        message = message.split(marker, 1)[0]
    message = message.strip()
    if len(message) > _MAX_MESSAGE_CHARS:
        message = message[:_MAX_MESSAGE_CHARS] + "..."
    return message


def build_constraint_spec(params: SamplingParams, json_whitespace: str | None = DEFAULT_JSON_WHITESPACE) -> str | None:
    """The llguidance grammar for params' constraint, or None when unconstrained.

    Only shape errors are found here (bad JSON, wrong types, GBNF that does not parse);
    GrammarCompiler.validate finds the rest (bad regex, unsatisfiable schema).
    """
    kind = constraint_kind(params)
    if kind is None:
        return None
    import llguidance  # here, not at import: quill.tools reads this module's constants on every chat request

    param = api_param(params, kind)
    options = {"whitespace_pattern": json_whitespace} if json_whitespace is not None else None
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=options)
    if kind == "json_schema":
        schema = _load_schema(params.json_schema, param)
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=options)
        except ValueError as e:
            raise GuidedError(param, f"invalid JSON schema: {clean_message(str(e))}") from None
    if kind == "regex":
        _check_text(params.regex, param, "regex")
        return llguidance.LLMatcher.grammar_from_regex(params.regex)
    if kind == "choice":
        # A Lark alternation of string literals; json.dumps escapes quotes, backslashes
        # and control characters the way Lark string literals expect.
        return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in params.choice))
    _check_text(params.grammar, param, "grammar")
    try:
        return llguidance.grammar_from("grammar", params.grammar)  # Lark, or GBNF converted to Lark
    except ValueError as e:
        raise GuidedError(param, f"invalid grammar: {clean_message(str(e))}") from None


def _check_text(value: Any, param: str, what: str) -> None:
    if not isinstance(value, str) or not value:
        raise GuidedError(param, f"{what} must be a non-empty string, got {value!r:.80}")


def _load_schema(schema: Any, param: str) -> dict | bool:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise GuidedError(param, f"JSON schema is not valid JSON: {e}") from None
    if isinstance(schema, bool):
        if not schema:
            raise GuidedError(param, "JSON schema `false` matches nothing")
        return schema
    if not isinstance(schema, dict):
        raise GuidedError(param, f"JSON schema must be an object, got {type(schema).__name__}")
    # Accept OpenAI's wrapper {"name", "schema", "strict"} too; "schema" is no JSON Schema keyword.
    if "schema" in schema and set(schema) <= _OPENAI_WRAPPER_KEYS:
        return _load_schema(schema["schema"], param)
    return schema


def constraint_kwargs(
    *,
    response_format: dict | None = None,
    guided_json: dict | str | None = None,
    guided_regex: str | None = None,
    guided_choice: list[str] | None = None,
    guided_grammar: str | None = None,
) -> dict[str, Any]:
    """Map OpenAI / vLLM request fields to SamplingParams keyword arguments.

    Returns {} when unconstrained, else one constraint field plus
    extra={"guided_param": <request field>} so errors name the field the client sent
    (merge that into any `extra` of your own). Raises GuidedError for malformed input.
    """
    given = {
        name: value
        for name, value in (
            ("response_format", _from_response_format(response_format)),
            ("guided_json", {"json_schema": guided_json} if guided_json is not None else None),
            ("guided_regex", {"regex": guided_regex} if guided_regex is not None else None),
            ("guided_choice", _from_choice(guided_choice)),
            ("guided_grammar", {"grammar": guided_grammar} if guided_grammar is not None else None),
        )
        if value
    }
    if len(given) > 1:
        names = sorted(given)
        raise GuidedError(names[-1], f"at most one constraint per request, got {names}")
    if not given:
        return {}
    (name, kwargs), = given.items()
    return {**kwargs, "extra": {"guided_param": name}}


def _from_response_format(response_format: dict | None) -> dict | None:
    if response_format is None:
        return None
    param = "response_format"
    if not isinstance(response_format, dict):
        raise GuidedError(param, f"must be an object, got {type(response_format).__name__}")
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        # llama-server accepts {"type": "json_object", "schema": {...}}; honour it.
        schema = response_format.get("schema")
        return {"json_schema": schema} if schema is not None else {"json_object": True}
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict):
            raise GuidedError(param, "type 'json_schema' needs a `json_schema` object with a `schema`")
        schema = spec.get("schema")
        # No schema given: any JSON object (strict is accepted and ignored: output always follows the schema).
        return {"json_schema": schema} if schema is not None else {"json_object": True}
    raise GuidedError(param, f"type must be 'text', 'json_object' or 'json_schema', got {kind!r}")


def _from_choice(choice: list[str] | None) -> dict | None:
    if choice is None:
        return None
    if isinstance(choice, str) or not isinstance(choice, (list, tuple)) or not choice:
        raise GuidedError("guided_choice", f"must be a non-empty list of strings, got {choice!r:.80}")
    if not all(isinstance(c, str) and c for c in choice):
        raise GuidedError("guided_choice", "every choice must be a non-empty string")
    return {"choice": tuple(choice)}
