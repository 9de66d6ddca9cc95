"""K-quant weights in the tiled layout on the VNNI tiles (tiled.for_cpu where AMX does not tile: a Zen 4, or
QUILL_NO_AMX=1): csrc/kquant_i8.c's quill_gemv_tiled_exact reads the AMX tiled layout and fills the same
tiles as the VNNI kernel on the file's blocks, so its outputs are those, bit for bit, at every batch; the
loader takes that layout and an engine's logits do not change. Natively where the CPU has AVX-512 VNNI,
else on the emulation build (conftest.py's avx512_kernels)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from quill.bench.synth import MODELS, random_blocks, write_synth
from quill.kernels import native, tiled
from quill.kernels.kquant import BlockWeight, block_weight
from quill.kernels.options import KernelOptions, use
from quill.kernels.packed import PackedLinear, SplitWeight, Workspace

TYPES = [Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_XS]
needs_kernels = pytest.mark.skipif(native.load() is None, reason="native kernels need x86-64 AVX2/FMA and gcc")
OPTIONS = KernelOptions(isa=512, amx=False, threads=2)


def _weight(qtype, rows=48, cols=512, seed=0) -> BlockWeight:
    raw = np.ascontiguousarray(random_blocks(qtype.name, rows, cols, np.random.default_rng(seed))).view(np.uint8)
    return block_weight(qtype, (rows, cols), raw)


def _inputs(cols: int, seed: int) -> torch.Tensor:
    """70 items of x (more than one 64-item chunk): item 3 holds a NaN (it must stay in its own row), item 5 is
    all zero (no digits)."""
    x = torch.randn(70, cols, generator=torch.Generator().manual_seed(seed))
    x[3, 7] = float("nan")
    x[5] = 0.0
    return x


def _gemvs(batch: int, x: torch.Tensor, *linears: PackedLinear) -> list[torch.Tensor]:
    """Each linear's GEMV of the first `batch` items of x."""
    outs = [torch.empty(batch, lin.out_features) for lin in linears]
    for lin, out in zip(linears, outs):
        lin.gemv(x[:batch].contiguous(), out)
    return outs


def _error(got: torch.Tensor, exact: torch.Tensor) -> float:
    """Largest error against the float64 product over the rows without a NaN, relative to its largest value."""
    fine = ~exact.isnan().any(1)
    return ((got[fine].double() - exact[fine]).abs().max() / exact[fine].abs().max()).item()


@needs_kernels
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_tiled_for_vnni_gives_the_blocks_outputs_bit_for_bit(qtype, avx512_kernels):
    blocks = _weight(qtype)
    with use(OPTIONS):
        w = tiled.for_cpu(blocks)
        assert isinstance(w, tiled.TiledWeight) and w.vnni and w.native_kind & 64
        assert w.nbytes <= 1.1 * blocks.nbytes
        ref_lin, lin = PackedLinear(blocks, None, Workspace()), PackedLinear(w, None, Workspace())
        x = _inputs(blocks.cols, 1)
        exact = x.double() @ blocks.dequantize().double().T
        for batch in (1, 2, 7, 16, 17, 40, 70):
            got, want = _gemvs(batch, x, lin, ref_lin)
            assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.nan_to_num(), want.nan_to_num()), batch
            assert _error(got, exact[:batch]) < 1e-5, batch
        _same_rows_everywhere(lin, w, blocks, x)
        # prefill-sized inputs stay on the tiles, every row the blocks' GEMV's bits (the blocks dequantize)
        want = torch.empty(24, w.rows)
        ref_lin.gemv(x[:24].nan_to_num(), want)
        assert torch.equal(lin(x[:24].nan_to_num()), want)


