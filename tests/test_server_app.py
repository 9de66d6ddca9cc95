"""The HTTP server against a fake engine, through the official openai client and raw HTTP."""

from __future__ import annotations

import json
import threading

import httpx
import openai
import pytest

from fake_engine import GREEDY_TEXT, FakeEngine
from quill.server.app import create_app
from server_utils import ThreadServer, metric_value

MODEL = "fake-model"
HELLO = [{"role": "user", "content": "Hello"}]


@pytest.fixture(scope="module")
def live():
    engine = FakeEngine(max_num_seqs=8)
    with ThreadServer(create_app(engine, MODEL, static_dir=None)) as server:
        server.engine = engine
        yield server


@pytest.fixture(scope="module")
def client(live):
    return openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0)


def sse_events(url: str, body: dict) -> list:
    """All `data:` payloads of a streamed request, [DONE] included as the string."""
    with httpx.stream("POST", url, json=body, timeout=30) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    return [line if line == "[DONE]" else json.loads(line) for line in lines]


# ---- happy paths ------------------------------------------------------------------------------


def test_models_health_and_openapi(live, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(live.url + "/health").status_code == 200
    spec = httpx.get(live.url + "/openapi.json").json()
    assert "/v1/chat/completions" in spec["paths"] and "/v1/completions" in spec["paths"]


def test_chat_non_streaming_usage_and_timings(client):
    resp = client.chat.completions.create(model=MODEL, messages=HELLO, temperature=0)
    choice = resp.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == GREEDY_TEXT
    assert choice.finish_reason == "stop"
    prompt_len = len("<user>Hello\n<assistant>")
    assert resp.usage.prompt_tokens == prompt_len
    assert resp.usage.completion_tokens == len(GREEDY_TEXT) + 1  # + EOS
    assert resp.usage.total_tokens == prompt_len + len(GREEDY_TEXT) + 1
    timings = resp.model_extra["timings"]
    assert timings["predicted_n"] == len(GREEDY_TEXT) + 1
    assert timings["prompt_n"] + timings["cache_n"] == prompt_len
    for key in ("prompt_ms", "predicted_ms", "predicted_per_second", "ttft_ms", "tpot_ms", "queue_ms"):
        assert timings[key] is not None and timings[key] >= 0, key


def test_chat_stream_role_first_usage_last_and_done(live, client):
    body = {"model": MODEL, "messages": HELLO, "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    events = sse_events(live.url + "/v1/chat/completions", body)
    assert events[-1] == "[DONE]"
    first, usage_chunk, chunks = events[0], events[-2], events[1:-2]
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == len(GREEDY_TEXT) + 1
    assert "timings" in usage_chunk
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    non_stream = client.chat.completions.create(model=MODEL, messages=HELLO, temperature=0)
    assert text == non_stream.choices[0].message.content


def test_stream_without_usage_puts_timings_on_the_last_chunk(live):
    body = {"model": MODEL, "messages": HELLO, "temperature": 0, "stream": True}
    events = sse_events(live.url + "/v1/chat/completions", body)
    assert events[-1] == "[DONE]"
    assert "timings" in events[-2] and events[-2]["choices"][0]["finish_reason"] == "stop"
    assert all("usage" not in e for e in events[:-1])


def test_openai_client_streaming(client):
    stream = client.chat.completions.create(model=MODEL, messages=HELLO, temperature=0, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].usage.prompt_tokens > 0
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == GREEDY_TEXT


def test_completions_string_token_ids_and_echo(client):
    resp = client.completions.create(model=MODEL, prompt="Say:", temperature=0, max_tokens=9)
    assert resp.choices[0].text == GREEDY_TEXT[:9]
    assert resp.choices[0].finish_reason == "length"
    assert resp.usage.completion_tokens == 9
    ids = client.completions.create(model=MODEL, prompt=list(b"Say:"), temperature=0, max_tokens=3)
    assert ids.choices[0].text == GREEDY_TEXT[:3] and ids.usage.prompt_tokens == 4
    echo = client.completions.create(model=MODEL, prompt="Say:", temperature=0, max_tokens=3, echo=True)
    assert echo.choices[0].text == "Say:" + GREEDY_TEXT[:3]


def test_completions_default_max_tokens_is_16(client):
    resp = client.completions.create(model=MODEL, prompt="x", temperature=0)
    assert resp.usage.completion_tokens == 16 and resp.choices[0].finish_reason == "length"


def test_stop_strings_stream_and_non_stream_agree(live, client):
    resp = client.chat.completions.create(model=MODEL, messages=HELLO, temperature=0, stop=["fox", "zzz"])
    assert resp.choices[0].message.content == "The quick brown "
    assert resp.choices[0].finish_reason == "stop"
    assert resp.choices[0].model_extra["stop_reason"] == "fox"
    events = sse_events(live.url + "/v1/chat/completions", {"model": MODEL, "messages": HELLO, "temperature": 0, "stop": "fox", "stream": True})
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events[1:-1])
    assert text == "The quick brown "


def test_max_tokens_gives_length(client):
    resp = client.chat.completions.create(model=MODEL, messages=HELLO, temperature=0, max_tokens=5)
    assert resp.choices[0].finish_reason == "length" and resp.choices[0].message.content == GREEDY_TEXT[:5]
    resp = client.chat.completions.create(model=MODEL, messages=HELLO, temperature=0, max_completion_tokens=4)
    assert resp.usage.completion_tokens == 4


def test_n_2_and_list_of_prompts(client):
    resp = client.chat.completions.create(model=MODEL, messages=HELLO, temperature=1.0, seed=3, n=2, max_tokens=12)
    assert [c.index for c in resp.choices] == [0, 1]
    assert resp.choices[0].message.content != resp.choices[1].message.content
    assert resp.usage.completion_tokens == 24
    many = client.completions.create(model=MODEL, prompt=["a", "bb"], n=2, temperature=0, max_tokens=2)
    assert sorted(c.index for c in many.choices) == [0, 1, 2, 3]
    assert many.usage.prompt_tokens == 3 and many.usage.completion_tokens == 8


def test_seed_reproducible(live, client):
    def run(seed):
        r = client.chat.completions.create(model=MODEL, messages=HELLO, temperature=1.0, seed=seed, max_tokens=20)
        return r.choices[0].message.content

    assert run(11) == run(11)
    assert run(11) != run(12)
    events = sse_events(live.url + "/v1/chat/completions", {"model": MODEL, "messages": HELLO, "temperature": 1.0, "seed": 11, "max_tokens": 20, "stream": True})
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events[1:-1]) == run(11)


