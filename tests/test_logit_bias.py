"""logit_bias (OpenAI semantics): validation, the sampler (per row, greedy too, under a grammar mask,
logprobs without the bias), the server on both endpoints, the Python API and a real `quill serve`."""

from __future__ import annotations

import httpx
import openai
import pytest
import torch

from fake_engine import FakeEngine
from quill.engine.sampler import Sampler, SamplingRow
from quill.sampling_params import LOGIT_BIAS_MAX_ENTRIES, ParamError, SamplingParams
from quill.server.app import create_app
from server_utils import ThreadServer, serving

V = 8
EOS = 7
DRAWS = 2000


def row(params: SamplingParams, generator=None, mask=None) -> SamplingRow:
    return SamplingRow(params, [1, 2], [], generator, mask)


def draws(sampler: Sampler, logits: torch.Tensor, rows: list[SamplingRow], steps: int) -> list[list[int]]:
    """Tokens drawn per row over `steps` calls on the same logits."""
    out = [[] for _ in rows]
    for _ in range(steps):
        result = sampler(logits, rows)
        assert not result.errors
        for i, token in enumerate(result.token_ids):
            out[i].append(token)
    return out


# ---------------------------------------------------------------- SamplingParams


def test_keys_are_ints_or_integer_strings_stored_as_ints():
    params = SamplingParams(logit_bias={"5": 1, 7: -100, "0": 100.0, 3: 2.5})
    assert params.logit_bias == {5: 1.0, 7: -100.0, 0: 100.0, 3: 2.5}
    assert all(type(k) is int and type(v) is float for k, v in params.logit_bias.items())
    assert SamplingParams(logit_bias={}).logit_bias is None
    assert SamplingParams().logit_bias is None


@pytest.mark.parametrize("bias, words", [
    ({"abc": 1}, ["'abc'", "not a token id"]),
    ({"5.0": 1}, ["'5.0'", "not a token id"]),
    ({" 5": 1}, ["' 5'", "not a token id"]),
    ({True: 1}, ["True", "not a token id"]),
    ({"9" * 5000: 1}, ["not a token id", "18 digits"]),
    ({"-3": 1}, ["-3", "negative"]),
    ({"5": 1, "05": 2}, ["'5'", "'05'", "same token id 5"]),
    ({"5": "x"}, ["token id 5", "number", "'x'"]),
    ({"5": True}, ["token id 5", "number", "True"]),
    ({"5": float("nan")}, ["token id 5", "finite", "nan"]),
    ({"5": float("inf")}, ["token id 5", "finite", "inf"]),
    ({"5": 100.5}, ["token id 5", "[-100, 100]", "100.5"]),
    ({"5": -101}, ["token id 5", "[-100, 100]", "-101"]),
    ({"5": 10**400}, ["token id 5", "[-100, 100]"]),
    ({str(i): 1 for i in range(LOGIT_BIAS_MAX_ENTRIES + 1)}, ["at most 300", "got 301"]),
    ([(5, 1)], ["mapping", "list"]),
])
def test_bad_logit_bias_names_the_limit_and_the_value(bias, words):
    with pytest.raises(ParamError) as info:
        SamplingParams(logit_bias=bias)
    assert info.value.param == "logit_bias"
    message = str(info.value)
    assert message.startswith("logit_bias: ") and len(message) < 200
    for word in words:
        assert word in message, message


def test_three_hundred_entries_and_the_range_ends_are_accepted():
    params = SamplingParams(logit_bias={i: (100 if i % 2 else -100) for i in range(LOGIT_BIAS_MAX_ENTRIES)})
    assert len(params.logit_bias) == 300
    params.check_logit_bias(300)
    with pytest.raises(ParamError, match=r"token id 299 is outside the vocabulary \[0, 299\)"):
        params.check_logit_bias(299)


# ---------------------------------------------------------------- sampler


def test_minus_100_never_drawn_plus_100_always_drawn_at_temperature_1():
    sampler = Sampler(V, (EOS,))
    torch.manual_seed(0)
    logits = torch.zeros(3, V)
    logits[:, 2] = 3.0  # without a bias, token 2 is drawn about 3/4 of the time
    rows = [row(SamplingParams(temperature=1.0, logit_bias={2: -100})),
            row(SamplingParams(temperature=1.0, logit_bias={"5": 100})),
            row(SamplingParams(temperature=1.0))]
    banned, forced, free = draws(sampler, logits, rows, DRAWS)
    assert 2 not in banned and len(set(banned)) == V - 1  # every other token still comes up
    assert set(forced) == {5}
    assert 0.65 < free.count(2) / DRAWS < 0.85 and 5 in free  # the unbiased row in the same batch


