"""Sampler: filters, penalties, greedy, seeded determinism, min_tokens, logprobs, structured mask."""

import math

import pytest
import torch

from quill.engine.sampler import (
    Sampler,
    SamplingRow,
    apply_min_p,
    apply_penalties,
    apply_top_k,
    apply_top_p,
)
from quill.sampling_params import SamplingParams

V = 32
EOS = 5


def kept(logits: torch.Tensor) -> set[int]:
    return set(torch.nonzero(torch.isfinite(logits)).flatten().tolist())


def row(params: SamplingParams, output=(), prompt=(1, 2, 3), generator=None, mask=None) -> SamplingRow:
    return SamplingRow(params, list(prompt), list(output), generator, mask)


# ---------------------------------------------------------------- filters


def test_top_k_exact_set_and_ties():
    logits = torch.tensor([1.0, 4.0, 3.0, 3.0, 0.0, 2.0])
    assert kept(apply_top_k(logits, 1)) == {1}
    assert kept(apply_top_k(logits, 2)) == {1, 2, 3}  # tie at the boundary: both kept
    assert kept(apply_top_k(logits, 4)) == {1, 2, 3, 5}
    for off in (0, -1, 6, 100):
        assert torch.equal(apply_top_k(logits, off), logits)


def test_top_k_per_row():
    logits = torch.tensor([[1.0, 2.0, 3.0], [3.0, 2.0, 1.0]])
    out = apply_top_k(logits, [1, 0])
    assert kept(out[0]) == {2}
    assert kept(out[1]) == {0, 1, 2}


def test_top_p_exact_sets_ties_and_noop():
    # probs ~ [0.534, 0.197, 0.197, 0.072]
    logits = torch.tensor([2.0, 1.0, 1.0, 0.0])
    assert kept(apply_top_p(logits, 0.5)) == {0}  # the top token alone already reaches p
    assert kept(apply_top_p(logits, 0.01)) == {0}
    assert kept(apply_top_p(logits, 0.6)) == {0, 1, 2}  # token 2 is tied with the last kept one
    assert kept(apply_top_p(logits, 0.95)) == {0, 1, 2, 3}
    assert torch.equal(apply_top_p(logits, 1.0), logits)


def test_top_p_skewed():
    probs = torch.tensor([0.05, 0.6, 0.25, 0.1])
    logits = probs.log()
    assert kept(apply_top_p(logits, 0.7)) == {1, 2}
    assert kept(apply_top_p(logits, 0.9)) == {1, 2, 3}
    assert kept(apply_top_p(logits, 0.55)) == {1}


def test_min_p_exact_set():
    probs = torch.tensor([0.5, 0.3, 0.12, 0.08])
    logits = probs.log()
    assert kept(apply_min_p(logits, 0.2)) == {0, 1, 2}  # threshold 0.1
    assert kept(apply_min_p(logits, 0.5)) == {0, 1}  # threshold 0.25
    assert kept(apply_min_p(logits, 1.0)) == {0}
    assert torch.equal(apply_min_p(logits, 0.0), logits)


# ---------------------------------------------------------------- penalties


def test_repetition_penalty_hf_semantics():
    logits = torch.tensor([2.0, -2.0, 1.0, -1.0, 4.0])
    params = SamplingParams(repetition_penalty=2.0)
    out = apply_penalties(logits, [0, 1], [3, 3], params)
    assert out.tolist() == [1.0, -4.0, 1.0, -2.0, 4.0]
    assert logits.tolist() == [2.0, -2.0, 1.0, -1.0, 4.0]  # input untouched


def test_presence_frequency_openai_semantics():
    logits = torch.zeros(5)
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    out = apply_penalties(logits, [4, 4, 4], [1, 2, 2, 2], params)
    # prompt tokens (4) are not penalised; token 1: 0.5 + 0.25; token 2: 0.5 + 0.75
    assert out.tolist() == pytest.approx([0.0, -0.75, -1.25, 0.0, 0.0])


def test_penalties_change_greedy_choice():
    sampler = Sampler(V, (EOS,))
    logits = torch.zeros(1, V)
    logits[0, 7] = 1.0
    logits[0, 8] = 0.9
    plain = sampler(logits, [row(SamplingParams(temperature=0))]).token_ids
    penalised = sampler(logits, [row(SamplingParams(temperature=0, frequency_penalty=0.2), output=[7])]).token_ids
    assert plain == [7] and penalised == [8]


# ---------------------------------------------------------------- greedy, seeds


def test_greedy_equals_argmax():
    torch.manual_seed(0)
    logits = torch.randn(6, V)
    sampler = Sampler(V, (EOS,))
    greedy = SamplingParams(temperature=0)
    out = sampler(logits, [row(greedy) for _ in range(6)])
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.logprobs == [None] * 6
    # The slow path (a mix with a sampled row) gives the same argmax for greedy rows.
    rows = [row(greedy) for _ in range(5)] + [row(SamplingParams(temperature=1.0, seed=1), generator=torch.Generator().manual_seed(1))]
    mixed = sampler(logits, rows)
    assert mixed.token_ids[:5] == logits[:5].argmax(-1).tolist()


