"""The storm behind `quill bench soak`: workers sending healthy, abandoned, bad and fault-injected
chat requests for a bounded time, each request ending in exactly one classified Outcome."""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from dataclasses import asdict, dataclass, field

import httpx

from quill.bench.soak_cases import BAD_CASES, FAULT_HEADER, GUIDED_ITEM, PoolItem, bad_body, healthy_body

KINDS = ("healthy", "disconnect", "bad", "faulty")

# How a request ended. Expected ones: completed, disconnected, rejected (bad only), accepted (bad
# only, noted), fault_reported (faulty only). Failures: mismatch, server_error, refused, lost.
OUTCOMES = ("completed", "mismatch", "disconnected", "rejected", "accepted", "fault_reported",
            "server_error", "refused", "lost")

# The fault phases a quill server knows (quill.engine.faults.FAULT_PHASES); other servers ignore the header.
DEFAULT_FAULT_PHASES = ("queued", "prefill", "forward", "decode", "sample", "grammar", "detokenize", "stop")


def fault_phases() -> tuple[str, ...]:
    try:
        from quill.engine.faults import FAULT_PHASES
    except ImportError:  # an older checkout without fault injection
        return DEFAULT_FAULT_PHASES
    return tuple(FAULT_PHASES)


@dataclass(frozen=True)
class SoakConfig:
    base_url: str
    duration_s: float
    concurrency: int
    disconnect: float  # fractions of all requests; healthy is what is left
    bad_input: float
    faulty: float
    max_tokens: int = 24
    seed: int = 0
    model: str | None = None  # None: the first id of GET /v1/models
    api_key: str | None = None
    request_timeout_s: float = 120.0  # a request still unanswered after this is lost
    settle_s: float = 10.0  # after the storm, how long the server may take to become idle
    rss_growth_limit: float = 0.05
    warmup_s: float = 0.0  # a storm of the same mix before the RSS baseline; its requests are checked too

    def validate(self) -> None:
        for name in ("disconnect", "bad_input", "faulty"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"--{name.replace('_', '-')} must be a fraction in [0, 1], got {value}")
        if self.disconnect + self.bad_input + self.faulty > 1.0 + 1e-9:
            raise ValueError("--disconnect + --bad-input + --faulty must be at most 1 "
                             f"(got {self.disconnect + self.bad_input + self.faulty:g}); the rest are healthy requests")
        if not self.duration_s > 0 or self.concurrency < 1 or self.max_tokens < 1:
            raise ValueError("--duration, --concurrency and --max-tokens must be positive")
        if not self.warmup_s >= 0:
            raise ValueError(f"--warmup must be at least 0 seconds, got {self.warmup_s}")


@dataclass
class Outcome:
    """One request of the storm, as the client saw it."""

    kind: str  # healthy | disconnect | bad | faulty
    case: str  # pool item, bad case, or "phase/pool item" for faulty
    stream: bool
    outcome: str = "lost"
    status: int | None = None
    detail: str | None = None
    start_s: float = 0.0  # seconds after the storm began
    seconds: float = 0.0
    chunks: int = 0  # content chunks read (streams)
    warmup: bool = False  # sent during the warm-up, before the RSS baseline


@dataclass
class Reply:
    """What came back for one request, before classification."""

    status: int | None = None
    text: str = ""
    chunks: int = 0
    done: bool = False  # [DONE] seen (streams) or a complete JSON body (non-streaming)
    error_event: str | None = None  # an SSE {"error": ...} payload's message
    cut: bool = False  # we hung up on purpose
    failure: str | None = None  # transport error, timeout, unparsable answer
    body: str = ""  # start of a non-200 body


def event_text(event: dict) -> str:
    return "".join((choice.get("delta") or {}).get("content") or "" for choice in event.get("choices") or []
                   if choice.get("index", 0) == 0)


def error_message(error) -> str:
    if isinstance(error, dict):
        return str(error.get("message") or error)
    return str(error)


