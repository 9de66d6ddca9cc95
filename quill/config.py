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

    architecture: str  # the family's ArchSpec name (quill.models.archs)
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
    sliding_window: int | None = None  # a query attends keys less than this many positions back
    sliding_layers: tuple[bool, ...] | None = None  # which layers have the window; None = all (Mistral, Phi-3)
    qk_norm: str | None = None  # RMSNorm on q and k before RoPE: "head" (each head: Qwen3, Gemma 3) or "full" (OLMo 2)
    norm_layout: str = "pre"  # "pre": norm -> branch -> add; "sandwich": norm -> branch -> norm -> add (Gemma); "post": branch -> norm -> add (OLMo 2)
    norm_offset: float = 0.0  # added to every stored RMSNorm weight (1 for Gemma's (1 + w) in Hugging Face files)
    hidden_act: str = "silu"  # the gated MLP's activation: "silu" (SwiGLU) or "gelu_tanh" (GeGLU)
    rope_layers: tuple[bool, ...] | None = None  # which layers rotate q/k; None = all (SmolLM3 has NoPE layers)
    rope_local_theta: float | None = None  # RoPE base of the sliding-window layers, unscaled (Gemma 3)
    rotary_dim: int = 0  # leading dims of each head that RoPE rotates; 0 = head_dim (Phi-4-mini: 3/4)
    final_logit_softcapping: float | None = None  # logits = cap * tanh(logits / cap)
    embedding_multiplier: float = 1.0  # Granite's scalars (1 / 0 / 1 / 1: the plain Llama layer)
    attention_multiplier: float = 0.0  # attention score scale; 0 means 1/sqrt(head_dim)
    residual_multiplier: float = 1.0  # each residual branch is scaled by it
    logits_scaling: float = 1.0  # logits are divided by it
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self):
        choices = {"qk_norm": (None, "head", "full"), "norm_layout": ("pre", "sandwich", "post"),
                   "hidden_act": ("silu", "gelu_tanh")}
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise UnsupportedModelError(f"{name} {getattr(self, name)!r} is not one quill implements ({allowed})")
        for name in ("sliding_layers", "rope_layers"):
            flags = getattr(self, name)
            if flags is not None and len(flags) != self.num_layers:
                raise UnsupportedModelError(f"{name} lists {len(flags)} layers; the model has {self.num_layers}")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise UnsupportedModelError(f"sliding_window must be a positive number of positions; got {self.sliding_window}")
        if self.rotary_dim and (self.rotary_dim % 2 or self.rotary_dim > self.head_dim):
            raise UnsupportedModelError(f"rotary_dim {self.rotary_dim} must be even and at most head_dim {self.head_dim}")

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of one layer (positions a query may look back, itself included), or None."""
        if self.sliding_window is None or (self.sliding_layers is not None and not self.sliding_layers[layer]):
            return None
        return self.sliding_window

    def layer_rope(self, layer: int) -> tuple[float, tuple | None] | None:
        """(base, scaling items) of one layer's RoPE, or None for a layer without it (NoPE)."""
        if self.rope_layers is not None and not self.rope_layers[layer]:
            return None
        if self.rope_local_theta is not None and self.layer_window(layer) is not None:
            return self.rope_local_theta, None
        return self.rope_theta, self.rope_scaling

    @property
    def rotary_width(self) -> int:
        return self.rotary_dim or self.head_dim

    @property
    def window_layers(self) -> int:
        """How many layers have a sliding window."""
        return sum(self.layer_window(i) is not None for i in range(self.num_layers))

    def recipe_summary(self) -> str:
        """The layer recipe in one line, for `quill info` and `quill memory`."""
        n = self.num_layers
        parts = [f"{self.norm_layout}-norm RMSNorm", "SwiGLU" if self.hidden_act == "silu" else "GeGLU (tanh GELU)"]
        if self.qk_norm:
            parts.append(f"q/k norm ({'per head' if self.qk_norm == 'head' else 'whole projection'})")
        if self.attention_bias:
            parts.append("q/k/v bias")
        rope_on = sum(self.layer_rope(i) is not None for i in range(n))
        parts.append(f"RoPE on {rope_on}/{n} layers" + (f" ({self.rotary_dim} of {self.head_dim} dims)" if self.rotary_dim else ""))
        if self.sliding_window:
            parts.append(f"sliding window {self.sliding_window:,} on {self.window_layers}/{n} layers"
                         + (f" (local RoPE base {self.rope_local_theta:g})" if self.rope_local_theta else ""))
        if self.final_logit_softcapping:
            parts.append(f"logit soft-cap {self.final_logit_softcapping:g}")
        return ", ".join(parts)

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
        num_heads = config["num_attention_heads"]
        head_dim = config.get("head_dim") or config["hidden_size"] // num_heads
        eos = config.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        rope = hf_rope(config, head_dim)
        sliding = config.get("sliding_window") if config.get("use_sliding_window", spec.sliding_window_by_default) else None
        sliding = sliding or None  # 0 or null: no window
        act = config.get("hidden_activation") or config.get("hidden_act") or spec.hidden_act
        fields = dict(
            architecture=spec.name,
            vocab_size=config["vocab_size"],
            hidden_size=config["hidden_size"],
            intermediate_size=config["intermediate_size"],
            num_layers=config["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=config.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            max_position_embeddings=config.get("max_position_embeddings", 2048),
            rms_norm_eps=config.get("rms_norm_eps", 1e-5),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            attention_bias=bool(config.get("attention_bias", spec.qkv_bias)),
            sliding_window=sliding,
            qk_norm=spec.qk_norm,
            norm_layout=spec.norm_layout,
            norm_offset=spec.hf_norm_offset,
            hidden_act=HF_ACTIVATIONS.get(act, act),
            final_logit_softcapping=config.get("final_logit_softcapping"),
            **{s.field: float(config.get(s.hf_key) or s.default) for s in spec.scalars},
            bos_token_id=config.get("bos_token_id"),
            eos_token_ids=eos_ids,
            **rope,
        )
        if spec.hf_config is not None:
            fields.update(spec.hf_config(config, fields))
        return cls(**fields)

    def to_dict(self) -> dict:
        """Every field, JSON-ready (tuples become lists); from_dict restores the same config."""
        from dataclasses import asdict

        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        """The inverse of to_dict: lists back to the tuples the frozen config holds."""
        fields = dict(d)
        for name in ("sliding_layers", "rope_layers", "eos_token_ids"):
            if fields.get(name) is not None:
                fields[name] = tuple(fields[name])
        if fields.get("rope_scaling") is not None:
            fields["rope_scaling"] = tuple((k, tuple(v) if isinstance(v, list) else v) for k, v in fields["rope_scaling"])
        return cls(**fields)

    @classmethod
    def from_json_file(cls, path: str | Path) -> "ModelConfig":
        return cls.from_hf_config(json.loads(Path(path).read_text()))


# config.json activation names -> ModelConfig.hidden_act
HF_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}
ROPE_SCALING_TYPES = ("llama3", "linear", "longrope", "yarn")  # besides none ("default")


