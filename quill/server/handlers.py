"""Chat and text completions: request -> engine jobs -> one JSON body or an SSE stream."""

from __future__ import annotations

import logging
import time
import uuid

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from quill.engine.errors import RequestFailed
from quill.server.accumulator import Accumulator
from quill.server.errors import APIError, bad_request, error_body_for
from quill.server.protocol import ChatCompletionRequest, CompletionRequest, requested_max_tokens, to_sampling_params
from quill.server.responses import OPENAI, TokenText
from quill.server.streams import DISCONNECTED, Job, RequestGroup, SSEResponse, until_disconnect
from quill.server.tool_calls import plan_tools

logger = logging.getLogger("quill.server")

MAX_CHOICES = 128  # prompts x n per HTTP request
FAULT_HEADER = "x-quill-fault"  # PHASE: make this request fail there (needs --enable-fault-injection)
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


def check_model(state, model: str | None) -> None:
    if model and model not in state.model_names:
        served = ", ".join(repr(m) for m in state.model_names)
        raise APIError(404, f"model {model!r} does not exist; this server serves {served}", param="model", code="model_not_found")


def template_messages(messages) -> list[dict]:
    """Request messages -> plain dicts for the chat template (text parts joined)."""
    if not messages:
        raise bad_request("messages: at least one message is required, got an empty list", "messages")
    out = []
    for i, message in enumerate(messages):
        content = message.content
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if part.type != "text" or part.text is None:
                    raise bad_request(f"messages[{i}].content[{j}]: only text parts are supported, got type {part.type!r}", "messages")
                texts.append(part.text)
            content = "\n".join(texts)
        if content is None:
            if message.role != "assistant":
                raise bad_request(f"messages[{i}].content: required for role {message.role!r}", "messages")
            content = ""
        item = {"role": "system" if message.role == "developer" else message.role, "content": content}
        if message.name:
            item["name"] = message.name
        if message.tool_calls:
            if message.role != "assistant":
                raise bad_request(f"messages[{i}].tool_calls: only assistant messages carry tool calls, this one is {message.role!r}",
                                  "messages")
            item["tool_calls"] = [call.model_dump(exclude_none=True) for call in message.tool_calls]  # see chat_prompt
        if message.tool_call_id is not None:
            item["tool_call_id"] = message.tool_call_id
        if message.reasoning_content is not None:
            item["reasoning_content"] = message.reasoning_content
        out.append(item)
    return out


def template_kwargs(body) -> dict:
    """The request's chat_template_kwargs, checked: a 400 naming the key for a reserved name."""
    from quill.chat_template import ChatTemplateError, check_template_kwargs

    try:
        return check_template_kwargs(getattr(body, "chat_template_kwargs", None))
    except ChatTemplateError as exc:
        raise bad_request(str(exc), "chat_template_kwargs") from exc


def encode_chat(engine, messages: list[dict], kwargs: dict | None = None) -> list[int]:
    """Render and encode (blocking: call it off the event loop, the render may take a while);
    `kwargs` are extra template variables (checked by template_kwargs)."""
    from quill.chat_template import ChatTemplateLimitError

    try:
        return list(engine.tokenizer.encode_chat(messages, **kwargs) if kwargs else engine.tokenizer.encode_chat(messages))
    except ChatTemplateLimitError as exc:  # the template ran too long or wrote too much
        raise bad_request(f"messages: {exc}", "messages") from exc
    except Exception as exc:  # template errors (e.g. roles that must alternate) are the caller's
        raise bad_request(f"messages: the chat template rejected them: {exc}", "messages") from exc


def encode_text(engine, text: str, param: str, add_special_tokens: bool = True) -> list[int]:
    try:
        return list(engine.tokenizer.encode(text, add_special_tokens=add_special_tokens))
    except ValueError as exc:  # e.g. a lone surrogate, had it got past the request model
        raise bad_request(f"{param}: {exc}", param.split("[", 1)[0]) from exc


def completion_prompts(engine, prompt) -> list[tuple[list[int], str]]:
    """`prompt` (string, strings, token ids, or lists of ids) -> [(ids, text)]."""
    tokenizer, vocab = engine.tokenizer, engine.tokenizer.vocab_size
    if isinstance(prompt, str):
        prompt = [prompt]
    if not prompt:
        raise bad_request("prompt: must not be empty", "prompt")
    if all(isinstance(p, int) for p in prompt):
        prompt = [prompt]
    result = []
    for i, item in enumerate(prompt):
        if isinstance(item, str):
            ids = encode_text(engine, item, f"prompt[{i}]")
            text = item
        else:
            bad = next((t for t in item if not 0 <= t < vocab), None)
            if bad is not None:
                raise bad_request(f"prompt[{i}]: token id {bad} is outside the vocabulary [0, {vocab})", "prompt")
            ids, text = list(item), tokenizer.decode(list(item))
        if not ids:
            raise bad_request(f"prompt[{i}]: is empty (0 tokens)", "prompt")
        result.append((ids, text))
    return result


