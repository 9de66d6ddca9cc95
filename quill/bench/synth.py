"""`quill bench synth`: a GGUF with the real shapes of a named model, random but valid blocks, the
tensor-type mix llama.cpp's quantizer writes for `--quant`, and the embedded model's tokenizer.

Random weights decode at the speed trained ones do, so the file measures quill and llama.cpp on
real sizes without a download. Names and metadata keys are the ones llama.cpp's converter writes
for each architecture (its `conversion/*.py`: base.py TextModel, llama.py LlamaModel, gemma.py
Gemma3Model, phi.py Phi3MiniModel, olmo.py Olmo2Model, granite.py GraniteModel, in the copy vendored
by llama-cpp-python 0.3.36), so both engines load it.

Real shapes (config.json values, read from these pages with the `search` tool; [!] = not found
verbatim, see the note under the table):

| model          | hidden | layers | heads/kv | head_dim | ffn   | vocab  | rope base | other                          | source |
|----------------|--------|--------|----------|----------|-------|--------|-----------|--------------------------------|--------|
| llama-3.2-1b   | 2048   | 16     | 32/8     | 64       | 8192  | 128256 | 500000    | llama3 rope x32, orig 8192, tied | hf Emm9625/Llama-3.2-1B-chatml (dup of meta-llama/Llama-3.2-1B) config.json |
| llama-3.2-3b   | 3072   | 28     | 24/8     | 128      | 8192  | 128256 | 500000    | llama3 rope x32, orig 8192, tied | hf mlx-community/Llama-3.2-3B-bf16 config.json |
| llama-3.1-8b   | 4096   | 32     | 32/8     | 128      | 14336 | 128256 | 500000    | llama3 rope x8, orig 8192, untied | hf NbAiLab/nb-llama-3.1-8B (from meta-llama/Llama-3.1-8B) config.json |
| qwen2.5-1.5b   | 1536   | 28     | 12/2     | 128      | 8960  | 151936 | 1e6       | qkv bias, tied, eps 1e-6       | hf onnx-community/Qwen2.5-1.5B-Instruct config.json |
| qwen3-1.7b     | 2048   | 28     | 16/8     | 128      | 6144  | 151936 | 1e6       | q/k norm, tied [!]             | apxml.com/models/qwen3-1-7b (model card figures) |
| gemma-3-1b     | 1152   | 26     | 4/1      | 256      | 6912  | 262144 | 1e6 / 1e4 | window 512, 5:1, ctx 32768     | hf Perditio/unsloth, vishnurchityala/sql-gemma3 (unsloth/gemma-3-1b-it) config.json |
| phi-4-mini     | 3072   | 32     | 24/8     | 128      | 8192  | 200064 | 10000     | partial rotary 0.75, LongRoPE (orig 4096, ctx 131072), tied | hf onnx-community/Phi-4-mini-instruct-ONNX-MHA config.json; factors also in a stored Phi4Config (configuration file) and TensorRT-LLM's Phi-4-MM test config |
| smollm3-3b     | 2048   | 36     | 16/4     | 128      | 11008 | 128256 | 5e6       | NoPE every 4th layer, tied, eps 1e-6, ctx 65536 | hf koutch/0.json_train_grpo_v1_dev (SmolLM3ForCausalLM) config.json; stored test configs quoting HuggingFaceTB/SmolLM3-3B |
| olmo-2-0425-1b | 2048   | 16     | 16/16    | 128      | 8192  | 100352 | 500000    | post-norm, q/k norm, untied, eps 1e-6, ctx 4096 [!] | OLMo 2 family configs (allenai/OLMo-2-1124-7B/13B, OLMo-2-0325-32B config.json); 1B widths from OLMo-1B's card |
| granite-3.2-2b | 2048   | 40     | 32/8     | 64       | 8192  | 49155  | 5e6       | multipliers emb 12, attn 0.015625, resid 0.22, logits 8; tied | hf unsloth/granite-3.2-2b-instruct config.json |
| mistral-nemo-12b | 5120 | 40     | 32/8     | 128      | 14336 | 131072 | 1e6       | written as "llama", untied     | hf riple-saanvi-lab/Saanvi-C0-12B (from mistralai/Mistral-Nemo-Instruct-2407) config.json; bartowski params.json |

[!] Qwen3-1.7B's tie_word_embeddings and OLMo-2-0425-1B's config.json were not in the stored
corpus: tied Qwen3 small models are what the 4B config shows (hf MultiRL/qwen3_4b_instruct_sft);
OLMo-2-0425-1B's hidden/layers/heads/ffn are OLMo-1B's (its card: 16 layers, 2048 hidden, 16 heads)
with OLMo 2's other settings. Granite-3.3-2B's config was not found either, so `--arch granite`
writes Granite-3.2-2B, whose config was.

The tensor-type mix follows llama.cpp's `src/llama-quant.cpp` (stored ggml-org/llama.cpp @007dbbf3;
the same rules are in the copy llama-cpp-python 0.3.36 vendors; the Q2_K and Q3_K_M rules and their
fallback to Q4_0 are read from that vendored copy), see `tensor_type()`.
"""

