"""`quill bench serve` against an in-process mock OpenAI streaming server with known delays."""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import multiprocessing
import time

import httpx
import numpy as np
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from quill.bench import serve
from quill.bench.client import RequestResult, handle_event, normalize_base_url
from quill.bench.loadgen import poisson_arrivals
from quill.bench.stats import Slo, distribution, ratios, summarize_level
from quill.bench.workloads import build_workload

FIRST_S = 0.100  # first content chunk this long after the request
GAP_S = 0.020  # then one chunk every GAP_S
NUM_CHUNKS = 5
TOL_MS = 5.0  # means and medians
# Tails (p90/p99 of 4 samples is nearly the max) and single requests catch one late wake-up
# of either process on a loaded 2-core machine; 5 ms failed about one run in ten there.
TAIL_TOL_MS = 10.0


class MockState:
    """What the mock server does and what it saw (lives in the server process)."""

    def __init__(self, label: str):
        self.label = label
        self.reset(0)

    def reset(self, fail_every: int) -> None:
        self.fail_every = fail_every
        self.count = 0
        self.bodies: list[dict] = []
        # time.monotonic() (CLOCK_MONOTONIC, as the client's perf_counter) so the processes compare.
        self.received: list[float] = []
        self.chunk_times: list[list[float]] = []  # when each content chunk was handed to the socket


def sse(obj) -> str:
    return f"data: {json.dumps(obj)}\n\n"


async def sleep_until(deadline: float) -> None:
    await asyncio.sleep(max(0.0, deadline - time.perf_counter()))