def _same_rows_everywhere(lin: PackedLinear, w, source, x: torch.Tensor) -> None:
    """A tiled weight's rows the same bits alone and in a batch (the stored tile, the items fused in pairs, a
    second chunk), a prefill's rows (every row on the tiles) the GEMV's, and the tiles dequantizing and looking
    up rows exactly as `source`, the weight they were made from."""
    alone = torch.empty(1, w.rows)
    for batch, row in ((16, 9), (3, 2), (4, 1), (70, 66)):
        batched = torch.empty(batch, w.rows)
        lin.gemv(x[row:row + 1].clone(), alone)
        lin.gemv(x[:batch].contiguous(), batched)
        assert torch.equal(alone[0], batched[row]), batch
    assert torch.equal(w.dequantize(), source.dequantize())
    prefill, want = lin(x[:24].nan_to_num()), torch.empty(24, w.rows)
    lin.gemv(x[:24].nan_to_num(), want)
    assert torch.equal(prefill, want)
    ids = torch.tensor([0, 17, 47, 5])
    assert torch.equal(w.dequantize_rows(ids), source.dequantize_rows(ids))


def _q8_0(rows=48, cols=512, seed=0):
    from quill.kernels.packed import pack_gguf

    raw = np.ascontiguousarray(random_blocks("Q8_0", rows, cols, np.random.default_rng(seed))).view(np.uint8)
    return pack_gguf(Q.Q8_0, (rows, cols), raw)


@needs_kernels
def test_q8_0_on_the_vnni_tiles_is_exact_and_batch_invariant(avx512_kernels):
    """Q8_0 takes the VNNI tiles too (kind LAYOUT_Q8: codes + 128 against the digits, the file's fp16 scales):
    not the q8 rows' float order, so the check is against the float64 product (1e-5 of the largest output,
    as every kernel), NaN rows kept apart, each row the same bits alone and in a batch, and the tiles
    dequantizing and looking up rows exactly as the packed weight does."""
    packed = _q8_0()
    assert packed.kind == "q8" and packed.mins is None
    with use(OPTIONS):
        w = tiled.for_cpu(packed)
        assert isinstance(w, tiled.TiledWeight) and w.vnni and w.kind == "q8" and w.native_kind == 1 | 2 | 64
        assert w.scale.dtype == torch.float16 and w.nbytes <= 1.1 * packed.nbytes
        lin, rows_lin = PackedLinear(w, None, Workspace()), PackedLinear(packed, None, Workspace())
        x = _inputs(packed.cols, 3)
        exact = x.double() @ packed.dequantize().double().T
        for batch in (1, 2, 5, 16, 17, 40, 70):
            got, rows_out = _gemvs(batch, x, lin, rows_lin)
            assert torch.equal(got.isnan(), rows_out.isnan()), batch
            assert _error(got, exact[:batch]) < 1e-5, batch
            if batch > 5:
                assert (got[5] == 0).all()  # an all-zero item has no digits
        _same_rows_everywhere(lin, w, packed, x)


@needs_kernels
@pytest.mark.parametrize("qtype,kind,bit", [(Q.Q3_K, "q3", 128), (Q.Q2_K, "q2", 256)], ids=["Q3_K", "Q2_K"])
def test_low_bit_k_quants_on_the_vnni_tiles_are_exact_and_batch_invariant(qtype, kind, bit, avx512_kernels):
    """Q3_K and Q2_K take the VNNI tiles (tiled.py's q3: codes q + 4 as a 2-bit plane and a top-bit plane,
    scales - 32 per 16 weights; q2: codes as a 2-bit plane, the file's scale bytes sc | m << 4 per 16
    weights, d and dmin), the AMX layout never (tile_weight refuses them). Their block rows run another float
    order, so the check is against the float64 product (1e-5 of the largest output), NaN rows kept apart,
    each row the same bits alone and in a batch (the fused single item and pairs, the stored tile, a second
    chunk), a prefill's rows the GEMV's, and the tiles dequantizing and looking up rows exactly as the blocks
    do."""
    blocks = _weight(qtype)
    assert tiled.tile_weight(blocks) is None
    with use(OPTIONS):
        w = tiled.for_cpu(blocks)
        assert isinstance(w, tiled.TiledWeight) and w.vnni and w.kind == kind and w.native_kind == bit | 64 | 4
        assert w.nbytes <= 1.1 * blocks.nbytes
        lin, rows_lin = PackedLinear(w, None, Workspace()), PackedLinear(blocks, None, Workspace())
        x = _inputs(blocks.cols, 4)
        exact = x.double() @ blocks.dequantize().double().T
        for batch in (1, 2, 3, 5, 16, 17, 40, 70):
            got, rows_out = _gemvs(batch, x, lin, rows_lin)
            assert torch.equal(got.isnan(), rows_out.isnan()), batch
            assert _error(got, exact[:batch]) < 1e-5, batch
        _same_rows_everywhere(lin, w, blocks, x)