from __future__ import annotations

import argparse
import functools
import math
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

# ---------------------------------------------------------------------------------------------
# Model shapes


@dataclass(frozen=True)
class Shape:
    name: str  # what --model takes
    hf_name: str  # the model it copies
    arch: str  # GGUF general.architecture
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    rope_base: float
    context: int
    tied: bool
    rms_eps: float = 1e-5
    head_dim_in_config: bool = True  # config.json has head_dim: the converter writes key_length / value_length
    llama3_rope: tuple[float, float, float, int] | None = None  # factor, low, high, original context
    window: int | None = None
    swa_base: float | None = None
    rotary_dim: int | None = None  # partial rotary (Phi-4-mini)
    longrope: tuple[tuple[float, ...], tuple[float, ...], int] | None = None  # long, short, original ctx
    multipliers: dict[str, float] = field(default_factory=dict)  # Granite


# Phi-4-mini-instruct's LongRoPE factors (config.json rope_scaling; 48 = rotary dims 96 / 2).
_PHI4_LONG = (1, 1.118320672, 1.250641126, 1.398617824, 1.564103225, 1.74916897, 1.956131817, 2.187582649,
              2.446418898, 2.735880826, 3.059592084, 3.421605075, 3.826451687, 4.279200023, 4.785517845,
              5.351743533, 5.984965424, 6.693110555, 7.485043894, 8.370679318, 9.36110372, 10.4687158,
              11.70738129, 13.09260651, 14.64173252, 16.37415215, 18.31155283, 20.47818807, 22.90118105,
              25.61086418, 28.64115884, 32.03, 32.1, 32.13, 32.23, 32.6, 32.61, 32.64, 32.66, 32.7, 32.71,
              32.93, 32.97, 33.28, 33.49, 33.5, 44.16, 47.77)
_PHI4_SHORT = (1.0,) * 48

MODELS: dict[str, Shape] = {s.name: s for s in (
    Shape("llama-3.2-1b", "meta-llama/Llama-3.2-1B", "llama", 2048, 16, 32, 8, 64, 8192, 128256, 500000.0,
          131072, True, llama3_rope=(32.0, 1.0, 4.0, 8192)),
    Shape("llama-3.2-3b", "meta-llama/Llama-3.2-3B", "llama", 3072, 28, 24, 8, 128, 8192, 128256, 500000.0,
          131072, True, llama3_rope=(32.0, 1.0, 4.0, 8192)),
    Shape("llama-3.1-8b", "meta-llama/Llama-3.1-8B", "llama", 4096, 32, 32, 8, 128, 14336, 128256, 500000.0,
          131072, False, llama3_rope=(8.0, 1.0, 4.0, 8192)),
    Shape("qwen2.5-1.5b", "Qwen/Qwen2.5-1.5B", "qwen2", 1536, 28, 12, 2, 128, 8960, 151936, 1e6, 32768, True,
          rms_eps=1e-6, head_dim_in_config=False),
    Shape("qwen3-1.7b", "Qwen/Qwen3-1.7B", "qwen3", 2048, 28, 16, 8, 128, 6144, 151936, 1e6, 40960, True,
          rms_eps=1e-6),
    Shape("gemma-3-1b", "google/gemma-3-1b-it", "gemma3", 1152, 26, 4, 1, 256, 6912, 262144, 1e6, 32768, True,
          rms_eps=1e-6, window=512, swa_base=10000.0),
    Shape("phi-4-mini", "microsoft/Phi-4-mini-instruct", "phi3", 3072, 32, 24, 8, 128, 8192, 200064, 10000.0,
          131072, True, head_dim_in_config=False, window=262144, rotary_dim=96,
          longrope=(_PHI4_LONG, _PHI4_SHORT, 4096)),
    Shape("smollm3-3b", "HuggingFaceTB/SmolLM3-3B", "smollm3", 2048, 36, 16, 4, 128, 11008, 128256, 5e6, 65536,
          True, rms_eps=1e-6),
    Shape("olmo-2-0425-1b", "allenai/OLMo-2-0425-1B", "olmo2", 2048, 16, 16, 16, 128, 8192, 100352, 500000.0,
          4096, False, rms_eps=1e-6, head_dim_in_config=False),
    Shape("granite-3.2-2b", "ibm-granite/granite-3.2-2b-instruct", "granite", 2048, 40, 32, 8, 64, 8192, 49155,
          5e6, 131072, True, head_dim_in_config=False,
          multipliers={"embedding_scale": 12.0, "attention.scale": 0.015625, "residual_scale": 0.22,
                       "logit_scale": 8.0}),
    Shape("mistral-nemo-12b", "mistralai/Mistral-Nemo-Instruct-2407", "llama", 5120, 40, 32, 8, 128, 14336, 131072,
          1e6, 1024000, False),
)}

