"""Streaming OpenAI chat client for benchmarks: one request in, its timings (RequestResult) out."""

from __future__ import annotations

import ipaddress
import json
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import httpx


@dataclass
class RequestResult:
    """Client-side timings of one streamed request (perf_counter seconds)."""

    index: int
    arrival: float  # when the workload wanted it sent (Poisson arrivals) or when a slot freed up
    send: float = 0.0  # when the POST actually went out; latencies are measured from here
    chunk_times: list[float] = field(default_factory=list)  # each chunk carrying content or reasoning
    end: float = 0.0  # stream closed
    output_tokens: int = 0  # usage.completion_tokens when the server sends it, else content chunks
    prompt_tokens: int | None = None
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens: prompt tokens from the prefix cache
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.chunk_times)

    @property
    def ttft(self) -> float | None:
        return self.chunk_times[0] - self.send if self.chunk_times else None

    @property
    def e2e(self) -> float | None:
        return self.chunk_times[-1] - self.send if self.chunk_times else None

    @property
    def itl(self) -> list[float]:
        times = self.chunk_times
        return [later - earlier for earlier, later in zip(times, times[1:])]

    @property
    def tpot(self) -> float | None:
        """(E2E - TTFT) / (output tokens - 1); undefined for a single token."""
        if not self.chunk_times or self.output_tokens < 2:
            return None
        return (self.chunk_times[-1] - self.chunk_times[0]) / (self.output_tokens - 1)

    def to_dict(self, origin: float) -> dict:
        """JSON figures in ms; arrival and send in seconds after origin (the level start)."""
        def ms(seconds: float | None) -> float | None:
            return None if seconds is None else round(seconds * 1000, 3)

        return {
            "index": self.index, "ok": self.ok, "error": self.error,
            "arrival_s": round(self.arrival - origin, 6), "send_s": round(self.send - origin, 6),
            "ttft_ms": ms(self.ttft), "tpot_ms": ms(self.tpot), "e2e_ms": ms(self.e2e),
            "output_tokens": self.output_tokens, "prompt_tokens": self.prompt_tokens, "cached_tokens": self.cached_tokens,
            "itl_ms": [ms(gap) for gap in self.itl],
        }


def normalize_base_url(url: str) -> str:
    """'http://host:8000/v1/' and 'http://host:8000' both become 'http://host:8000'."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"--base-url must look like http://host:port, got {url!r}")
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


def is_loopback(url: str) -> bool:
    host = urlsplit(url).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def make_client(base_url: str, api_key: str | None, timeout_s: float) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    return httpx.AsyncClient(
        base_url=base_url,
        headers=headers,
        timeout=httpx.Timeout(timeout_s, connect=min(timeout_s, 10.0)),
        limits=httpx.Limits(max_connections=None, max_keepalive_connections=None),
        # A proxy between the bench and a local server would be measured too.
        trust_env=not is_loopback(base_url),
    )


async def first_model_id(client: httpx.AsyncClient) -> str:
    """The first id listed by GET /v1/models."""
    response = await client.get("/v1/models")
    response.raise_for_status()
    models = response.json().get("data") or []
    if not models:
        raise ValueError(f"{client.base_url}/v1/models lists no models (still loading?); pass --model or retry")
    return models[0]["id"]


def handle_event(result: RequestResult, payload: str, received: float) -> bool:
    """Apply one SSE data payload; True once the stream says [DONE]."""
    if payload == "[DONE]":
        return True
    event = json.loads(payload)
    if event.get("error"):
        error = event["error"]
        result.error = "server error: " + str(error.get("message", error) if isinstance(error, dict) else error)
        return True
    # A chunk carrying several tokens is still one arrival: the client saw them at the same instant.
    # A reasoning model's thinking (delta.reasoning_content) is output too: TTFT is its first token.
    if any((choice.get("delta") or {}).get("content") or (choice.get("delta") or {}).get("reasoning_content")
           for choice in event.get("choices") or []):
        result.chunk_times.append(received)
    usage = event.get("usage")
    if usage:
        result.output_tokens = usage.get("completion_tokens", result.output_tokens)
        result.prompt_tokens = usage.get("prompt_tokens", result.prompt_tokens)
        details = usage.get("prompt_tokens_details") or {}
        result.cached_tokens = details.get("cached_tokens", result.cached_tokens)
    return False


async def read_stream(response: httpx.Response, result: RequestResult) -> None:
    done = False
    async for line in response.aiter_lines():
        received = time.perf_counter()
        if not line.startswith("data:"):
            continue  # blank separators, comments and event names
        done = handle_event(result, line[len("data:"):].strip(), received)
        if done:
            break
    if not done and result.error is None:
        result.error = "stream ended before [DONE]"
    if result.output_tokens == 0:  # no usage chunk: count content chunks instead
        result.output_tokens = len(result.chunk_times)


async def stream_chat(client: httpx.AsyncClient, body: dict, result: RequestResult) -> RequestResult:
    """POST a streaming chat completion and fill result's timings; errors land in result.error."""
    result.send = time.perf_counter()
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                result.error = f"HTTP {response.status_code}: {text[:200]}"
            else:
                await read_stream(response, result)
    except (httpx.HTTPError, json.JSONDecodeError, OSError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    result.end = time.perf_counter()
    if result.error is None and not result.chunk_times:
        result.error = "no content tokens in the stream"
    return result
