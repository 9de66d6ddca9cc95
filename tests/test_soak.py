"""`quill bench soak`: its pieces against an in-process mock server (healthy, then broken on purpose),
and a real `quill serve --enable-fault-injection` under a 60 s storm (slow)."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
from pathlib import Path

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from quill.bench import soak
from quill.bench.soak_cases import BAD_CASES, FAULT_HEADER, bad_body, healthy_body, healthy_pool
from quill.bench.soak_storm import Reply, SoakConfig, classify
from server_utils import ServeProcess, ThreadServer, free_port

MOCK_MODEL = "mock"
HEALTHY_KEYS = {"model", "messages", "max_tokens", "temperature", "stream", "top_p", "seed", "stream_options",
                "guided_choice"}


class Mock:
    """A chat server that runs exactly the healthy request shapes soak sends (400 for anything else),
    with flaws switched on per test; gauges as quill's GET /v1/stats."""

    def __init__(self, **flaws):
        self.flaws = flaws
        self.count = 0  # chat requests that passed validation (the first 7 are the reference runs)
        self.abandoned = 0  # streams whose client went away
        self.stats = flaws.get("stats", True)

    def valid(self, body) -> bool:
        if not isinstance(body, dict) or not set(body) <= HEALTHY_KEYS or body.get("model") != MOCK_MODEL:
            return False
        max_tokens, messages = body.get("max_tokens"), body.get("messages")
        if type(max_tokens) is not int or not 1 <= max_tokens <= 64:
            return False
        if not isinstance(messages, list) or not messages:
            return False
        for message in messages:
            if not isinstance(message, dict) or message.get("role") not in ("system", "user"):
                return False
            content = message.get("content")
            if not isinstance(content, str) or len(content) > 2000:
                return False
            try:
                content.encode()
            except UnicodeEncodeError:
                return False
        temperature = body.get("temperature")
        if not isinstance(temperature, (int, float)) or not 0 <= temperature <= 2:
            return False
        if "top_p" in body and not 0 < body["top_p"] <= 1:
            return False
        if "seed" in body and not (type(body["seed"]) is int and 0 <= body["seed"] < 2**63):
            return False
        if "stream_options" in body and body["stream_options"] != {"include_usage": True}:
            return False
        if "guided_choice" in body and self.flaws.get("no_guided"):
            return False
        return body.get("guided_choice", ["yes", "no", "maybe"]) == ["yes", "no", "maybe"]

    def words(self, body: dict) -> list[str]:
        content = body["messages"][-1]["content"]
        words = [f"w{(len(content) * 31 + i * 7 + (body.get('seed') or 0)) % 97}" for i in range(body["max_tokens"])]
        if self.flaws.get("wrong_text") and self.count > 7 and body.get("temperature") == 0:  # after the references
            words[-1] = "WRONG"
        return [" " + word for word in words]

    def app(self) -> Starlette:
        async def models(request: Request):
            return JSONResponse({"object": "list", "data": [{"id": MOCK_MODEL, "object": "model"}]})

        async def stats(request: Request):
            if not self.stats:
                return JSONResponse({"error": "no"}, status_code=404)
            growth = self.flaws.get("rss_per_request", 0) * self.count
            growth += self.flaws.get("rss_first_touch", 0) * min(self.count, 40)  # reserved, touched once
            return JSONResponse({"in_flight": 0, "max_model_len": 500, "engine": {
                "running": 0, "waiting": 0, "kv_blocks_total": 100, "kv_blocks_cached": 4,
                "kv_blocks_used": self.abandoned if self.flaws.get("leak") else 0,
                "process_rss_bytes": 100_000_000 + growth}})

        async def chat(request: Request):
            try:
                body = json.loads(await request.body())
            except (ValueError, UnicodeDecodeError):
                body = None
            if body is not None and isinstance(body, dict) and any(isinstance(v, float) and math.isnan(v) for v in body.values()):
                body = None
            if not self.valid(body):
                status = 500 if self.flaws.get("bad_is_500") else 400
                return JSONResponse({"error": {"message": "bad request"}}, status_code=status)
            self.count += 1
            count = self.count
            words = self.words(body)
            fault = request.headers.get(FAULT_HEADER)
            if not body.get("stream"):
                return JSONResponse({"choices": [{"index": 0, "message": {"role": "assistant", "content": "".join(words)},
                                                  "finish_reason": "length"}]})

            async def events():
                finished = False
                try:
                    yield 'data: {"choices": [{"index": 0, "delta": {"role": "assistant"}}]}\n\n'
                    for i, word in enumerate(words):
                        await asyncio.sleep(0.002)
                        if fault and i == 1:
                            yield f"data: {json.dumps({'error': {'message': f'injected at {fault}', 'code': 500}})}\n\n"
                            break
                        yield f"data: {json.dumps({'choices': [{'index': 0, 'delta': {'content': word}}]})}\n\n"
                    if self.flaws.get("drop_done") and count > 7 and count % 5 == 0:
                        finished = True
                        return
                    yield "data: [DONE]\n\n"
                    finished = True
                finally:
                    if not finished:
                        self.abandoned += 1

            return StreamingResponse(events(), media_type="text/event-stream")

        return Starlette(routes=[Route("/v1/models", models), Route("/v1/stats", stats),
                                 Route("/v1/chat/completions", chat, methods=["POST"])])