def resolve_max_tokens(req, prompt_len: int, max_model_len: int, default: int | None, prompt_param: str) -> int:
    """The output budget; a prompt that cannot fit, with max_tokens, is a 400 naming both numbers."""
    requested, name = requested_max_tokens(req)
    if prompt_len >= max_model_len:
        raise APIError(
            400,
            f"{prompt_param}: the prompt is {prompt_len:,} tokens; this model's context is {max_model_len:,} tokens "
            "and at least one must be left for the output",
            param=prompt_param,
            code="context_length_exceeded",
        )
    room = max_model_len - prompt_len
    if requested is None:
        return room if default is None else min(default, room)
    if requested >= 1 and requested > room:
        raise APIError(
            400,
            f"{name}: the prompt is {prompt_len:,} tokens and {name} is {requested:,}, {prompt_len + requested:,} in total; "
            f"this model's context is {max_model_len:,} tokens",
            param=name,
            code="context_length_exceeded",
        )
    return requested


def engine_error(exc: Exception, names: dict, retry_after: float) -> APIError:
    """Map what engine.generate raised at admission to an HTTP error."""
    from quill.sampling_params import ParamError

    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, RequestFailed):  # this request failed inside the engine; the others carry on
        return APIError(500, str(exc), code=exc.code)
    if isinstance(exc, ParamError):
        param = names.get(exc.param, exc.param)
        return bad_request(f"{param}: {str(exc).split(': ', 1)[-1]}", param)
    status = getattr(exc, "status", None)
    if isinstance(exc, ValueError) and isinstance(status, int):  # quill.engine.errors.AdmissionError
        param = names.get(exc.param, exc.param) if getattr(exc, "param", None) else None
        shed = status in (429, 503)
        return APIError(status, str(exc), param=param, code=getattr(exc, "code", None), retry_after=retry_after if shed else None)
    if isinstance(exc, (ValueError, TypeError)):
        return bad_request(str(exc) or type(exc).__name__)
    raise exc


async def chat_completions(request: Request, body: ChatCompletionRequest, state, adapter=None) -> Response:
    """`adapter`: what turns the OpenAI body or stream into what goes out (responses.OpenAIAdapter,
    the default; quill.server.anthropic answers /v1/messages through this path with its own)."""
    engine = state.require_engine()
    check_model(state, body.model)
    ids, tools = await run_in_threadpool(chat_prompt, state, engine, body)
    max_tokens = resolve_max_tokens(body, len(ids), engine.max_model_len, None, "messages")
    opened = reasoning_opened(state, engine, body, ids)
    grammar = tools.grammar(engine.tokenizer, opened) if tools is not None else None
    params = to_sampling_params(body, max_tokens, engine.tokenizer.vocab_size, tool_grammar=grammar,
                                keep_special_tokens=tools is not None and tools.needs_special_tokens(engine.tokenizer))
    response_id = f"chatcmpl-{uuid.uuid4().hex}"
    jobs = [Job(response_id, ids, None)]
    return await _generate(request, state, engine, body, "chat", response_id, jobs, params, echo=None,
                           reasoning_opened=opened, tool_parser=tools.new_parser if tools is not None else None, adapter=adapter)


def chat_prompt(state, engine, body: ChatCompletionRequest) -> tuple[list[int], object]:
    """(prompt ids, tool plan or None) as chat_completions renders them, tools included (blocking:
    call it off the event loop). /v1/messages/count_tokens counts these."""
    from quill.tools import ToolError, detect_parser, template_history

    template = getattr(engine.tokenizer, "chat_template", None)
    family = state.tool_parser or detect_parser(template)  # the request's tool-call format, decided once
    tools = plan_tools(body, family)
    messages, kwargs = template_messages(body.messages), template_kwargs(body)
    try:  # past calls' arguments as objects, and history in the family's own terms where its template has none
        messages = template_history(messages, template, family)
    except ToolError as exc:
        raise bad_request(str(exc), exc.param) from exc
    if tools is not None:
        messages, extra = tools.template_inputs(messages, template)
        kwargs = {**kwargs, **extra}
    return encode_chat(engine, messages, kwargs), tools


def reasoning_opened(state, engine, body: ChatCompletionRequest, ids: list[int]) -> bool | None:
    """None when this request's reasoning format is `none` (the text stays whole in content); else
    whether its prompt left the output inside a think block. The format: the request's
    reasoning_format, else `quill serve --reasoning-format`, else the model template's default."""
    from quill.reasoning import default_reasoning_format, prompt_ids_open_reasoning

    chosen = body.reasoning_format or state.reasoning_format
    if chosen is None:
        chosen = default_reasoning_format(getattr(engine.tokenizer, "chat_template", None))
    if chosen == "none":
        return None
    return prompt_ids_open_reasoning(engine.tokenizer.decode, ids)