@needs_kernels
@pytest.mark.parametrize("qtype", [*TYPES, Q.Q8_0, Q.Q3_K], ids=lambda t: t.name)
def test_int8_activations_on_the_vnni_tiles_give_the_blocks_int8_bits(qtype, avx512_kernels):
    """With int8 activations (the opt-in) the K-quants and Q8_0 keep the VNNI tiles: quill_gemv_tiled_i8 rounds x
    as quill_gemv_i8 does and meets the tile decode_tiled makes (decode_blocks' integers and scales), so every
    batch, prefill rows included, is the blocks' int8 kernel's bits. Q3_K has no int8 kernel: its tiles stay on
    the exact digits."""
    source = _q8_0() if qtype == Q.Q8_0 else _weight(qtype)
    int8 = dataclasses.replace(OPTIONS, int8=True)
    x = _inputs(source.cols, 5)
    with use(int8):
        w = tiled.for_cpu(source)
        assert isinstance(w, tiled.TiledWeight) and w.vnni
        lin, ref = PackedLinear(w, None, Workspace()), PackedLinear(source, None, Workspace())
        has_int8 = qtype != Q.Q3_K
        assert (packed_int8_kind(w) is not None) == has_int8
        for batch in (1, 2, 3, 5, 16, 17, 70):
            got, want = _gemvs(batch, x, lin, ref)
            if has_int8:
                assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.nan_to_num(), want.nan_to_num()), batch
        if has_int8:  # the fused items (batches 1-4) and the stored tile: each row the same bits alone and in a batch
            assert torch.equal(lin(x[:24].nan_to_num()), ref(x[:24].nan_to_num()))
            _same_rows_everywhere(lin, w, source, x)
    if not has_int8:  # the same bits as the exact options give
        with use(OPTIONS):
            assert torch.equal(_gemvs(70, x, PackedLinear(w, None, Workspace()))[0].nan_to_num(), got.nan_to_num())


def packed_int8_kind(w):
    from quill.kernels.packed import int8_kind

    return int8_kind(w, native.load())


@needs_kernels
def test_for_cpu_tiles_only_k_quants_and_q8_0_and_only_without_amx(avx512_kernels):
    q4k, q5_0 = _weight(Q.Q4_K), _weight(Q.Q5_0, cols=64)
    with use(OPTIONS):
        assert isinstance(tiled.for_cpu(q4k), tiled.TiledWeight)
        assert tiled.for_cpu(q5_0) is q5_0  # a block kind the tiles do not take keeps its layout
        split = tiled.for_cpu(SplitWeight([q4k, q5_0]))
        assert isinstance(split.parts[0], tiled.TiledWeight) and split.parts[1] is q5_0
        assert tiled.for_cpu(_weight(Q.Q4_K, rows=40)).__class__ is BlockWeight  # rows not in whole tiles
        q8 = _q8_0()
        assert isinstance(tiled.for_cpu(q8), tiled.TiledWeight)
        for kept in (_q8_0(cols=288),  # not whole 256-column blocks of digits
                     dataclasses.replace(q8, mins=torch.ones_like(q8.scale)),  # a min (Q5_1's layout)
                     dataclasses.replace(q8, scale=q8.scale + 1e-9)):  # scales fp16 would round (--quantize int8)
            assert tiled.for_cpu(kept) is kept
    with use(dataclasses.replace(OPTIONS, int8=True)):  # the VNNI tiles have int8 kernels too
        assert isinstance(tiled.for_cpu(q4k), tiled.TiledWeight) and isinstance(tiled.for_cpu(q8), tiled.TiledWeight)
    with use(dataclasses.replace(OPTIONS, isa=256)):  # the AVX2 digit tiles take Q4_K, Q5_K, Q3_K and Q2_K only
        assert tiled.for_cpu(q4k).avx2
        for kept in (_weight(Q.Q6_K), _weight(Q.IQ4_XS), _q8_0(), q5_0):
            assert tiled.for_cpu(kept) is kept
    with use(dataclasses.replace(OPTIONS, isa=256, int8=True)):  # the AVX2 digit tiles have an int8 kernel too,
        assert tiled.for_cpu(q4k).avx2 and tiled.for_cpu(_weight(Q.Q6_K)).avx2  # which takes Q6_K as well
        assert tiled.for_cpu(_weight(Q.IQ4_XS)).__class__ is BlockWeight


