"""The paged KV cache tensors, and how many blocks a memory budget buys."""

from __future__ import annotations

import math
import mmap
import os

import torch

from quill.config import CacheConfig, ModelConfig

DEFAULT_FRACTION_OF_FREE_RAM = 0.25
DEFAULT_MAX_KV_BYTES = 2 << 30
KV_CACHE_DTYPES = {"fp32": torch.float32, "fp16": torch.float16}  # names as in config.KV_CACHE_DTYPE_NAMES


def available_memory_bytes() -> int:
    """MemAvailable from /proc/meminfo, falling back to total physical memory."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def num_blocks_for(cache: CacheConfig, model: ModelConfig, bytes_per_element: int = 4,
                   draft: ModelConfig | None = None) -> int:
    """Pool size from the budget (--kv-cache-memory), or min(25% of free RAM, 2 GiB) by default.
    With a draft model that has its own cache, a block is both models' K/V for its tokens."""
    if cache.num_blocks_override is not None:
        return cache.num_blocks_override
    budget = cache.kv_cache_memory
    if budget is None:
        budget = min(int(available_memory_bytes() * DEFAULT_FRACTION_OF_FREE_RAM), DEFAULT_MAX_KV_BYTES)
    per_token = model.kv_bytes_per_token(bytes_per_element)
    if draft is not None:
        per_token += draft.kv_bytes_per_token(bytes_per_element)
    block_bytes = per_token * cache.block_size
    num_blocks = budget // block_bytes
    if num_blocks < 1:
        raise ValueError(
            f"kv_cache_memory {budget:,} bytes holds no block: one block of {cache.block_size} tokens "
            f"needs {block_bytes:,} bytes"
        )
    return int(num_blocks)


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device) -> torch.Tensor:
    """A zeroed tensor. On the CPU, an anonymous mapping: the OS hands out zero pages as they are first
    written, so the pool costs memory only as sequences fill it and the engine starts without writing
    gigabytes (torch.zeros writes every byte). Without huge pages: a sequence's first block touches one
    4 KiB page per layer and KV head, not 2 MiB of zeroing each (1 GiB for a 1B model's first token)."""
    if str(device) != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    area = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):
        area.madvise(mmap.MADV_NOHUGEPAGE)
    return torch.frombuffer(area, dtype=dtype).view(shape)  # the tensor keeps the mapping alive


class KVCache:
    """Per layer, one K and one V tensor of (kv_heads, num_blocks * block_size, head_dim): head-major, so
    one head's rows for the positions of a block lie side by side and attention reads them as a stream."""

    def __init__(self, model: ModelConfig, num_blocks: int, block_size: int, dtype=torch.float32, device="cpu"):
        self.num_blocks, self.block_size = num_blocks, block_size
        slots = num_blocks * block_size
        shape = (model.num_kv_heads, slots, model.head_dim)
        self.layers = [(_zeros(shape, dtype, device), _zeros(shape, dtype, device)) for _ in range(model.num_layers)]
        self.bytes_per_token = model.kv_bytes_per_token(dtype.itemsize)

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size
