"""Parity with transformers (fp32) on tiny random models: prefill logits and 8 decode steps."""

from __future__ import annotations

import pytest
import torch

from quill.config import ModelConfig
from quill.engine.block_manager import BlockManager
from quill.kernels import native
from quill.kernels.options import KernelOptions
from quill.kernels.options import use as use_kernel_options
from quill.engine.kv_cache import KVCache
from quill.engine.model_runner import ModelRunner
from quill.engine.scheduler import ScheduledSeq
from quill.engine.sequence import Sequence
from quill.models.llama import LlamaForCausalLM
from quill.sampling_params import SamplingParams

from tiny_models import make_hf_model

pytest.importorskip("transformers")

KINDS = ["llama-gqa", "llama3-tied", "qwen2", "qwen3", "qwen3-yarn", "granite", "mistral", "mistral-nemo", "gemma3", "olmo2",
         "smollm3", "phi3"]


# Served context per kind where it matters: LongRoPE takes its short factors for a context within
# original_max_position_embeddings (64 for the tiny phi3), as transformers does for a short sequence.
CONTEXT_LEN = {"phi3": 64}


def build_quill(hf_model, block_size=4, num_blocks=64, kv_dtype=torch.float32, model=None, context_len=None):
    cfg = ModelConfig.from_hf_config(hf_model.config.to_dict())
    if model is None:
        state = {k: v.detach().clone() for k, v in hf_model.state_dict().items()}
        model = LlamaForCausalLM(cfg, lambda name: state[name], context_len=context_len)
    kv = KVCache(cfg, num_blocks, block_size, kv_dtype)
    bm = BlockManager(num_blocks, block_size, enable_prefix_caching=False)
    return cfg, ModelRunner(model, cfg, kv, sampler=None), bm


def run_chunk(runner, bm, seq, start, n):
    """One sequence's chunk through runner.forward (decodes take the fused C path when built)."""
    assert bm.allocate(seq, n)
    hidden, _ = runner.forward([ScheduledSeq.plan(seq, start, n)])
    seq.num_computed_tokens = start + n
    return runner.model.compute_logits(hidden)  # (n, V)


def assert_prefill_and_8_decodes_match(hf, runner, bm, prompt: list[int]) -> None:
    """Prefill logits, then 8 greedy decode steps, each within 1e-4 of transformers."""
    seq = Sequence("r", prompt, SamplingParams())
    logits = run_chunk(runner, bm, seq, 0, len(prompt))
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0]
    assert (logits - ref).abs().max().item() < 1e-4
    tokens = list(prompt)
    for _ in range(8):
        nxt = int(logits[-1].argmax())
        seq.append_token(nxt, 0.0)
        tokens.append(nxt)
        logits = run_chunk(runner, bm, seq, len(tokens) - 1, 1)
        with torch.no_grad():
            ref = hf(torch.tensor([tokens])).logits[0, -1:]
        assert (logits - ref).abs().max().item() < 1e-4


@pytest.mark.parametrize("fused", [True, False], ids=["fused-decode", "torch-decode"])
@pytest.mark.parametrize("kind", KINDS)
def test_prefill_and_decode_match_transformers(kind, fused):
    hf = make_hf_model(kind)
    cfg, runner, bm = build_quill(hf, context_len=CONTEXT_LEN.get(kind))
    if fused:
        assert runner.fused is not None or native.load() is None
    else:
        runner.fused = None
    assert cfg.tie_word_embeddings == (kind in ("llama3-tied", "qwen3", "qwen3-yarn", "granite", "gemma3", "smollm3"))
    torch.manual_seed(1)
    prompt = torch.randint(0, cfg.vocab_size, (37,)).tolist()  # crosses several 4-token blocks
    assert_prefill_and_8_decodes_match(hf, runner, bm, prompt)


