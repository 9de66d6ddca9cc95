"""Chat templates: Hugging Face-compatible Jinja rendered in an immutable, bounded sandbox."""

from __future__ import annotations

import contextvars
import dataclasses
import functools
import json
import time
from collections.abc import Mapping
from datetime import datetime
from functools import lru_cache

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import Namespace

# A template comes with the model file: untrusted code. The sandbox stops it from touching
# Python; these stop it from running forever or filling memory.
MAX_RENDER_SECONDS = 2.0
MAX_OUTPUT_CHARS = 8 * 1024 * 1024  # the prompt a template may write (and any one string it builds)
_MAX_EXPONENT = 4096  # `a ** b`: a huge b takes unbounded time inside one operation


class ChatTemplateError(ValueError):
    """A chat template is missing, does not compile, or failed while rendering."""


class ChatTemplateLimitError(ChatTemplateError):
    """A chat template ran past MAX_RENDER_SECONDS or built text past MAX_OUTPUT_CHARS."""


class _RenderBudget:
    """One render's deadline; the sandbox hooks and every loop iteration check it."""

    def __init__(self, seconds: float, max_chars: int):
        self.seconds = seconds
        self.max_chars = max_chars
        self.deadline = time.monotonic() + seconds

    def check_time(self) -> None:
        if time.monotonic() > self.deadline:
            raise ChatTemplateLimitError(f"chat template: rendering exceeded the limit of {self.seconds:g} s")

    def check_size(self, size: int, what: str) -> None:
        if size > self.max_chars:
            raise ChatTemplateLimitError(
                f"chat template: {what} is {size:,} characters, over the limit of {self.max_chars:,}")


# The render in progress on this thread / task (hooks such as filters get no render context).
_BUDGET: contextvars.ContextVar[_RenderBudget | None] = contextvars.ContextVar("quill_chat_template_budget", default=None)


def _budget() -> _RenderBudget:
    return _BUDGET.get() or _RenderBudget(MAX_RENDER_SECONDS, MAX_OUTPUT_CHARS)


def _size(value) -> int | None:
    return len(value) if isinstance(value, (str, list, tuple, dict)) else None


def _check_result(value, what: str):
    size = _size(value)
    if size is not None:
        _budget().check_size(size, what)
    return value


def _check_int_args(args, kwargs, what: str) -> None:
    """A width or count argument (center(10**9), indent, wordwrap) would build a huge string."""
    limit = _budget().max_chars
    for value in (*args, *kwargs.values()):
        if isinstance(value, int) and not isinstance(value, bool) and value > limit:
            raise ChatTemplateLimitError(f"chat template: {what} got {value:,}, over the limit of {limit:,}")


def _loop_items(iterable):
    """Wraps the iterable of every {% for %}: a loop without output or calls still checks the clock."""
    budget = _budget()
    for item in iterable:
        budget.check_time()
        yield item


class _BoundedNamespace(Namespace):
    """namespace() whose attributes cannot hold a string or list over the size limit, nor have a
    name starting with "_" (transformers refuses those too: they lead towards CPython internals)."""

    def __init__(*args, **kwargs):  # noqa: N805 - jinja's trick, so that namespace(self=...) still works
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name, value in attrs.items():
            _BoundedNamespace._check(name, value)
        Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _BoundedNamespace._check(name, value)
        super().__setitem__(name, value)

    @staticmethod
    def _check(name, value) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"a chat template may not store an attribute whose name starts with '_' on a namespace, got {name!r}")
        _check_result(value, f"namespace attribute {name!r}")


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


class _BoundedEnvironment(ImmutableSandboxedEnvironment):
    """The immutable sandbox, with the clock checked on every call, attribute and item access,
    and repetition / concatenation / power refused when the result would be too big."""

    intercepted_binops = frozenset({"*", "**", "+"})

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 - jinja's own signature
        _budget().check_time()
        if isinstance(getattr(__obj, "__self__", None), str):  # "x".center(10**9), "x".ljust(...)
            _check_int_args(args, kwargs, f"{getattr(__obj, '__name__', 'a str method')}()")
        for value in (*args, *kwargs.values()):  # macro arguments built by ~ (which has no hook)
            _check_result(value, "an argument")
        return _check_result(super().call(__context, __obj, *args, **kwargs), "a call's result")

    def getattr(self, obj, attribute):
        _budget().check_time()
        return super().getattr(obj, attribute)

    def getitem(self, obj, argument):
        _budget().check_time()
        return super().getitem(obj, argument)

    def call_binop(self, context, operator_name, left, right):
        budget = _budget()
        budget.check_time()
        if operator_name == "*":
            for seq, count in ((left, right), (right, left)):
                if _size(seq) is not None and isinstance(count, int):
                    budget.check_size(_size(seq) * max(count, 0), "a repeated string or list")
        elif operator_name == "+" and _size(left) is not None and _size(right) is not None:
            budget.check_size(_size(left) + _size(right), "a concatenation")
        elif operator_name == "**" and isinstance(right, (int, float)) and abs(right) > _MAX_EXPONENT:
            if isinstance(left, (int, float)) and abs(left) > 1:
                raise ChatTemplateLimitError(f"chat template: exponent {right:,} is over the limit of {_MAX_EXPONENT:,}")
        return self.binop_table[operator_name](left, right)