AVX2 = KernelOptions(isa=256, amx=False, threads=2)


@needs_kernels
@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.Q3_K, Q.Q2_K], ids=lambda t: t.name)
def test_avx2_digit_tiles_give_the_vnni_tiles_bits(qtype, avx512_kernels):
    """The tiled layout's AVX2 kernel (csrc/tiled_avx2.c, where the VNNI tiles do not run: an AVX2 CPU or isa 256)
    computes the VNNI tiles' integer dots with vpmaddubsw and their float sequence, so its outputs are theirs bit
    for bit at every batch (the VNNI tiles natively, or emulated where the CPU lacks them), NaN rows included and
    items scaled to the fp32 range's ends (a unit of 2^-150, the digits' two-step scaling); each row the same bits
    alone and in a batch; and the tiles dequantize (quill_tiled_dequant's AVX2 unpacking) and look up rows as the
    blocks do. (Q6_K takes these tiles only with int8 activations, tiled.tile_for_avx2; its exact digits are
    checked here all the same.)"""
    blocks = _weight(qtype)
    with use(dataclasses.replace(AVX2, int8=qtype == Q.Q6_K)):
        w = tiled.for_cpu(blocks)
    with use(AVX2):
        assert isinstance(w, tiled.TiledWeight) and w.avx2 and w.vnni and w.native_kind & (512 | 64) == 512 | 64
        assert w.nbytes <= 1.1 * blocks.nbytes
        assert torch.equal(w.dequantize(), blocks.dequantize())
        ids = torch.tensor([0, 17, 47, 5])
        assert torch.equal(w.dequantize_rows(ids), blocks.dequantize_rows(ids))
    with use(OPTIONS):
        vnni = tiled.for_cpu(blocks)
        assert not vnni.avx2 and torch.equal(vnni.codes, w.codes)
    lin, vnni_lin = PackedLinear(w, None, Workspace()), PackedLinear(vnni, None, Workspace())
    x = _inputs(blocks.cols, 5)
    x[8] *= 1e-38  # digits scaled up by more than 2^127: two steps
    x[9] *= 1e30
    exact = x.double() @ blocks.dequantize().double().T
    for batch in (1, 2, 3, 5, 16, 17, 70):
        with use(AVX2):
            got = _gemvs(batch, x, lin)[0]
        with use(OPTIONS):
            want = _gemvs(batch, x, vnni_lin)[0]
        assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.nan_to_num(), want.nan_to_num()), batch
        assert _error(got, exact[:batch]) < 1e-5, batch
    alone = torch.empty(1, w.rows)
    with use(AVX2):
        for batch, row in ((16, 9), (3, 2), (4, 1), (70, 66)):
            batched = torch.empty(batch, w.rows)
            lin.gemv(x[row:row + 1].clone(), alone)
            lin.gemv(x[:batch].contiguous(), batched)
            assert torch.equal(alone[0], batched[row]), batch