def test_padded_vocab_never_sampled():
    sampler = Sampler(V, (EOS,))
    logits = torch.zeros(1, V + 8)
    logits[0, V + 3] = 100.0
    assert sampler(logits, [row(SamplingParams(temperature=0))]).token_ids[0] < V
    assert sampler(logits, [row(SamplingParams(temperature=1.0))]).token_ids[0] < V


def _seeded_run(batch_others: int, steps: int = 12) -> list[int]:
    params = SamplingParams(temperature=0.9, top_k=20, top_p=0.95, seed=7)
    gen = torch.Generator().manual_seed(7)
    logits_gen = torch.Generator().manual_seed(123)  # row 0's logits are the same every run
    other_gen = torch.Generator().manual_seed(batch_others + 99)
    sampler = Sampler(V, (EOS,))
    tokens: list[int] = []
    for _ in range(steps):
        row0 = torch.randn(1, V, generator=logits_gen) * 2
        others = torch.randn(batch_others, V, generator=other_gen) * 2
        rows = [row(params, output=tokens, generator=gen)]
        for j in range(batch_others):
            other_params = SamplingParams(temperature=1.0 + 0.05 * j, top_p=0.9, seed=j if j % 2 else None)
            other_g = torch.Generator().manual_seed(j) if j % 2 else None
            rows.append(row(other_params, output=[j], generator=other_g))
        out = sampler(torch.cat([row0, others]), rows)
        tokens.append(out.token_ids[0])
    return tokens


def test_seeded_row_independent_of_batch():
    alone = _seeded_run(0)
    assert _seeded_run(15) == alone
    assert _seeded_run(3) == alone
    assert len(set(alone)) > 1  # it really sampled


def test_different_seeds_differ():
    sampler = Sampler(V, (EOS,))
    logits = torch.zeros(1, V)
    draws = {}
    for seed in (1, 2):
        gen = torch.Generator().manual_seed(seed)
        draws[seed] = [sampler(logits, [row(SamplingParams(seed=seed), generator=gen)]).token_ids[0] for _ in range(10)]
    assert draws[1] != draws[2]


def test_sampling_respects_filters():
    sampler = Sampler(V, (EOS,))
    torch.manual_seed(3)
    logits = torch.randn(1, V)
    allowed = set(logits[0].topk(3).indices.tolist())
    params = SamplingParams(temperature=5.0, top_k=3)
    for _ in range(50):
        assert sampler(logits, [row(params)]).token_ids[0] in allowed


# ---------------------------------------------------------------- min_tokens, logprobs, mask


def test_min_tokens_masks_eos_and_stop_ids():
    sampler = Sampler(V, (EOS,))
    logits = torch.zeros(1, V)
    logits[0, EOS] = 50.0
    logits[0, 9] = 40.0
    logits[0, 11] = 30.0
    params = SamplingParams(temperature=0, min_tokens=3, stop_token_ids=(9,))
    assert sampler(logits, [row(params, output=[1, 2])]).token_ids == [11]
    assert sampler(logits, [row(params, output=[1, 2, 3])]).token_ids == [EOS]
    ignore = SamplingParams(temperature=0, min_tokens=3, stop_token_ids=(9,), ignore_eos=True)
    assert sampler(logits, [row(ignore, output=[1])]).token_ids == [EOS]  # ignore_eos: EOS not masked
    sampled = SamplingParams(temperature=1.0, min_tokens=3, stop_token_ids=(9,))
    for _ in range(20):
        assert sampler(logits, [row(sampled, output=[])]).token_ids[0] not in (EOS, 9)


def test_logprobs_are_log_softmax_with_sorted_top():
    sampler = Sampler(V, (EOS,))
    torch.manual_seed(1)
    logits = torch.randn(2, V)
    rows = [row(SamplingParams(temperature=0, logprobs=4)), row(SamplingParams(temperature=0.7, logprobs=0))]
    out = sampler(logits, rows)
    reference = torch.log_softmax(logits, dim=-1)
    for i in range(2):
        entry = out.logprobs[i]
        assert entry["token_id"] == out.token_ids[i]
        assert entry["logprob"] == pytest.approx(reference[i, out.token_ids[i]].item(), abs=1e-6)
    top = out.logprobs[0]["top"]
    assert len(top) == 4
    values = [v for _, v in top]
    assert values == sorted(values, reverse=True)
    expected = reference[0].topk(4)
    assert [t for t, _ in top] == expected.indices.tolist()
    assert values == pytest.approx(expected.values.tolist(), abs=1e-6)
    assert out.logprobs[1]["top"] == []
    assert math.isclose(sum(math.exp(v) for v in reference[0].tolist()), 1.0, rel_tol=1e-5)