def test_greedy_takes_the_argmax_of_the_biased_logits():
    sampler = Sampler(V, (EOS,))
    logits = torch.tensor([[0.0, 1.0, 9.0, 8.5, 0.0, 0.0, 0.0, 0.0]] * 4)
    rows = [row(SamplingParams(temperature=0, logit_bias={2: -1})),  # 8.0 < 8.5: token 3 wins
            row(SamplingParams(temperature=0, logit_bias={2: -0.4})),  # 8.6 > 8.5: still 2
            row(SamplingParams(temperature=0, logit_bias={0: 100})),
            row(SamplingParams(temperature=0))]
    assert sampler(logits, rows).token_ids == [3, 2, 0, 2]


def test_each_row_gets_only_its_own_bias():
    """A biased row changes nothing for its neighbours: a seeded unbiased row draws the same tokens
    alone and between two biased rows, and a greedy row keeps its argmax."""
    sampler = Sampler(V, (EOS,))
    torch.manual_seed(3)
    logits = torch.randn(4, V)
    unbiased = SamplingParams(temperature=1.0, seed=7)
    g = torch.Generator().manual_seed(7)
    alone = [sampler(logits[1:2], [row(unbiased, g)]).token_ids[0] for _ in range(50)]
    g = torch.Generator().manual_seed(7)
    batch = [row(SamplingParams(temperature=1.0, logit_bias={t: -100 for t in range(V - 1)})),
             row(unbiased, g),
             row(SamplingParams(temperature=0, logit_bias={1: 100})),
             row(SamplingParams(temperature=0))]
    results = [sampler(logits, batch) for _ in range(50)]
    assert [r.token_ids[1] for r in results] == alone
    assert {r.token_ids[0] for r in results} == {V - 1}  # every other id banned on row 0
    assert {r.token_ids[2] for r in results} == {1}
    assert {r.token_ids[3] for r in results} == {int(logits[3].argmax())}
    assert len(set(alone)) > 1  # the seeded row really samples, so equality above is not luck


def test_the_callers_logits_are_not_modified():
    sampler = Sampler(V, (EOS,))
    logits = torch.randn(2, V)
    before = logits.clone()
    sampler(logits, [row(SamplingParams(temperature=0, logit_bias={3: 50})), row(SamplingParams(temperature=1, logit_bias={4: -50}))])
    assert torch.equal(logits, before)


def test_a_batch_without_bias_keeps_the_greedy_fast_path(monkeypatch):
    """No request with a bias: plain greedy rows never reach the processing path (no copy, no bias
    work); one biased row in the batch sends it there."""
    sampler = Sampler(V, (EOS,))
    logits = torch.randn(3, V)

    def refuse(*args, **kwargs):
        raise AssertionError("processing path taken")

    monkeypatch.setattr(sampler, "_process", refuse)
    plain = [row(SamplingParams(temperature=0)) for _ in range(3)]
    assert sampler(logits, plain).token_ids == logits.argmax(dim=-1).tolist()
    with pytest.raises(AssertionError, match="processing path"):
        sampler(logits, plain[:2] + [row(SamplingParams(temperature=0, logit_bias={0: 1}))])


def test_a_token_the_grammar_forbids_stays_forbidden():
    sampler = Sampler(V, (EOS,))
    torch.manual_seed(4)
    logits = torch.randn(1, V)
    mask = torch.tensor([True, True, False, True, False, False, False, False])
    params = SamplingParams(temperature=1.0, logit_bias={2: 100, 4: 100, 3: 100})
    drawn = draws(sampler, logits, [row(params, mask=mask)], 200)[0]
    assert set(drawn) == {3}  # the one allowed token with a bias; 2 and 4 stay masked
    masked = logits.clone()
    masked[0, ~mask] = float("-inf")  # the runner's MaskWorker writes -inf before the sampler
    drawn = draws(sampler, masked, [SamplingRow(params, [1], [], None, constrained=True)], 200)[0]
    assert set(drawn) == {3}
    greedy = SamplingParams(temperature=0, logit_bias={2: 100, 4: 100})
    assert sampler(masked, [SamplingRow(greedy, [1], [], None, constrained=True)]).token_ids == [int(masked[0].argmax())]