async def completions(request: Request, body: CompletionRequest, state) -> Response:
    engine = state.require_engine()
    check_model(state, body.model)
    prompts = completion_prompts(engine, body.prompt)
    n = body.n or 1
    if len(prompts) * n > MAX_CHOICES:
        raise bad_request(f"prompt: {len(prompts)} prompts x n={n} is {len(prompts) * n} completions; the limit is {MAX_CHOICES}", "prompt")
    budgets = [resolve_max_tokens(body, len(ids), engine.max_model_len, COMPLETIONS_DEFAULT_MAX_TOKENS, "prompt") for ids, _ in prompts]
    if len(set(budgets)) > 1:  # one SamplingParams for the group: the tightest default wins
        budgets = [min(budgets)]
    params = to_sampling_params(body, budgets[0], engine.tokenizer.vocab_size)
    response_id = f"cmpl-{uuid.uuid4().hex}"
    jobs = [Job(response_id if len(prompts) == 1 else f"{response_id}-{i}", ids, text) for i, (ids, text) in enumerate(prompts)]
    echo = [text for _, text in prompts] if body.echo else None
    return await _generate(request, state, engine, body, "completion", response_id, jobs, params, echo=echo)


async def _generate(request, state, engine, body, kind, response_id, jobs, params, echo, reasoning_opened=None,
                    tool_parser=None, adapter=None) -> Response:
    """Run the jobs; answer one JSON body, or hand the group to an SSE response; `adapter` (default
    OpenAI's) shapes what goes out."""
    adapter = adapter or OPENAI
    acc = Accumulator(
        kind=kind,
        response_id=response_id,
        model=body.model or state.served_model_name,
        created=int(time.time()),
        n=params.n,
        num_prompts=len(jobs),
        names=TokenText(engine.tokenizer),
        echo=echo,
        include_usage=bool(body.stream and body.stream_options and body.stream_options.include_usage),
        reasoning_opened=reasoning_opened,
        tool_parser=tool_parser,
    )
    names = state.param_names(body)
    group = RequestGroup(engine, jobs, params, fault=request.headers.get(FAULT_HEADER))
    state.begin(group)
    closed = False

    async def close() -> None:
        nonlocal closed
        if not closed:
            closed = True
            try:
                await group.aclose()
            finally:
                state.end(group)

    handed_off = False  # once the SSE response owns the group, it closes it
    try:
        group.start()
        try:
            first = await until_disconnect(request.receive, group.next())
        except RequestFailed as exc:
            if not body.stream:
                raise
            # Admitted, then failed inside the engine before its first output: a stream still
            # answers 200 and carries the failure as an error event, as it would a moment later.
            handed_off = True
            return SSEResponse(_stream(acc, group, None, names, state, adapter, request.scope["path"], failed=exc), on_close=close)
        if first is DISCONNECTED:
            return Response(status_code=499)
        if body.stream:
            handed_off = True
            return SSEResponse(_stream(acc, group, first, names, state, adapter, request.scope["path"]), on_close=close)
        result = await until_disconnect(request.receive, _collect(acc, group, first))
        if result is DISCONNECTED:
            return Response(status_code=499)
        return JSONResponse(adapter.body(acc.response()))
    except Exception as exc:
        raise engine_error(exc, names, state.retry_after) from exc
    finally:
        if not handed_off:
            await close()


async def _collect(acc: Accumulator, group: RequestGroup, event) -> None:
    while event is not None:
        acc.update(*event)
        event = await group.next()


async def _stream(acc: Accumulator, group: RequestGroup, event, names: dict, state, adapter, path: str,
                  failed: Exception | None = None):
    """The stream's bytes: the accumulator's OpenAI chunks through `adapter`; `event` is the first
    output (None when the request failed before it); `path` picks the error body's shape."""
    prompt_tokens = sum(len(job.prompt_token_ids) for job in group.jobs)
    cached_tokens = (event[1].num_cached_tokens or 0) if event is not None else 0
    opening = adapter.start(acc.id, prompt_tokens, cached_tokens) + b"".join(map(adapter.chunk, acc.opening_chunks()))
    if opening:  # an adapter may have nothing to say yet (an empty write is no SSE event)
        yield opening
    try:
        if failed is not None:
            raise failed
        while event is not None:
            step = b"".join(map(adapter.chunk, acc.chunks(*event)))
            if step:
                yield step
            event = await group.next()
    except Exception as exc:  # mid-stream: headers are gone, so the error travels as an event
        try:
            err = engine_error(exc, names, state.retry_after)
        except Exception:
            logger.exception("engine failed mid-stream")
            err = APIError(500, f"internal server error: {type(exc).__name__}", code="internal_error")
        state.metrics.count_error(err.status, err.code)
        yield adapter.error(error_body_for(err, path))
        return
    closing = acc.closing_chunk()
    yield (adapter.chunk(closing) if closing is not None else b"") + adapter.end()
