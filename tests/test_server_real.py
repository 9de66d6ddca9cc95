"""Acceptance: a real `quill serve` process on the default model, driven over loopback."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest

from server_utils import ServeProcess, metric_value, post_then_close, read_sse_then_close, wait_until

pytestmark = pytest.mark.slow

MODEL = "quill-test"
HELLO = [{"role": "user", "content": "Name a colour."}]
ABORT_DEADLINE_S = 2.0  # the bound: client gone -> aborted and blocks freed


def abort_deadline(server) -> float:
    """2 s, or three mean engine steps when this (shared, loaded) machine makes one step that slow:
    an abort lands between steps, so the step in flight always finishes first."""
    engine = httpx.get(server.url + "/v1/stats", headers=server.headers, timeout=10).json()["engine"]
    steps = max(engine.get("num_steps") or 0, 1)
    mean_step = ((engine.get("step_prefill_seconds") or 0.0) + (engine.get("step_decode_seconds") or 0.0)) / steps
    return max(ABORT_DEADLINE_S, 3.0 * mean_step)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # Small chunks keep every step short, so an abort lands quickly even mid-prefill. Speculation is on,
    # so streams, aborts and disconnects are exercised with verify rows in the batch too.
    proc = ServeProcess(tmp_path_factory.mktemp("serve"), "--max-model-len", "1024", "--kv-cache-memory", "96MiB",
                        "--max-num-seqs", "4", "--max-num-batched-tokens", "32", "--log-level", "info",
                        "--speculative", "ngram")
    try:
        yield proc.wait_ready()
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=300)


def events_of(url: str, body: dict, headers: dict | None = None) -> list:
    with httpx.stream("POST", url, json=body, headers=headers or {}, timeout=300) as response:
        assert response.status_code == 200, response.read()
        lines = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    return [line if line == "[DONE]" else json.loads(line) for line in lines]


def stream_until(url: str, body: dict, headers: dict, stop: threading.Event) -> None:
    """Read a stream until `stop` is set, then hang up (a client that holds a running slot)."""
    with httpx.stream("POST", url, json=body, headers=headers, timeout=300) as response:
        for _ in response.iter_lines():
            if stop.is_set():
                return


def idle_blocks(server) -> bool:
    text = server.metrics()
    return metric_value(text, "quill_kv_blocks_used") == 0 and metric_value(text, "quill_requests_running") == 0 \
        and metric_value(text, "quill_requests_waiting") == 0


def test_health_was_503_while_starting_and_cold_start_logged(server):
    assert server.health_seen[-1] == 200
    assert 503 in server.health_seen  # the port answers before the model is loaded
    out = server.output()
    assert "cold start: import" in out and "weights" in out and "warm-up" in out and "ready" in out
    assert f"http://127.0.0.1:{server.port}/v1" in out


def test_chat_non_stream_and_stream_agree(server, client):
    resp = client.chat.completions.create(model=MODEL, messages=HELLO, temperature=0, max_tokens=6)
    text = resp.choices[0].message.content
    assert text and resp.choices[0].finish_reason in ("stop", "length")
    assert resp.usage.completion_tokens >= 1 and resp.usage.prompt_tokens > 5
    assert resp.usage.prompt_tokens_details.cached_tokens >= 0
    assert resp.model_extra["timings"]["predicted_n"] == resp.usage.completion_tokens
    body = {"model": MODEL, "messages": HELLO, "temperature": 0, "max_tokens": 6, "stream": True, "stream_options": {"include_usage": True}}
    events = events_of(server.url + "/v1/chat/completions", body)
    assert events[0]["choices"][0]["delta"]["role"] == "assistant" and not events[0]["choices"][0]["delta"].get("content")
    assert events[-1] == "[DONE]" and events[-2]["choices"] == [] and events[-2]["usage"]["completion_tokens"] >= 1
    assert events[-2]["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # same prompt again: prefix-cache hit
    assert "timings" in events[-2]
    streamed = "".join(e["choices"][0]["delta"].get("content") or "" for e in events[1:-2])
    assert streamed == text
    assert events[-3]["choices"][0]["finish_reason"] == resp.choices[0].finish_reason


def test_completions_max_tokens_length_and_stop(client):
    resp = client.completions.create(model=MODEL, prompt="One, two, three, four,", temperature=0, max_tokens=6)
    text = resp.choices[0].text
    assert resp.choices[0].finish_reason == "length" and resp.usage.completion_tokens == 6
    words = [w for w in text.split() if w.strip(",")]
    assert words, text
    stop = words[-1].strip(",")
    stopped = client.completions.create(model=MODEL, prompt="One, two, three, four,", temperature=0, max_tokens=6, stop=[stop])
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].text == text[: text.index(stop)]


def test_n_2_seed_and_logprobs(client):
    def sample(seed, n=1):
        return client.chat.completions.create(model=MODEL, messages=HELLO, temperature=1.0, seed=seed, max_tokens=5, n=n)

    a, b = sample(1234), sample(1234)
    assert a.choices[0].message.content == b.choices[0].message.content
    two = sample(99, n=2)
    assert [c.index for c in two.choices] == [0, 1] and two.usage.completion_tokens >= 2
    lp = client.chat.completions.create(model=MODEL, messages=HELLO, temperature=0, max_tokens=3, logprobs=True, top_logprobs=2)
    content = lp.choices[0].logprobs.content
    assert len(content) == lp.usage.completion_tokens
    assert all(len(c.top_logprobs) == 2 and c.logprob <= 0 for c in content)
    assert content[0].top_logprobs[0].logprob >= content[0].top_logprobs[1].logprob


def test_eight_concurrent_streams(server):
    results: dict[int, list] = {}

    def one(i: int) -> None:
        body = {"model": MODEL, "messages": [{"role": "user", "content": f"Count to {i}."}], "max_tokens": 3, "temperature": 0, "stream": True}
        results[i] = events_of(server.url + "/v1/chat/completions", body)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    assert sorted(results) == list(range(8))
    for events in results.values():
        assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] in ("stop", "length")
    assert wait_until(lambda: idle_blocks(server), timeout=5)


def _aborts(server) -> float:
    return metric_value(server.metrics(), "quill_requests_total", {"finish_reason": "abort"})


def test_disconnect_after_three_chunks(server):
    before = _aborts(server)
    generated = metric_value(server.metrics(), "quill_generation_tokens_total")
    body = {"model": MODEL, "messages": HELLO, "max_tokens": 500, "ignore_eos": True, "stream": True, "logprobs": True}
    events = read_sse_then_close(server.url + "/v1/chat/completions", body, 4)  # the role chunk, then 3 with tokens
    streamed = sum(len((e["choices"][0]["logprobs"] or {}).get("content") or ()) for e in events)
    assert streamed >= 3
    deadline = abort_deadline(server)
    gone = time.monotonic()
    assert wait_until(lambda: _aborts(server) == before + 1 and idle_blocks(server), timeout=deadline)
    assert time.monotonic() - gone <= deadline
    # Not left decoding for nobody: at most the step already queued plus the step in flight, each of up
    # to 9 tokens (a verified run of 8 proposals and the row's own pick: --num-speculative-tokens 8).
    assert metric_value(server.metrics(), "quill_generation_tokens_total") - generated <= streamed + 2 * 9


def test_disconnect_during_long_prefill(server):
    before = _aborts(server)
    generated = metric_value(server.metrics(), "quill_generation_tokens_total")
    prompt = "Tell me about rivers. " * 60  # ~300 tokens: about ten 32-token prefill steps
    post_then_close(server.port, "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 50, "stream": True}, wait_s=0.5)
    assert wait_until(lambda: _aborts(server) == before + 1 and idle_blocks(server), timeout=abort_deadline(server))
    assert metric_value(server.metrics(), "quill_generation_tokens_total") == generated  # never reached decode


def test_bad_inputs_then_healthy(server):
    chat = {"model": MODEL, "messages": HELLO}
    cases = [
        (b"{not json", 400), (b"[]", 400),
        ({"model": MODEL}, 400), ({**chat, "messages": []}, 400), ({**chat, "messages": [{"role": "x", "content": "y"}]}, 400),
        ({**chat, "temperature": -0.5}, 400), ({**chat, "top_p": 2}, 400), ({**chat, "n": 0}, 400), ({**chat, "max_tokens": 0}, 400),
        ({**chat, "max_tokens": 5000}, 400), ({**chat, "messages": [{"role": "user", "content": "word " * 1100}]}, 400),
        ({**chat, "logprobs": True, "top_logprobs": 99}, 400), ({**chat, "stop": ["s"] * 17}, 400),
        ({**chat, "guided_regex": "("}, 400), ({**chat, "response_format": {"type": "json_schema", "json_schema": {"schema": 5}}}, 400),
        ({**chat, "stop_token_ids": [10**9]}, 400), ({**chat, "model": "missing"}, 404),
        ({**chat, "messages": [{"role": "user", "content": "x" * (5 << 20)}]}, 413),
    ]
    for body, status in cases:
        kwargs = {"content": body, "headers": {"Content-Type": "application/json"}} if isinstance(body, bytes) else {"json": body}
        r = httpx.post(server.url + "/v1/chat/completions", timeout=60, **kwargs)
        assert r.status_code == status, (body if len(str(body)) < 300 else str(body)[:300], r.text)
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    over = httpx.post(server.url + "/v1/chat/completions", json={**chat, "max_tokens": 5000}).json()["error"]
    assert over["code"] == "context_length_exceeded" and "5,000" in over["message"] and "1,024" in over["message"]
    assert httpx.get(server.url + "/health").status_code == 200
    ok = httpx.post(server.url + "/v1/chat/completions", json={**chat, "max_tokens": 2}, timeout=300)
    assert ok.status_code == 200
    assert wait_until(lambda: idle_blocks(server), timeout=5)


def test_metrics_histograms_move_and_tokenizer_endpoints(server, client):
    before = server.metrics()
    client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=3, temperature=0, extra_body={"ignore_eos": True})
    after = server.metrics()
    for name in ("quill_time_to_first_token_seconds_count", "quill_e2e_request_latency_seconds_count",
                 "quill_queue_time_seconds_count", "quill_time_per_output_token_seconds_count"):
        assert metric_value(after, name) == metric_value(before, name) + 1, name
    assert metric_value(after, "quill_inter_token_latency_seconds_count") == metric_value(before, "quill_inter_token_latency_seconds_count") + 2
    assert metric_value(after, "quill_kv_blocks_total") > 0
    quote = "one two three four five six seven eight nine ten\n" * 4 + "one two"
    done = client.completions.create(model=MODEL, prompt=quote, max_tokens=24, temperature=0)
    timings = done.model_extra["timings"]
    assert 0 <= timings["draft_n_accepted"] <= timings["draft_n"]
    final = server.metrics()
    assert metric_value(final, "quill_spec_proposed_tokens_total") == metric_value(after, "quill_spec_proposed_tokens_total") + timings["draft_n"]
    assert metric_value(final, "quill_spec_accepted_tokens_total") >= timings["draft_n_accepted"]
    toks = httpx.post(server.url + "/tokenize", json={"prompt": "Hello world"}).json()
    assert toks["count"] == len(toks["tokens"]) >= 2 and toks["max_model_len"] == 1024
    assert httpx.post(server.url + "/detokenize", json={"tokens": toks["tokens"]}).json()["prompt"] == "Hello world"


def test_small_server_key_queue_and_sigterm_drain(tmp_path):
    """--api-key, --max-waiting 1 with one running slot, disconnect while queued, SIGTERM drain."""
    proc = ServeProcess(tmp_path, "--api-key", "sekret", "--max-num-seqs", "1", "--max-waiting", "1", "--max-model-len", "512",
                        "--kv-cache-memory", "32MiB", "--max-num-batched-tokens", "32", "--drain-timeout", "60")
    try:
        proc.wait_ready()
        auth = proc.headers = {"Authorization": "Bearer sekret"}
        url = proc.url + "/v1/chat/completions"
        long = {"model": MODEL, "messages": HELLO, "max_tokens": 400, "ignore_eos": True, "stream": True}
        assert httpx.post(url, json=long).status_code == 401
        assert httpx.post(url, json=long, headers={"Authorization": "Bearer nope"}).json()["error"]["code"] == "invalid_api_key"
        release = threading.Event()
        holder = threading.Thread(target=stream_until, args=(url, long, auth, release))
        holder.start()
        assert wait_until(lambda: metric_value(proc.metrics(), "quill_requests_running") == 1, timeout=120)
        # The one waiting slot: this request queues, then its client hangs up.
        hang_up = threading.Event()
        queued = threading.Thread(target=post_then_close, args=(proc.port, "/v1/chat/completions", {**long, "stream": False}),
                                  kwargs={"until": hang_up, "headers": auth})
        queued.start()
        assert wait_until(lambda: metric_value(proc.metrics(), "quill_requests_waiting") == 1, timeout=60)
        shed = httpx.post(url, json={**long, "stream": False}, headers=auth)
        assert shed.status_code in (429, 503) and int(shed.headers["Retry-After"]) >= 1
        assert shed.json()["error"]["code"] == "queue_full"
        hang_up.set()
        queued.join()
        assert wait_until(lambda: metric_value(proc.metrics(), "quill_requests_waiting") == 0, timeout=abort_deadline(proc))
        release.set()
        holder.join(timeout=600)
        assert wait_until(lambda: idle_blocks(proc), timeout=abort_deadline(proc))
        assert metric_value(proc.metrics(), "quill_requests_total", {"finish_reason": "abort"}) == 2
        # SIGTERM with a request in flight: new ones get 503, the in-flight one finishes, exit 0.
        results = {}  # 200 tokens: long enough (over a second here) that the poll below sees it running
        inflight = threading.Thread(target=lambda: results.update(events=events_of(url, {**long, "max_tokens": 200}, auth)))
        inflight.start()
        assert wait_until(lambda: metric_value(proc.metrics(), "quill_requests_running") == 1, timeout=120)
        proc.proc.send_signal(signal.SIGTERM)
        assert wait_until(lambda: httpx.get(proc.url + "/health").status_code == 503, timeout=5)
        assert httpx.post(url, json={**long, "stream": False}, headers=auth).status_code == 503
        inflight.join(timeout=600)
        assert results["events"][-1] == "[DONE]" and results["events"][-2]["choices"][0]["finish_reason"] == "length"
        assert proc.proc.wait(timeout=30) == 0
    finally:
        proc.stop()


def test_bench_serve_against_real_server(server, tmp_path):
    """`quill bench serve`: 2 levels x 8 requests against this real server, JSON fields and the PNG."""
    out_json, out_png = tmp_path / "bench.json", tmp_path / "bench.png"
    proc = subprocess.run(
        [sys.executable, "-m", "quill.cli", "bench", "serve", "--base-url", server.url, "--workload",
         "chat-shared-prefix", "--concurrency", "1,4", "--num-requests", "8", "--max-tokens", "8",
         "--warmup", "1", "--no-progress", "--json", str(out_json), "--plot", str(out_png)],
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(out_json.read_text())
    levels = result["servers"][0]["levels"]
    assert [lv["level"] for lv in levels] == [1, 4]
    for lv in levels:
        assert lv["errors"] == 0 and lv["completed"] == 8
        for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
            assert lv[key]["p50"] > 0 and lv[key]["p99"] >= lv[key]["p50"]
        assert lv["output_throughput"] > 0 and lv["request_throughput"] > 0
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
