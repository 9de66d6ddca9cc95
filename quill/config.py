"""Frozen configuration dataclasses: model shape, KV cache, scheduler and engine."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

class UnsupportedModelError(ValueError):
    """The model file uses an architecture or tensor type quill cannot run."""


@dataclass(frozen=True)
class ModelConfig:
    """The shape of a Llama-family decoder; built from config.json or GGUF metadata."""

    architecture: str  # "llama" | "mistral" | "qwen2"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: tuple[tuple[str, object], ...] | None = None  # frozen dict items
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v bias (Qwen2)
    sliding_window: int | None = None
    qk_norm: bool = False  # q_norm / k_norm: RMSNorm over each head of q and k before RoPE (Qwen3)
    embedding_multiplier: float = 1.0  # Granite's scalars (1 / 0 / 1 / 1: the plain Llama layer)
    attention_multiplier: float = 0.0  # attention score scale; 0 means 1/sqrt(head_dim)
    residual_multiplier: float = 1.0  # each residual branch is scaled by it
    logits_scaling: float = 1.0  # logits are divided by it
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    @property
    def attention_scale(self) -> float:
        return self.attention_multiplier or self.head_dim**-0.5

    @property
    def rope_scaling_dict(self) -> dict | None:
        return dict(self.rope_scaling) if self.rope_scaling else None

    def kv_bytes_per_token(self, bytes_per_element: int = 4) -> int:
        """2 (K and V) x layers x kv_heads x head_dim x bytes per element (DESIGN.md)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * bytes_per_element

    @cached_property
    def num_parameters(self) -> int:
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        q = self.num_heads * self.head_dim
        kv = self.num_kv_heads * self.head_dim
        attn = h * q + 2 * h * kv + q * h + (q + 2 * kv if self.attention_bias else 0)
        per_layer = attn + 3 * h * i + 2 * h
        head = 0 if self.tie_word_embeddings else v * h
        return v * h + self.num_layers * per_layer + h + head

    @classmethod
    def from_hf_config(cls, config: dict) -> "ModelConfig":
        from quill.models.archs import HF_ARCHITECTURES, for_hf

        archs = config.get("architectures") or [config.get("model_type", "?")]
        spec = for_hf(archs[0])
        if spec is None:
            raise UnsupportedModelError(
                f"unsupported architecture {archs[0]!r}; quill runs {', '.join(sorted(HF_ARCHITECTURES))}"
            )
        arch = spec.name
        num_heads = config["num_attention_heads"]
        head_dim = config.get("head_dim") or config["hidden_size"] // num_heads
        eos = config.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        rope_scaling = config.get("rope_scaling") or config.get("rope_parameters")
        if rope_scaling:
            rope_scaling = dict(rope_scaling)
            rope_type = rope_scaling.get("rope_type", rope_scaling.get("type"))
            if rope_type in (None, "default"):
                rope_scaling = None
            elif rope_type != "llama3":
                raise UnsupportedModelError(f"unsupported rope_scaling type {rope_type!r}; quill supports 'llama3'")
        rope_theta = config.get("rope_theta")
        if rope_theta is None:
            rope_theta = (config.get("rope_parameters") or {}).get("rope_theta", 10000.0)
        sliding = config.get("sliding_window") if config.get("use_sliding_window", spec.sliding_window_by_default) else None
        return cls(
            architecture=arch,
            vocab_size=config["vocab_size"],
            hidden_size=config["hidden_size"],
            intermediate_size=config["intermediate_size"],
            num_layers=config["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=config.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            max_position_embeddings=config.get("max_position_embeddings", 2048),
            rms_norm_eps=config.get("rms_norm_eps", 1e-5),
            rope_theta=float(rope_theta),
            rope_scaling=tuple(sorted(rope_scaling.items())) if rope_scaling else None,
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            attention_bias=bool(config.get("attention_bias", spec.qkv_bias)),
            sliding_window=sliding,
            qk_norm=spec.qk_norm,
            **{s.field: float(config.get(s.hf_key) or s.default) for s in spec.scalars},
            bos_token_id=config.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )

    @classmethod
    def from_json_file(cls, path: str | Path) -> "ModelConfig":
        return cls.from_hf_config(json.loads(Path(path).read_text()))


KV_CACHE_DTYPE_NAMES = ("fp32", "fp16")
KV_CACHE_DTYPE_CHOICES = ("auto", *KV_CACHE_DTYPE_NAMES)  # --kv-cache-dtype


def resolve_kv_dtype(name: str, file_format: str) -> str:
    """--kv-cache-dtype: "auto" is fp16 for a GGUF file (llama.cpp's default for the same file) and
    fp32 for a safetensors folder (the exact path the transformers parity tests check)."""
    if name == "auto":
        return "fp16" if file_format == "gguf" else "fp32"
    if name not in KV_CACHE_DTYPE_NAMES:
        raise ValueError(f"kv_cache_dtype must be one of auto, {', '.join(KV_CACHE_DTYPE_NAMES)}; got {name!r}")
    return name


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache: block size, memory budget and prefix caching."""

    block_size: int = 16
    kv_cache_memory: int | None = None  # bytes; None = derived from free RAM
    enable_prefix_caching: bool = True
    num_blocks_override: int | None = None  # tests: an exact pool size
    kv_cache_dtype: str = "auto"  # "auto" | "fp32" | "fp16" (resolve_kv_dtype above)


@dataclass(frozen=True)
class SchedulerConfig:
    """Per-step limits for continuous batching."""

    max_num_batched_tokens: int = 512
    max_num_seqs: int = 64
    max_waiting: int | None = None  # admission beyond this is refused (server sheds load)


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs to start."""

    model: str | None = None  # path; None = the embedded default model
    device: str = "cpu"
    threads: int | None = None
    quantize: str | None = None  # "int8": quantize fp16/bf16/fp32 weights at load (GGUF files are used as they are)
    max_model_len: int | None = None  # None = the model's context length
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    fault_injection: bool = False  # tests and `quill bench soak` only: lets requests arm a FaultPlan phase
