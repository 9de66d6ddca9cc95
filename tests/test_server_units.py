"""Server pieces without a server: flags, sizes, parameter mapping, timings, metrics hooks."""

from __future__ import annotations

import argparse

import pytest

from quill.outputs import CompletionOutput
from quill.server.errors import APIError
from quill.server.metrics import ServerMetrics
from quill.server.protocol import ChatCompletionRequest, CompletionRequest, to_sampling_params
from quill.server.responses import timings
from quill.server.serve_cmd import engine_config, parse_size, register
from server_utils import metric_value


@pytest.mark.parametrize("text,value", [
    ("2GiB", 2 * 1024**3), ("512M", 512 * 1024**2), ("1.5GB", 1_500_000_000), ("4096", 4096), ("64 kib", 65536), ("1mb", 10**6),
])
def test_parse_size(text, value):
    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["", "2 gigs", "-1G", "0", "G"])
def test_parse_size_rejects(text):
    with pytest.raises(ValueError, match="size"):
        parse_size(text)


def parse(argv):
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    return parser.parse_args(["serve", *argv])


def test_flags_build_the_engine_config():
    args = parse(["--kv-cache-memory", "256MiB", "--max-num-seqs", "8", "--max-num-batched-tokens", "128", "--no-prefix-cache",
                  "--max-waiting", "3", "--threads", "2", "--max-model-len", "1024", "--model", "m.gguf"])
    cfg = engine_config(args)
    assert cfg.model == "m.gguf" and cfg.threads == 2 and cfg.max_model_len == 1024
    assert cfg.cache.kv_cache_memory == 256 * 2**20 and not cfg.cache.enable_prefix_caching
    assert (cfg.scheduler.max_num_seqs, cfg.scheduler.max_num_batched_tokens, cfg.scheduler.max_waiting) == (8, 128, 3)
    defaults = engine_config(parse([]))
    assert defaults.model is None and defaults.cache.enable_prefix_caching and defaults.scheduler.max_waiting is None
    assert args.host == "127.0.0.1" and args.port == 8000 and args.func.__name__ == "run"


@pytest.mark.parametrize("argv", [["--kv-cache-memory", "lots"], ["--max-num-seqs", "0"], ["--drain-timeout", "-1"], ["--log-level", "loud"]])
def test_bad_flags_exit_with_usage(argv, capsys):
    with pytest.raises(SystemExit):
        parse(argv)
    assert "error" in capsys.readouterr().err


def test_chat_params_map_names_and_defaults():
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], logprobs=True, top_logprobs=3, stop="END", seed=-1)
    p = to_sampling_params(req, max_tokens=10, vocab_size=100)
    assert (p.logprobs, p.stop, p.seed, p.temperature, p.top_p, p.n, p.max_tokens) == (3, ("END",), None, 1.0, 1.0, 1, 10)
    assert to_sampling_params(ChatCompletionRequest(messages=[{"role": "user", "content": "x"}]), 5, 100).logprobs is None
    with pytest.raises(APIError) as info:
        to_sampling_params(ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], max_completion_tokens=1), -1, 100)
    assert info.value.param == "max_completion_tokens" and info.value.status == 400


def test_completion_params_and_guided_sources():
    req = CompletionRequest(prompt="x", logprobs=2, guided_json={"type": "object"})
    p = to_sampling_params(req, 4, 100)
    assert p.logprobs == 2 and p.json_schema == {"type": "object"}
    with pytest.raises(APIError) as info:
        to_sampling_params(CompletionRequest(prompt="x", response_format={"type": "json_object"}, guided_regex="a"), 4, 100)
    assert info.value.param == "response_format"


def test_timings_single_and_aggregated():
    one = {"prompt_tokens": 10, "cached_tokens": 4, "output_tokens": 5, "queue_ms": 1.0, "ttft_ms": 20.0, "tpot_ms": 10.0,
           "e2e_ms": 60.0, "prefill_ms": 12.0}
    t = timings([[one]])
    assert (t["prompt_n"], t["cache_n"], t["predicted_n"], t["predicted_ms"]) == (6, 4, 5, 40.0)
    assert t["predicted_per_second"] == pytest.approx(100.0)  # (5 - 1) / 40 ms
    assert t["prompt_per_second"] == pytest.approx(500.0)  # 6 / 12 ms
    two = dict(one, output_tokens=3, e2e_ms=100.0, ttft_ms=30.0, tpot_ms=35.0)
    agg = timings([[one, two]])
    assert agg["prompt_n"] == 6 and agg["predicted_n"] == 8 and agg["predicted_ms"] == 70.0
    assert agg["ttft_ms"] == 20.0 and agg["e2e_ms"] == 100.0 and agg["tpot_ms"] == 22.5
    empty = timings([[{}]])
    assert empty["predicted_per_second"] is None and empty["prompt_n"] == 0


def test_metrics_hook_counts_and_skips_abort_latencies():
    m = ServerMetrics(lambda: {"running": 2, "kv_blocks_used": 7})
    done = {"prompt_tokens": 10, "cached_tokens": 4, "queue_ms": 5.0, "ttft_ms": 50.0, "tpot_ms": 10.0, "e2e_ms": 90.0, "itl_ms": [10.0, 10.0]}
    m.on_request_finished("a", CompletionOutput(0, "hi", [1, 2, 3], "stop", metrics=done))
    m.on_request_finished("a", CompletionOutput(1, "ho", [1, 2], "length", metrics=done))  # n=2: prompt counted once
    m.on_request_finished("b", CompletionOutput(0, "", [], "abort", metrics={"prompt_tokens": 8, "cached_tokens": 0, "queue_ms": None}))
    text = m.render().decode()
    assert metric_value(text, "quill_requests_total", {"finish_reason": "stop"}) == 1
    assert metric_value(text, "quill_requests_total", {"finish_reason": "abort"}) == 1
    assert metric_value(text, "quill_prompt_tokens_total", {"kind": "computed"}) == 6
    assert metric_value(text, "quill_prompt_tokens_total", {"kind": "cached"}) == 4
    assert metric_value(text, "quill_generation_tokens_total") == 5
    assert metric_value(text, "quill_time_to_first_token_seconds_count") == 2
    assert metric_value(text, "quill_inter_token_latency_seconds_count") == 4
    assert metric_value(text, "quill_requests_running") == 2 and metric_value(text, "quill_kv_blocks_used") == 7
