"""Packed low-bit layout and the native GEMV kernels: exactness, accuracy, batch invariance, memory."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from quill.kernels import native, tiled
from quill.kernels.kquant import BlockWeight
from quill.kernels.options import KernelOptions
from quill.kernels.options import use as use_kernel_options
from quill.kernels.packed import PACKABLE, PackedLinear, PackedWeight, SplitWeight, Workspace, concat_rows, pack_gguf

from test_gguf import random_tensor

needs_native = pytest.mark.skipif(native.load() is None, reason="native kernels need x86-64 AVX2/FMA and gcc")
needs_amx = pytest.mark.usefixtures("amx_kernels")  # natively, or on the AMX emulation (conftest.py)
TYPES = sorted(PACKABLE, key=lambda t: t.name)


def packed(qtype, rows=24, blocks=3, seed=0):
    if gguf.GGML_QUANT_SIZES[qtype][0] == 1:  # F16 / BF16: "blocks" of 64 weights
        blocks *= 64
    raw, shape = random_tensor(qtype, rows, blocks, seed)
    return pack_gguf(qtype, shape, raw), gguf.quants.dequantize(raw, qtype).reshape(shape)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_packed_layout_round_trip_equals_gguf(qtype):
    w, ref = packed(qtype, blocks=256 // 32 if qtype in (Q.Q4_K, Q.Q5_K) else 3)
    exact = w.dequantize_rows(torch.arange(w.rows)).numpy()  # scale * code + min, two roundings as gguf
    np.testing.assert_array_equal(exact, ref)
    np.testing.assert_allclose(w.dequantize().numpy(), ref, rtol=1e-6, atol=1e-6)  # native (FMA) tile


def test_unpackable_types_return_none():
    raw, shape = random_tensor(Q.F32, 4, 64)
    assert pack_gguf(Q.F32, shape, raw) is None  # fp32 stays a dense torch weight


@needs_native
@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_NL, Q.IQ4_XS],
                         ids=lambda t: t.name)
@pytest.mark.parametrize("batch", [1, 3, 16, 40])
def test_kernel_matches_fp32_reference(qtype, batch):
    w, ref = packed(qtype, rows=40, blocks=8 if qtype in (Q.Q4_K, Q.Q5_K) else 5 if qtype != Q.IQ4_XS else 2, seed=batch)
    lin = PackedLinear(w, None, Workspace())
    x = torch.randn(batch, w.cols, generator=torch.Generator().manual_seed(1))
    expected = x.double() @ torch.from_numpy(ref).double().T
    got = lin(x, gemv_rows=batch).double()
    scale = expected.abs().max()
    assert ((got - expected).abs().max() / scale).item() < 1e-4
    # the prefill path (dequant tile + BLAS) agrees too
    assert ((lin(x, gemv_rows=0).double() - expected).abs().max() / scale).item() < 1e-4


@needs_native
@pytest.mark.parametrize("qtype", [Q.Q4_1, Q.Q8_0])  # the q4 and q8 layouts' row kernels
def test_kernel_rows_are_batch_invariant(qtype):
    w, _ = packed(qtype, rows=64, blocks=18, seed=3)
    lin = PackedLinear(w, None, Workspace())
    batch = torch.randn(16, w.cols, generator=torch.Generator().manual_seed(2))
    full = lin(batch, gemv_rows=16)
    for i in (0, 5, 6, 7, 8, 11, 12, 15):  # both ends of every pass (6 items per pass with AVX2, 8 with AVX-512)
        alone = lin(batch[i : i + 1], gemv_rows=1)
        assert torch.equal(alone[0], full[i]), f"row {i} differs alone vs in a batch of 16"
    reordered = lin(batch.flip(0), gemv_rows=16)
    assert torch.equal(reordered.flip(0), full)
    # decode rows stay on the kernel even when prefill rows share the step
    mixed = torch.cat([batch[:3], torch.randn(40, w.cols)])
    assert torch.equal(lin(mixed, gemv_rows=3)[:3], full[:3])


@needs_native
@pytest.mark.parametrize("isa", [256, 512])  # 512: natively or on the emulation (conftest.py)
@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q8_0])
def test_row_kernels_in_chunks_match_whole_rows(qtype, isa):
    """Batches of 8 or more whose x outgrows L1 run the q4/q8 rows in chunks of columns over blocks of rows
    (quant_gemv.c's GEMV_FN): 70 rows (a last block of 6), 101 groups (chunks of 32, then 5: an odd last
    group), a NaN and an inf in one item. Each row is bit-identical alone (whole rows) and in every batch,
    and within 1e-5 of fp64."""
    w, ref = packed(qtype, rows=70, blocks=101, seed=7)
    lin = PackedLinear(w, None, Workspace())
    x = torch.randn(21, w.cols, generator=torch.Generator().manual_seed(8))
    x[11, 3], x[12, 40] = float("nan"), float("inf")
    with use_kernel_options(KernelOptions(isa=isa, amx=False, threads=2)):
        alone = torch.cat([lin(x[b : b + 1], gemv_rows=1) for b in range(21)])
        for batch in (8, 9, 16, 21):
            assert torch.equal(lin(x[:batch], gemv_rows=batch).view(torch.int32), alone[:batch].view(torch.int32)), batch
    finite = [b for b in range(21) if b not in (11, 12)]
    expected = x[finite].double() @ torch.from_numpy(ref).double().T
    assert ((alone[finite].double() - expected).abs().max() / expected.abs().max()).item() < 1e-5
    assert alone[11].isnan().all() and not alone[12].isfinite().any()


# The types whose weights take the q4/q8 layouts, which the AMX tiling converts, and the GGUF block
# types it tiles with their own scales (the others keep their GGUF blocks: quill.kernels.kquant).
PACKED_TILED = [t for t in TYPES if isinstance(packed(t)[0], PackedWeight)]
BLOCK_TILED = [Q.Q4_K, Q.Q5_K, Q.IQ4_XS, Q.Q6_K]
TILED_TYPES = PACKED_TILED + BLOCK_TILED


def tiled_pair(qtype, rows=48, seed=0):
    """A packed weight, its tiled form and gguf's values; 64-column chunks need 2 blocks of 32."""
    w, ref = packed(qtype, rows=rows, blocks=6, seed=seed)
    return w, tiled.tile_weight(w), ref