# --arch: each family quill supports -> its representative real model. "mistral" files are written as
# "llama" with head_dim 128 apart from hidden / heads, as the converter writes Mistral Nemo.
ARCH_DEFAULTS = {"llama": "llama-3.2-1b", "qwen2": "qwen2.5-1.5b", "qwen3": "qwen3-1.7b", "gemma3": "gemma-3-1b",
                 "phi3": "phi-4-mini", "smollm3": "smollm3-3b", "olmo2": "olmo-2-0425-1b",
                 "granite": "granite-3.2-2b", "mistral": "mistral-nemo-12b"}

# llama.cpp's converter: LlamaModel and its subclasses write {arch}.vocab_size and rope.dimension_count
# and interleave q/k rows (random rows: the permutation changes nothing here).
_LLAMA_MODEL_ARCHS = ("llama", "smollm3", "granite")

# ---------------------------------------------------------------------------------------------
# The quantizer's recipe (src/llama-quant.cpp)

_FTYPES = {  # --quant -> (llama_ftype, default tensor type), llama_ftype_get_default_type()
    "F16": ("MOSTLY_F16", "F16"),
    "Q8_0": ("MOSTLY_Q8_0", "Q8_0"),
    "Q4_0": ("MOSTLY_Q4_0", "Q4_0"),
    "Q2_K": ("MOSTLY_Q2_K", "Q2_K"),
    "Q3_K_M": ("MOSTLY_Q3_K_M", "Q3_K"),
    "Q4_K_M": ("MOSTLY_Q4_K_M", "Q4_K"),
    "Q5_K_M": ("MOSTLY_Q5_K_M", "Q5_K"),
    "Q6_K": ("MOSTLY_Q6_K", "Q6_K"),
    "IQ4_XS": ("MOSTLY_IQ4_XS", "IQ4_XS"),
}
QUANTS = tuple(_FTYPES)
# tensor_type_fallback(): a type whose block does not divide the row length falls back to these.
_FALLBACK = {"Q2_K": "Q4_0", "Q3_K": "Q4_0", "Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0", "IQ4_XS": "IQ4_NL"}


def _block(type_name: str) -> int:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    return GGML_QUANT_SIZES[GGMLQuantizationType[type_name]][0]