@pytest.mark.parametrize("kind", KINDS)
def test_fp16_kv_cache_fused_decode_matches_torch_and_stays_near_fp32(kind):
    """With an fp16 cache the fused C decode reads the same rounded K/V as the torch path (they
    agree to fp32 noise), and both stay within fp16's rounding of transformers' fp32 logits."""
    hf = make_hf_model(kind)
    cfg, fused, bm_f = build_quill(hf, kv_dtype=torch.float16, context_len=CONTEXT_LEN.get(kind))
    _, plain, bm_t = build_quill(hf, kv_dtype=torch.float16, model=fused.model)
    assert fused.fused is not None or native.load() is None
    plain.fused = None
    torch.manual_seed(2)
    prompt = torch.randint(0, cfg.vocab_size, (37,)).tolist()
    seq_f, seq_t = Sequence("f", prompt, SamplingParams()), Sequence("t", prompt, SamplingParams())
    lf, lt = run_chunk(fused, bm_f, seq_f, 0, len(prompt)), run_chunk(plain, bm_t, seq_t, 0, len(prompt))
    assert torch.equal(lf, lt)  # the same torch prefill on both
    tokens = list(prompt)
    for _ in range(8):
        nxt = int(lt[-1].argmax())
        tokens.append(nxt)
        for seq in (seq_f, seq_t):
            seq.append_token(nxt, 0.0)
        lf = run_chunk(fused, bm_f, seq_f, len(tokens) - 1, 1)
        lt = run_chunk(plain, bm_t, seq_t, len(tokens) - 1, 1)
        with torch.no_grad():
            ref = hf(torch.tensor([tokens])).logits[0, -1:]
        assert (lf - lt).abs().max().item() < 1e-4
        assert (lt - ref).abs().max().item() < 1e-2 * max(1.0, ref.abs().max().item())


@pytest.mark.parametrize("isa", [256, 512])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16], ids=["kv-fp32", "kv-fp16"])
@pytest.mark.parametrize("kind", ["llama-gqa", "gemma3"])
def test_fused_decode_on_both_vector_widths(kind, kv_dtype, isa):
    """The fused decode layer and its attention (head_dim 16: the 16-lane attention with isa 512, natively
    or emulated, see conftest.py) against transformers (fp32 cache), or the torch decode path (fp16 cache)."""
    hf = make_hf_model(kind)
    with use_kernel_options(KernelOptions(isa=isa, amx=False, threads=2)):
        cfg, fused, bm_f = build_quill(hf, kv_dtype=kv_dtype)
        if native.load() is None:
            pytest.skip("native kernels need x86-64 AVX2/FMA and gcc")
        assert fused.fused is not None and fused.fused.options.isa == isa
        torch.manual_seed(3)
        prompt = torch.randint(0, cfg.vocab_size, (37,)).tolist()
        if kv_dtype == torch.float32:
            assert_prefill_and_8_decodes_match(hf, fused, bm_f, prompt)
            return
        _, plain, bm_t = build_quill(hf, kv_dtype=kv_dtype, model=fused.model)
        plain.fused = None
        seq_f, seq_t = Sequence("f", prompt, SamplingParams()), Sequence("t", prompt, SamplingParams())
        run_chunk(fused, bm_f, seq_f, 0, len(prompt))
        lt = run_chunk(plain, bm_t, seq_t, 0, len(prompt))
        for step in range(8):
            nxt = int(lt[-1].argmax())
            for seq in (seq_f, seq_t):
                seq.append_token(nxt, 0.0)
            lf = run_chunk(fused, bm_f, seq_f, len(prompt) + step, 1)
            lt = run_chunk(plain, bm_t, seq_t, len(prompt) + step, 1)
            assert (lf - lt).abs().max().item() < 1e-4


def test_chunked_prefill_with_prefix_matches_one_pass():
    """A prompt computed in 3 chunks (attending the cached prefix) equals one pass."""
    hf = make_hf_model("llama-gqa")
    cfg, runner, bm = build_quill(hf)
    prompt = torch.randint(0, cfg.vocab_size, (30,), generator=torch.Generator().manual_seed(3)).tolist()
    seq = Sequence("r", prompt, SamplingParams())
    parts = [run_chunk(runner, bm, seq, s, n) for s, n in ((0, 11), (11, 9), (20, 10))]
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0]
    assert (torch.cat(parts) - ref).abs().max().item() < 1e-4