def test_logprobs_are_of_the_distribution_without_the_bias():
    sampler = Sampler(V, (EOS,))
    torch.manual_seed(5)
    logits = torch.randn(2, V)
    rows = [row(SamplingParams(temperature=0, logprobs=3, logit_bias={6: 100})),
            row(SamplingParams(temperature=1.0, logprobs=0, logit_bias={"1": 100}))]
    out = sampler(logits, rows)
    assert out.token_ids == [6, 1]
    reference = torch.log_softmax(logits, dim=-1)
    assert out.logprobs[0]["logprob"] == pytest.approx(reference[0, 6].item(), abs=1e-6)
    assert out.logprobs[1]["logprob"] == pytest.approx(reference[1, 1].item(), abs=1e-6)
    assert [t for t, _ in out.logprobs[0]["top"]] == reference[0].topk(3).indices.tolist()


def test_an_id_outside_the_vocabulary_fails_its_row_alone():
    sampler = Sampler(V, (EOS,))
    logits = torch.randn(2, V + 4)  # padded logits: ids V.. are padding, never a bias target
    out = sampler(logits, [row(SamplingParams(temperature=0, logit_bias={V: 100})), row(SamplingParams(temperature=0, logit_bias={1: 100}))])
    assert set(out.errors) == {0} and "token id 8 is outside the vocabulary [0, 8)" in str(out.errors[0])
    assert out.token_ids == [-1, 1]


# ---------------------------------------------------------------- server (fake engine, official client)


@pytest.fixture(scope="module")
def fake():
    engine = FakeEngine(max_model_len=128)  # vocabulary of 260 ids
    with ThreadServer(create_app(engine, "fake-model", static_dir=None)) as server:
        server.engine = engine
        server.client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        yield server


def test_both_endpoints_pass_logit_bias_to_the_engine(fake):
    chat = fake.client.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "hi"}],
                                               max_tokens=2, logit_bias={"65": 10, "66": -100})
    assert fake.engine.received_params[chat.id].logit_bias == {65: 10.0, 66: -100.0}
    comp = fake.client.completions.create(model="fake-model", prompt="hi", max_tokens=2, logit_bias={"259": 100})
    assert fake.engine.received_params[comp.id].logit_bias == {259: 100.0}
    streamed = list(fake.client.completions.create(model="fake-model", prompt="hi", max_tokens=2, stream=True, logit_bias={"1": 1}))
    assert fake.engine.received_params[streamed[0].id].logit_bias == {1: 1.0}


@pytest.mark.parametrize("bias, words", [
    ({"260": 1}, ["token id 260", "[0, 260)"]),
    ({"x": 1}, ["'x'", "not a token id"]),
    ({"5": 150}, ["[-100, 100]", "150"]),
    ({str(i): 1 for i in range(301)}, ["at most 300", "301"]),
])
@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_bad_logit_bias_is_a_400_naming_the_field(fake, endpoint, bias, words):
    with pytest.raises(openai.BadRequestError) as info:
        if endpoint == "chat":
            fake.client.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "hi"}], logit_bias=bias)
        else:
            fake.client.completions.create(model="fake-model", prompt="hi", logit_bias=bias)
    error = info.value.body
    assert info.value.status_code == 400 and error["param"] == "logit_bias" and error["type"] == "invalid_request_error"
    for word in words:
        assert word in error["message"], error


def test_non_finite_or_non_numeric_bias_in_the_json_is_a_400(fake):
    for raw in (b'{"5": NaN}', b'{"5": 1e999}', b'{"5": "1"}', b'[[5, 1]]'):
        body = b'{"model": "fake-model", "prompt": "hi", "logit_bias": ' + raw + b"}"
        r = httpx.post(fake.url + "/v1/completions", content=body, headers={"Content-Type": "application/json"})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"].startswith("logit_bias"), r.text


# ---------------------------------------------------------------- the Python API on the default model