def test_logprobs_chat_and_completions(client):
    resp = client.chat.completions.create(model=MODEL, messages=HELLO, temperature=0, max_tokens=4, logprobs=True, top_logprobs=2)
    content = resp.choices[0].logprobs.content
    assert [c.token for c in content] == list(GREEDY_TEXT[:4])
    assert all(len(c.top_logprobs) == 2 and c.logprob <= 0 for c in content)
    assert content[0].bytes == list(b"T")
    comp = client.completions.create(model=MODEL, prompt="x", temperature=0, max_tokens=3, logprobs=1)
    lp = comp.choices[0].logprobs
    assert lp.tokens == list(GREEDY_TEXT[:3]) and lp.text_offset == [0, 1, 2]
    assert len(lp.token_logprobs) == 3 and all(len(t) == 1 for t in lp.top_logprobs)
    plain = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=2)
    assert plain.choices[0].logprobs is None


def test_streamed_logprobs_cover_every_token(live):
    body = {"model": MODEL, "messages": HELLO, "temperature": 0, "max_tokens": 6, "logprobs": True, "top_logprobs": 1, "stream": True}
    events = sse_events(live.url + "/v1/chat/completions", body)
    tokens = [t["token"] for e in events[1:-1] if e["choices"][0]["logprobs"] for t in e["choices"][0]["logprobs"]["content"]]
    assert tokens == list(GREEDY_TEXT[:6])


def test_eight_concurrent_streams(client):
    results: dict[int, str] = {}

    def one(i: int) -> None:
        stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": f"hi {i}"}], temperature=0, max_tokens=30, stream=True)
        results[i] = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert results == {i: GREEDY_TEXT[:30] for i in range(8)}


def test_prefix_cache_hits_show_in_usage(client):
    messages = [{"role": "user", "content": "a long shared prefix " * 4}]
    client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1)
    again = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1)
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    assert again.model_extra["timings"]["cache_n"] == again.usage.prompt_tokens_details.cached_tokens


def test_sampling_fields_reach_the_engine(live, client):
    client.chat.completions.create(
        model=MODEL, messages=HELLO, max_tokens=5, temperature=0.5, top_p=0.9, presence_penalty=0.5, frequency_penalty=-0.5, seed=-1,
        extra_body={"top_k": 7, "min_p": 0.1, "repetition_penalty": 1.2, "ignore_eos": True, "min_tokens": 2, "stop_token_ids": [5],
                    "guided_choice": ["yes", "no"]},
    )
    params = list(live.engine.received_params.values())[-1]
    assert (params.temperature, params.top_p, params.top_k, params.min_p) == (0.5, 0.9, 7, 0.1)
    assert (params.repetition_penalty, params.presence_penalty, params.frequency_penalty) == (1.2, 0.5, -0.5)
    assert params.ignore_eos and params.min_tokens == 2 and params.stop_token_ids == (5,) and params.seed is None
    assert params.choice == ("yes", "no")
    client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=2, response_format={"type": "json_object"})
    assert list(live.engine.received_params.values())[-1].json_object
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=2,
                                   response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
    assert list(live.engine.received_params.values())[-1].json_schema == schema