async def read_sse(response: httpx.Response, reply: Reply, cut_after_chunks: int | None) -> None:
    """Fill reply from an SSE body; hang up after `cut_after_chunks` content chunks (None: never)."""
    if cut_after_chunks == 0:
        reply.cut = True
        return
    async for line in response.aiter_lines():
        if not line.startswith("data:"):
            continue
        payload = line[len("data:"):].strip()
        if payload == "[DONE]":
            reply.done = True
            return
        try:
            event = json.loads(payload)
        except json.JSONDecodeError:
            reply.failure = f"unparsable SSE event {payload[:80]!r}"
            return
        if not isinstance(event, dict):
            reply.failure = f"SSE event is not an object: {payload[:80]!r}"
            return
        if event.get("error") is not None:
            reply.error_event = error_message(event["error"])
            continue  # a well-behaved server still ends the stream with [DONE]
        text = event_text(event)
        if text:
            reply.text += text
            reply.chunks += 1
            if cut_after_chunks is not None and reply.chunks >= cut_after_chunks:
                reply.cut = True
                return
    if not reply.done and reply.failure is None:
        reply.failure = "stream ended before [DONE]"


async def send(client: httpx.AsyncClient, content: bytes, stream: bool, headers: dict,
               cut_after_chunks: int | None, reply: Reply) -> None:
    """POST /v1/chat/completions and fill reply; transport errors land in reply.failure."""
    try:
        async with client.stream("POST", "/v1/chat/completions", content=content,
                                 headers={"Content-Type": "application/json", **headers}) as response:
            reply.status = response.status_code
            if response.status_code != 200:
                reply.body = (await response.aread()).decode(errors="replace")[:300]
            elif stream:
                await read_sse(response, reply, cut_after_chunks)
            elif cut_after_chunks == 0:
                reply.cut = True
            else:
                raw = await response.aread()
                try:
                    data = json.loads(raw)
                    reply.text = data["choices"][0]["message"].get("content") or ""
                    reply.done = True
                except (json.JSONDecodeError, KeyError, IndexError, TypeError, AttributeError):
                    reply.failure = f"unparsable JSON answer {raw[:80]!r}"
    except (httpx.HTTPError, OSError) as exc:
        reply.failure = f"{type(exc).__name__}: {exc}"


async def timed_send(client, content: bytes, stream: bool, headers: dict, cut_after_chunks: int | None,
                     cut_after_s: float | None, timeout_s: float) -> Reply:
    """send() under a hang-up time (on purpose) and a deadline (past it the request is lost)."""
    reply = Reply()
    limit = timeout_s if cut_after_s is None else min(cut_after_s, timeout_s)
    try:
        await asyncio.wait_for(send(client, content, stream, headers, cut_after_chunks, reply), limit)
    except (asyncio.TimeoutError, TimeoutError):
        if cut_after_s is not None and cut_after_s < timeout_s:
            reply.cut = True
        else:
            reply.failure = f"no answer within {timeout_s:g} s"
    return reply


def classify(kind: str, reply: Reply, expected: str | None) -> tuple[str, str | None]:
    """(outcome, detail) of one reply; `expected` is the reference text of a pool item."""
    status = reply.status
    if status is not None and status >= 500:
        return "server_error", f"HTTP {status}: {reply.body[:200]}"
    if status is not None and 400 <= status < 500:
        if kind == "bad":
            return "rejected", f"HTTP {status}"
        return "refused", f"HTTP {status}: {reply.body[:200]}"
    if status is not None and status != 200:
        return "lost", f"HTTP {status}: {reply.body[:200]}"
    if kind == "bad" and status == 200:
        return "accepted", "HTTP 200"
    if reply.error_event is not None:
        if kind == "faulty" and reply.done:
            return "fault_reported", reply.error_event[:200]
        if kind != "faulty":
            return "server_error", f"SSE error event: {reply.error_event[:200]}"
    if reply.failure is not None:
        return "lost", reply.failure
    if reply.cut:
        return "disconnected", f"after {reply.chunks} chunks" if status else "before the response headers"
    if not reply.done:
        return "lost", "no answer"
    if expected is not None and reply.text != expected:
        return "mismatch", f"expected {expected[:80]!r}, got {reply.text[:80]!r}"
    return "completed", None


