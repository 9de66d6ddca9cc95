"""Pydantic request models (OpenAI schema plus vLLM / llama.cpp extensions)."""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

INT64_MAX = 2**63 - 1
_SURROGATE = re.compile("[\ud800-\udfff]")


class _Request(BaseModel):
    # Unknown fields are accepted and ignored (logged), as vLLM and llama-server do, so that
    # clients which send extra OpenAI fields keep working. NaN / Infinity are refused.
    # Strict, as OpenAI is: "max_tokens": true or "3", "n": 2.0 are errors, not 1, 3 and 2
    # (an int is still a valid float: "temperature": 1 is fine).
    model_config = ConfigDict(extra="allow", allow_inf_nan=False, strict=True)

    @model_validator(mode="before")
    @classmethod
    def _no_lone_surrogates(cls, data: Any) -> Any:
        found = find_lone_surrogate(data)
        if found is not None:
            path, position, char = found
            raise PydanticCustomError(
                "lone_surrogate",
                "{param}: contains a lone UTF-16 surrogate {char} at character {position}; text must be valid Unicode "
                "(pair each \\ud800-\\udbff escape with a \\udc00-\\udfff one)",
                {"param": path, "char": char, "position": position},
            )
        return data


def find_lone_surrogate(value: Any, path: str = "") -> tuple[str, int, str] | None:
    """(field path, character index, escaped char) of the first unpaired surrogate in a JSON
    value. json.loads lets "\\ud800" through; no tokenizer or UTF-8 encoder can take it."""
    if isinstance(value, str):
        match = _SURROGATE.search(value)
        return None if match is None else (path or "body", match.start(), f"\\u{ord(match.group()):04x}")
    if isinstance(value, dict):
        for key, item in value.items():
            found = find_lone_surrogate(key, f"{path}.{key}".lstrip(".") if isinstance(key, str) else path)
            found = found or find_lone_surrogate(item, f"{path}.{key}".lstrip("."))
            if found is not None:
                return found
    elif isinstance(value, list):
        for index, item in enumerate(value):
            found = find_lone_surrogate(item, f"{path}.{index}" if path else str(index))
            if found is not None:
                return found
    return None


_STRICT = ConfigDict(extra="allow", strict=True)


class StreamOptions(BaseModel):
    model_config = _STRICT
    include_usage: bool = False


class TextPart(BaseModel):
    model_config = _STRICT
    type: str = "text"
    text: str | None = None


class ToolCallFunction(BaseModel):
    model_config = _STRICT
    name: str
    arguments: str  # OpenAI sends the arguments object as JSON text


class ToolCallItem(BaseModel):
    """One call of an assistant message's tool_calls, as OpenAI clients send it back."""

    model_config = _STRICT
    id: str | None = None
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(BaseModel):
    model_config = _STRICT
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallItem] | None = None  # assistant: the calls it made
    tool_call_id: str | None = None  # tool: the call this message answers
    reasoning_content: str | None = None  # assistant: its reasoning, for templates that show it (Qwen3's)


class _SamplingFields(_Request):
    """Fields shared by chat and text completions."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=-1, le=INT64_MAX)  # -1 = random (llama.cpp convention)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    # vLLM / llama.cpp extensions
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    response_format: dict[str, Any] | None = None  # checked by guided_spec.constraint_kwargs
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None


class _ChatTemplateFields(BaseModel):
    """vLLM's chat_template_kwargs: extra variables for the model's chat template, e.g.
    {"enable_thinking": false}. Names quill sets itself (messages, add_generation_prompt, tools,
    documents) and non-variables (chat_template, tokenize, ...) are refused with a 400 by the
    handler (quill.chat_template.check_template_kwargs), not silently ignored or let through."""

    chat_template_kwargs: dict[str, Any] | None = None

    @field_validator("chat_template_kwargs", mode="before")
    @classmethod
    def _template_kwargs_object(cls, value: Any) -> Any:
        if value is not None and not isinstance(value, dict):
            raise PydanticCustomError(
                "chat_template_kwargs_type",
                "must be a JSON object mapping chat template variable names to values (e.g. enable_thinking)",
            )
        return value


class ChatCompletionRequest(_SamplingFields, _ChatTemplateFields):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    # llama-server's per-request field: "none" leaves <think>...</think> in content, "deepseek"
    # moves it to message.reasoning_content; None: the server's --reasoning-format (quill.reasoning).
    reasoning_format: Literal["none", "deepseek"] | None = None


class CompletionRequest(_SamplingFields):
    """POST /v1/completions."""

    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


class TokenizeRequest(_Request, _ChatTemplateFields):
    """POST /tokenize: either `prompt` or `messages` (vLLM shape)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(_Request):
    """POST /detokenize (vLLM shape)."""

    model: str | None = None
    tokens: list[int]


# ---- translation to SamplingParams -------------------------------------------------------