@pytest.mark.slow
def test_llm_logit_bias_forces_bans_and_stays_in_its_row(make_llm):
    llm = make_llm(kv_cache_memory=32 << 20)
    prompt = "The capital of France is"
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    plain = llm.generate(prompt, greedy)[0].outputs[0].token_ids
    (forced_id,) = llm.tokenizer.encode(" banana", add_special_tokens=False)
    forced = SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True, logit_bias={forced_id: 100})
    banned = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logit_bias={plain[0]: -100})
    outs = llm.generate([prompt, prompt, prompt], [forced, greedy, banned])
    assert outs[0].outputs[0].token_ids == [forced_id] * 4
    assert outs[1].outputs[0].token_ids == plain  # the unbiased row in the same batch
    assert outs[2].outputs[0].token_ids[0] != plain[0] and plain[0] not in outs[2].outputs[0].token_ids
    vocab = llm.engine.runner.sampler.vocab_size
    with pytest.raises(ParamError, match=rf"logit_bias: token id {vocab} is outside the vocabulary \[0, {vocab}\)"):
        llm.generate(prompt, SamplingParams(logit_bias={vocab: 1}))


# ---------------------------------------------------------------- a real `quill serve`, the official client


@pytest.fixture(scope="module")
def real(tmp_path_factory):
    with serving(tmp_path_factory.mktemp("serve"), "--max-model-len", "512", "--kv-cache-memory", "32MiB",
                 "--max-num-seqs", "4") as proc:
        yield proc


def token_id(server, text: str) -> int:
    """The id of `text`, which must be one token (checked both ways through the server)."""
    ids = httpx.post(server.url + "/tokenize", json={"prompt": text, "add_special_tokens": False}).json()["tokens"]
    assert len(ids) == 1, (text, ids)
    assert httpx.post(server.url + "/detokenize", json={"tokens": ids}).json()["prompt"] == text
    return ids[0]


@pytest.mark.slow
def test_real_server_minus_100_removes_the_greedy_token(real):
    client = real.client
    prompt = "The capital of France is"
    first = client.completions.create(model="quill-test", prompt=prompt, temperature=0, max_tokens=1).choices[0].text
    banned = token_id(real, first)
    again = client.completions.create(model="quill-test", prompt=prompt, temperature=0, max_tokens=1,
                                      logit_bias={str(banned): -100}).choices[0].text
    assert again != first
    messages = [{"role": "user", "content": "What is the capital of France? One word."}]
    chat = client.chat.completions.create(model="quill-test", messages=messages, temperature=0, max_tokens=1)
    chat_first = chat.choices[0].message.content
    chat_banned = token_id(real, chat_first)
    chat_again = client.chat.completions.create(model="quill-test", messages=messages, temperature=0, max_tokens=1,
                                                logit_bias={str(chat_banned): -100})
    assert chat_again.choices[0].message.content != chat_first


@pytest.mark.slow
def test_real_server_plus_100_makes_every_sampled_token_that_token(real):
    client = real.client
    banana = token_id(real, " banana")
    chat = client.chat.completions.create(model="quill-test", messages=[{"role": "user", "content": "Name a colour."}],
                                          temperature=1.0, max_tokens=8, logprobs=True, logit_bias={str(banana): 100})
    content = chat.choices[0].logprobs.content
    assert chat.choices[0].finish_reason == "length" and len(content) == 8
    assert [c.token for c in content] == [" banana"] * 8
    assert chat.choices[0].message.content == " banana" * 8
    # Logprobs are the model's own (without the bias, as vLLM reports them): " banana" is not
    # the model's likely first answer to this question.
    assert content[0].logprob < -1.0
    comp = client.completions.create(model="quill-test", prompt="Once upon a time", temperature=1.0, max_tokens=6,
                                     n=2, logit_bias={str(banana): 100})
    assert [c.text for c in comp.choices] == [" banana" * 6] * 2
    # A grammar still decides: +100 on a token it forbids does not bring that token back.
    constrained = client.chat.completions.create(model="quill-test", messages=[{"role": "user", "content": "Name a colour."}],
                                                 temperature=1.0, max_tokens=5, logit_bias={str(banana): 100},
                                                 extra_body={"guided_choice": ["red", "blue"]})
    assert constrained.choices[0].message.content in ("red", "blue")
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="quill-test", prompt="x", logit_bias={"10000000": 1})
    assert info.value.body["param"] == "logit_bias" and "10000000" in info.value.body["message"]
