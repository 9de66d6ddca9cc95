"""Chat templates: Hugging Face-compatible Jinja rendered in an immutable sandbox."""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """A chat template is missing, does not compile, or failed while rendering."""


def _raise_exception(message: str):
    # Templates call this to reject a conversation (e.g. "roles must alternate").
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # Jinja's built-in tojson HTML-escapes <, >, & and ', which would corrupt prompts.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks; we only render it."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

    def _render_body(self, caller):
        return caller()


def _make_environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationBlock, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


_ENVIRONMENT = _make_environment()


@lru_cache(maxsize=32)
def compile_chat_template(template: str) -> jinja2.Template:
    """Compile once per distinct template string; raises ChatTemplateError on bad syntax."""
    if not isinstance(template, str):
        raise ChatTemplateError(f"chat template must be a string, got {type(template).__name__}")
    try:
        return _ENVIRONMENT.from_string(template)
    except jinja2.exceptions.TemplateSyntaxError as exc:
        raise ChatTemplateError(f"chat template has a syntax error at line {exc.lineno}: {exc.message}") from exc
    except jinja2.exceptions.TemplateError as exc:
        raise ChatTemplateError(f"chat template does not compile: {exc}") from exc


def _check_messages(messages) -> list[dict]:
    if not isinstance(messages, (list, tuple)):
        raise ChatTemplateError(f"messages must be a list of dicts, got {type(messages).__name__}")
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ChatTemplateError(f"messages[{index}] must be a dict, got {type(message).__name__}")
        if not isinstance(message.get("role"), str):
            raise ChatTemplateError(f"messages[{index}] needs a string 'role', got {message.get('role')!r}")
    return list(messages)


def render_chat_template(
    template: str | None,
    messages: list[dict],
    *,
    add_generation_prompt: bool = True,
    tools: list[dict] | None = None,
    documents: list[dict] | None = None,
    special_tokens: dict[str, str | None] | None = None,
    **kwargs,
) -> str:
    """Render `messages` like transformers' apply_chat_template(tokenize=False).

    `special_tokens` (bos_token, eos_token, ...) become template variables; None values are left
    undefined so `{{ bos_token }}` renders "" rather than "None", as in transformers.
    """
    if template is None:
        raise ChatTemplateError(
            "this model has no chat template (none in its GGUF metadata, chat_template.jinja or "
            "tokenizer_config.json); pass a template explicitly or use a plain completion prompt"
        )
    compiled = compile_chat_template(template)
    variables = {k: v for k, v in (special_tokens or {}).items() if v is not None}
    variables.update(kwargs)
    variables.update(
        messages=_check_messages(messages),
        tools=tools,
        documents=documents,
        add_generation_prompt=bool(add_generation_prompt),
    )
    try:
        return compiled.render(**variables)
    except jinja2.exceptions.TemplateError as exc:
        # raise_exception(), undefined attributes, sandbox violations.
        raise ChatTemplateError(f"chat template rejected the conversation: {exc}") from exc
    except Exception as exc:  # a template is untrusted code: any failure is the template's, not ours
        raise ChatTemplateError(f"chat template failed while rendering: {type(exc).__name__}: {exc}") from exc