def test_tokenize_and_detokenize(live):
    r = httpx.post(live.url + "/tokenize", json={"prompt": "hey"}).json()
    assert r == {"count": 3, "max_model_len": 512, "tokens": list(b"hey")}
    r = httpx.post(live.url + "/tokenize", json={"messages": HELLO}).json()
    assert r["count"] == len("<user>Hello\n<assistant>")
    assert httpx.post(live.url + "/detokenize", json={"tokens": list(b"hey")}).json() == {"prompt": "hey"}


def test_stats_endpoint(live):
    stats = httpx.get(live.url + "/v1/stats").json()
    assert stats["ready"] is True and stats["engine"]["kv_blocks_total"] == 256


def test_metrics_histograms_move(live, client):
    before = httpx.get(live.url + "/metrics").text
    client.chat.completions.create(model=MODEL, messages=HELLO, temperature=0, max_tokens=5)
    after = httpx.get(live.url + "/metrics").text
    for name in ("quill_time_to_first_token_seconds_count", "quill_e2e_request_latency_seconds_count",
                 "quill_queue_time_seconds_count", "quill_time_per_output_token_seconds_count"):
        assert metric_value(after, name) == metric_value(before, name) + 1, name
    assert metric_value(after, "quill_inter_token_latency_seconds_count") == metric_value(before, "quill_inter_token_latency_seconds_count") + 4
    assert metric_value(after, "quill_generation_tokens_total") == metric_value(before, "quill_generation_tokens_total") + 5
    length = {"finish_reason": "length"}
    assert metric_value(after, "quill_requests_total", length) == metric_value(before, "quill_requests_total", length) + 1
    prompt = {"kind": "computed"}
    assert metric_value(after, "quill_prompt_tokens_total", prompt) > metric_value(before, "quill_prompt_tokens_total", prompt)
    for gauge in ("quill_requests_running", "quill_requests_waiting", "quill_kv_blocks_used", "quill_kv_blocks_total", "quill_prefix_cache_hit_rate"):
        assert f"\n{gauge} " in after, gauge


def test_engine_failure_mid_stream_is_an_error_event(live):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "FAIL_MIDSTREAM"}], "temperature": 0, "stream": True}
    events = sse_events(live.url + "/v1/chat/completions", body)
    assert events[-1] == "[DONE]"
    assert "error" in events[-2] and events[-2]["error"]["message"]
    assert httpx.get(live.url + "/health").status_code == 200


def test_stream_n_2_every_choice_opens_and_finishes(live):
    body = {"model": MODEL, "messages": HELLO, "temperature": 1.0, "seed": 5, "n": 2, "max_tokens": 4, "stream": True}
    events = sse_events(live.url + "/v1/chat/completions", body)
    opening = [e["choices"][0] for e in events[:2]]
    assert [c["index"] for c in opening] == [0, 1] and all(c["delta"]["role"] == "assistant" for c in opening)
    finishes = {e["choices"][0]["index"]: e["choices"][0]["finish_reason"] for e in events[2:-1] if e["choices"][0]["finish_reason"]}
    assert finishes == {0: "length", 1: "length"}
    texts = {i: "".join(e["choices"][0]["delta"].get("content", "") for e in events[2:-1] if e["choices"][0]["index"] == i) for i in (0, 1)}
    assert all(len(t) == 4 for t in texts.values())


def test_stream_completions_with_echo(live):
    events = sse_events(live.url + "/v1/completions", {"model": MODEL, "prompt": "Say:", "max_tokens": 3, "temperature": 0, "echo": True, "stream": True})
    assert events[0]["object"] == "text_completion" and events[0]["choices"][0]["text"] == "Say:"
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == "Say:" + GREEDY_TEXT[:3]


def test_curl_style_form_content_type_is_read_as_json(live):
    body = json.dumps({"model": MODEL, "messages": HELLO, "max_tokens": 2, "temperature": 0})
    r = httpx.post(live.url + "/v1/chat/completions", content=body, headers={"Content-Type": "application/x-www-form-urlencoded"})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == GREEDY_TEXT[:2]


def test_get_one_model(live):
    assert httpx.get(live.url + f"/v1/models/{MODEL}").json()["id"] == MODEL
    r = httpx.get(live.url + "/v1/models/other")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