def test_batched_decode_matches_single():
    """Two sequences decoded in one step give the same logits as each alone."""
    hf = make_hf_model("qwen2")
    cfg, runner, bm = build_quill(hf)
    gen = torch.Generator().manual_seed(5)
    seqs = [Sequence(f"r{i}", torch.randint(0, 128, (n,), generator=gen).tolist(), SamplingParams())
            for i, n in enumerate((9, 21))]
    for s in seqs:
        run_chunk(runner, bm, s, 0, s.num_prompt_tokens - 1)
    for s in seqs:
        assert bm.allocate(s, 1)
    hidden, _ = runner.forward([ScheduledSeq.plan(s, s.num_prompt_tokens - 1, 1) for s in seqs])
    batched = runner.model.compute_logits(hidden)
    with torch.no_grad():
        refs = torch.cat([hf(torch.tensor([list(s.prompt_token_ids)])).logits[0, -1:] for s in seqs])
    assert (batched - refs).abs().max().item() < 1e-4


def test_unsupported_architecture_is_named():
    from quill.config import UnsupportedModelError

    with pytest.raises(UnsupportedModelError, match="GPTNeoXForCausalLM"):
        ModelConfig.from_hf_config({"architectures": ["GPTNeoXForCausalLM"]})


def _byte_tokenizer_folder(path, vocab_size):
    """A byte-level BPE tokenizer.json (no merges) + config files, like a real HF folder."""
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    for name in ("<s>", "</s>"):
        vocab[name] = len(vocab)
    assert len(vocab) <= vocab_size
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<s>", "</s>"])
    tok.save(str(path / "tokenizer.json"))
    template = "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "chat_template": template}))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": vocab["</s>"]}))
    return vocab["</s>"]


def test_hf_folder_end_to_end_matches_transformers(tmp_path):
    """config.json + safetensors + tokenizer.json + template + generation_config, through LLM()."""
    import transformers as tf

    from quill.llm import LLM

    torch.manual_seed(0)
    cfg = tf.Qwen2Config(vocab_size=258, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    hf = tf.Qwen2ForCausalLM(cfg).float().eval()
    hf.save_pretrained(tmp_path, safe_serialization=True)
    eos = _byte_tokenizer_folder(tmp_path, cfg.vocab_size)
    llm = LLM(str(tmp_path), kv_cache_memory=8 << 20)
    assert eos in llm.engine.eos_token_ids
    assert llm.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}]).startswith("<s>user: hi")
    out = llm.generate("hello world", SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))[0]
    ids = out.prompt_token_ids
    with torch.no_grad():
        ref = hf.generate(torch.tensor([ids]), max_new_tokens=10, do_sample=False, eos_token_id=None,
                          pad_token_id=0)[0, len(ids):].tolist()
    assert out.outputs[0].token_ids == ref


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_folder_stays_16_bit_and_matches_transformers(tmp_path, dtype):
    """A bf16 or fp16 folder keeps its matrices 16-bit (GGUF's BF16/F16 blocks over the file's bytes: half the
    memory of fp32) and still agrees with transformers run on the same weights in fp32."""
    import transformers as tf

    from quill.kernels.kquant import BlockWeight
    from quill.llm import LLM

    if native.load() is None:
        pytest.skip("16-bit weights need the native kernels")
    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=258, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=dtype == torch.bfloat16)
    tf.LlamaForCausalLM(cfg).to(dtype).save_pretrained(tmp_path, safe_serialization=True)
    _byte_tokenizer_folder(tmp_path, cfg.vocab_size)
    hf = tf.LlamaForCausalLM.from_pretrained(tmp_path, torch_dtype=torch.float32).eval()  # the same values, fp32
    llm = LLM(str(tmp_path), kv_cache_memory=8 << 20)
    model = llm.engine.loaded.model
    assert isinstance(model.layers[0].mlp.down_proj.weight, BlockWeight)
    assert isinstance(model.embed_tokens.weight, BlockWeight)
    fp32_bytes = sum(p.numel() * 4 for p in hf.parameters())
    assert model.resident_bytes() < 0.6 * fp32_bytes
    out = llm.generate("hello world", SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))[0]
    ids = out.prompt_token_ids
    with torch.no_grad():
        ref = hf.generate(torch.tensor([ids]), max_new_tokens=10, do_sample=False, eos_token_id=None,
                          pad_token_id=0)[0, len(ids):].tolist()
        logits = hf(torch.tensor([ids])).logits[0, -1]
    assert out.outputs[0].token_ids == ref
    from quill.bench.accuracy import position_logits

    assert (position_logits(llm.engine.loaded, ids)[-1] - logits).abs().max().item() < 1e-4