def _bounded_filter(fn):
    @functools.wraps(fn)  # keeps jinja's pass_context / pass_environment marks
    def bounded(*args, **kwargs):
        _budget().check_time()
        _check_int_args(args[1:], kwargs, "a filter argument")
        return _check_result(fn(*args, **kwargs), "a filter's result")

    return bounded


_LOOP_HELPER = "_quill_loop_items"


def _make_environment() -> ImmutableSandboxedEnvironment:
    env = _BoundedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationBlock, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.filters = {name: _bounded_filter(fn) for name, fn in env.filters.items()}
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["namespace"] = _BoundedNamespace
    env.globals[_LOOP_HELPER] = _loop_items
    return env


def _bound_loops(ast: jinja2.nodes.Template) -> jinja2.nodes.Template:
    """Route every {% for %} iterable through _loop_items (nested range() loops emit nothing and
    call nothing, so no other hook would see them)."""
    for node in ast.find_all((jinja2.nodes.Name, jinja2.nodes.Macro)):
        if node.name == _LOOP_HELPER and (isinstance(node, jinja2.nodes.Macro) or node.ctx != "load"):
            raise ChatTemplateError(f"chat template may not define {_LOOP_HELPER!r} (a name quill reserves)")
    for loop in ast.find_all(jinja2.nodes.For):
        loop.iter = jinja2.nodes.Call(jinja2.nodes.Name(_LOOP_HELPER, "load"), [loop.iter], [], None, None, lineno=loop.lineno)
    return ast


_ENVIRONMENT = _make_environment()


@lru_cache(maxsize=32)
def compile_chat_template(template: str) -> jinja2.Template:
    """Compile once per distinct template string; raises ChatTemplateError on bad syntax."""
    if not isinstance(template, str):
        raise ChatTemplateError(f"chat template must be a string, got {type(template).__name__}")
    try:
        return _ENVIRONMENT.from_string(_bound_loops(_ENVIRONMENT.parse(template)))
    except jinja2.exceptions.TemplateSyntaxError as exc:
        raise ChatTemplateError(f"chat template has a syntax error at line {exc.lineno}: {exc.message}") from exc
    except jinja2.exceptions.TemplateError as exc:
        raise ChatTemplateError(f"chat template does not compile: {exc}") from exc


