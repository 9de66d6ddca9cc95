"""quill.cluster without Ray: the prefix key, the routing policy, the metrics page, the ASGI bridge."""

from __future__ import annotations

import asyncio
import json
import random

import pytest

from quill.cluster.bridge import ResponseStart, respond
from quill.cluster.metrics import MetricsBoard, merge_replica_metrics
from quill.cluster.routing import PrefixRoutingPolicy, QuillCall, routing_key, routing_prompt
from quill.engine.block_manager import BlockManager
from quill.engine.block_pool import prefix_block_hashes
from quill.engine.sequence import Sequence
from quill.sampling_params import SamplingParams


class FakeTokenizer:
    """Characters as token ids; the 'template' writes role: content lines."""

    def encode(self, text, add_special_tokens=True):
        return [ord(c) for c in text]

    def apply_chat_template(self, messages, add_generation_prompt=True):
        return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant: "

    def encode_chat(self, messages):
        return self.encode(self.apply_chat_template(messages))


# ---- the prefix key ---------------------------------------------------------------------------
def test_prefix_block_hashes_are_what_the_block_manager_registers():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    tokens = list(range(100, 111))  # 2 full blocks and 3 tokens
    seq = Sequence("req", tokens, SamplingParams())
    assert bm.allocate(seq, len(tokens))
    bm.cache_blocks(seq, len(tokens))
    hashes = prefix_block_hashes(tokens, 4)
    assert len(hashes) == 2
    assert set(bm.cached_hashes()) == set(hashes)
    assert prefix_block_hashes(tokens[:8] + [0, 0, 0, 0], 4)[:2] == hashes  # a chain: same prefix, same digests
    assert prefix_block_hashes([1] + tokens[1:], 4)[1] != hashes[1]  # a changed first token changes every digest