def test_tiled_types_are_the_q4_q8_layouts_and_four_block_types():
    assert [t.name for t in PACKED_TILED] == ["Q4_0", "Q4_1", "Q5_1", "Q8_0"]
    w = packed(Q.Q2_K)[0]
    assert tiled.tile_weight(w) is None and tiled.for_cpu(w) is w  # other block weights pass through unchanged
    assert all(isinstance(packed(t)[0], BlockWeight) for t in BLOCK_TILED)


@needs_amx
@pytest.mark.parametrize("qtype", TILED_TYPES, ids=lambda t: t.name)
def test_tiled_layout_holds_the_same_values(qtype):
    w, t, ref = tiled_pair(qtype)
    assert t is not None and (t.rows, t.cols) == (w.rows, w.cols)
    assert torch.equal(t.dequantize(), w.dequantize())  # same values, only reordered
    ids = torch.tensor([0, 7, 16, 47, 3])
    assert torch.equal(t.dequantize_rows(ids), w.dequantize_rows(ids))
    np.testing.assert_array_equal(t.dequantize_rows(torch.arange(t.rows)).numpy(), ref)
    if isinstance(w, PackedWeight):
        assert t.nbytes <= w.nbytes  # all-zero mins (Q8_0) are dropped
    else:  # the file's scales: an int8 per group and an fp16 factor per 256 (Q4_K's d and dmin take 2 bytes more)
        assert w.nbytes <= t.nbytes <= 1.03 * w.nbytes and t.scale_d is not None


@needs_amx
def test_tiled_layout_refuses_shapes_that_do_not_fit():
    w, _ = packed(Q.Q4_1, rows=40, blocks=6)  # 40 rows: not whole 16-row blocks
    assert tiled.tile_weight(w) is None and tiled.for_cpu(w) is w
    w, _ = packed(Q.Q4_1, rows=48, blocks=5)  # 160 columns: not whole 64-column chunks
    assert tiled.tile_weight(w) is None


