import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))


def use_library(monkeypatch, lib) -> None:
    """Put a kernel library (an emulation build) behind native.load() and options.hardware() for one
    test, the hardware being what its own probes report. Objects built before the test (session
    fixtures) keep the library they were built with."""
    from quill.kernels import native, options

    hw = options.probe(lib)
    monkeypatch.setattr(native, "load", lambda emulate=None: lib)
    monkeypatch.setattr(options, "hardware", lambda: hw)


def use_emulation(monkeypatch, emulate: str) -> None:
    """use_library with native.load(emulate=...): the same C source on csrc/isa.h's emulation."""
    from quill.kernels import native

    lib = native.load(emulate=emulate)
    if lib is None:
        pytest.fail(f"the {emulate} emulation did not build (simde-py is a test dependency: pip install -e '.[test]')")
    use_library(monkeypatch, lib)


def _run_avx512_kernels(monkeypatch) -> None:
    """Make the AVX-512 kernels run for one test whatever the CPU: natively where it has AVX-512 with
    VNNI, else the same C source built on SIMDe's emulation of each intrinsic."""
    from quill.kernels import native, options

    hw = options.hardware()
    if native.load() is not None and not (hw.avx512 and hw.vnni):
        use_emulation(monkeypatch, "avx512-vnni")


@pytest.fixture(autouse=True)
def _avx512_kernels(request, monkeypatch):
    """A test parametrized with isa=512 runs the AVX-512 kernels, natively or emulated (above): no
    AVX-512 path is only ever skipped on an AVX2-only host."""
    callspec = getattr(request.node, "callspec", None)
    if callspec is not None and callspec.params.get("isa") == 512:
        _run_avx512_kernels(monkeypatch)


@pytest.fixture
def avx512_kernels(monkeypatch):
    """The same for a test without an isa parameter that needs AVX-512 code."""
    _run_avx512_kernels(monkeypatch)


@pytest.fixture
def amx_kernels(monkeypatch):
    """The AMX tiled path for one test whatever the CPU: natively where the OS grants the tile unit, else
    the C source on the emulation with isa.h's tile unit (native.load(emulate="amx"))."""
    from quill.kernels import native, tiled

    if native.load() is None:
        pytest.skip("native kernels need x86-64 AVX2/FMA and gcc")
    if tiled.available():
        return
    use_emulation(monkeypatch, "amx")
    assert tiled.available()


@pytest.fixture(scope="session")
def default_loaded():
    """The embedded default model, loaded once per test session."""
    from quill.models.loader import load_model

    return load_model(None)


@pytest.fixture(scope="session")
def make_llm(default_loaded):
    """make_llm(**engine options) -> an LLM over the shared default weights with its own KV pool."""
    from quill.config import CacheConfig, EngineConfig, SchedulerConfig
    from quill.llm import LLM

    def make(num_kv_blocks=None, kv_cache_memory=64 << 20, block_size=16, enable_prefix_caching=True,
             max_num_seqs=64, max_num_batched_tokens=512, max_model_len=None, fault_injection=False,
             speculative=None):
        from quill.config import SpeculativeConfig

        cfg = EngineConfig(
            model=None,
            max_model_len=max_model_len,
            cache=CacheConfig(block_size, kv_cache_memory, enable_prefix_caching, num_kv_blocks),
            scheduler=SchedulerConfig(max_num_batched_tokens, max_num_seqs),
            fault_injection=fault_injection,
            speculative=SpeculativeConfig() if speculative is None else SpeculativeConfig(speculative),
        )
        return LLM.from_engine_config(cfg, default_loaded)

    return make