@dataclass
class Storm:
    """The storm's state: what to send and every outcome so far."""

    config: SoakConfig
    model: str
    context: int  # tokens; sizes the over-the-context prompt
    pool: list[PoolItem]
    references: dict[str, str]
    outcomes: list[Outcome] = field(default_factory=list)
    phases: tuple[str, ...] = field(default_factory=fault_phases)

    def draw_kind(self, rng: random.Random) -> str:
        x = rng.random()
        for kind, fraction in (("bad", self.config.bad_input), ("faulty", self.config.faulty),
                               ("disconnect", self.config.disconnect)):
            if x < fraction:
                return kind
            x -= fraction
        return "healthy"

    async def one(self, client: httpx.AsyncClient, rng: random.Random, origin: float) -> Outcome:
        """Draw, send and classify one request."""
        cfg = self.config
        kind = self.draw_kind(rng)
        item = rng.choice(self.pool)
        headers: dict = {}
        cut_chunks: int | None = None
        cut_s: float | None = None
        expected: str | None = self.references[item.name]
        case = item.name
        if kind == "bad":
            bad = rng.choice(BAD_CASES)
            stream = bad.can_stream and rng.random() < 0.5
            content = bad_body(bad, self.model, cfg.max_tokens, self.context, stream)
            cut_chunks = 0  # should a server accept it, do not wait for what it generates
            case, expected = bad.name, None
        else:
            stream = kind in ("disconnect", "faulty") or rng.random() < 0.75
            body = healthy_body(item, self.model, cfg.max_tokens, stream, include_usage=rng.random() < 0.5)
            if kind == "faulty":
                phase = rng.choice(self.phases)
                guided = [p for p in self.pool if p.name == GUIDED_ITEM]
                if phase == "grammar" and guided:  # reached only by a constrained request
                    item, expected = guided[0], self.references[GUIDED_ITEM]
                    body = healthy_body(item, self.model, cfg.max_tokens, stream, include_usage=rng.random() < 0.5)
                headers[FAULT_HEADER] = phase
                case = f"{phase}/{item.name}"
            elif kind == "disconnect":
                if rng.random() < 0.25:
                    cut_s = rng.uniform(0.0, 1.0)  # may land before the headers: in the queue or prefill
                else:
                    cut_chunks = rng.randint(0, max(cfg.max_tokens - 1, 1))
            content = json.dumps(body).encode()
        start = time.perf_counter()
        reply = await timed_send(client, content, stream, headers, cut_chunks, cut_s, cfg.request_timeout_s)
        outcome, detail = classify(kind, reply, expected)
        return Outcome(kind, case, stream, outcome, reply.status, detail, round(start - origin, 3),
                       round(time.perf_counter() - start, 3), reply.chunks)

    async def run(self, client: httpx.AsyncClient, on_outcome=None, *, warmup: bool = False) -> float:
        """Every worker loops until the duration (or the warm-up) is over, the request in flight
        finishing; seconds taken. Warm-up workers draw from their own random streams."""
        origin = time.perf_counter()
        deadline = origin + (self.config.warmup_s if warmup else self.config.duration_s)

        async def worker(index: int) -> None:
            rng = random.Random(f"{self.config.seed}-{'warmup-' if warmup else ''}{index}")
            while time.perf_counter() < deadline:
                outcome = await self.one(client, rng, origin)
                outcome.warmup = warmup
                self.outcomes.append(outcome)
                if on_outcome is not None:
                    on_outcome(outcome)

        await asyncio.gather(*(worker(i) for i in range(self.config.concurrency)))
        return time.perf_counter() - origin