def _use_more_bits(i: int, n: int) -> bool:
    """llama-quant.cpp use_more_bits(): the first and last eighth of the layers and every third between."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def _category(name: str) -> str:
    """tensor_get_category(): by substring, in the same order."""
    if name == "output.weight":
        return "output"
    if name == "token_embd.weight":
        return "token_embd"
    for key, cat in (("attn_qkv.weight", "attn_qkv"), ("attn_v.weight", "attn_v"), ("attn_k.weight", "attn_k"),
                     ("attn_q.weight", "attn_q"), ("attn_output.weight", "attn_output"), ("ffn_up", "ffn_up"),
                     ("ffn_gate", "ffn_gate"), ("ffn_down", "ffn_down")):
        if key in name:
            return cat
    return "other"


def tensor_type(quant: str, name: str, cols: int, layer: int, num_layers: int, gqa: int, tied: bool) -> str:
    """The type llama.cpp's quantizer gives a 2-D weight for ftype `quant` (no imatrix, no overrides).

    llama_tensor_get_type_impl(): the output tensor, and token_embd when there is no output tensor
    (tied), get Q8_0 if their rows do not fit the default type's block, else Q6_K unless the default is
    Q8_0. attn_v and attn_qkv (category_is_attn_v) get Q5_K for IQ4_XS when n_gqa >= 4, Q6_K for
    Q4_K_M / Q5_K_M in the layers use_more_bits() picks, Q4_K for Q2_K when n_gqa >= 4 (else Q3_K), and
    for Q3_K_M Q5_K in the first two and Q4_K after (counted over the attn_v tensors, which the loader's
    weight map sorts by layer, so the count is the layer). ffn_down: Q6_K where use_more_bits() for
    Q4_K_M and Q5_K_M; Q5_K in the first eighth of the layers for IQ4_XS without an imatrix; Q3_K for
    Q2_K; for Q3_K_M Q5_K in the first sixteenth, else Q4_K (Q3_K only for Falcon). attn_output: Q3_K for
    Q2_K, Q4_K for Q3_K_M (no experts, not Falcon). Nothing else changes for these ftypes (an untied
    token_embd keeps the default). Then tensor_type_fallback() swaps a type whose block does not divide
    the row (Q2_K, Q3_K->Q4_0, Q4_K->Q5_0, Q5_K->Q5_1, Q6_K->Q8_0, IQ4_XS->IQ4_NL; F16 if still not)."""
    ftype, new = _FTYPES[quant][0], _FTYPES[quant][1]
    if new == "F16":  # not a quantized ftype: every weight keeps the converter's F16
        return new
    cat = _category(name)
    if cat == "output" or (tied and cat == "token_embd"):
        if cols % _block(new):
            new = "Q8_0"
        elif new != "Q8_0":
            new = "Q6_K"
    elif cat in ("attn_v", "attn_qkv"):
        if ftype == "MOSTLY_Q2_K":
            new = "Q4_K" if gqa >= 4 else "Q3_K"
        elif ftype == "MOSTLY_Q3_K_M":
            new = "Q5_K" if layer < 2 else "Q4_K"
        elif ftype == "MOSTLY_IQ4_XS" and gqa >= 4:
            new = "Q5_K"
        elif ftype in ("MOSTLY_Q4_K_M", "MOSTLY_Q5_K_M") and _use_more_bits(layer, num_layers):
            new = "Q6_K"
    elif cat == "attn_output":
        if ftype == "MOSTLY_Q2_K":
            new = "Q3_K"
        elif ftype == "MOSTLY_Q3_K_M":
            new = "Q4_K"
    elif cat == "ffn_down":
        if ftype == "MOSTLY_Q2_K":
            new = "Q3_K"
        elif ftype == "MOSTLY_Q3_K_M":
            new = "Q5_K" if layer < num_layers // 16 else "Q4_K"
        elif ftype == "MOSTLY_Q4_K_M":
            if _use_more_bits(layer, num_layers):
                new = "Q6_K"
        elif layer < num_layers // 8 and ftype == "MOSTLY_IQ4_XS":
            new = "Q5_K"
        elif ftype == "MOSTLY_Q5_K_M" and _use_more_bits(layer, num_layers):
            new = "Q6_K"
    if cols % _block(new):
        new = _FALLBACK.get(new, new)
        if cols % _block(new):
            new = "F16"
    return new


# ---------------------------------------------------------------------------------------------
# Tensors


@dataclass(frozen=True)
class TensorPlan:
    name: str
    shape: tuple[int, ...]  # torch order: (rows, cols) or (n,)
    kind: str  # "weight" (quantized by the recipe), "norm", "bias", "rope_freqs", "rope_long", "rope_short"
    layer: int = -1


def tensor_plan(s: Shape, num_layers: int, vocab: int) -> list[TensorPlan]:
    """Every tensor the converter writes for this architecture, in the converter's order."""
    h, q, kv, ffn = s.hidden, s.heads * s.head_dim, s.kv_heads * s.head_dim, s.ffn
    plan = [TensorPlan("token_embd.weight", (vocab, h), "weight")]
    if s.llama3_rope:
        plan.append(TensorPlan("rope_freqs.weight", (s.head_dim // 2,), "rope_freqs"))
    if s.longrope:
        plan += [TensorPlan("rope_factors_long.weight", (s.rotary_dim // 2,), "rope_long"),
                 TensorPlan("rope_factors_short.weight", (s.rotary_dim // 2,), "rope_short")]
    for i in range(num_layers):
        def t(name, shape, kind="weight"):
            plan.append(TensorPlan(f"blk.{i}.{name}", shape, kind, i))

        if s.arch != "olmo2":  # OLMo 2 has no input norms (post-norm only)
            t("attn_norm.weight", (h,), "norm")
        if s.arch == "phi3":  # fused qkv_proj and gate_up_proj kept fused: attn_qkv, ffn_up of 2 x ffn rows
            t("attn_qkv.weight", (q + 2 * kv, h))
        else:
            t("attn_q.weight", (q, h))
            t("attn_k.weight", (kv, h))
            t("attn_v.weight", (kv, h))
        if s.arch == "qwen2":
            t("attn_q.bias", (q,), "bias")
            t("attn_k.bias", (kv,), "bias")
            t("attn_v.bias", (kv,), "bias")
        if s.arch in ("qwen3", "gemma3"):  # per-head q/k RMSNorm
            t("attn_q_norm.weight", (s.head_dim,), "norm")
            t("attn_k_norm.weight", (s.head_dim,), "norm")
        if s.arch == "olmo2":  # q/k RMSNorm over the whole projection
            t("attn_q_norm.weight", (q,), "norm")
            t("attn_k_norm.weight", (kv,), "norm")
        t("attn_output.weight", (h, q))
        if s.arch in ("gemma3", "olmo2"):
            t("post_attention_norm.weight", (h,), "norm")
        if s.arch != "olmo2":  # Gemma 3's pre_feedforward_layernorm is ffn_norm too
            t("ffn_norm.weight", (h,), "norm")
        if s.arch == "phi3":
            t("ffn_up.weight", (2 * ffn, h))
        else:
            t("ffn_gate.weight", (ffn, h))
            t("ffn_up.weight", (ffn, h))
        t("ffn_down.weight", (h, ffn))
        if s.arch in ("gemma3", "olmo2"):
            t("post_ffw_norm.weight", (h,), "norm")
    plan.append(TensorPlan("output_norm.weight", (h,), "norm"))
    if not s.tied:
        plan.append(TensorPlan("output.weight", (vocab, h), "weight"))
    return plan


def plan_types(s: Shape, plan: list[TensorPlan], quant: str, num_layers: int) -> dict[str, str]:
    """Tensor name -> GGML type name. 1-D tensors stay F32 (the converter writes them F32 and the
    quantizer leaves tensors under 2 dims and *_norm.weight alone: tensor_allows_quantization())."""
    tied = not any(t.name == "output.weight" for t in plan)
    gqa = s.heads // s.kv_heads
    return {t.name: tensor_type(quant, t.name, t.shape[-1], t.layer, num_layers, gqa, tied) if t.kind == "weight"
            else "F32" for t in plan}


# Block layouts (ggml-common.h): (byte offset of each fp16 scale field, its magnitude); every other
# byte (codes, 6-bit sub-block scales, high bits) may take any value. Magnitudes keep |w| around 0.05,
# like trained weights: Q8_0 d*q (q int8), Q4_0 d*(q-8), Q5_0 d*(q-16), Q4_1/Q5_1 d*q + m,
# Q4_K/Q5_K d*sc*q - dmin*m (6-bit sc, m), Q6_K d*sc*(q-32) (int8 sc), IQ4_NL d*k[q] and IQ4_XS
# d*(ls-32)*k[q] (k in [-127, 113], 6-bit ls), Q2_K d*sc*q - dmin*m (4-bit sc, m; q 0..3, d at 80, dmin
# at 82) and Q3_K d*(sc-32)*q (6-bit sc, q -4..3, d at 108).
_SCALE_FIELDS = {
    "Q8_0": ((0, 0.05 / 127),),
    "Q4_0": ((0, 0.05 / 8),),
    "Q4_1": ((0, 0.1 / 15), (2, -0.05)),
    "Q5_0": ((0, 0.05 / 16),),
    "Q5_1": ((0, 0.1 / 31), (2, -0.05)),
    "Q4_K": ((0, 0.1 / (63 * 15)), (2, 0.05 / 63)),
    "Q5_K": ((0, 0.1 / (63 * 31)), (2, 0.05 / 63)),
    "Q6_K": ((208, 0.05 / (128 * 32)),),
    "IQ4_NL": ((0, 0.05 / 127),),
    "IQ4_XS": ((0, 0.05 / (32 * 127)),),
    "Q2_K": ((80, 0.1 / (15 * 3)), (82, 0.05 / 15)),
    "Q3_K": ((108, 0.05 / (32 * 4)),),
}


def random_blocks(type_name: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """(rows, bytes per row) uint8 of valid random blocks: random codes, finite fp16 scales."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    if type_name == "F16":
        return (rng.standard_normal((rows, cols), dtype=np.float32) * 0.02).astype(np.float16)
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]
    nblocks = rows * cols // block
    data = rng.integers(0, 256, size=nblocks * size, dtype=np.uint8).reshape(nblocks, size)
    for offset, magnitude in _SCALE_FIELDS[type_name]:
        scale = (magnitude * rng.uniform(0.5, 1.5, nblocks)).astype(np.float16)
        data[:, offset:offset + 2] = scale.view(np.uint8).reshape(nblocks, 2)
    return data.reshape(rows, cols // block * size)


def llama3_rope_freqs(head_dim: int, base: float, factor: float, low: float, high: float, original: int) -> np.ndarray:
    """rope_freqs.weight as the converter computes it for rope_type "llama3" (LlamaModel): per rotary
    frequency 1 for wavelengths under original/high, `factor` above original/low, smooth between."""
    out = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * base ** (i / head_dim)
        if wavelen < original / high:
            out.append(1.0)
        elif wavelen > original / low:
            out.append(factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def _f32_tensor(t: TensorPlan, s: Shape, rng: np.random.Generator) -> np.ndarray:
    if t.kind == "norm":  # RMSNorm gains near 1 (Gemma's stored 1 + w, w near 0, is the same)
        return (1.0 + 0.02 * rng.standard_normal(t.shape)).astype(np.float32)
    if t.kind == "bias":
        return (0.02 * rng.standard_normal(t.shape)).astype(np.float32)
    if t.kind == "rope_freqs":
        return llama3_rope_freqs(s.head_dim, s.rope_base, *s.llama3_rope)
    if t.kind == "rope_long":
        return np.array(s.longrope[0], dtype=np.float32)
    if t.kind == "rope_short":
        return np.array(s.longrope[1], dtype=np.float32)
    raise ValueError(t.kind)


# ---------------------------------------------------------------------------------------------
# Tokenizer


@functools.lru_cache(maxsize=1)
def _default_tokenizer() -> tuple[tuple[str, object, object, object], ...]:
    """The embedded default model's tokenizer.* fields as (key, value, type, sub-type), read once."""
    from gguf import GGUFReader, GGUFValueType

    from quill.models.default import default_model_path

    reader = GGUFReader(str(default_model_path()))
    return tuple((k, f.contents(), f.types[0], f.types[-1] if f.types[0] == GGUFValueType.ARRAY else None)
                 for k, f in reader.fields.items() if k.startswith("tokenizer."))


def _tokenizer_fields(vocab: int) -> list[tuple[str, object, object, object]]:
    """The default tokenizer's fields, its token list padded with unused tokens up to `vocab` (llama.cpp
    sizes token_embd / output by the token count), or cut to `vocab` (the tests' small files; merges
    that need a dropped token are dropped too, and so are special-token ids past the end)."""
    fields = {key: (value, vtype, sub) for key, value, vtype, sub in _default_tokenizer()}
    tokens = [str(t) for t in fields["tokenizer.ggml.tokens"][0]]
    types = [int(t) for t in fields["tokenizer.ggml.token_type"][0]]
    merges = fields.get("tokenizer.ggml.merges", (None,))[0]
    if vocab >= len(tokens):
        unused = vocab - len(tokens)
        tokens += [f"<|synth_unused_{i}|>" for i in range(unused)]
        types += [5] * unused  # llama.cpp's LLAMA_TOKEN_TYPE_UNUSED
    else:
        tokens, types = tokens[:vocab], types[:vocab]
        kept = set(tokens)
        if merges is not None:
            merges = [m for m in merges if (p := str(m).split(" ")) and len(p) == 2 and p[0] in kept
                      and p[1] in kept and p[0] + p[1] in kept]
    replaced = {"tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types, "tokenizer.ggml.merges": merges}
    out = []
    for key, (value, vtype, sub) in fields.items():
        value = replaced.get(key, value)
        if isinstance(value, int) and key.endswith("_id") and value >= vocab:
            continue
        out.append((key, value, vtype, sub))
    return out


# ---------------------------------------------------------------------------------------------
# Writing


@dataclass
class SynthResult:
    path: Path
    shape: Shape
    num_layers: int
    vocab: int
    types: dict[str, str]
    parameters: int
    bytes: int
    seconds: float


def resolve(model: str | None, arch: str | None) -> Shape:
    if model and arch:
        raise ValueError("give --model or --arch, not both")
    if arch:
        if arch not in ARCH_DEFAULTS:
            raise ValueError(f"unknown --arch {arch!r}; supported: {', '.join(ARCH_DEFAULTS)}")
        return MODELS[ARCH_DEFAULTS[arch]]
    name = model or "llama-3.2-1b"
    if name not in MODELS:
        raise ValueError(f"unknown --model {name!r}; supported: {', '.join(MODELS)}")
    return MODELS[name]


def write_synth(path: str | Path, s: Shape, quant: str, *, num_layers: int | None = None, vocab: int | None = None,
                seed: int = 0) -> SynthResult:
    """Write the file; `num_layers` / `vocab` shrink it (tests), everything else is the real shape."""
    import gguf

    if quant not in _FTYPES:
        raise ValueError(f"unknown --quant {quant!r}; supported: {', '.join(QUANTS)}")
    num_layers = s.layers if num_layers is None else num_layers
    vocab = s.vocab if vocab is None else vocab
    if num_layers < 1 or vocab < 1:
        raise ValueError("layers and vocab must be positive")
    t0 = time.perf_counter()
    rng = np.random.default_rng(seed)
    plan = tensor_plan(s, num_layers, vocab)
    types = plan_types(s, plan, quant, num_layers)
    arch = s.arch
    w = gguf.GGUFWriter(str(path), arch)
    w.add_type("model")
    w.add_name(f"synth {s.hf_name}" + ("" if num_layers == s.layers else f" ({num_layers} layers)"))
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_file_type(int(gguf.LlamaFileType[_FTYPES[quant][0]]))
    # TextModel.set_gguf_parameters (conversion/base.py)
    w.add_block_count(num_layers)
    w.add_context_length(s.context)
    w.add_embedding_length(s.hidden)
    w.add_feed_forward_length(s.ffn)
    w.add_head_count(s.heads)
    w.add_head_count_kv(s.kv_heads)
    w.add_layer_norm_rms_eps(s.rms_eps)
    w.add_rope_freq_base(s.rope_base)
    if s.head_dim_in_config and arch != "phi3":
        w.add_key_length(s.head_dim)
        w.add_value_length(s.head_dim)
    if s.swa_base is not None:  # rope_local_base_freq (Gemma 3)
        w.add_rope_freq_base_swa(s.swa_base)
    if arch in _LLAMA_MODEL_ARCHS:  # LlamaModel.set_gguf_parameters
        w.add_vocab_size(vocab)
        w.add_rope_dimension_count(s.head_dim)
    if arch == "gemma3":  # Gemma3Model: the window (sliding_window_pattern is not 1)
        w.add_sliding_window(s.window)
    if arch == "phi3":  # Phi3MiniModel writes its own keys: rope dims from the partial factor, the window
        # (0 when absent), LongRoPE's original context and attention factor
        w.add_rope_dimension_count(s.rotary_dim)
        w.add_sliding_window(s.window or 0)
        original = s.longrope[2]
        w.add_rope_scaling_orig_ctx_len(original)
        scale = s.context / original
        w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0)
    for key, value in s.multipliers.items():  # GraniteModel: *_multiplier as *_scale
        w.add_float32(f"{arch}.{key}", value)
    for key, value, vtype, sub in _tokenizer_fields(vocab):
        w.add_key_value(key, value, vtype, sub_type=sub)

    data = {}
    for t in plan:
        qtype = gguf.GGMLQuantizationType[types[t.name]]
        if t.kind == "weight" and qtype == gguf.GGMLQuantizationType.F16:
            w.add_tensor_info(t.name, t.shape, np.dtype(np.float16), t.shape[0] * t.shape[1] * 2)
        elif t.kind == "weight":
            byte_shape = gguf.quant_shape_to_byte_shape(t.shape, qtype)
            w.add_tensor_info(t.name, byte_shape, np.dtype(np.uint8), int(np.prod(byte_shape)), raw_dtype=qtype)
        else:
            data[t.name] = _f32_tensor(t, s, rng)
            w.add_tensor_info(t.name, t.shape, np.dtype(np.float32), data[t.name].nbytes)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    parameters = 0
    for t in plan:
        parameters += int(np.prod(t.shape))
        if t.kind == "weight":
            w.write_tensor_data(random_blocks(types[t.name], t.shape[0], t.shape[1], rng))
        else:
            w.write_tensor_data(data.pop(t.name))
    w.close()
    path = Path(path)
    return SynthResult(path, s, num_layers, vocab, types, parameters, path.stat().st_size, time.perf_counter() - t0)


# ---------------------------------------------------------------------------------------------
# CLI


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "synth", help="write a GGUF with a real model's shapes, random valid blocks and llama.cpp's quant mix",
        description="Writes a GGUF with the real shapes of a named model (or of --arch's representative model), "
                    "llama.cpp's converter's tensor names and metadata keys, the tensor types llama.cpp's "
                    "quantizer picks for --quant, random but valid blocks, and the embedded model's tokenizer "
                    "padded to the real vocabulary. For `quill bench latency --vs llama.cpp` without downloads.")
    p.add_argument("--model", "-m", default=None, help=f"model shape (default llama-3.2-1b): {', '.join(MODELS)}")
    p.add_argument("--arch", default=None, help=f"a family's representative model: {', '.join(ARCH_DEFAULTS)}")
    p.add_argument("--quant", "-q", default="Q4_K_M", help=f"llama.cpp file type: {', '.join(QUANTS)} (default Q4_K_M)")
    p.add_argument("--output", "-o", default=None, help="GGUF path to write")
    p.add_argument("--list", action="store_true", help="list the models and exit")
    p.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--layers", type=int, default=None, help=argparse.SUPPRESS)  # tests: real width, fewer layers
    p.add_argument("--vocab", type=int, default=None, help=argparse.SUPPRESS)  # tests: fewer token rows
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from gguf import GGMLQuantizationType

    from quill.kernels.dequant import SUPPORTED_TYPES

    if args.list:
        by_arch = {v: k for k, v in ARCH_DEFAULTS.items()}
        print(f"{'model':<18}{'arch':<9}{'layers':>7}{'hidden':>8}{'heads':>7}{'kv':>4}{'head':>6}{'ffn':>7}"
              f"{'vocab':>8}  copies")
        for s in MODELS.values():
            default = f" (--arch {by_arch[s.name]})" if s.name in by_arch else ""
            print(f"{s.name:<18}{s.arch:<9}{s.layers:>7}{s.hidden:>8}{s.heads:>7}{s.kv_heads:>4}{s.head_dim:>6}"
                  f"{s.ffn:>7}{s.vocab:>8}  {s.hf_name}{default}")
        print(f"quants: {', '.join(QUANTS)}")
        return 0
    shape = resolve(args.model, args.arch)
    if args.quant not in _FTYPES:
        raise ValueError(f"unknown --quant {args.quant!r}; supported: {', '.join(QUANTS)}")
    if not args.output:
        raise ValueError("give -o FILE.gguf")
    r = write_synth(args.output, shape, args.quant, num_layers=args.layers, vocab=args.vocab, seed=args.seed)
    counts = Counter(r.types.values())
    print(f"wrote {r.path}: {shape.name} ({shape.hf_name}, {shape.arch}), {r.num_layers} layers, vocab {r.vocab}, "
          f"{args.quant}")
    print(f"  {r.bytes / 2**20:.1f} MiB, {r.parameters / 1e9:.3f} B parameters, {r.seconds:.1f} s")
    print("  tensor types: " + ", ".join(f"{k} x{v}" for k, v in sorted(counts.items())))
    unreadable = sorted(k for k in counts if GGMLQuantizationType[k] not in SUPPORTED_TYPES)
    if unreadable:
        print(f"  note: quill does not read {', '.join(unreadable)} yet; llama.cpp does", file=sys.stderr)
    return 0