def test_quantize_int8_round_trip_bound():
    from quill.kernels.quantize import quantize_int8

    w = torch.randn(48, 96, generator=torch.Generator().manual_seed(4))
    q = quantize_int8(w)
    back = q.dequantize_rows(torch.arange(48))
    step = q.scale.repeat_interleave(32, dim=1)  # (48, 96) per-element group scale
    assert (back - w).abs().le(step / 2 + 1e-7).all()
    with pytest.raises(ValueError, match="divisible by 32"):
        quantize_int8(torch.randn(4, 40))


def test_hf_folder_quantize_int8_close_to_fp32(tmp_path):
    import transformers as tf

    from quill.kernels.packed import PackedLinear
    from quill.llm import LLM

    if native.load() is None:
        pytest.skip("int8 needs the native kernels")
    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=258, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    tf.LlamaForCausalLM(cfg).float().save_pretrained(tmp_path, safe_serialization=True)
    _byte_tokenizer_folder(tmp_path, cfg.vocab_size)
    fp32 = LLM(str(tmp_path), kv_cache_memory=8 << 20)
    int8 = LLM(str(tmp_path), kv_cache_memory=8 << 20, quantize="int8")
    assert isinstance(int8.engine.loaded.model.layers[0].mlp.down_proj, PackedLinear)
    assert int8.engine.loaded.model.resident_bytes() < fp32.engine.loaded.model.resident_bytes()
    from quill.bench.accuracy import position_logits

    ids = fp32.tokenizer.encode("int8 weights should barely move the logits of this prompt")
    a, b = position_logits(fp32.engine.loaded, ids), position_logits(int8.engine.loaded, ids)
    assert ((b - a).norm() / a.norm()).item() < 0.05


GGUF_KINDS = {"llama-gqa": "llama", "llama3-tied": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3-yarn": "qwen3",
              "granite": "granite",
              "mistral-nemo": "llama", "gemma3": "gemma3", "olmo2": "olmo2", "smollm3": "smollm3", "phi3": "phi3"}


LAYOUT_FIELDS = ("num_layers", "head_dim", "sliding_window", "sliding_layers", "rope_layers", "rope_theta",
                 "rope_local_theta", "rotary_dim", "qk_norm", "norm_layout", "hidden_act", "embedding_multiplier",
                 "attention_multiplier", "attention_bias", "tie_word_embeddings")


def gguf_model(hf, path, arch: str, context_len=None, **kw):
    """hf written as llama.cpp's converter writes `arch`, then loaded through quill's GGUF loader."""
    import collections

    from quill.models.gguf import GGUFModelFile
    from quill.models.loader import PackedGGUFWeights
    from tiny_models import write_llama_gguf

    write_llama_gguf(hf, path, arch=arch, **kw)
    gf = GGUFModelFile(path)
    return LlamaForCausalLM(gf.model_config(), PackedGGUFWeights(gf, "cpu", collections.Counter()),
                            context_len=context_len)