def test_routing_prompt_reads_each_route_as_the_replica_renders_it():
    tok = FakeTokenizer()
    chat = json.dumps({"model": "m", "messages": [{"role": "system", "content": "S"},
                                                   {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]})
    ids, text = routing_prompt(tok, "/v1/chat/completions", chat.encode())
    assert text == "system: S\nuser: ab\nassistant: " and ids == tok.encode(text)
    anthropic = json.dumps({"model": "m", "system": "S", "messages": [{"role": "user", "content": "ab"}]})
    assert routing_prompt(tok, "/v1/messages", anthropic.encode())[1] == text
    assert routing_prompt(tok, "/v1/completions", b'{"prompt": "xyz"}') == (tok.encode("xyz"), "xyz")
    assert routing_prompt(tok, "/v1/completions", b'{"prompt": [5, 6, 7]}') == ([5, 6, 7], "")
    # Nothing to match: routed by load alone, and the replica gives the answer (e.g. a 400).
    assert routing_prompt(tok, "/v1/chat/completions", b"not json") is None
    assert routing_prompt(tok, "/v1/chat/completions", b'{"messages": []}') is None
    assert routing_prompt(tok, "/v1/chat/completions", b'{"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}') is None
    assert routing_prompt(tok, "/v1/models", b"{}") is None
    hashes, _ = routing_key(tok, 4, "/v1/completions", b'{"prompt": "abcdefghij"}')
    assert hashes == tuple(prefix_block_hashes(tok.encode("abcdefghij"), 4))


# ---- the policy -----------------------------------------------------------------------------------
def test_policy_prefers_the_longest_cached_prefix_then_load():
    policy = PrefixRoutingPolicy(imbalance_threshold=4, rng=random.Random(0))
    a, b, c = (prefix_block_hashes(list(range(s, s + 64)), 16) for s in (0, 1000, 2000))
    policy.report("r1", at=1.0, hashes=a[:2])
    policy.report("r2", at=1.0, hashes=a + b)
    assert policy.matched_blocks("r1", a) == 2 and policy.matched_blocks("r2", a) == 4
    assert policy.rank(["r1", "r2"], a)[0] == ["r2"]
    assert policy.rank(["r1", "r2"], b)[0] == ["r2"]
    # Nothing matches: the least loaded first, then the one holding fewer blocks.
    assert policy.rank(["r1", "r2"], c)[0] == ["r1"]
    for _ in range(2):
        policy.routed("r1", c)
    assert policy.rank(["r1", "r2"], prefix_block_hashes(list(range(5000, 5064)), 16))[0] == ["r2"]
    # What was routed counts as held until a report taken well after it says otherwise.
    assert policy.matched_blocks("r1", c) == 4
    policy.completed("r1")
    policy.completed("r1")
    assert policy.ongoing("r1") == 0


def test_policy_falls_back_to_power_of_two_when_loads_are_imbalanced():
    policy = PrefixRoutingPolicy(imbalance_threshold=2, rng=random.Random(1))
    a = prefix_block_hashes(list(range(64)), 16)
    policy.report("r1", at=1.0, hashes=a)
    for _ in range(3):
        policy.routed("r1", ())
    # Loads differ by 3 > 2: the less loaded of two random replicas, whatever the cache says.
    assert policy.rank(["r1", "r2"], a) == [["r2"], ["r1"]]
    policy.completed("r1")
    assert policy.rank(["r1", "r2"], a)[0] == ["r1"]  # within the threshold again: the cache wins


def test_policy_reports_replace_routed_history_and_dead_replicas_are_forgotten():
    clock = [100.0]
    policy = PrefixRoutingPolicy(report_margin_s=10.0, clock=lambda: clock[0], rng=random.Random(2))
    a = prefix_block_hashes(list(range(64)), 16)
    policy.routed("r1", a)
    policy.report("r1", at=105.0, hashes=())  # too recent to judge: the request may still be queued
    assert policy.matched_blocks("r1", a) == 4
    policy.report("r1", at=120.0, hashes=a[:1])  # later: the report is the truth (the rest was evicted)
    assert policy.matched_blocks("r1", a) == 1
    policy.report("r1", at=110.0, hashes=a)  # older than what it has: ignored
    assert policy.matched_blocks("r1", a) == 1
    policy.forget("r1")
    assert policy.matched_blocks("r1", a) == 0 and policy.held_blocks("r1") == 0
    with pytest.raises(ValueError, match="imbalance_threshold must be >= 0, got -1"):
        PrefixRoutingPolicy(imbalance_threshold=-1)


# ---- metrics ------------------------------------------------------------------------------------
def test_merged_metrics_label_every_sample_with_its_replica():
    from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    def page(used: float) -> str:
        registry = CollectorRegistry()
        Gauge("quill_kv_blocks_used", "blocks", registry=registry).set(used)
        Counter("quill_requests", "finished", ["finish_reason"], registry=registry).labels("abort").inc()
        return generate_latest(registry).decode()

    merged = merge_replica_metrics({"r1": page(3), "r2": page(0), "bad": "not { metrics"}).decode()
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(merged) for s in family.samples}
    assert samples[("quill_kv_blocks_used", (("replica", "r1"),))] == 3
    assert samples[("quill_kv_blocks_used", (("replica", "r2"),))] == 0
    assert samples[("quill_requests_total", (("finish_reason", "abort"), ("replica", "r2")))] == 1
    assert samples[("quill_cluster_replicas_reporting", ())] == 2
    assert samples[("quill_cluster_metrics_unparsed", (("replica", "bad"),))] == 1
    assert merged.count("# TYPE quill_kv_blocks_used gauge") == 1


def test_metrics_board_drops_silent_replicas():
    now = [0.0]
    board = MetricsBoard(stale_s=5.0, clock=lambda: now[0])
    board.push("r1", "a")
    now[0] = 3.0
    board.push("r2", "b")
    now[0] = 6.0
    assert board.texts() == {"r2": "b"}


# ---- the bridge -----------------------------------------------------------------------------------
def _call(path: str, body: bytes = b"", method: str = "POST") -> QuillCall:
    return QuillCall(method, path, b"", ((b"content-type", b"application/json"),), body)


def test_bridge_returns_the_apps_own_response_and_passes_a_disconnect_on():
    seen = {}

    async def app(scope, receive, send):
        request = await receive()
        seen["body"], seen["path"] = request["body"], scope["path"]
        await send({"type": "http.response.start", "status": 201, "headers": [(b"x-a", b"1")]})
        for i in range(1000):
            await send({"type": "http.response.body", "body": b"chunk%d" % i, "more_body": True})
            await asyncio.sleep(0.001)
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def whole():
        return [piece async for piece in respond(app, _call("/x", b"hello"), "r1")]

    pieces = asyncio.run(whole())
    assert pieces[0] == ResponseStart(201, ((b"x-a", b"1"),), "r1")
    assert pieces[1:3] == [b"chunk0", b"chunk1"] and len(pieces) == 1001
    assert seen == {"body": b"hello", "path": "/x"}

    ended = {}

    async def streaming_app(scope, receive, send):
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        watcher = asyncio.ensure_future(receive())
        while not watcher.done():
            await send({"type": "http.response.body", "body": b"tok", "more_body": True})
            await asyncio.sleep(0.01)
        ended["message"] = watcher.result()["type"]

    async def cancel_midway():
        pieces = []

        async def consume():
            async for piece in respond(streaming_app, _call("/s"), "r1"):
                pieces.append(piece)

        task = asyncio.ensure_future(consume())
        while len(pieces) < 3:
            await asyncio.sleep(0.01)
        task.cancel()  # Ray Serve cancels the replica's call when the client goes away
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(cancel_midway())
    assert ended == {"message": "http.disconnect"}