def make_app(state: MockState) -> Starlette:
    async def models(request: Request):
        return JSONResponse({"object": "list", "data": [{"id": f"mock-{state.label}", "object": "model"}]})

    async def control(request: Request):
        if request.method == "POST":
            state.reset((await request.json()).get("fail_every", 0))
        return JSONResponse({"count": state.count, "bodies": state.bodies, "received": state.received,
                             "chunk_times": state.chunk_times})

    async def chat(request: Request):
        start = time.perf_counter()
        state.received.append(time.monotonic())
        body = await request.json()
        state.count += 1
        state.bodies.append(body)
        sent: list[float] = []
        state.chunk_times.append(sent)
        if state.fail_every and state.count % state.fail_every == 0:
            return JSONResponse({"error": {"message": "mock failure"}}, status_code=500)

        async def events():
            yield sse({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
            for i in range(NUM_CHUNKS):
                # Absolute deadlines so scheduling jitter does not accumulate.
                await sleep_until(start + FIRST_S + i * GAP_S)
                sent.append(time.monotonic())
                yield sse({"choices": [{"index": 0, "delta": {"content": f" tok{i}"}}]})
            yield sse({"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]})
            yield sse({"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": NUM_CHUNKS}})
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return Starlette(routes=[
        Route("/v1/models", models),
        Route("/v1/chat/completions", chat, methods=["POST"]),
        Route("/mock", control, methods=["GET", "POST"]),
    ])


def serve_mock(label: str, sock: socket.socket) -> None:
    server = uvicorn.Server(uvicorn.Config(make_app(MockState(label)), log_level="warning", lifespan="off"))
    server.run(sockets=[sock])


class Mock:
    """Handle on a mock server running in its own process (no GIL shared with the client)."""

    def __init__(self, label: str):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        # fork: the child inherits the bound socket and this module without re-importing it.
        self.process = multiprocessing.get_context("fork").Process(target=serve_mock, args=(label, self.sock), daemon=True)
        self.process.start()
        deadline = time.time() + 20
        while True:
            try:
                httpx.get(self.url + "/v1/models", timeout=1).raise_for_status()
                break
            except httpx.HTTPError:
                assert time.time() < deadline, "mock server did not start"
                time.sleep(0.05)

    def reset(self, fail_every: int = 0) -> None:
        httpx.post(self.url + "/mock", json={"fail_every": fail_every}).raise_for_status()

    def seen(self) -> dict:
        return httpx.get(self.url + "/mock").json()

    def close(self) -> None:
        self.process.terminate()
        self.process.join(timeout=10)
        self.sock.close()


@pytest.fixture(scope="module")
def mock_servers():
    mocks = {label: Mock(label) for label in ("A", "B")}
    yield mocks
    for mock in mocks.values():
        mock.close()


@pytest.fixture
def servers(mock_servers):
    for mock in mock_servers.values():
        mock.reset()
    return mock_servers


def run_cli(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="quill bench")
    serve.register(parser.add_subparsers())
    args = parser.parse_args(["serve", "--no-progress", *(argv if "--warmup" in argv else ("--warmup", "0", *argv))])
    return args.func(args)


def assert_near(value: float, expected_ms: float, what: str, tol_ms: float = TOL_MS) -> None:
    assert abs(value - expected_ms) <= tol_ms, f"{what} = {value:.2f} ms, expected {expected_ms} ms"


def test_timings_goodput_json_and_plot(servers, tmp_path, capsys):
    mock = servers["A"]
    url = mock.url
    out_json, out_png = tmp_path / "r.json", tmp_path / "r.png"
    rc = run_cli("--base-url", url + "/v1/", "--workload", "random", "--concurrency", "1,2", "--num-requests", "4",
                 "--max-tokens", str(NUM_CHUNKS), "--slo-ttft-ms", "1000", "--slo-tpot-ms", "1000",
                 "--json", str(out_json), "--plot", str(out_png))
    assert rc == 0
    result = json.loads(out_json.read_text())
    server = result["servers"][0]
    assert server["model"] == "mock-A"  # from GET /v1/models
    assert [level["level"] for level in server["levels"]] == [1, 2]
    seen = mock.seen()
    for level_index, level in enumerate(server["levels"]):
        assert level["completed"] == 4 and level["errors"] == 0
        assert level["total_output_tokens"] == 4 * NUM_CHUNKS
        assert level["itl_ms"]["count"] == 4 * (NUM_CHUNKS - 1)
        # Nominal values, loosely: a shared 2-core machine delays wake-ups by a few ms.
        assert_near(level["ttft_ms"]["p50"], FIRST_S * 1000, "ttft p50", tol_ms=15)
        assert_near(level["itl_ms"]["p50"], GAP_S * 1000, "itl p50", tol_ms=15)
        # Exactly: what the mock actually did (its chunk send times on the shared CLOCK_MONOTONIC).
        window = slice(4 * level_index, 4 * level_index + 4)
        sent = {b["messages"][-1]["content"]: np.array(t) for b, t in zip(seen["bodies"][window], seen["chunk_times"][window])}
        prompts = [b.messages[-1]["content"] for b in build_workload("random", 4, NUM_CHUNKS, seed=0)]
        per_request = [(sent[prompts[r["index"]]] - level["start_time"] - r["send_s"]) * 1000 for r in level["requests"]]
        expected = {"ttft_ms": np.array([t[0] for t in per_request]),
                    "itl_ms": np.concatenate([np.diff(t) for t in per_request]),
                    "tpot_ms": np.array([(t[-1] - t[0]) / (NUM_CHUNKS - 1) for t in per_request]),
                    "e2e_ms": np.array([t[-1] for t in per_request])}
        for metric, values in expected.items():
            assert_near(level[metric]["mean"], values.mean(), f"c={level['level']} {metric} mean")
            assert_near(level[metric]["p50"], np.percentile(values, 50), f"c={level['level']} {metric} p50")
            for q in (90, 99):
                assert_near(level[metric][f"p{q}"], np.percentile(values, q), f"c={level['level']} {metric} p{q}",
                            tol_ms=TAIL_TOL_MS)
        for r, times in zip(level["requests"], per_request):
            assert_near(r["ttft_ms"], times[0], f"request {r['index']} ttft", tol_ms=TAIL_TOL_MS)
            assert r["output_tokens"] == NUM_CHUNKS and len(r["itl_ms"]) == NUM_CHUNKS - 1
        assert level["goodput"] == pytest.approx(level["request_throughput"])
        assert level["output_throughput"] == pytest.approx(level["total_output_tokens"] / level["duration_s"])
    # Concurrency 1 sends each request after the previous one finished; concurrency 2 sends two at once.
    one, two = (sorted(level["requests"], key=lambda r: r["send_s"]) for level in server["levels"])
    assert one[1]["send_s"] * 1000 >= one[0]["send_s"] * 1000 + one[0]["e2e_ms"]
    assert two[1]["send_s"] * 1000 < two[0]["send_s"] * 1000 + two[0]["ttft_ms"]
    body = mock.seen()["bodies"][0]
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["ignore_eos"] is True and body["max_tokens"] == NUM_CHUNKS and body["temperature"] == 0
    assert result["config"]["slo"] == {"ttft_ms": 1000.0, "tpot_ms": 1000.0}
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    printed = capsys.readouterr().out
    assert "concurrency 2" in printed and "TTFT" in printed


@pytest.mark.parametrize("slo_args", [("--slo-ttft-ms", "10"), ("--slo-tpot-ms", "5"),
                                      ("--slo-ttft-ms", "1000", "--slo-tpot-ms", "5")])
def test_goodput_zero_when_no_request_meets_slo(servers, tmp_path, slo_args):
    url = servers["A"].url
    out_json = tmp_path / "r.json"
    rc = run_cli("--base-url", url, "--concurrency", "2", "--num-requests", "2", "--max-tokens", "5",
                 *slo_args, "--json", str(out_json))
    assert rc == 0
    level = json.loads(out_json.read_text())["servers"][0]["levels"][0]
    assert level["completed"] == 2 and level["goodput"] == 0


def test_goodput_missing_slo_counts_as_met_and_none_without_slo(servers, tmp_path):
    url = servers["A"].url
    out_json = tmp_path / "r.json"
    assert run_cli("--base-url", url, "--concurrency", "2", "--num-requests", "2", "--slo-tpot-ms", "1000",
                   "--json", str(out_json)) == 0
    level = json.loads(out_json.read_text())["servers"][0]["levels"][0]
    assert level["goodput"] == pytest.approx(level["request_throughput"])
    assert run_cli("--base-url", url, "--concurrency", "2", "--num-requests", "2", "--json", str(out_json)) == 0
    assert json.loads(out_json.read_text())["servers"][0]["levels"][0]["goodput"] is None


def test_http_errors_are_counted(servers, tmp_path):
    url = servers["A"].url
    servers["A"].reset(fail_every=3)
    out_json = tmp_path / "r.json"
    assert run_cli("--base-url", url, "--concurrency", "2", "--num-requests", "6", "--json", str(out_json)) == 0
    level = json.loads(out_json.read_text())["servers"][0]["levels"][0]
    assert level["errors"] == 2 and level["completed"] == 4
    assert any("HTTP 500" in error for error in level["error_samples"])
    assert level["ttft_ms"]["count"] == 4  # failed requests stay out of the latencies
    servers["A"].reset(fail_every=1)
    assert run_cli("--base-url", url, "--num-requests", "2") == 1  # nothing succeeded


def test_request_rate_poisson(servers, tmp_path):
    url = servers["A"].url
    out_json = tmp_path / "r.json"
    assert run_cli("--base-url", url, "--request-rate", "40,inf", "--num-requests", "4", "--seed", "3",
                   "--temperature", "0.5", "--json", str(out_json), "--plot", str(tmp_path / "r.png")) == 0
    result = json.loads(out_json.read_text(), parse_constant=pytest.fail)  # strict JSON: no Infinity
    assert result["mode"] == "request_rate" and result["config"]["request_rates"] == [40.0, "inf"]
    assert (tmp_path / "r.png").read_bytes()[:4] == b"\x89PNG"
    for level in result["servers"][0]["levels"]:
        assert level["completed"] == 4
        # Simultaneous sends each open a new connection: a looser bound.
        assert_near(level["ttft_ms"]["p50"], FIRST_S * 1000, "ttft p50", tol_ms=15)
    assert sorted(body["seed"] for body in servers["A"].seen()["bodies"][:4]) == [3, 4, 5, 6]


def test_vs_interleaves_levels_and_reports_ratios(servers, tmp_path, capsys):
    out_json = tmp_path / "r.json"
    assert run_cli("--base-url", servers["A"].url, "--vs", servers["B"].url, "--concurrency", "1,2",
                   "--num-requests", "2", "--warmup", "1", "--json", str(out_json)) == 0
    received = [(t, label) for label in "AB" for t in servers[label].seen()["received"]]
    # One uncounted warm-up per server, then A level 1, B level 1, A level 2, B level 2.
    assert [label for _, label in sorted(received)] == ["A", "B", "A", "A", "B", "B", "A", "A", "B", "B"]
    assert servers["A"].seen()["bodies"][0]["messages"][0]["content"].startswith("Warm-up")
    result = json.loads(out_json.read_text())
    assert [s["model"] for s in result["servers"]] == ["mock-A", "mock-B"]
    assert all(level["num_requests"] == 2 for s in result["servers"] for level in s["levels"])
    assert [row["level"] for row in result["ratios"]] == [1, 2]
    for row, a, b in zip(result["ratios"], *(s["levels"] for s in result["servers"])):
        assert row["ratios"]["ttft_ms.p50"] == pytest.approx(a["ttft_ms"]["p50"] / b["ttft_ms"]["p50"])
        assert row["ratios"]["output_throughput"] == pytest.approx(a["output_throughput"] / b["output_throughput"])
        assert row["ratios"]["ttft_ms.p50"] == pytest.approx(1.0, abs=0.3)  # identical mocks
    assert "A/B ratios" in capsys.readouterr().out


def test_unreachable_server_and_bad_arguments(capsys):
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    assert run_cli("--base-url", f"http://127.0.0.1:{port}", "--num-requests", "1") == 1
    assert "error" in capsys.readouterr().err
    for bad in (["--concurrency", "0"], ["--concurrency", "1,x"], ["--request-rate", "-1"], ["--num-requests", "0"]):
        with pytest.raises(SystemExit):
            run_cli("--base-url", "http://127.0.0.1:1", *bad)
        assert bad[1] in capsys.readouterr().err
    assert run_cli("--base-url", "http://127.0.0.1:1", "--workload", "file:/nonexistent.jsonl") == 2
    assert "/nonexistent.jsonl" in capsys.readouterr().err
    with pytest.raises(ValueError, match="ftp://x"):
        normalize_base_url("ftp://x")


def test_multi_token_chunk_counts_once_and_usage_sets_tokens():
    result = RequestResult(index=0, arrival=0.0, send=10.0)
    handle_event(result, json.dumps({"choices": [{"delta": {"role": "assistant"}}]}), 10.05)
    for t in (10.1, 10.2, 10.4):
        handle_event(result, json.dumps({"choices": [{"delta": {"content": "ab"}}]}), t)
    handle_event(result, json.dumps({"choices": [], "usage": {"completion_tokens": 6, "prompt_tokens": 3,
                                                             "prompt_tokens_details": {"cached_tokens": 2}}}), 10.41)
    assert handle_event(result, "[DONE]", 10.42)
    assert result.cached_tokens == 2 and result.to_dict(0.0)["cached_tokens"] == 2
    assert result.ttft == pytest.approx(0.1) and result.e2e == pytest.approx(0.4)
    assert result.itl == pytest.approx([0.1, 0.2])
    assert result.output_tokens == 6 and result.tpot == pytest.approx(0.3 / 5)
    single = RequestResult(index=1, arrival=0.0, send=0.0, chunk_times=[0.5], output_tokens=1)
    assert single.tpot is None and Slo(tpot_ms=1).met(single)


def test_reasoning_chunks_are_output_too():
    """A thinking model streams delta.reasoning_content first: TTFT is its first token, and a request whose
    reasoning filled max_tokens is not an error."""
    result = RequestResult(index=0, arrival=0.0, send=10.0)
    handle_event(result, json.dumps({"choices": [{"delta": {"reasoning_content": "hm"}}]}), 10.1)
    handle_event(result, json.dumps({"choices": [{"delta": {"reasoning_content": "ok"}}]}), 10.2)
    handle_event(result, json.dumps({"choices": [{"delta": {"content": "4"}}]}), 10.3)
    assert handle_event(result, "[DONE]", 10.31)
    assert result.ttft == pytest.approx(0.1) and result.chunk_times == [10.1, 10.2, 10.3]


def test_stats_percentiles_and_ratios():
    results = [RequestResult(i, 0.0, send=0.0, chunk_times=[0.01 * (i + 1), 0.01 * (i + 1) + 0.002],
                             output_tokens=2) for i in range(100)]
    summary = summarize_level(results, 1.0, 3.0, 4, "concurrency", Slo(ttft_ms=50))
    ttfts = np.arange(1, 101) * 10.0
    assert summary["ttft_ms"]["p90"] == pytest.approx(np.percentile(ttfts, 90))
    assert summary["ttft_ms"]["p50"] == pytest.approx(505.0)
    assert summary["goodput"] == pytest.approx(5 / 2.0)  # TTFT 10..50 ms meet 50 ms
    assert summary["request_throughput"] == pytest.approx(50.0)
    assert summary["cache_hit_rate"] is None  # the server said nothing about cached tokens
    for i, result in enumerate(results):
        result.prompt_tokens, result.cached_tokens = 100, (50 if i % 2 else 0)
    assert summarize_level(results, 1.0, 3.0, 4, "concurrency", Slo())["cache_hit_rate"] == pytest.approx(0.25)
    assert distribution([]) is None
    half = dict(summary, request_throughput=25.0)
    assert ratios(summary, half)["request_throughput"] == pytest.approx(2.0)
    assert ratios(summary, dict(summary, goodput=0))["goodput"] is None


def test_workloads_are_seeded(tmp_path):
    chat = build_workload("chat-shared-prefix", 5, 16, seed=1)
    systems = {req.messages[0]["content"] for req in chat}
    assert len(systems) == 1 and 1500 <= len(systems.pop()) <= 2000
    assert len({req.messages[1]["content"] for req in chat}) == 5
    assert build_workload("chat-shared-prefix", 5, 16, seed=1) == chat
    assert build_workload("chat-shared-prefix", 5, 16, seed=2) != chat
    teams = build_workload("chat-multi-prefix", 40, 16, seed=1)
    assert len({req.messages[0]["content"] for req in teams}) == 4  # four teams' system prompts, each used
    assert all(1500 <= len(req.messages[0]["content"]) <= 2100 for req in teams)
    rand = build_workload("random", 20, 8, seed=0, random_words=(3, 9))
    assert all(3 <= len(req.messages[0]["content"].split()) <= 9 for req in rand)
    assert len({len(req.messages[0]["content"].split()) for req in rand}) > 1
    path = tmp_path / "w.jsonl"
    path.write_text('{"prompt": "hi", "max_tokens": 3}\n\n{"messages": [{"role": "user", "content": "yo"}]}\n')
    reqs = build_workload(f"file:{path}", 3, 9, seed=0)
    assert [r.max_tokens for r in reqs] == [3, 9, 3] and reqs[1].messages[0]["content"] == "yo"
    path.write_text('{"prompt": "hi"}\n{"text": 1}\n')
    with pytest.raises(ValueError, match=r"w\.jsonl:2"):
        build_workload(f"file:{path}", 2, 9, seed=0)
    with pytest.raises(ValueError, match="'bogus'"):
        build_workload("bogus", 1, 1, seed=0)


def test_poisson_arrivals_seeded_with_the_right_rate():
    arrivals = poisson_arrivals(20000, 50.0, seed=7)
    assert arrivals == poisson_arrivals(20000, 50.0, seed=7)
    assert arrivals != poisson_arrivals(20000, 50.0, seed=8)
    assert np.mean(np.diff(arrivals)) == pytest.approx(1 / 50.0, rel=0.05)
    assert poisson_arrivals(3, float("inf"), seed=0) == [0.0, 0.0, 0.0]