def run_cli(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="quill bench")
    soak.register(parser.add_subparsers())
    return (args := parser.parse_args(["soak", "--no-progress", *argv])).func(args)


def run_mock(mock: Mock, tmp_path: Path, *argv: str) -> tuple[int, dict]:
    out = tmp_path / "soak.json"
    with ThreadServer(mock.app()) as server:
        code = run_cli("--base-url", server.url, "--json", str(out), "--settle", "2", *argv)
    return code, json.loads(out.read_text())


def verdicts(result: dict) -> dict[str, bool | None]:
    return {row["name"]: row["passed"] for row in result["criteria"]}


STORM = ("--duration", "2", "--concurrency", "4", "--max-tokens", "6")


def test_healthy_mock_passes_every_criterion(tmp_path, capsys):
    code, result = run_mock(Mock(), tmp_path, *STORM, "--disconnect", "0.3", "--bad-input", "0.3", "--faulty", "0.2")
    out = capsys.readouterr().out
    assert code == 0, out
    counts = result["counts"]
    assert all(verdicts(result).values()), result["criteria"]
    assert sum(counts["sent"].values()) == counts["total"] == len(result["requests"]) > 20
    assert all(counts["sent"][kind] > 0 for kind in ("healthy", "disconnect", "bad", "faulty")), counts["sent"]
    assert counts["outcomes"]["bad"] == {"rejected": counts["sent"]["bad"]}
    assert counts["outcomes"]["healthy"] == {"completed": counts["sent"]["healthy"]}
    assert counts["faults_reported"] > 0 and counts["disconnected"] > 0
    assert set(counts["outcomes"]["faulty"]) <= {"fault_reported", "completed"}  # the grammar phase on a free request
    assert result["rss_growth"] == 0.0 and result["idle"]
    assert sum(sum(t.values()) for t in counts["faulty_by_phase"].values()) == counts["sent"]["faulty"]
    assert "faulty by phase: " in out
    for line in ("PASS  no 5xx", "PASS  no leaked KV blocks", "PASS  RSS growth < 5%", "result: PASS"):
        assert line in out
    # The reference run is the pool alone, and one streaming and one JSON reply were compared with it.
    assert set(result["references"]) == {item.name for item in healthy_pool()}
    healthy = [r for r in result["requests"] if r["kind"] == "healthy"]
    assert {r["stream"] for r in healthy} == {True, False}


