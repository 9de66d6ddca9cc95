"""Response pieces in OpenAI's shapes: usage, llama-server-style timings, logprobs, SSE, the
OpenAI adapter."""

from __future__ import annotations

import json


def sse(data: dict | str) -> bytes:
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"), ensure_ascii=False)
    return f"data: {payload}\n\n".encode()


class OpenAIAdapter:
    """What goes out of chat and text completions: the accumulator's OpenAI bodies as they are.

    An adapter turns the final OpenAI response into the body to send (`body`) and a stream's
    pieces into SSE bytes: `start` once before the first chunk (the response id, the prompt's
    tokens and how many of them came from the prefix cache), `chunk` for each OpenAI chunk,
    then either `error` (an error body already in the request's shape, errors.error_body_for)
    or `end`. Empty bytes mean nothing to send. quill.server.anthropic.AnthropicAdapter is the
    other one; handlers.chat_completions takes either.
    """

    def body(self, response: dict) -> dict:
        return response

    def start(self, response_id: str, prompt_tokens: int, cached_tokens: int) -> bytes:
        return b""

    def chunk(self, chunk: dict) -> bytes:
        return sse(chunk)

    def error(self, body: dict) -> bytes:
        return sse(body) + sse("[DONE]")

    def end(self) -> bytes:
        return sse("[DONE]")


OPENAI = OpenAIAdapter()


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int, reasoning_tokens: int | None = None) -> dict:
    """OpenAI's usage object; completion_tokens_details.reasoning_tokens only where reasoning is
    parsed (reasoning_format deepseek), as vLLM reports it only with a reasoning parser."""
    body = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }
    if reasoning_tokens is not None:
        body["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
    return body


def _round(x: float | None, digits: int = 3) -> float | None:
    return None if x is None else round(x, digits)


def timings(per_prompt: list[list[dict]]) -> dict:
    """llama-server's `timings` for a request: one metrics dict per completion, grouped by prompt.

    With one completion this is that completion's figures. With several (n > 1, or a list of
    prompts), token counts add up, times are the request's span (max), and
    predicted_per_second = sum(output tokens - 1) / the longest generation time, which for a
    single completion equals DESIGN.md's generation tok/s.
    """
    firsts = [group[0] for group in per_prompt if group]
    every = [m for group in per_prompt for m in group]
    prompt_total = sum(m.get("prompt_tokens") or 0 for m in firsts)
    cache_n = sum(m.get("cached_tokens") or 0 for m in firsts)
    prompt_n = prompt_total - cache_n
    prompt_ms = _max(m.get("prefill_ms") for m in firsts)
    predicted_n = sum(m.get("output_tokens") or 0 for m in every)
    spans = [m["e2e_ms"] - m["ttft_ms"] for m in every if m.get("e2e_ms") is not None and m.get("ttft_ms") is not None]
    predicted_ms = max(spans) if spans else None
    steps = sum(max((m.get("output_tokens") or 0) - 1, 0) for m in every)
    tpots = [m["tpot_ms"] for m in every if m.get("tpot_ms") is not None]
    return {
        "prompt_n": prompt_n,
        "cache_n": cache_n,
        "prompt_ms": _round(prompt_ms),
        "prompt_per_second": _round(prompt_n / prompt_ms * 1000.0, 2) if prompt_ms else None,
        "predicted_n": predicted_n,
        "predicted_ms": _round(predicted_ms),
        "predicted_per_second": _round(steps / predicted_ms * 1000.0, 2) if predicted_ms else None,
        "ttft_ms": _round(_min(m.get("ttft_ms") for m in every)),
        "tpot_ms": _round(sum(tpots) / len(tpots)) if tpots else None,
        "queue_ms": _round(_min(m.get("queue_ms") for m in every)),
        "e2e_ms": _round(_max(m.get("e2e_ms") for m in every)),
        # speculative decoding, as llama-server names them: proposed tokens verified, and of those kept
        "draft_n": sum(m.get("spec_proposed_tokens") or 0 for m in every),
        "draft_n_accepted": sum(m.get("spec_accepted_tokens") or 0 for m in every),
    }


def _max(values) -> float | None:
    present = [v for v in values if v is not None]
    return max(present) if present else None


def _min(values) -> float | None:
    present = [v for v in values if v is not None]
    return min(present) if present else None


class TokenText:
    """Token id -> display text and bytes, cached (logprobs name every token they list)."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def text(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._tokenizer.decode([token_id])
            self._cache[token_id] = text
        return text

    def decode(self, token_ids: list[int]) -> str:
        return self._tokenizer.decode(token_ids)

    def entry(self, token_id: int, logprob: float) -> dict:
        text = self.text(token_id)
        return {"token": text, "logprob": _logprob(logprob), "bytes": list(text.encode("utf-8"))}


def _logprob(value: float) -> float:
    # -inf is not JSON; OpenAI clients expect a number.
    return max(float(value), -9999.0)


def chat_logprobs(entries: list[dict], names: TokenText) -> dict:
    """Engine logprob entries -> OpenAI chat `logprobs` ({"content": [...]})."""
    content = []
    for e in entries:
        item = names.entry(e["token_id"], e["logprob"])
        item["top_logprobs"] = [names.entry(tid, lp) for tid, lp in e.get("top") or ()]
        content.append(item)
    return {"content": content, "refusal": None}


def completion_logprobs(entries: list[dict], names: TokenText, text_offset: int) -> dict:
    """Engine logprob entries -> OpenAI completions `logprobs` (tokens, token_logprobs, ...)."""
    tokens, token_logprobs, top, offsets = [], [], [], []
    offset = text_offset
    for e in entries:
        text = names.text(e["token_id"])
        tokens.append(text)
        token_logprobs.append(_logprob(e["logprob"]))
        top.append({names.text(tid): _logprob(lp) for tid, lp in e.get("top") or ()})
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}