@needs_kernels
@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.Q3_K], ids=lambda t: t.name)
def test_int8_activations_on_the_avx2_digit_tiles_give_the_vnni_tiles_int8_bits(qtype, avx512_kernels):
    """With int8 activations the AVX2 digit tiles run one plane of vpmaddubsw on them (quill_gemv_tiled_i8_avx2) and
    the VNNI tiles' int8 float sequence (int8_unit8), so Q4_K, Q5_K and Q6_K give the VNNI tiles' int8 bits, and
    the AVX2 blocks' int8 kernel's, at every batch (lines decoded in each pass, or from the stored tile past
    fly_passes8), each row the same alone and in a batch; Q3_K has no int8 kernel and keeps the exact digits."""
    blocks = _weight(qtype)
    avx2_int8, vnni_int8 = dataclasses.replace(AVX2, int8=True), dataclasses.replace(OPTIONS, int8=True)
    with use(avx2_int8):
        w = tiled.for_cpu(blocks)
        assert isinstance(w, tiled.TiledWeight) and w.avx2
        assert (packed_int8_kind(w) is not None) == (qtype != Q.Q3_K)
    with use(vnni_int8):
        vnni = tiled.for_cpu(blocks)
    lin, vnni_lin, blocks_lin = (PackedLinear(v, None, Workspace()) for v in (w, vnni, blocks))
    x = _inputs(blocks.cols, 6)
    for batch in (1, 2, 3, 5, 16, 17, 70):
        with use(avx2_int8):
            got, on_blocks = _gemvs(batch, x, lin, blocks_lin)
        with use(vnni_int8):
            want = _gemvs(batch, x, vnni_lin)[0]
        assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.nan_to_num(), want.nan_to_num()), batch
        if qtype != Q.Q3_K:
            assert torch.equal(got.nan_to_num(), on_blocks.nan_to_num()), batch
    if qtype != Q.Q3_K:  # (a prefill on Q3_K's AVX2 tiles dequantizes for BLAS, as with exact activations)
        with use(avx2_int8):
            _same_rows_everywhere(lin, w, blocks, x)


def _tiled_against_blocks(recipe: str, tmp_path, monkeypatch):
    """A small Llama-shaped synth file of `recipe` (2 layers, vocab 512) in an engine with AMX off and the
    environment's kernels, loaded as tiled.for_cpu has it and again with every weight kept as the file has it:
    the first engine's weight parts, and each engine's (prefill, decode) logits of the same 40-token prompt
    (engine.consistency.prefill_vs_decode, the last 24 positions)."""
    from quill.config import CacheConfig, EngineConfig
    from quill.engine.consistency import prefill_vs_decode
    from quill.engine.engine import LLMEngine

    shape = dataclasses.replace(MODELS["llama-3.2-1b"], hidden=256, heads=8, kv_heads=4, head_dim=32, ffn=512)
    path = tmp_path / f"small-{recipe}.gguf"
    write_synth(path, shape, recipe, num_layers=2, vocab=512)
    monkeypatch.setenv("QUILL_NO_AMX", "1")

    def engine():
        return LLMEngine(EngineConfig(model=str(path), cache=CacheConfig(num_blocks_override=16)))

    tiled_engine = engine()
    weights = [getattr(m, "weight", None) for m in tiled_engine.runner.model.modules()]
    parts = [p for w in weights for p in getattr(w, "parts", [w])]
    monkeypatch.setattr(tiled, "for_cpu", lambda w: w)
    blocks_engine = engine()
    ids = [(7 * i + 3) % 500 + 1 for i in range(40)]
    return parts, prefill_vs_decode(tiled_engine, ids, 24), prefill_vs_decode(blocks_engine, ids, 24)


@needs_kernels
@pytest.mark.parametrize("recipe", ["Q4_K_M", "Q8_0"])
def test_an_engine_on_the_vnni_tiled_layout_gives_the_blocks_logits(recipe, tmp_path, monkeypatch, avx512_kernels):
    """A small Llama-shaped Q4_K_M file (Q4_K, Q6_K, a tied Q6_K head) and a Q8_0 one: with AMX off, their
    weights load tiled for VNNI. A prefill on the tiles runs every row through them where the blocks and the
    q8 rows dequantize for BLAS (and Q8_0's tiles are not the rows' float order), so the prefill logits and
    the decode steps' after it agree with the reference engine's within fp32 rounding, with the same greedy
    tokens, and the tiled engine's prefill and decode logits agree at least as tightly as the reference's
    do. (The tiles' GEMV is the blocks' bit for bit: test_tiled_for_vnni_gives_the_blocks_outputs_bit_for_bit.)"""
    monkeypatch.delenv("QUILL_NO_AVX512", raising=False)
    parts, (a, b), (a_ref, b_ref) = _tiled_against_blocks(recipe, tmp_path, monkeypatch)
    kinds = {p.kind for p in parts if isinstance(p, tiled.TiledWeight) and p.vnni}
    assert ({"q4", "q6"} if recipe == "Q4_K_M" else {"q8"}) <= kinds, kinds
    for got, want in ((a, a_ref), (b, b_ref)):
        assert (got - want).abs().max() <= 1e-4 * want.abs().max(), (got - want).abs().max()
        assert torch.equal(got.argmax(-1), want.argmax(-1))
    assert (a - b).abs().max() <= max(2 * (a_ref - b_ref).abs().max(), 1e-5 * a_ref.abs().max())