# Where a message may carry its reasoning text; the first is the name templates read (Qwen3's
# message.reasoning_content), "thinking" is what gpt-oss templates read.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _plain(value):
    """A value as transformers lets a template see it (_plain_template_data): JSON-like data
    rebuilt from plain types (str / int / float subclasses such as enums back to the base type,
    dataclasses and pydantic models to dicts, numpy scalars to Python ones), anything else
    replaced by an inert "<TypeName>" string, so no object's methods are reachable from Jinja."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(key): _plain(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_plain(item) for item in value]
    if isinstance(value, tuple):
        return tuple(_plain(item) for item in value)
    if type(value).__module__ == "numpy" and callable(getattr(value, "item", None)) and getattr(value, "ndim", None) == 0:
        return _plain(value.item())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {field.name: _plain(getattr(value, field.name)) for field in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return _plain(value.model_dump())
    return f"<{type(value).__name__}>"


def _template_message(message: dict) -> dict:
    """One message as transformers' apply_chat_template hands it to the template: keys whose
    value is None dropped (OpenAI clients send "content": null, "tool_calls": null; a template's
    `is defined` / `in message` tests must see them absent), and reasoning given under any of
    _REASONING_FIELDS also present as `thinking` and `reasoning_content` (in transformers' key order)."""
    message = {key: value for key, value in message.items() if value is not None}
    reasoning = next((message[key] for key in _REASONING_FIELDS if message.get(key) is not None), None)
    if reasoning is not None:
        message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
    return message


def _check_messages(messages) -> list[dict]:
    if not isinstance(messages, (list, tuple)):
        raise ChatTemplateError(f"messages must be a list of dicts, got {type(messages).__name__}")
    if not messages:  # transformers refuses one too, before the template sees it
        raise ChatTemplateError("cannot apply a chat template to an empty conversation; give at least one message")
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ChatTemplateError(f"messages[{index}] must be a dict, got {type(message).__name__}")
        if not isinstance(message.get("role"), str):
            raise ChatTemplateError(f"messages[{index}] needs a string 'role', got {message.get('role')!r}")
    return [_template_message(_plain(message)) for message in messages]


# Names a caller's extra template variables (LLM.chat's and the server's chat_template_kwargs)
# may not take, and why. quill sets the first four itself from its own arguments; in vLLM the
# request's own fields win over chat_template_kwargs for these (and it refuses chat_template and
# tokenize outright): quill refuses them all rather than ignore one silently. The rest are
# arguments of transformers' apply_chat_template, which never reach the template there, or
# quill's own render limits.
_QUILL_SETS = "quill sets it from the conversation / request itself"
_NOT_A_VARIABLE = "it is an argument of transformers' apply_chat_template, not a template variable"
RESERVED_TEMPLATE_KWARGS: dict[str, str] = {
    "messages": _QUILL_SETS,
    "add_generation_prompt": _QUILL_SETS,
    "tools": _QUILL_SETS,
    "documents": _QUILL_SETS,
    "chat_template": "it would choose the template, not fill a variable in it",
    **{name: _NOT_A_VARIABLE for name in (
        "conversation", "tokenize", "continue_final_message", "return_dict", "return_tensors",
        "return_assistant_tokens_mask", "padding", "truncation", "max_length", "tokenizer_kwargs",
        "sanitize_control_tokens")},
    "special_tokens": "it is one of quill's render settings",
    "max_seconds": "it is one of quill's render limits",
    "max_chars": "it is one of quill's render limits",
    _LOOP_HELPER: "quill reserves it for its loop guard",
}


def check_template_kwargs(kwargs, name: str = "chat_template_kwargs") -> dict:
    """Extra template variables (e.g. enable_thinking, date_string) from a caller: a dict with
    string keys, none of them in RESERVED_TEMPLATE_KWARGS. Special-token names (bos_token, ...)
    are allowed and override the tokenizer's, as in transformers. Raises ChatTemplateError
    naming `name` and the key."""
    if kwargs is None:
        return {}
    if not isinstance(kwargs, dict):
        raise ChatTemplateError(f"{name} must be a dict of template variable names to values, got {type(kwargs).__name__}")
    for key in kwargs:
        if not isinstance(key, str):
            raise ChatTemplateError(f"{name}: keys must be strings, got {key!r}")
        if key in RESERVED_TEMPLATE_KWARGS:
            raise ChatTemplateError(f"{name}.{key}: may not be set here: {RESERVED_TEMPLATE_KWARGS[key]}")
    return dict(kwargs)


def render_chat_template(
    template: str | None,
    messages: list[dict],
    *,
    add_generation_prompt: bool = True,
    tools: list[dict] | None = None,
    documents: list[dict] | None = None,
    special_tokens: dict[str, str | None] | None = None,
    max_seconds: float = MAX_RENDER_SECONDS,
    max_chars: int = MAX_OUTPUT_CHARS,
    **kwargs,
) -> str:
    """Render `messages` like transformers' apply_chat_template(tokenize=False).

    `special_tokens` (bos_token, eos_token, ...) become template variables; None values are left
    undefined so `{{ bos_token }}` renders "" rather than "None", as in transformers. Other
    keyword arguments (enable_thinking, date_string, ...) are template variables too and win over
    a special token of the same name, as in transformers. Messages reach the template as there:
    None-valued keys dropped, reasoning aliased (_template_message). A render past `max_seconds`,
    or text past `max_chars`, raises ChatTemplateLimitError.
    """
    if template is None:
        raise ChatTemplateError(
            "this model has no chat template (none in its GGUF metadata, chat_template.jinja or "
            "tokenizer_config.json); pass a template explicitly or use a plain completion prompt"
        )
    if _LOOP_HELPER in kwargs:
        raise ChatTemplateError(f"{_LOOP_HELPER!r} is a name quill reserves; it cannot be a template variable")
    compiled = compile_chat_template(template)
    variables = {k: v for k, v in (special_tokens or {}).items() if v is not None}
    variables.update(kwargs)
    variables = _plain(variables)
    variables.update(
        messages=_check_messages(messages),
        tools=_plain(tools),
        documents=_plain(documents),
        add_generation_prompt=bool(add_generation_prompt),
    )
    token = _BUDGET.set(_RenderBudget(max_seconds, max_chars))
    try:
        return _render_bounded(compiled, variables)
    except ChatTemplateLimitError:
        raise
    except RecursionError as exc:
        raise ChatTemplateLimitError("chat template: rendering recursed too deeply (macros calling themselves?)") from exc
    except jinja2.exceptions.TemplateError as exc:
        # raise_exception(), undefined attributes, sandbox violations.
        raise ChatTemplateError(f"chat template rejected the conversation: {exc}") from exc
    except Exception as exc:  # a template is untrusted code: any failure is the template's, not ours
        raise ChatTemplateError(f"chat template failed while rendering: {type(exc).__name__}: {exc}") from exc
    finally:
        _BUDGET.reset(token)


def _render_bounded(compiled: jinja2.Template, variables: dict) -> str:
    budget = _budget()
    pieces, size = [], 0
    for piece in compiled.generate(**variables):
        size += len(piece)
        budget.check_size(size, "the rendered prompt")
        budget.check_time()
        pieces.append(piece)
    return "".join(pieces)