# SamplingParams field -> the request field a user would recognise, per endpoint.
_CHAT_PARAM_NAMES = {"logprobs": "top_logprobs"}


def requested_max_tokens(req: _SamplingFields) -> tuple[int | None, str]:
    """(value, name) of the output-length limit the user asked for (None: not given)."""
    if isinstance(req, ChatCompletionRequest) and req.max_completion_tokens is not None:
        return req.max_completion_tokens, "max_completion_tokens"
    return req.max_tokens, "max_tokens"


def structured_fields(req: _SamplingFields) -> tuple[dict[str, Any], dict[str, str]]:
    """SamplingParams constraint kwargs, and which request field each came from."""
    fields = {
        "response_format": req.response_format,
        "guided_json": req.guided_json,
        "guided_regex": req.guided_regex,
        "guided_choice": req.guided_choice,
        "guided_grammar": req.guided_grammar,
    }
    if all(v is None for v in fields.values()):
        return {}, {}
    from quill.engine.guided_spec import constraint_kwargs  # imports llguidance: only when asked
    from quill.sampling_params import ParamError
    from quill.server.errors import bad_request

    try:
        kwargs = constraint_kwargs(**fields)
    except ParamError as exc:
        raise bad_request(f"{exc.param}: {str(exc).split(': ', 1)[-1]}", exc.param) from exc
    source = (kwargs.get("extra") or {}).get("guided_param")
    return kwargs, {k: source for k in kwargs if k != "extra" and source}


def unsupported_fields(req: _SamplingFields) -> None:
    """Refuse OpenAI fields quill cannot honour rather than silently ignoring them."""
    from quill.server.errors import bad_request

    if isinstance(req, ChatCompletionRequest):
        if req.top_logprobs is not None and not req.logprobs:
            raise bad_request("top_logprobs requires logprobs=true", "top_logprobs")
    if isinstance(req, CompletionRequest):
        if req.suffix:
            raise bad_request("suffix is not supported by quill", "suffix", "unsupported_parameter")
        if req.best_of is not None and req.best_of != (req.n or 1):
            raise bad_request(f"best_of must equal n ({req.n or 1}) in quill, got {req.best_of}", "best_of", "unsupported_parameter")
        if req.echo and req.logprobs is not None:
            raise bad_request("echo together with logprobs is not supported by quill", "echo", "unsupported_parameter")


def to_sampling_params(req: _SamplingFields, max_tokens: int, vocab_size: int, tool_grammar: str | None = None,
                       keep_special_tokens: bool = False):
    """Build SamplingParams; a ParamError becomes a 400 naming the request's own field.

    tool_grammar: the llguidance grammar a chat request's tools put on the output
    (quill.server.tool_calls.ToolPlan.grammar); it cannot be combined with another constraint.
    keep_special_tokens: decode special tokens into the text (a tool-call marker is one)."""
    from quill.sampling_params import ParamError, SamplingParams
    from quill.server.errors import bad_request

    unsupported_fields(req)
    for tid in req.stop_token_ids or ():
        if not 0 <= tid < vocab_size:
            raise bad_request(f"stop_token_ids: token id {tid} is outside the vocabulary [0, {vocab_size})", "stop_token_ids")
    constraint, source = structured_fields(req)
    if tool_grammar is not None:
        if constraint:
            field = constraint["extra"]["guided_param"]
            raise bad_request(f"{field}: cannot be combined with tools: the tool-call format already constrains the output "
                              "(send tool_choice \"none\" to use it without tools)", field)
        constraint, source = {"grammar": tool_grammar, "extra": {"guided_param": "tools"}}, {"grammar": "tools"}
    chat = isinstance(req, ChatCompletionRequest)
    logprobs = ((req.top_logprobs or 0) if req.logprobs else None) if chat else req.logprobs
    _, max_name = requested_max_tokens(req)
    names = {**(_CHAT_PARAM_NAMES if chat else {}), "max_tokens": max_name, **source}
    try:
        params = SamplingParams(
            n=1 if req.n is None else req.n,
            max_tokens=max_tokens,
            min_tokens=req.min_tokens or 0,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=0 if req.top_k is None else req.top_k,
            min_p=0.0 if req.min_p is None else req.min_p,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            seed=None if req.seed in (None, -1) else req.seed,
            stop=req.stop or (),
            stop_token_ids=tuple(req.stop_token_ids or ()),
            ignore_eos=req.ignore_eos,
            logprobs=logprobs,
            include_stop_str_in_output=req.include_stop_str_in_output,
            skip_special_tokens=req.skip_special_tokens and not keep_special_tokens,
            logit_bias=req.logit_bias,
            **constraint,
        )
        params.check_logit_bias(vocab_size)  # the engine checks again, against what it can sample
        return params
    except ParamError as exc:
        param = names.get(exc.param, exc.param)
        message = str(exc).split(": ", 1)[-1]
        raise bad_request(f"{param}: {message}", param) from exc