@pytest.mark.parametrize("fused", [True, False], ids=["fused-decode", "torch-decode"])
@pytest.mark.parametrize("kind", GGUF_KINDS)
def test_gguf_file_matches_transformers(tmp_path, kind, fused):
    """The tiny model written as a GGUF with llama.cpp's tensor names and metadata keys (llama: q/k
    permuted, llama3 scaling as rope_freqs.weight; qwen3: attn_q_norm / attn_k_norm) loads and
    agrees with transformers: prefill and 8 decode steps, on the fused and the torch decode path."""
    hf = make_hf_model(kind)
    model = gguf_model(hf, tmp_path / f"{kind}.gguf", GGUF_KINDS[kind], context_len=CONTEXT_LEN.get(kind))
    cfg = model.config
    if kind == "llama3-tied":
        assert cfg.rope_scaling_dict["rope_type"] == "freq_factors" and len(cfg.rope_scaling_dict["factors"]) == cfg.head_dim // 2
    assert cfg.qk_norm == {"qwen3": "head", "qwen3-yarn": "head", "gemma3": "head", "olmo2": "full"}.get(kind)
    from_hf = ModelConfig.from_hf_config(hf.config.to_dict())
    for field in LAYOUT_FIELDS:  # the layer recipe read from GGUF keys (or llama.cpp's rules) = config.json's
        assert getattr(cfg, field) == pytest.approx(getattr(from_hf, field)), field
    _, runner, bm = build_quill(hf, model=model)
    if fused:
        assert runner.fused is not None or native.load() is None
    else:
        runner.fused = None
    prompt = torch.randint(0, cfg.vocab_size, (45,), generator=torch.Generator().manual_seed(2)).tolist()  # past 32
    assert_prefill_and_8_decodes_match(hf, runner, bm, prompt)


def test_rope_freqs_matter(tmp_path):
    """Without rope_freqs the Llama 3.1-style file is plain RoPE, and transformers disagrees."""
    hf = make_hf_model("llama3-tied")
    plain = gguf_model(hf, tmp_path / "plain.gguf", "llama", rope_freqs=False)
    _, runner, bm = build_quill(hf, model=plain)
    prompt = torch.randint(0, 128, (45,), generator=torch.Generator().manual_seed(2)).tolist()
    wrong = run_chunk(runner, bm, Sequence("p", prompt, SamplingParams()), 0, len(prompt))
    with torch.no_grad():
        assert (wrong - hf(torch.tensor([prompt])).logits[0]).abs().max().item() > 1e-3


def test_fused_path_refuses_a_recipe_it_does_not_implement(caplog):
    """The fused decode layer checks the model it is given and refuses, naming why, anything it would
    not compute exactly: an unknown architecture, a sliding window, a layer built differently, q/k
    norms that disagree with the config. Every supported architecture is accepted (asserted above)."""
    import dataclasses
    import logging

    from quill.kernels.fused_decode import FusedDecoder, refusal

    if native.load() is None:
        pytest.skip("no native kernels on this machine")
    hf = make_hf_model("qwen3")
    _, runner, _ = build_quill(hf)
    model = runner.model
    assert refusal(model) is None and runner.fused is not None
    good = model.config
    cases = {
        "architecture 'gemma2'": dataclasses.replace(good, architecture="gemma2"),
        "layer 0's sliding window None is not the config's 8": dataclasses.replace(good, sliding_window=8),
        "q/k norms [True, True] (head) do not match the config (qk_norm=None)": dataclasses.replace(good, qk_norm=None),
        "layer 0's RoPE (RotaryEmbedding) is not the config's (None": dataclasses.replace(good, rope_layers=(False, True)),
    }
    for reason, cfg in cases.items():
        model.config = cfg
        with caplog.at_level(logging.WARNING, logger="quill.kernels"):
            decoder = FusedDecoder(model, runner.kv_cache.layers)
        assert not decoder.available and reason in decoder.refusal, decoder.refusal
        assert reason in caplog.text
    model.config = good

    class Sandwich(type(model.layers[0])):  # a layer with a different residual layout
        pass

    model.layers[0].__class__ = Sandwich
    assert "layer 0 is built from Sandwich" in refusal(model)
    model.layers[0].__class__ = Sandwich.__bases__[0]
    model.layers[1].mlp.act_name = "relu"  # an activation the kernel has no code for
    assert "layer 1's activation 'relu' is not one it implements" in refusal(model)