@needs_kernels
@pytest.mark.parametrize("recipe", ["Q4_K_M", "Q8_0"])
def test_an_int8_engine_on_the_vnni_tiles_gives_the_blocks_logits_bit_for_bit(recipe, tmp_path, monkeypatch, avx512_kernels):
    """With int8 activations the weights load tiled for VNNI too, and every row of every linear is the blocks' int8
    kernel's bits (prefill rows and decode steps alike go through the int8 kernels): the engines' logits are
    equal."""
    monkeypatch.delenv("QUILL_NO_AVX512", raising=False)
    monkeypatch.setenv("QUILL_INT8_ACTIVATIONS", "1")
    parts, (a, b), (a_ref, b_ref) = _tiled_against_blocks(recipe, tmp_path, monkeypatch)
    kinds = {p.kind for p in parts if isinstance(p, tiled.TiledWeight) and p.vnni}
    assert ({"q4", "q6"} if recipe == "Q4_K_M" else {"q8"}) <= kinds, kinds
    assert torch.equal(a, a_ref) and torch.equal(b, b_ref)


@needs_kernels
def test_an_int8_engine_on_the_avx2_digit_tiles_gives_the_blocks_logits_bit_for_bit(tmp_path, monkeypatch):
    """With the AVX2 kernels and int8 activations a small Q4_K_M file's Q4_K weights load tiled for the AVX2 digit
    tiles and run their int8 kernel (the blocks' int8 bits), its Q6_K ones keep their blocks: prefill and decode
    logits equal the blocks engine's."""
    monkeypatch.setenv("QUILL_NO_AVX512", "1")
    monkeypatch.setenv("QUILL_INT8_ACTIVATIONS", "1")
    parts, (a, b), (a_ref, b_ref) = _tiled_against_blocks("Q4_K_M", tmp_path, monkeypatch)
    assert any(isinstance(p, tiled.TiledWeight) and p.avx2 and p.kind == "q4" for p in parts)
    assert torch.equal(a, a_ref) and torch.equal(b, b_ref)


@needs_kernels
def test_an_engine_on_the_avx2_digit_tiles_gives_the_blocks_logits(tmp_path, monkeypatch):
    """With the AVX2 kernels (QUILL_NO_AVX512=1, as on an AVX2-only CPU) a small Q3_K_M file's Q3_K, Q4_K and Q5_K
    weights load tiled for the AVX2 digit tiles and its Q6_K ones keep their blocks: the fused decode layers run
    the tiles (kind bit 512), a prefill dequantizes them for BLAS as it does the blocks (the same values, so
    the same prefill logits), and the decode steps after it agree with the blocks engine's within fp32 rounding,
    with the same greedy tokens."""
    monkeypatch.setenv("QUILL_NO_AVX512", "1")
    parts, (a, b), (a_ref, b_ref) = _tiled_against_blocks("Q3_K_M", tmp_path, monkeypatch)
    kinds = {p.kind for p in parts if isinstance(p, tiled.TiledWeight) and p.avx2}
    assert {"q3", "q4", "q5"} <= kinds, kinds
    assert any(isinstance(p, BlockWeight) and p.qtype == Q.Q6_K for p in parts)
    assert torch.equal(a, a_ref)
    assert (b - b_ref).abs().max() <= 1e-4 * b_ref.abs().max(), (b - b_ref).abs().max()
    assert torch.equal(b.argmax(-1), b_ref.argmax(-1))