def hf_rope(config: dict, head_dim: int) -> dict:
    """ModelConfig's RoPE fields from config.json, in either layout transformers writes: the older
    rope_theta + rope_scaling (+ partial_rotary_factor, + Gemma 3's rope_local_base_freq) or
    rope_parameters, flat or keyed by layer type ("full_attention" / "sliding_attention")."""
    params = config.get("rope_parameters") or {}
    local = None
    if "full_attention" in params or "sliding_attention" in params:
        local = params.get("sliding_attention")
        params = params.get("full_attention") or local or {}
    scaling = dict(config.get("rope_scaling") or params)
    theta = params.get("rope_theta", config.get("rope_theta"))
    theta = 10000.0 if theta is None else float(theta)
    partial = scaling.pop("partial_rotary_factor", None) or config.get("partial_rotary_factor") or 1.0
    scaling.pop("rope_theta", None)
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind in (None, "default"):
        scaling = None
    elif kind not in ROPE_SCALING_TYPES:
        raise UnsupportedModelError(f"unsupported rope_scaling type {kind!r}; quill applies {', '.join(ROPE_SCALING_TYPES)}")
    else:
        scaling["rope_type"] = kind
        if kind in ("longrope", "yarn"):
            scaling.setdefault("original_max_position_embeddings", config.get("original_max_position_embeddings"))
            scaling.setdefault("max_position_embeddings", config.get("max_position_embeddings"))
    if local is not None and local.get("rope_type", "default") != "default":
        raise UnsupportedModelError(f"unsupported RoPE scaling {local.get('rope_type')!r} on sliding-window layers")
    local_theta = local.get("rope_theta") if local is not None else config.get("rope_local_base_freq")
    rotary = int(head_dim * float(partial))
    return dict(rope_theta=theta, rope_scaling=freeze(scaling) if scaling else None,
                rope_local_theta=None if local_theta is None else float(local_theta),
                rotary_dim=0 if rotary == head_dim else rotary)


def freeze(d: dict) -> tuple:
    """A dict as sorted items, lists as tuples: hashable for the frozen config."""
    return tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in d.items()))


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


SPECULATIVE_METHODS = ("ngram", "draft", "off")  # --speculative