@pytest.mark.parametrize("fused", [True, False], ids=["fused-decode", "torch-decode"])
def test_window_layers_ignore_positions_outside_the_window(fused):
    """Gemma 3's layout (5 window layers, then a global one), context 40 > window 16: after the
    prefill, the K/V of the positions that fell out of the window are overwritten with noise in the
    window layers' caches; the next decode step's logits do not move. The same noise on a position
    inside the window, or on an old position of the global layer, does move them."""
    from tiny_models import WINDOW

    hf = make_hf_model("gemma3")
    cfg, runner, bm = build_quill(hf)
    if fused:
        assert runner.fused is not None or native.load() is None
    else:
        runner.fused = None
    sliding = [i for i in range(cfg.num_layers) if cfg.layer_window(i)]
    assert sliding == [0, 1, 2, 3, 4] and cfg.layer_window(5) is None
    prompt = torch.randint(0, cfg.vocab_size, (40,), generator=torch.Generator().manual_seed(7)).tolist()
    seq = Sequence("w", prompt, SamplingParams())
    run_chunk(runner, bm, seq, 0, len(prompt))
    seq.append_token(5, 0.0)
    assert bm.allocate(seq, 1)
    slots = torch.tensor([b * 4 + o for b in seq.block_table for o in range(4)])  # position -> slot (block size 4)
    new_pos = len(prompt)  # the decode's query; it attends positions new_pos - WINDOW + 1 .. new_pos
    outside = slots[: new_pos - WINDOW + 1]
    caches = runner.kv_cache.layers

    def decode_with(noise: list[tuple[int, torch.Tensor]]) -> torch.Tensor:
        saved = [(i, caches[i][0].clone(), caches[i][1].clone()) for i in range(cfg.num_layers)]
        for layer, where in noise:
            for cache in caches[layer]:
                cache[:, where] = torch.randn(cache[:, where].shape, generator=torch.Generator().manual_seed(layer)) * 50
        seq.num_computed_tokens = new_pos
        hidden, _ = runner.forward([ScheduledSeq.plan(seq, new_pos, 1)])
        for i, k, v in saved:
            caches[i][0].copy_(k)
            caches[i][1].copy_(v)
        return runner.model.compute_logits(hidden)

    clean = decode_with([])
    with torch.no_grad():
        ref = hf(torch.tensor([prompt + [5]])).logits[0, -1:]
    assert (clean - ref).abs().max().item() < 1e-4
    assert torch.equal(decode_with([(i, outside) for i in sliding]), clean)
    assert (decode_with([(0, slots[new_pos - WINDOW + 1 : new_pos - WINDOW + 2])]) - clean).abs().max() > 1e-3
    assert (decode_with([(5, slots[:1])]) - clean).abs().max() > 1e-3


def test_gguf_window_zero_means_none(tmp_path):
    """llama.cpp's converter writes attention.sliding_window = 0 for a Phi model without a window
    (Phi-4): no window, not a refused window of 0 positions."""
    from quill.models.gguf import GGUFModelFile
    from tiny_models import write_llama_gguf

    hf = make_hf_model("phi3")
    hf.config.sliding_window = None
    write_llama_gguf(hf, tmp_path / "phi.gguf", arch="phi3")
    assert GGUFModelFile(tmp_path / "phi.gguf").model_config().sliding_window is None
    assert ModelConfig.from_hf_config({**hf.config.to_dict(), "sliding_window": 0}).sliding_window is None
