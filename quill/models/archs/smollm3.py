"""SmolLM3: the Llama layer, but every 4th layer has no RoPE (NoPE). config.json lists them in
no_rope_layers (1 = RoPE, 0 = none); llama.cpp's loader fixes the same rule for smollm3 (layer i
skips RoPE when (i + 1) % 4 == 0). The converter is a LlamaModel subclass: q/k rows interleaved."""

from quill.models.archs import ArchSpec

NO_ROPE_INTERVAL = 4


def _every_4th_nope(num_layers: int) -> tuple[bool, ...]:
    return tuple((i + 1) % NO_ROPE_INTERVAL != 0 for i in range(num_layers))


def _hf(config: dict, fields: dict) -> dict:
    flags = config.get("no_rope_layers")
    return {"rope_layers": tuple(bool(f) for f in flags) if flags else _every_4th_nope(fields["num_layers"])}


def _gguf(key, fields: dict) -> dict:
    return {"rope_layers": _every_4th_nope(fields["num_layers"])}


SPEC = ArchSpec(
    name="smollm3",
    hf_classes=("SmolLM3ForCausalLM",),
    gguf_arch="smollm3",
    families="SmolLM3",
    gguf_permutes_qk=True,
    hf_config=_hf,
    gguf_config=_gguf,
)