def test_broken_mock_fails_each_criterion_with_evidence(tmp_path, capsys):
    mock = Mock(bad_is_500=True, drop_done=True, wrong_text=True, leak=True, rss_per_request=1_000_000)
    code, result = run_mock(mock, tmp_path, *STORM, "--disconnect", "0.3", "--bad-input", "0.2")
    out = capsys.readouterr().out
    assert code == 1, out
    assert verdicts(result) == {"no 5xx": False, "no lost requests": False, "no healthy request refused (4xx)": True,
                                "no healthy mismatches": False, "no leaked KV blocks": False,
                                "RSS growth < 5%": False}, result["criteria"]
    counts = result["counts"]
    assert counts["server_errors"] == counts["sent"]["bad"] > 0
    assert all(s["detail"].startswith("HTTP 500") for s in counts["server_error_samples"])
    assert {s["detail"] for s in counts["lost_samples"]} == {"stream ended before [DONE]"}
    assert all("WRONG" in s["detail"] for s in counts["mismatch_samples"])
    assert result["gauges_after"]["kv_blocks_used"] > 0
    assert "result: FAIL" in out and "FAIL  no leaked KV blocks" in out and "5xx: bad" in out


def test_warmup_keeps_first_touch_out_of_rss_growth(tmp_path, capsys):
    # Memory touched during the first 40 requests only (a lazily mapped pool) is growth when the baseline
    # follows the reference runs, and none when it follows the warm-up storm.
    storm = ("--duration", "1", "--concurrency", "4", "--max-tokens", "6", "--disconnect", "0", "--bad-input", "0")
    code, cold = run_mock(Mock(rss_first_touch=1_000_000), tmp_path, *storm, "--warmup", "0")
    assert code == 1 and verdicts(cold)["RSS growth < 5%"] is False and cold["rss_growth"] > 0.05, cold["criteria"]
    assert cold["warmup_seconds"] == 0 and not any(r["warmup"] for r in cold["requests"])
    capsys.readouterr()
    code, warm = run_mock(Mock(rss_first_touch=1_000_000), tmp_path, *storm, "--warmup", "1")
    out = capsys.readouterr().out
    assert code == 0 and warm["rss_growth"] == 0.0, out
    warmup = [r for r in warm["requests"] if r["warmup"]]
    assert len(warmup) > 40 and all(r["outcome"] == "completed" for r in warmup)  # checked like the rest
    assert warm["counts"]["total"] == len(warm["requests"]) > len(warmup)
    assert "s warm-up:" in out and "before (after the warm-up)" in out


def test_process_rss_leaves_out_freed_heap():
    """The RSS the server's stats report does not count heap memory freed since: 150 MiB of 1.5 KiB objects
    (malloc'd from glibc's arenas, not mmap'd) raise it, and once freed it falls back near where it was; a
    leak (objects still referenced) would stay."""
    from quill.engine.async_engine import process_rss_bytes

    before = process_rss_bytes()
    held = [bytes(1500) + bytes([i % 256]) for i in range(100_000)]
    during = process_rss_bytes()
    assert during - before > 100 << 20, (before, during)
    del held
    after = process_rss_bytes()
    assert after - before < (during - before) / 4, (before, during, after)


def test_server_without_stats_or_guided_decoding(tmp_path, capsys):
    code, result = run_mock(Mock(stats=False, no_guided=True), tmp_path, "--duration", "0.5", "--concurrency", "2",
                            "--max-tokens", "4", "--disconnect", "0", "--bad-input", "0", "--faulty", "0.5")
    out = capsys.readouterr().out
    assert code == 0, out
    assert verdicts(result)["no leaked KV blocks"] is None and verdicts(result)["RSS growth < 5%"] is None
    assert "server gauges: not available" in out and "n/a   no leaked KV blocks" in out
    # The constrained pool item is left out (and named), not counted as a refusal.
    assert list(result["skipped_pool_items"]) == ["guided-choice"] and "guided-choice left out" in out
    assert "guided-choice" not in {r["case"].split("/")[-1] for r in result["requests"]}


def test_arguments_and_unreachable_server(capsys):
    assert run_cli("--base-url", "http://127.0.0.1:9", "--disconnect", "0.6", "--bad-input", "0.5") == 2
    assert "at most 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        run_cli("--base-url", "http://127.0.0.1:9", "--faulty", "1.5")
    assert "fraction" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        run_cli("--base-url", "http://127.0.0.1:9", "--warmup", "-1")
    assert "expected a number of at least 0, got '-1'" in capsys.readouterr().err
    assert run_cli("--base-url", f"http://127.0.0.1:{free_port()}", "--duration", "1") == 1
    assert "cannot list models" in capsys.readouterr().err