async def reference_texts(client: httpx.AsyncClient, model: str, pool: list[PoolItem], max_tokens: int,
                          timeout_s: float) -> tuple[dict[str, str], dict[str, str]]:
    """Each pool item run alone, one after another: the text every storm reply must equal.

    Returns (references, skipped): an optional item the server refuses with a 4xx (a server
    without guided decoding) is skipped, with the reason; any other failure raises RuntimeError."""
    references, skipped = {}, {}
    for item in pool:
        content = json.dumps(healthy_body(item, model, max_tokens, stream=True)).encode()
        reply = await timed_send(client, content, True, {}, None, None, timeout_s)
        outcome, detail = classify("healthy", reply, None)
        if outcome == "refused" and item.optional:
            skipped[item.name] = detail or "refused"
        elif outcome != "completed":
            raise RuntimeError(f"reference request {item.name!r} failed alone ({outcome}: {detail})")
        else:
            references[item.name] = reply.text
    return references, skipped


# ---- the server's own gauges (quill's GET /v1/stats) ----------------------------------------------

GAUGES = ("running", "waiting", "kv_blocks_used", "kv_blocks_total", "kv_blocks_cached", "process_rss_bytes")


async def read_gauges(client: httpx.AsyncClient) -> dict | None:
    """running, waiting, KV blocks and RSS from GET /v1/stats; None where the server has no such page."""
    try:
        response = await client.get("/v1/stats")
        if response.status_code != 200:
            return None
        data = response.json()
    except (httpx.HTTPError, OSError, ValueError):
        return None
    if not isinstance(data, dict):
        return None
    engine = data.get("engine") if isinstance(data.get("engine"), dict) else data
    gauges = {name: engine.get(name) for name in GAUGES}
    gauges["in_flight"] = data.get("in_flight")
    gauges["max_model_len"] = data.get("max_model_len")
    if all(gauges[name] is None for name in GAUGES):
        return None
    return gauges


async def wait_idle(client: httpx.AsyncClient, settle_s: float) -> tuple[dict | None, bool, float]:
    """Poll /v1/stats until running == waiting == 0 (at most settle_s): (gauges, idle, seconds waited)."""
    start = time.perf_counter()
    while True:
        gauges = await read_gauges(client)
        idle = gauges is not None and gauges.get("running") == 0 and gauges.get("waiting") == 0
        waited = time.perf_counter() - start
        if gauges is None or idle or waited >= settle_s:
            return gauges, idle, waited
        await asyncio.sleep(0.1)


def tally(outcomes: list[Outcome]) -> dict:
    """Counts by kind and outcome, and samples of everything that went wrong."""
    by_kind = {kind: dict(Counter(o.outcome for o in outcomes if o.kind == kind)) for kind in KINDS}
    sent = {kind: sum(1 for o in outcomes if o.kind == kind) for kind in KINDS}
    streams = {kind: sum(1 for o in outcomes if o.kind == kind and o.stream) for kind in KINDS}
    count = Counter(o.outcome for o in outcomes)

    def samples(name: str, limit: int = 20) -> list[dict]:
        return [asdict(o) for o in outcomes if o.outcome == name][:limit]

    return {
        "sent": sent, "streaming": streams, "total": len(outcomes), "outcomes": by_kind,
        "completed": count["completed"], "mismatches": count["mismatch"], "server_errors": count["server_error"],
        "refused": count["refused"], "lost": count["lost"], "disconnected": count["disconnected"],
        "bad_rejected": count["rejected"], "bad_accepted": count["accepted"], "faults_reported": count["fault_reported"],
        "server_error_samples": samples("server_error"), "mismatch_samples": samples("mismatch"),
        "lost_samples": samples("lost"), "refused_samples": samples("refused"),
        "accepted_cases": sorted({o.case for o in outcomes if o.outcome == "accepted"}),
        "faulty_by_phase": {phase: dict(Counter(o.outcome for o in outcomes
                                                if o.kind == "faulty" and o.case.split("/")[0] == phase))
                            for phase in sorted({o.case.split("/")[0] for o in outcomes if o.kind == "faulty"})},
    }
