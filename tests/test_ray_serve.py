"""Acceptance: `quill serve --ray` on a local Ray cluster on loopback, 2 replicas of the default model
with small KV pools, driven through the official openai client.

Two clusters run one after the other (Ray Serve starts in ~15 s here): the prefix-aware router's,
which also serves the chat, disconnect and replica-kill tests, and round-robin's for the hit-rate
comparison.
"""

from __future__ import annotations

import json
import os
import random
import signal
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

pytest.importorskip("ray.serve", reason="quill[ray] is not installed")

from quill.bench.workloads import multi_prefix_chat  # noqa: E402
from server_utils import ServeProcess, metric_value, wait_until  # noqa: E402

pytestmark = pytest.mark.slow

MODEL = "quill-test"
REPLICA_FLAGS = ("--ray", "--replicas", "2", "--threads", "1", "--kv-cache-memory", "64MiB", "--max-model-len", "1024",
                 "--max-num-seqs", "8", "--max-num-batched-tokens", "256", "--speculative", "off", "--log-level", "warning")
HIT_RATE_REQUESTS = 24


def ray_serve(log_dir: Path, router: str) -> ServeProcess:
    proc = ServeProcess(log_dir, *REPLICA_FLAGS, "--router", router)
    try:
        return proc.wait_ready(timeout=240)
    except BaseException:
        proc.stop()
        raise


def hit_rate(url: str) -> tuple[float, list[str]]:
    """Prompt tokens served from a prefix cache / prompt tokens, over 24 requests drawn (seeded)
    from 4 distinct ~400-token system prompts, sent one at a time; and which replica took each."""
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
    cached = prompt = 0
    replicas = []
    for request in multi_prefix_chat(HIT_RATE_REQUESTS, max_tokens=2, seed=3, num_prefixes=4):
        raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=list(request.messages),
                                                               max_tokens=2, temperature=0)
        replicas.append(raw.headers["x-quill-replica"])
        usage = raw.parse().usage
        cached += usage.prompt_tokens_details.cached_tokens
        prompt += usage.prompt_tokens
    return cached / prompt, replicas


@pytest.fixture(scope="module")
def hit_rates():
    return {}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    proc = ray_serve(tmp_path_factory.mktemp("ray-prefix"), "prefix")
    try:
        yield proc
    finally:
        code = proc.stop()
        assert code == 0, (code, proc.log_path.read_text()[-3000:])


def replica_metric(server, name: str, replica: str, **labels) -> float:
    return metric_value(server.metrics(), name, {**labels, "replica": replica})


def test_prefix_router_hit_rate(cluster, hit_rates):
    # First in the module, on replicas that hold only their warm-up's blocks: a new prefix goes to the
    # replica holding the fewest blocks, so after the other tests (a 400-token story held on one replica)
    # all four prefixes could rightly go to the other one, and "both took work" would not hold.
    assert wait_until(lambda: metric_value(cluster.metrics(), "quill_cluster_replicas_reporting") == 2, timeout=20)
    rate, replicas = hit_rate(cluster.url)
    hit_rates["prefix"] = rate
    assert len(set(replicas)) == 2  # both replicas took work


def test_chat_streamed_and_not(cluster):
    client = openai.OpenAI(base_url=cluster.url + "/v1", api_key="none", max_retries=0, timeout=120)
    messages = [{"role": "user", "content": "Name a colour."}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0)
    assert whole.choices[0].finish_reason in ("stop", "length") and whole.usage.completion_tokens >= 1
    raw = httpx.post(cluster.url + "/v1/chat/completions", timeout=60,
                     json={"model": MODEL, "messages": messages, "max_tokens": 6, "temperature": 0})
    timings = raw.json()["timings"]  # llama-server's timings, as single-process quill serve sends them
    assert timings["predicted_n"] == raw.json()["usage"]["completion_tokens"] and "ttft_ms" in timings
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content  # greedy: the same answer on either replica
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    # Errors keep quill's shapes: OpenAI's on /v1/chat/completions, Anthropic's on /v1/messages.
    with pytest.raises(openai.NotFoundError) as err:
        client.chat.completions.create(model="nope", messages=messages, max_tokens=2)
    assert err.value.body["code"] == "model_not_found"
    bad = httpx.post(cluster.url + "/v1/messages", json={"model": MODEL, "max_tokens": 0, "messages": messages}, timeout=30)
    assert bad.status_code == 400 and bad.json()["type"] == "error"
    # The ingress reads a body only up to --max-body-size (4 MiB by default), as quill serve does.
    huge = httpx.post(cluster.url + "/v1/chat/completions", content=b"x" * (5 << 20), timeout=60,
                      headers={"content-type": "application/json"})
    assert huge.status_code == 413 and huge.json()["error"]["code"] == "request_too_large"