def test_classify():
    done = Reply(status=200, text="abc", done=True)
    assert classify("healthy", done, "abc") == ("completed", None)
    assert classify("healthy", done, "abd")[0] == "mismatch"
    assert classify("faulty", Reply(status=200, error_event="boom", done=True), "abc") == ("fault_reported", "boom")
    assert classify("faulty", Reply(status=200, error_event="boom", failure="stream ended before [DONE]"), "x")[0] == "lost"
    assert classify("healthy", Reply(status=200, error_event="boom", done=True), "x")[0] == "server_error"
    assert classify("bad", Reply(status=422), None) == ("rejected", "HTTP 422")
    assert classify("bad", Reply(status=200, cut=True), None) == ("accepted", "HTTP 200")
    assert classify("bad", Reply(status=503, body="busy"), None)[0] == "server_error"
    assert classify("healthy", Reply(status=429), "x")[0] == "refused"
    assert classify("disconnect", Reply(status=200, cut=True, chunks=3), "x") == ("disconnected", "after 3 chunks")
    assert classify("disconnect", Reply(cut=True), "x") == ("disconnected", "before the response headers")
    assert classify("healthy", Reply(failure="no answer within 5 s"), "x") == ("lost", "no answer within 5 s")


def test_bad_cases_are_all_distinct_and_invalid():
    pool = healthy_pool()
    assert len({case.name for case in BAD_CASES}) == len(BAD_CASES) >= 25
    mock = Mock()
    for case in BAD_CASES:
        for stream in (False, True):
            raw = bad_body(case, MOCK_MODEL, 8, 500, stream)
            try:
                body = json.loads(raw)
            except ValueError:
                continue
            assert not mock.valid(body), case.name
    for item in pool:  # and the healthy shapes pass the same check
        assert mock.valid(healthy_body(item, MOCK_MODEL, 8, stream=True, include_usage=True))
    assert "\\ud800" in bad_body(next(c for c in BAD_CASES if c.name == "lone-surrogate"), "m", 8, 500, False).decode()


def test_config_validation():
    with pytest.raises(ValueError, match="at most 1"):
        SoakConfig("http://x", 1, 1, 0.5, 0.5, 0.5).validate()
    SoakConfig("http://x", 1, 1, 0.5, 0.25, 0.25).validate()


# ---- the real server -----------------------------------------------------------------------------

REAL_STORM = ("--duration", "60", "--concurrency", "8", "--disconnect", "0.3", "--bad-input", "0.1",
              "--faulty", "0.05", "--max-tokens", "24", "--seed", "1", "--request-timeout", "300")


@pytest.mark.slow
def test_real_server_survives_a_60s_storm(tmp_path, capsys):
    # A small KV pool and few sequences per step: requests queue, get preempted and recomputed.
    server = ServeProcess(tmp_path, "--enable-fault-injection", "--kv-cache-memory", "24MiB", "--max-num-seqs", "4",
                          "--max-num-batched-tokens", "64", "--max-model-len", "1024", "--log-level", "warning",
                          model_name="quill-soak")
    url = server.url
    try:
        server.wait_ready()
        out_json = tmp_path / "soak.json"
        code = run_cli("--base-url", url, *REAL_STORM, "--json", str(out_json))
        report = capsys.readouterr().out
        print(report)
        result = json.loads(out_json.read_text())
        counts = result["counts"]
        assert counts["server_errors"] == 0, counts["server_error_samples"]
        assert counts["lost"] == 0, counts["lost_samples"]
        assert counts["mismatches"] == 0, counts["mismatch_samples"]
        assert counts["refused"] == 0, counts["refused_samples"]
        assert result["idle"] and result["gauges_after"]["kv_blocks_used"] == 0, result["gauges_after"]
        assert all(counts["sent"][kind] > 0 for kind in ("healthy", "disconnect", "bad", "faulty")), counts["sent"]
        assert counts["faults_reported"] > 0, counts["outcomes"]["faulty"]
        assert code == 0, report
    finally:
        server.stop()