def test_bridge_raises_what_the_app_raises():
    async def broken(scope, receive, send):
        raise KeyError("boom")

    async def run():
        return [piece async for piece in respond(broken, _call("/x"))]

    with pytest.raises(KeyError, match="boom"):
        asyncio.run(run())


# ---- flags and options ----------------------------------------------------------------------------
def test_the_single_process_server_never_imports_ray():
    import subprocess
    import sys

    code = ("import sys, quill.cli, quill.server.serve_cmd, quill.server.app, quill.server.runner; "
            "print(sorted(m for m in sys.modules if m == 'ray' or m.startswith('ray.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_ray_flags_without_ray_are_refused(capsys):
    from quill.server.serve_cmd import main

    assert main(["--replicas", "2"]) == 2
    assert "--replicas needs --ray" in capsys.readouterr().err
    assert main(["--router", "round-robin", "--port", "1"]) == 2
    assert "--router needs --ray" in capsys.readouterr().err


def test_cluster_options_name_the_limit_and_the_value():
    pytest.importorskip("ray.serve")
    from quill.cluster.deployments import ClusterOptions, app_builder, parse_serve_args
    from quill.cluster.serve_cmd import cluster_options

    with pytest.raises(ValueError, match="replicas must be >= 1, got 0"):
        ClusterOptions(replicas=0)
    with pytest.raises(ValueError, match=r"max_replicas \(1\) must be >= replicas \(2\)"):
        ClusterOptions(replicas=2, max_replicas=1)
    with pytest.raises(ValueError, match=r"target_ongoing_requests must be in \(0, max_ongoing_requests=4\], got 5"):
        ClusterOptions(target_ongoing_requests=5, max_ongoing_requests=4)
    with pytest.raises(ValueError, match="router must be one of prefix, pow2, round-robin, ray-prefix, got 'x'"):
        ClusterOptions(router="x")
    with pytest.raises(ValueError, match="unknown quill app argument.s. replica; known: args, "):
        app_builder({"replica": 2})
    args = parse_serve_args(["--ray", "--replicas", "2", "--max-num-seqs", "8"])
    options = cluster_options(args, cpu_count=2)
    assert (options.replicas, options.replica_cpus, args.threads, options.max_ongoing_requests, options.router,
            options.autoscaling) == (2, 1.0, 1, 16, "prefix", False)
    scaled = cluster_options(parse_serve_args(["--ray", "--max-replicas", "3", "--threads", "2"]), cpu_count=2)
    assert scaled.autoscaling and scaled.replica_cpus == 2.0 and scaled.target_ongoing_requests == 8.0


def test_replica_deployment_options_carry_scaling_and_routing():
    pytest.importorskip("ray.serve")
    from quill.cluster.deployments import ClusterOptions, replica_deployment_options
    from quill.cluster.ray_router import QuillPrefixRouter, RoundRobinRouter

    fixed = replica_deployment_options(ClusterOptions(replicas=2, replica_cpus=1.0, max_ongoing_requests=16))
    assert fixed["num_replicas"] == 2 and "autoscaling_config" not in fixed
    assert fixed["ray_actor_options"] == {"num_cpus": 1.0} and fixed["max_ongoing_requests"] == 16
    assert fixed["request_router_config"].request_router_kwargs == {"imbalance_threshold": 4}
    assert fixed["request_router_config"].request_router_class in (QuillPrefixRouter, "quill.cluster.ray_router.QuillPrefixRouter")
    scaled = replica_deployment_options(ClusterOptions(replicas=1, max_replicas=4, target_ongoing_requests=6))
    auto = scaled["autoscaling_config"]
    assert "num_replicas" not in scaled
    assert (auto.min_replicas, auto.initial_replicas, auto.max_replicas, auto.target_ongoing_requests) == (1, 1, 4, 6)
    assert "request_router_config" not in replica_deployment_options(ClusterOptions(router="pow2"))
    robin = replica_deployment_options(ClusterOptions(router="round-robin"))["request_router_config"]
    assert robin.request_router_class in (RoundRobinRouter, "quill.cluster.ray_router.RoundRobinRouter")
