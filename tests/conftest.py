import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))


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