def test_metrics_carry_a_replica_label(cluster):
    assert wait_until(lambda: metric_value(cluster.metrics(), "quill_cluster_replicas_reporting") == 2, timeout=20)
    text = cluster.metrics()
    replicas = {line.split('replica="')[1].split('"')[0] for line in text.splitlines()
                if line.startswith("quill_kv_blocks_total{")}
    assert len(replicas) == 2


def test_disconnect_frees_blocks_on_the_replica_that_held_them(cluster):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Write a long story about a river."}],
            "max_tokens": 400, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", cluster.url + "/v1/chat/completions", json=body, timeout=60) as response:
        replica = response.headers["x-quill-replica"]
        before = replica_metric(cluster, "quill_requests_total", replica, finish_reason="abort")
        lines = response.iter_lines()
        for _ in range(6):
            next(lines)
        assert wait_until(lambda: replica_metric(cluster, "quill_kv_blocks_used", replica) > 0, timeout=10)
    # The client hung up: Ray Serve cancels the call, the replica's app sees http.disconnect and
    # aborts; the replica pushes its metrics each second.
    assert wait_until(lambda: replica_metric(cluster, "quill_requests_total", replica, finish_reason="abort") == before + 1
                      and replica_metric(cluster, "quill_kv_blocks_used", replica) == 0
                      and replica_metric(cluster, "quill_requests_running", replica) == 0, timeout=15), cluster.metrics()


def _replica_pids() -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            if b"ServeReplica:quill:QuillReplica" in cmdline:
                pids.append(int(entry.name))
    return pids


def test_a_killed_replica_fails_its_requests_cleanly_and_the_endpoint_keeps_serving(cluster):
    pids = _replica_pids()
    assert len(pids) == 2, pids
    results: list[str] = []
    streaming: dict[str, int] = {}  # replica id -> streams that have their first token
    lock = threading.Lock()
    first_token = threading.Condition(lock)

    def stream_one(index: int) -> None:
        # Distinct first blocks: the prefix router sends unmatched prompts to the least loaded replica.
        body = {"model": MODEL, "messages": [{"role": "system", "content": f"{index} {index} {index} You count."},
                                             {"role": "user", "content": f"Count to fifty, take {index}."}],
                "max_tokens": 64, "stream": True, "ignore_eos": True}
        events = []
        try:
            with httpx.stream("POST", cluster.url + "/v1/chat/completions", json=body, timeout=120) as response:
                if response.status_code != 200:
                    results.append(f"http {response.status_code} {json.loads(response.read())['error']['code']}")
                    return
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
                        if len(events) == 2:
                            with first_token:
                                streaming[response.headers["x-quill-replica"]] = streaming.get(response.headers["x-quill-replica"], 0) + 1
                                first_token.notify_all()
        except httpx.HTTPError as exc:
            results.append(f"transport {type(exc).__name__}")
            return
        last = json.loads(events[-2]) if len(events) >= 2 else {}
        assert events[-1] == "[DONE]", events[-3:]
        if "error" in last:
            results.append(f"error event {last['error']['code']}")
        else:
            assert last["choices"][0]["finish_reason"] == "length"
            results.append("finished")

    threads = []
    with first_token:
        # Streams until both replicas are serving one (any replica killed then has streams in flight).
        while len(streaming) < 2 and len(threads) < 8:
            threads.append(threading.Thread(target=stream_one, args=(len(threads),)))
            threads[-1].start()
            first_token.wait_for(lambda: sum(streaming.values()) >= len(threads) or len(results) > 0, timeout=60)
    assert len(streaming) == 2, (streaming, results)
    os.kill(random.Random(0).choice(pids), signal.SIGKILL)
    for thread in threads:
        thread.join(timeout=120)
    assert len(results) == len(threads), results
    assert all(r == "finished" or r in ("error event replica_failed", "http 503 replica_failed") for r in results), results
    assert "error event replica_failed" in results and "finished" in results, results
    # New requests go to the live replica, then Ray brings the dead one back.
    client = openai.OpenAI(base_url=cluster.url + "/v1", api_key="none", max_retries=2, timeout=120)
    for _ in range(3):
        reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
        assert reply.choices[0].finish_reason == "length"
    assert wait_until(lambda: len(_replica_pids()) == 2, timeout=90)


def test_round_robin_hit_rate_is_lower(tmp_path, hit_rates):
    if "prefix" not in hit_rates:
        pytest.skip("the prefix router's hit rate was not measured")
    proc = ray_serve(tmp_path, "round-robin")
    try:
        rate, replicas = hit_rate(proc.url)
    finally:
        code = proc.stop()
        assert code == 0, (code, proc.log_path.read_text()[-3000:])
    print(f"prefix-cache hit rate over {HIT_RATE_REQUESTS} requests, 4 system prompts: "
          f"prefix router {hit_rates['prefix']:.3f}, round-robin {rate:.3f}")
    assert replicas[0::2] != replicas[1::2]  # it did alternate
    assert hit_rates["prefix"] > rate + 0.05, (hit_rates, rate)