def parse_draft_layers(spec: str) -> tuple[int, ...]:
    """--draft-layers: "N" = the target's first N layers; "0-5,26-29" = those layers (ranges inclusive)."""
    text = spec.strip()
    try:
        if text.isdigit():
            return tuple(range(int(text)))
        layers: set[int] = set()
        for part in text.split(","):
            lo, sep, hi = part.strip().partition("-")
            a, b = int(lo), int(hi) if sep else int(lo)
            if a > b:
                raise ValueError
            layers.update(range(a, b + 1))
    except ValueError:
        raise ValueError(f"draft layers must be a count (\"8\") or layer ranges (\"0-5,26-29\"); got {spec!r}") from None
    return tuple(sorted(layers))


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (quill/engine/speculative.py): propose tokens, verify them in one pass.

    Outputs never change: proposals are checked by the batch-invariant decode rows and the
    request's own sampler, so only speed does. Proposers: "ngram" (prompt lookup) and "draft", a
    draft model's greedy guesses: another model with the same tokenizer (draft_model), or a subset
    of the target's own layers (draft_layers: self-speculation, no extra weights or KV)."""

    method: str = "ngram"  # "ngram": prompt lookup (on by default: it measured no loss where it cannot help); "draft"; "off"
    num_tokens: int = 8  # proposed tokens per sequence and step, at most (the cost model picks fewer)
    ngram_max: int = 4  # the longest suffix looked up in the prompt and output
    ngram_min: int = 2  # the shortest
    draft_model: str | None = None  # "draft": a model path (GGUF, folder, .quill) with the target's tokenizer
    draft_layers: tuple[int, ...] | None = None  # "draft": these layers of the target (sorted, distinct)
    draft_quantize: str | None = None  # "int8": quantize the draft model's fp16/bf16/fp32 weights at load

    def __post_init__(self):
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative method must be one of {', '.join(SPECULATIVE_METHODS)}; got {self.method!r}")
        if not 1 <= self.num_tokens <= 16:
            raise ValueError(f"num_speculative_tokens must be in [1, 16]; got {self.num_tokens}")
        if not 1 <= self.ngram_min <= self.ngram_max <= 8:
            raise ValueError(f"n-gram lengths must satisfy 1 <= min <= max <= 8; got min {self.ngram_min}, max {self.ngram_max}")
        drafts = [name for name, v in (("draft_model", self.draft_model), ("draft_layers", self.draft_layers)) if v is not None]
        if self.method == "draft" and len(drafts) != 1:
            raise ValueError("speculative method 'draft' needs exactly one of a draft model (--draft-model PATH) or "
                             f"draft layers of the target (--draft-layers N); got {len(drafts)}")
        if self.method != "draft" and drafts:
            raise ValueError(f"{drafts[0]} is for speculative method 'draft', not {self.method!r}")
        if self.draft_quantize is not None and (self.draft_model is None or self.draft_quantize != "int8"):
            raise ValueError(f"draft quantize must be 'int8' and needs a draft model; got {self.draft_quantize!r}"
                             + ("" if self.draft_model else " without one"))
        if self.draft_layers is not None and (not self.draft_layers or list(self.draft_layers) != sorted(set(self.draft_layers))
                                              or self.draft_layers[0] < 0):
            raise ValueError(f"draft layers must be distinct non-negative layer numbers in order; got {self.draft_layers}")

    @property
    def enabled(self) -> bool:
        return self.method != "off"

    @classmethod
    def from_options(cls, method: str | None = None, num_tokens: int | None = None, draft_model: str | None = None,
                     draft_layers: str | int | tuple[int, ...] | None = None,
                     draft_quantize: str | None = None) -> "SpeculativeConfig":
        """The flags' and LLM's form: method None is "draft" when a draft is named, else the default;
        draft_layers as --draft-layers text, a count, or layer numbers."""
        if isinstance(draft_layers, (str, int)) and not isinstance(draft_layers, bool):
            draft_layers = parse_draft_layers(str(draft_layers))
        elif draft_layers is not None:
            draft_layers = tuple(draft_layers)
        if method is None:
            method = "draft" if draft_model is not None or draft_layers is not None else cls.method
        return cls(method, cls.num_tokens if num_tokens is None else num_tokens,
                   draft_model=draft_model, draft_layers=draft_layers, draft_quantize=draft_quantize)


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs to start."""

    model: str | None = None  # path; None = the embedded default model
    device: str = "cpu"
    threads: int | None = None
    quantize: str | None = None  # "int8": quantize fp16/bf16/fp32 weights at load (GGUF files are used as they are)
    cache_dir: str | None = None  # convert to .quill there on first use, map it afterwards (models/model_cache.py)
    # "int8": round activations to int8 (per 32, own scale) in the linears that have an int8 kernel
    # (opt-in; AVX-512 VNNI, else AVX2); "exact": fp32 activations; None: QUILL_INT8_ACTIVATIONS=1 or exact
    activations: str | None = None
    max_model_len: int | None = None  # None = the model's context length
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    fault_injection: bool = False  # tests and `quill bench soak` only: lets requests arm a FaultPlan phase
