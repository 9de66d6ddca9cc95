"""StopChecker rules and StreamingText deltas (holdback of possible stop-string prefixes)."""

import random

import pytest

from quill.engine.sequence import Sequence
from quill.engine.stop_checker import StopChecker, StreamingText, check_stop_strings
from quill.sampling_params import SamplingParams

EOS = 2


class Run:
    """Feeds (token id, token text) pairs through a checker and a streamer, like the engine does."""

    def __init__(self, params: SamplingParams, prompt_len: int = 3, max_model_len: int = 1000):
        self.seq = Sequence("r", list(range(10, 10 + prompt_len)), params)
        self.checker = StopChecker((EOS,), max_model_len)
        self.stream = StreamingText.for_params(params)
        self.text = ""
        self.deltas: list[str] = []
        self.result = None

    def feed(self, token_id: int, piece: str):
        assert self.result is None, "fed a finished sequence"
        self.seq.append_token(token_id, 0.0)
        self.text += piece
        self.result = self.checker.check(self.seq, self.text, len(piece))
        if self.result is not None:
            self.text = self.result.text
        self.deltas.append(self.stream.delta(self.text, self.result is not None))
        return self.result

    def feed_all(self, pieces):
        for i, piece in enumerate(pieces):
            if self.feed(100 + i, piece):
                break
        return self.result


def test_stop_string_split_across_three_tokens():
    run = Run(SamplingParams(stop=("<|end|>",), max_tokens=50))
    result = run.feed_all(["Hello", " world", "<", "|en", "d|>", " never"])
    assert result.finish_reason == "stop" and result.stop_reason == "<|end|>"
    assert result.text == "Hello world"
    assert run.deltas == ["Hello", " world", "", "", ""]
    assert "".join(run.deltas) == "Hello world"
    assert run.seq.num_output_tokens == 5


def test_include_stop_str_in_output():
    run = Run(SamplingParams(stop=("<|end|>",), include_stop_str_in_output=True, max_tokens=50))
    result = run.feed_all(["Hi", "<", "|en", "d|>tail"])
    assert result.text == "Hi<|end|>"
    assert "".join(run.deltas) == "Hi<|end|>"
    assert run.deltas[1] == "<"  # nothing held back: the stop string stays in the output anyway


def test_stop_string_at_position_zero():
    run = Run(SamplingParams(stop=("STOP",), max_tokens=50))
    result = run.feed_all(["STOP", "x"])
    assert result.finish_reason == "stop" and result.text == ""
    assert run.deltas == [""]


def test_earliest_of_several_stop_strings_wins():
    params = SamplingParams(stop=("cd", "abcdef"), max_tokens=50)
    result = check_stop_strings("xxabcdef", 6, params)
    assert result.stop_reason == "abcdef" and result.text == "xx"  # starts before "cd"
    result = check_stop_strings("xxabcdcd", 6, params)
    assert result.stop_reason == "cd" and result.text == "xxab"


def test_stop_string_found_only_once_and_only_in_new_tail():
    params = SamplingParams(stop=("ab", "xyzw"))
    # "ab" lies wholly in old text: not reported again even though it is within the window.
    assert check_stop_strings("abq", 1, params) is None
    assert check_stop_strings("qab", 1, params).stop_reason == "ab"


def test_holdback_released_when_prefix_does_not_complete():
    run = Run(SamplingParams(stop=("<|end|>",), max_tokens=50))
    assert run.feed(100, "a<|") is None
    assert run.deltas[-1] == "a"  # "<|" could start the stop string
    assert run.feed(101, "e") is None
    assert run.deltas[-1] == ""
    assert run.feed(102, "x") is None
    assert run.deltas[-1] == "<|ex"  # no longer a prefix: released
    run.feed(103, "<")
    assert run.deltas[-1] == ""
    result = run.checker.check(run.seq, run.text, 0)
    assert result is None
    assert run.stream.delta(run.text, finished=True) == "<"  # finished (e.g. abort): all released