@needs_amx
@pytest.mark.parametrize("qtype", TILED_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("batch", [1, 2, 5, 16, 19])
def test_tiled_kernel_matches_fp32_reference(qtype, batch):
    _, t, ref = tiled_pair(qtype, seed=batch)
    lin = PackedLinear(t, None, Workspace())
    x = torch.randn(batch, t.cols, generator=torch.Generator().manual_seed(1))
    x[0, 5] = 300.0  # an outlier: the digit split is per 32-element group (Q6_K: per 256), which loses resolution
    expected = x.double() @ torch.from_numpy(ref).double().T
    got = lin(x, gemv_rows=batch).double()
    assert ((got - expected).abs().max() / expected.abs().max()).item() < 1e-5
    assert ((lin(x, gemv_rows=0).double() - expected).abs().max() / expected.abs().max()).item() < 1e-5


@needs_amx
@pytest.mark.parametrize("batch", [1, 3, 6, 16, 21])
def test_q6_k_tiled_error_is_its_super_block_digits(batch):
    """Q6_K's tiled GEMV (q6_levels_gemv) sums exact integers over each 256-column super-block, so its error is
    the activations' digits (at most half a unit of 2^(e-22) per element, 2^(e-1) <= the super-block's largest
    |x| < 2^e) plus a few fp32 roundings per super-block. A wrong byte, level or offset is far outside."""
    _, t, ref = tiled_pair(Q.Q6_K, rows=32, seed=batch)  # 6 super-blocks of 256 columns
    lin = PackedLinear(t, None, Workspace())
    x = torch.randn(batch, t.cols, generator=torch.Generator().manual_seed(batch))
    x[0, 300] = 1e3  # an outlier coarsens its super-block's digits only
    x[-1, 512:768] = 0.0  # an all-zero super-block
    x[batch // 2, 1024:1280] *= 1e-20  # and a tiny one
    w = torch.from_numpy(ref).double()
    xd = x.double()
    exact = xd @ w.T
    sb = xd.abs().view(batch, -1, 256).amax(-1)  # (batch, super-blocks)
    unit = torch.where(sb > 0, torch.exp2(torch.floor(torch.log2(sb)) + 1 - 22), torch.zeros_like(sb))
    digits = (unit / 2) @ w.abs().view(w.shape[0], -1, 256).sum(-1).T  # sum over blocks of half-unit * sum|w|
    bound = digits + 2**-21 * (xd.abs() @ w.abs().T)
    got = lin(x, gemv_rows=batch).double()
    assert ((got - exact).abs() <= bound).all()
    assert ((got - exact).abs() / (xd.abs() @ w.abs().T)).max() > 0  # (the bound is not met by luck of zeros)


@needs_amx
@pytest.mark.parametrize("rows", [64, 48])  # batch 1 pairs the halves of a thread's row blocks: 3 leave one alone
@pytest.mark.parametrize("qtype", [Q.Q4_1, Q.Q8_0] + BLOCK_TILED, ids=lambda t: t.name)
def test_tiled_kernel_rows_are_batch_invariant(qtype, rows):
    _, t, _ = tiled_pair(qtype, rows=rows, seed=3)
    lin = PackedLinear(t, None, Workspace())
    batch = torch.randn(19, t.cols, generator=torch.Generator().manual_seed(2))
    full = lin(batch[:16], gemv_rows=16)
    for i in (0, 5, 15):
        assert torch.equal(lin(batch[i : i + 1], gemv_rows=1)[0], full[i]), f"row {i} differs alone vs in 16"
    assert torch.equal(lin(batch[:16].flip(0), gemv_rows=16).flip(0), full)
    assert torch.equal(lin(batch, gemv_rows=19)[:16], full)  # past one 16-item pass, odd count padded


@needs_amx
def test_split_projection_tiles_its_parts_and_writes_their_columns():
    """Q4_K_M's q/k/v: Q4_K parts beside a Q6_K part (and a Q2_K one that does not tile), each written into
    its columns of the fused output (the tiled kernel's row stride)."""
    parts = [packed(q, rows=r, blocks=2, seed=i) for i, (q, r) in enumerate([(Q.Q4_K, 32), (Q.Q6_K, 16), (Q.Q2_K, 16),
                                                                             (Q.IQ4_XS, 48), (Q.Q5_K, 16)])]
    split = tiled.for_cpu(concat_rows([w for w, _ in parts]))
    assert isinstance(split, SplitWeight)
    assert [type(p).__name__ for p in split.parts] == ["TiledWeight", "TiledWeight", "BlockWeight", "TiledWeight",
                                                       "TiledWeight"]
    ref = torch.from_numpy(np.concatenate([r for _, r in parts])).double()
    lin = PackedLinear(split, None, Workspace())
    for batch in (1, 5, 17):
        x = torch.randn(batch, split.cols, generator=torch.Generator().manual_seed(batch))
        expected = x.double() @ ref.T
        for rows in (batch, 0):  # the GEMV kernels, and prefill's dequantized tile
            got = lin(x, gemv_rows=rows).double()
            assert ((got - expected).abs().max() / expected.abs().max()).item() < 1e-5


@needs_amx
@pytest.mark.parametrize("qtype", [Q.Q4_1, Q.Q8_0] + BLOCK_TILED, ids=lambda t: t.name)
def test_tiled_kernel_propagates_nan_and_inf(qtype):
    _, t, _ = tiled_pair(qtype)
    lin = PackedLinear(t, None, Workspace())
    x = torch.randn(3, t.cols, generator=torch.Generator().manual_seed(4))
    x[0, 7], x[1, 40] = float("nan"), float("inf")
    out = lin(x, gemv_rows=3)
    assert out[0].isnan().all() and not out[1].isfinite().any() and out[2].isfinite().all()


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
