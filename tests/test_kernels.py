"""Packed low-bit layout and the native GEMV kernels: exactness, accuracy, batch invariance, memory."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from quill.kernels import native
from quill.kernels.packed import PACKABLE, PackedLinear, Workspace, concat_rows, pack_gguf

from test_gguf import random_tensor

needs_native = pytest.mark.skipif(native.load() is None, reason="native kernels need x86-64 AVX2/FMA and gcc")
TYPES = sorted(PACKABLE, key=lambda t: t.name)


def packed(qtype, rows=24, blocks=3, seed=0):
    raw, shape = random_tensor(qtype, rows, blocks, seed)
    return pack_gguf(qtype, shape, raw), gguf.quants.dequantize(raw, qtype).reshape(shape)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_packed_layout_round_trip_equals_gguf(qtype):
    w, ref = packed(qtype, blocks=256 // 32 if qtype in (Q.Q4_K, Q.Q5_K) else 3)
    exact = w.dequantize_rows(torch.arange(w.rows)).numpy()  # scale * code + min, two roundings as gguf
    np.testing.assert_array_equal(exact, ref)
    np.testing.assert_allclose(w.dequantize().numpy(), ref, rtol=1e-6, atol=1e-6)  # native (FMA) tile


def test_unpackable_types_return_none():
    raw, shape = random_tensor(Q.Q6_K, 4, 1)
    assert pack_gguf(Q.Q6_K, shape, raw) is None
    raw, shape = random_tensor(Q.F16, 4, 1)
    assert pack_gguf(Q.F16, shape, raw) is None


@needs_native
@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.Q4_K, Q.Q5_K], ids=lambda t: t.name)
@pytest.mark.parametrize("batch", [1, 3, 16, 40])
def test_kernel_matches_fp32_reference(qtype, batch):
    w, ref = packed(qtype, rows=40, blocks=8 if qtype in (Q.Q4_K, Q.Q5_K) else 5, seed=batch)
    lin = PackedLinear(w, None, Workspace())
    x = torch.randn(batch, w.cols, generator=torch.Generator().manual_seed(1))
    expected = x.double() @ torch.from_numpy(ref).double().T
    got = lin(x, gemv_rows=batch).double()
    scale = expected.abs().max()
    assert ((got - expected).abs().max() / scale).item() < 1e-4
    # the prefill path (dequant tile + BLAS) agrees too
    assert ((lin(x, gemv_rows=0).double() - expected).abs().max() / scale).item() < 1e-4


@needs_native
def test_kernel_rows_are_batch_invariant():
    w, _ = packed(Q.Q4_1, rows=64, blocks=18, seed=3)
    lin = PackedLinear(w, None, Workspace())
    batch = torch.randn(16, w.cols, generator=torch.Generator().manual_seed(2))
    full = lin(batch, gemv_rows=16)
    for i in (0, 5, 15):
        alone = lin(batch[i : i + 1], gemv_rows=1)
        assert torch.equal(alone[0], full[i]), f"row {i} differs alone vs in a batch of 16"
    reordered = lin(batch.flip(0), gemv_rows=16)
    assert torch.equal(reordered.flip(0), full)
    # decode rows stay on the kernel even when prefill rows share the step
    mixed = torch.cat([batch[:3], torch.randn(40, w.cols)])
    assert torch.equal(lin(mixed, gemv_rows=3)[:3], full[:3])


def test_concat_rows_fuses_projections():
    a, ra = packed(Q.Q4_1, rows=8, seed=1)
    b, rb = packed(Q.Q4_1, rows=5, seed=2)
    fused = concat_rows([a, b])
    assert fused.rows == 13
    np.testing.assert_array_equal(fused.dequantize_rows(torch.arange(13)).numpy(), np.concatenate([ra, rb]))


@pytest.mark.slow
def test_default_model_resident_weights_within_bound(default_loaded):
    resident = default_loaded.model.resident_bytes()
    assert resident <= 1.25 * default_loaded.file_bytes, (resident, default_loaded.file_bytes)
    if native.load() is not None:
        assert type(default_loaded.model.layers[0].mlp.down_proj).__name__ == "PackedLinear"