def test_deltas_concatenate_to_final_text_random_splits():
    rng = random.Random(1234)
    alphabet = "ab<|>end x"
    stops_pool = [("<|end|>",), ("ab",), ("end", "x x"), ("|>", "<|e"), ("ab<", "b"), ()]
    for trial in range(300):
        stop = stops_pool[trial % len(stops_pool)]
        include = trial % 3 == 0
        params = SamplingParams(stop=stop, include_stop_str_in_output=include, max_tokens=40)
        full = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 60)))
        pieces, i = [], 0
        while i < len(full):
            step = rng.randint(0, 4)  # empty pieces happen (partial UTF-8 upstream)
            pieces.append(full[i : i + step])
            i += step
        run = Run(params)
        result = run.feed_all(pieces)
        if result is None:
            run.deltas.append(run.stream.delta(run.text, finished=True))
        expected = _reference_final_text(pieces[:40], stop, include)
        assert "".join(run.deltas) == run.text == expected, (trial, pieces, stop)


def _reference_final_text(pieces: list[str], stop, include: bool) -> str:
    """Independent reference: at the first token whose text so far holds a stop string, cut at
    the earliest match (searching the whole text, no windows)."""
    text = ""
    for piece in pieces:
        text += piece
        matches = [(text.find(s), stop.index(s), s) for s in stop if s in text]
        if matches:
            position, _, s = min(matches)
            return text[: position + len(s)] if include else text[:position]
    return text


def test_max_tokens_is_length():
    run = Run(SamplingParams(max_tokens=3))
    assert run.feed(100, "a") is None
    assert run.feed(101, "b") is None
    result = run.feed(102, "c")
    assert result.finish_reason == "length" and result.stop_reason is None and result.text == "abc"


def test_context_limit_is_length():
    run = Run(SamplingParams(max_tokens=None), prompt_len=4, max_model_len=6)
    assert run.feed(100, "a") is None
    assert run.feed(101, "b").finish_reason == "length"


def test_eos_stops_unless_ignored():
    run = Run(SamplingParams(max_tokens=10))
    run.feed(100, "a")
    result = run.feed(EOS, "")
    assert result.finish_reason == "stop" and result.stop_reason is None and result.text == "a"
    ignoring = Run(SamplingParams(max_tokens=10, ignore_eos=True))
    ignoring.feed(100, "a")
    assert ignoring.feed(EOS, "") is None


def test_eos_on_last_allowed_token_is_stop():
    run = Run(SamplingParams(max_tokens=2))
    run.feed(100, "a")
    assert run.feed(EOS, "").finish_reason == "stop"


def test_stop_token_ids():
    run = Run(SamplingParams(stop_token_ids=(77,), max_tokens=10, ignore_eos=True))
    run.feed(100, "a")
    result = run.feed(77, "\n")
    assert result.finish_reason == "stop" and result.stop_reason == 77
    assert result.text == "a"  # the stop token's own text is dropped
    assert "".join(run.deltas) == "a"
    kept = Run(SamplingParams(stop_token_ids=(77,), include_stop_str_in_output=True))
    kept.feed(100, "a")
    assert kept.feed(77, "\n").text == "a\n"


def test_nothing_but_length_before_min_tokens():
    params = SamplingParams(min_tokens=3, stop_token_ids=(77,), stop=("zz",), max_tokens=10)
    run = Run(params)
    assert run.feed(EOS, "") is None
    assert run.feed(77, "zz") is None
    result = run.feed(EOS, "")
    assert result is not None and result.finish_reason == "stop"


def test_bad_arguments_name_the_value():
    with pytest.raises(ValueError, match="max_model_len"):
        StopChecker((EOS,), 0)
    seq = Sequence("r", [1], SamplingParams())
    seq.append_token(5, 0.0)
    with pytest.raises(ValueError, match="num_new_chars"):
        StopChecker((EOS,), 10).check(seq, "ab", 3)
    stream = StreamingText(("x",))
    stream.delta("abc", finished=False)
    with pytest.raises(ValueError, match="already streamed"):
        stream.delta("a", finished=True)