def test_structured_mask_respected():
    sampler = Sampler(V, (EOS,))
    torch.manual_seed(2)
    logits = torch.randn(3, V) * 5
    allowed_ids = [3, 17, 30]
    mask = torch.zeros(V, dtype=torch.bool)
    mask[allowed_ids] = True
    greedy_row = row(SamplingParams(temperature=0, logprobs=5), mask=mask)
    sample_row = row(SamplingParams(temperature=2.0), mask=mask)
    free_row = row(SamplingParams(temperature=0))
    for _ in range(20):
        out = sampler(logits, [greedy_row, sample_row, free_row])
        assert out.token_ids[0] in allowed_ids and out.token_ids[1] in allowed_ids
        assert out.token_ids[2] == logits[2].argmax().item()
    assert out.token_ids[0] == max(allowed_ids, key=lambda t: logits[0, t].item())
    top = out.logprobs[0]["top"]
    assert {t for t, _ in top} == set(allowed_ids)  # masked (-inf) tokens are not listed
    assert sum(math.exp(v) for _, v in top) == pytest.approx(1.0, rel=1e-5)


def test_shorter_mask_disallows_the_rest_and_empty_mask_fails():
    sampler = Sampler(V, (EOS,))
    logits = torch.zeros(1, V)
    logits[0, V - 1] = 10.0
    short = torch.tensor([False, True])
    assert sampler(logits, [row(SamplingParams(temperature=0), mask=short)]).token_ids == [1]
    out = sampler(logits, [row(SamplingParams(temperature=0), mask=torch.zeros(V, dtype=torch.bool))])
    assert out.token_ids == [-1] and "allows no token" in str(out.errors[0])


def test_a_failing_row_fails_alone_and_the_others_are_unchanged():
    """One row with an empty mask, one with NaN logits, one whose every token is blocked: each
    fails with its own reason; the healthy rows pick exactly what they pick without them."""
    sampler = Sampler(V, (EOS,))
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(5, V, generator=gen)
    logits[3, 2] = float("nan")
    logits[4] = float("-inf")
    healthy = [row(SamplingParams(temperature=0)), row(SamplingParams(temperature=0.8, seed=3), generator=torch.Generator().manual_seed(3))]
    bad = [row(SamplingParams(temperature=0), mask=torch.zeros(V, dtype=torch.bool)), row(SamplingParams(temperature=0, logprobs=1)),
           row(SamplingParams(temperature=0.5))]
    mixed = sampler(logits, healthy[:1] + [healthy[1]] + bad)
    assert set(mixed.errors) == {2, 3, 4}
    assert "allows no token" in str(mixed.errors[2]) and "NaN" in str(mixed.errors[3]) and "masked" in str(mixed.errors[4])
    assert mixed.token_ids[2:] == [-1, -1, -1] and mixed.logprobs[3] is None
    alone = sampler(logits[:2], [row(SamplingParams(temperature=0)),
                                 row(SamplingParams(temperature=0.8, seed=3), generator=torch.Generator().manual_seed(3))])
    assert alone.token_ids == mixed.token_ids[:2] and not alone.errors


def test_min_tokens_against_a_runner_applied_grammar_lets_the_grammar_win():
    """The runner masks logits itself and marks the row constrained (no allowed_mask): when the
    grammar allows only EOS, min_tokens must not leave the row with nothing to draw."""
    sampler = Sampler(V, (EOS,))
    logits = torch.full((1, V), float("-inf"))
    logits[0, EOS] = 0.0  # what MaskWorker leaves when only EOS is allowed
    params = SamplingParams(temperature=0.7, min_tokens=8, seed=1)
    out = sampler(logits, [SamplingRow(params, (), (), torch.Generator().manual_seed(1), constrained=True)])
    assert out.token_ids == [EOS] and not out.errors
    unconstrained = sampler(logits, [SamplingRow(params, (), (), torch.Generator().manual_seed(1))])
    assert 0 in unconstrained.errors  # without the mark, min_tokens blocks the only token: that row fails alone


def test_grammar_that_only_allows_eos_wins_over_min_tokens():
    sampler = Sampler(V, (EOS,))
    mask = torch.zeros(V, dtype=torch.bool)
    mask[EOS] = True
    params = SamplingParams(temperature=0, min_tokens=4)
    assert sampler(torch.zeros(1, V), [row(params, mask=mask)]).token_ids == [EOS]


def test_bad_shapes_name_the_problem():
    sampler = Sampler(V, (EOS,))
    with pytest.raises(ValueError, match="B=2"):
        sampler(torch.zeros(1, V), [row(SamplingParams()), row(SamplingParams())])
    with pytest.raises(ValueError, match="vocab_size"):
        sampler(torch.zeros(1, V - 1), [row(SamplingParams())])
