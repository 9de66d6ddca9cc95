"""Load generator for `quill bench serve`: closed-loop concurrency levels or Poisson arrivals."""

from __future__ import annotations

import asyncio
import random
import sys
import time
from dataclasses import asdict, dataclass
from typing import Callable

import httpx

from quill.bench import report
from quill.bench.client import RequestResult, first_model_id, make_client, stream_chat
from quill.bench.stats import Slo, ratios, summarize_level
from quill.bench.workloads import BenchRequest, build_workload


@dataclass(frozen=True)
class ServeBenchConfig:
    """What to send, where, and at which load levels."""

    base_url: str
    workload: str = "chat-shared-prefix"
    concurrency: tuple[int, ...] | None = (1,)
    request_rates: tuple[float, ...] | None = None  # Poisson arrivals; replaces concurrency
    num_requests: int = 100
    max_tokens: int = 128
    slo: Slo = Slo()
    seed: int = 0
    temperature: float = 0.0
    ignore_eos: bool = True
    timeout_s: float = 600.0
    random_words: tuple[int, int] = (32, 256)
    model: str | None = None  # None: the first id of GET /v1/models
    api_key: str | None = None
    vs_url: str | None = None
    vs_model: str | None = None
    warmup_requests: int = 1  # sent first, never counted: cold start stays out of warm latencies
    progress: bool = True

    @property
    def mode(self) -> str:
        return "request_rate" if self.request_rates else "concurrency"

    @property
    def levels(self) -> tuple[float, ...]:
        return self.request_rates if self.request_rates else self.concurrency


def request_body(request: BenchRequest, model: str, config: ServeBenchConfig, index: int) -> dict:
    body = {
        "model": model,
        "messages": list(request.messages),
        "max_tokens": request.max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": config.temperature,
    }
    if config.ignore_eos:
        body["ignore_eos"] = True  # fixed output lengths make levels comparable
    if config.temperature > 0:
        body["seed"] = config.seed + index
    return body


def poisson_arrivals(num_requests: int, rate: float, seed: int) -> list[float]:
    """Seconds after the level start at which each request arrives (exponential gaps)."""
    if rate == float("inf"):
        return [0.0] * num_requests
    rng = random.Random(seed)
    arrivals, now = [], 0.0
    for _ in range(num_requests):
        arrivals.append(now)
        now += rng.expovariate(rate)
    return arrivals


def progress_bar(total: int, desc: str, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, file=sys.stderr, disable=not enabled, leave=False)


async def run_closed_loop(client, bodies: list[dict], concurrency: int, bar) -> list[RequestResult]:
    """Keep `concurrency` requests in flight until every body has been sent and answered."""
    queue = list(range(len(bodies)))[::-1]
    results: list[RequestResult] = [None] * len(bodies)  # type: ignore[list-item]

    async def worker() -> None:
        while queue:
            index = queue.pop()
            results[index] = await stream_chat(client, bodies[index], RequestResult(index, time.perf_counter()))
            bar.update(1)

    await asyncio.gather(*(worker() for _ in range(min(concurrency, len(bodies)))))
    return results


async def run_open_loop(client, bodies: list[dict], rate: float, seed: int, bar) -> list[RequestResult]:
    """Send each body at its Poisson arrival time regardless of how many are still running."""
    start = time.perf_counter()

    async def one(index: int, offset: float) -> RequestResult:
        await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
        result = await stream_chat(client, bodies[index], RequestResult(index, start + offset))
        bar.update(1)
        return result

    arrivals = poisson_arrivals(len(bodies), rate, seed)
    return list(await asyncio.gather(*(one(i, offset) for i, offset in enumerate(arrivals))))


async def run_level(server: dict, config: ServeBenchConfig, level: float) -> dict:
    bodies = [request_body(req, server["model"], config, i) for i, req in enumerate(server["workload"])]
    desc = f"{server['label']} {report.level_name(config.mode, level)}"
    with progress_bar(len(bodies), desc, config.progress) as bar:
        start = time.perf_counter()
        if config.mode == "concurrency":
            results = await run_closed_loop(server["client"], bodies, int(level), bar)
        else:
            results = await run_open_loop(server["client"], bodies, level, config.seed, bar)
        end = time.perf_counter()
    return summarize_level(results, start, end, level, config.mode, config.slo)


async def open_server(label: str, base_url: str, model: str | None, config: ServeBenchConfig,
                      workload: list[BenchRequest]) -> dict:
    client = make_client(base_url, config.api_key, config.timeout_s)
    try:
        model = model or await first_model_id(client)
    except httpx.HTTPError as exc:
        await client.aclose()
        raise ConnectionError(f"cannot list models at {base_url}/v1/models ({type(exc).__name__}: {exc}); "
                              "is the server up? (--model skips this call)") from None
    except Exception:
        await client.aclose()
        raise
    return {"label": label, "base_url": base_url, "model": model, "client": client, "workload": workload,
            "levels": [], "warmup_errors": await warm_up(client, model, config)}


async def warm_up(client, model: str, config: ServeBenchConfig) -> list[str]:
    """Short requests outside the workload (so no workload prompt gets cached); returns their errors."""
    errors = []
    for index in range(config.warmup_requests):
        request = BenchRequest(({"role": "user", "content": f"Warm-up {index}: say hello."},), min(config.max_tokens, 8))
        result = await stream_chat(client, request_body(request, model, config, index), RequestResult(-1, 0.0))
        if result.error:
            print(f"warning: warm-up request to {client.base_url} failed: {result.error}", file=sys.stderr)
            errors.append(result.error)
    return errors


async def bench(config: ServeBenchConfig, on_level: Callable[[str, dict], None] | None = None) -> dict:
    """Run every level on A (and B, interleaved A1 B1 A2 B2 ...); returns the JSON-ready report."""
    targets = [("A", config.base_url, config.model)]
    if config.vs_url:
        targets.append(("B", config.vs_url, config.vs_model))
    # Built before connecting so a bad workload file fails fast; both servers get the same requests.
    workload = build_workload(config.workload, config.num_requests, config.max_tokens, config.seed, config.random_words)
    servers: list[dict] = []
    try:
        for label, url, model in targets:
            servers.append(await open_server(label, url, model, config, workload))
        for level in config.levels:
            for server in servers:
                summary = await run_level(server, config, level)
                server["levels"].append(summary)
                if on_level:
                    on_level(server["label"], summary)
    finally:
        for server in servers:
            await server["client"].aclose()
    public = [{k: v for k, v in s.items() if k not in ("client", "workload")} for s in servers]
    out = {"config": config_dict(config), "mode": config.mode, "servers": public}
    if len(public) == 2:
        out["ratios"] = [{"level": a["level"], "ratios": ratios(a, b)}
                         for a, b in zip(public[0]["levels"], public[1]["levels"])]
    return out


def config_dict(config: ServeBenchConfig) -> dict:
    data = asdict(config)
    data["api_key"] = "***" if config.api_key else None  # never write secrets into result files
    data.pop("progress")
    return data