@needs_kernels
@pytest.mark.parametrize("recipe", ["Q4_K_M", "Q8_0"])
def test_the_vnni_quill_layout_maps_the_same_tiles(recipe, tmp_path, monkeypatch, avx512_kernels):
    """`quill convert --layout vnni` writes the K-quants and Q8_0 as the VNNI tiles (auto picks it without AMX): the
    file loads the same objects as the GGUF does on such an engine, with the same logits (and with int8
    activations, whose kernel those tiles have too); an engine that does not run the VNNI tiles (the AVX2
    kernels forced here) refuses it naming what to do."""
    from quill.bench.accuracy import position_logits
    from quill.models import quillfile
    from quill.models.convert import convert
    from quill.models.loader import load_model

    monkeypatch.setenv("QUILL_NO_AMX", "1")
    monkeypatch.delenv("QUILL_NO_AVX512", raising=False)
    monkeypatch.delenv("QUILL_INT8_ACTIVATIONS", raising=False)
    shape = dataclasses.replace(MODELS["llama-3.2-1b"], hidden=256, heads=8, kv_heads=4, head_dim=32, ffn=512)
    src = tmp_path / f"small-{recipe}.gguf"
    write_synth(src, shape, recipe, num_layers=1, vocab=512)
    assert quillfile.resolve_layout("auto") == "vnni"
    out = tmp_path / "small.quill"
    assert convert(src, out, progress=False).layout == "vnni"  # verified tensor by tensor before the rename
    qf = quillfile.QuillFile(out, check_cpu=False)
    assert "avx512vnni" in qf.required_features and '"vnni": true' in qf.meta["quill.structure"]
    mapped, direct = load_model(str(out), context_len=64), load_model(str(src), context_len=64)
    assert mapped.model.resident_bytes() == direct.model.resident_bytes()
    down = mapped.model.layers[0].mlp.down_proj.weight
    assert isinstance(down, tiled.TiledWeight) and down.vnni and down.kind == ("q8" if recipe == "Q8_0" else "q6")
    ids = [(5 * i + 2) % 500 + 1 for i in range(20)]
    assert torch.equal(position_logits(mapped, ids), position_logits(direct, ids))
    monkeypatch.setenv("QUILL_INT8_ACTIVATIONS", "1")
    mapped, direct = load_model(str(out), context_len=64), load_model(str(src), context_len=64)
    assert torch.equal(position_logits(mapped, ids), position_logits(direct, ids))
    monkeypatch.delenv("QUILL_INT8_ACTIVATIONS")
    monkeypatch.setenv("QUILL_NO_AVX512", "1")
    with pytest.raises(quillfile.QuillFileError, match="VNNI.*--layout portable"):
        load_model(str(out), context_len=64)


@needs_kernels
@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q5_K, Q.IQ4_XS], ids=lambda t: t.name)
def test_the_amx_kernel_gives_the_vnni_tiles_bits(qtype):
    """The AMX GEMV recombines the same exact integer dots as the VNNI tiles and scales them in the same fp32
    order (amx_gemv.c's combine: dot times unit times scale, then the group's min, group by group; the sums
    of x from simd.h's sum32), so on the same tiled K-quant weight, Q6_K aside (its AMX kernel takes its
    digits per 256 columns), the two agree bit for bit at every batch: on the emulation build on every host,
    and natively where the CPU has both."""
    libs = [native.load(emulate="amx")]
    assert libs[0] is not None, "simde-py is a test dependency: pip install -e '.[test]'"
    if native.load().quill_amx_enable() and native.load().quill_hw_vnni():
        libs.append(native.load())
    w = tiled.tile_weight(_weight(qtype, rows=32))
    x = torch.randn(19, w.cols, generator=torch.Generator().manual_seed(5))
    x[2, 5], x[4] = float("nan"), 0.0
    for lib in libs:
        for batch in (1, 3, 16, 19):
            outs = []
            for kind in (w.native_kind, w.native_kind | 64):  # the AMX tiles, then the VNNI tiles
                scratch = torch.empty(lib.quill_tiled_scratch_bytes(kind, batch, w.cols) // 4 + 16)
                out = torch.empty(batch, w.rows)
                lib.quill_tiled_gemv(kind, *w.native_args()[1:], x.data_ptr(), out.data_ptr(), w.rows, w.cols, batch,
                                     w.rows, scratch.data_ptr(), 2)
                outs.append(out)
            amx, vnni = outs
            assert torch.equal(amx.isnan(), vnni.isnan()) and amx.isnan().any(1).tolist() == [i == 2 for i in range(batch)]
            assert torch.equal(amx.nan_to_num(), vnni.nan_to_num()), batch
