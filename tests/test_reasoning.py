"""quill.reasoning: the <think>...</think> parser (whole texts and every way of streaming them),
the default format from a chat template, a prompt that opens the block, reasoning token counts."""

from __future__ import annotations

import itertools

import pytest

from quill.engine.stop_checker import StreamingText, partial_match_len
from quill.reasoning import (
    THINK_END,
    THINK_START,
    ReasoningParser,
    check_reasoning_format,
    count_reasoning_tokens,
    default_reasoning_format,
    prompt_ids_open_reasoning,
    prompt_opens_reasoning,
    split_reasoning,
)

QWEN_STYLE = "<think>\nI add 2 and 2.\n</think>\n\nThe answer is 4."

# (output text, prompt opened a think block, reasoning_content, content)
CASES = [
    (QWEN_STYLE, False, "I add 2 and 2.", "The answer is 4."),
    ("  \n<think>a b</think>c", False, "a b", "c"),
    ("<think>one\n\ntwo \n</think>  three\n", False, "one\n\ntwo", "three\n"),  # inner whitespace kept
    ("I count.\n</think>\n\nFour.", True, "I count.", "Four."),  # DeepSeek-R1: the prompt ended in <think>\n
    ("\nI count.</think>", True, "I count.", None),  # stopped right after </think>: content None (vLLM)
    ("<think>\nstill thinking about", False, "still thinking about", None),  # max_tokens hit while reasoning
    ("still thinking  \n", True, "still thinking", None),
    ("The answer is 4.", False, None, "The answer is 4."),  # no think block (enable_thinking=false)
    ("  Hi <think>x</think> y", False, None, "  Hi <think>x</think> y"),  # only a leading <think> opens one
    ("<think></think>Four.", False, None, "Four."),
    ("<think>\n\n</think>\n\n", False, None, ""),
    ("<think>a</think>b</think>c <think>d", False, "a", "b</think>c <think>d"),  # the first </think> closes
    ("<think>x < y and </thin k</think>z", False, "x < y and </thin k", "z"),  # near-misses are reasoning
    ("a<b</c</thinker</think>d", True, "a<b</c</thinker", "d"),
    ("<think>a</th", False, "a</th", None),  # a marker cut off by the end is text
    ("<thi", False, None, "<thi"),
    ("<think", True, "<think", None),
    ("", False, None, ""),
    ("", True, None, ""),
    ("\n\n", True, None, ""),
]


def stream(parser: ReasoningParser, pieces) -> tuple[list[str], list[str], list[str]]:
    """Feed the pieces, then finish; the deltas of each kind, and the order kinds came out in."""
    reasoning, content, order = [], [], []
    for out in [parser.feed(piece) for piece in pieces] + [parser.finish()]:
        for kind, delta, into in (("r", out[0], reasoning), ("c", out[1], content)):
            if delta:
                into.append(delta)
                order.append(kind)
    return reasoning, content, order


@pytest.mark.parametrize("text, opened, reasoning, content", CASES)
def test_whole_text(text, opened, reasoning, content):
    assert split_reasoning(text, opened) == (reasoning, content)


def splits(text: str):
    """Every way of cutting text into two and three pieces (empty pieces too), and one character each."""
    n = len(text)
    for i in range(n + 1):
        yield [text[:i], text[i:]]
    for i, j in itertools.combinations(range(n + 1), 2):
        yield [text[:i], text[i:j], text[j:]]
    yield list(text)


@pytest.mark.parametrize("text, opened, reasoning, content", CASES)
def test_every_split_streams_the_same_parts(text, opened, reasoning, content):
    """Each split point falls inside <think> and </think> somewhere: the streamed deltas of each
    kind still add up to the whole-text answer, and no reasoning comes after content began."""
    for pieces in splits(text):
        parser = ReasoningParser(opened)
        r, c, order = stream(parser, pieces)
        assert ("".join(r), "".join(c)) == (reasoning or "", content or ""), pieces
        assert parser.message() == (reasoning, content), pieces
        assert "".join(order) == "".join(sorted(order, key="rc".index)), (pieces, order)


def test_markers_never_reach_either_kind_token_by_token():
    text = QWEN_STYLE
    for pieces in splits(text):
        r, c, _ = stream(ReasoningParser(False), pieces)
        for delta in r + c:
            assert "<" not in delta and ">" not in delta, (pieces, delta)  # no marker, not even part of one


def test_reasoning_streams_as_it_comes_and_holds_only_what_may_be_a_marker():
    parser = ReasoningParser(False)
    assert parser.feed("<thi") == ("", "")  # may still be <think>
    assert parser.feed("nk>\n") == ("", "")  # leading whitespace of the reasoning is dropped
    assert parser.feed("abc") == ("abc", "")
    assert parser.feed(" </th") == ("", "")  # the space waits: it goes if </think> follows
    assert parser.feed("x") == (" </thx", "")
    assert parser.feed("\n</think>") == ("", "")
    assert parser.feed("\n\nDone") == ("", "Done")
    assert parser.feed(" <think>") == ("", " <think>")  # content passes through untouched
    assert parser.finish() == ("", "")
    assert parser.message() == ("abc </thx", "Done <think>")
    assert parser.has_reasoning and parser.closed


def test_no_opening_tag_means_content_at_once():
    parser = ReasoningParser(False)
    assert parser.feed("  ") == ("", "")  # whitespace could still precede <think>
    assert parser.feed("Hi") == ("", "  Hi")
    assert not parser.has_reasoning


def test_opened_by_the_prompt_and_never_closed():
    parser = ReasoningParser(True)
    assert parser.feed("\nLet me see") == ("Let me see", "")
    assert parser.feed(" more\n") == (" more", "")
    assert parser.finish() == ("", "")
    assert parser.message() == ("Let me see more", None)
    assert parser.has_reasoning and not parser.closed


def test_default_format_from_the_template():
    from test_chat_template_families import QWEN3

    assert default_reasoning_format(QWEN3) == "deepseek"
    # DeepSeek-R1-Distill's first template only strips reasoning from history
    assert default_reasoning_format("{% set content = content.split('</think>')[-1] %}{{ content }}") == "deepseek"
    assert default_reasoning_format("{% for m in messages %}<|im_start|>{{ m.role }}{% endfor %}") == "none"
    assert default_reasoning_format("") == "none"
    assert default_reasoning_format(None) == "none"


def test_check_reasoning_format():
    assert check_reasoning_format("none") == "none" and check_reasoning_format("deepseek") == "deepseek"
    for bad in ("auto", "DeepSeek", "", None):
        with pytest.raises(ValueError, match="reasoning_format must be one of none, deepseek"):
            check_reasoning_format(bad)


@pytest.mark.parametrize("prompt, opened", [
    ("<｜User｜>Hi<｜Assistant｜><think>\n", True),  # DeepSeek-R1
    ("<|im_start|>assistant\n<think>\n", True),  # Qwen3-Thinking-2507
    ("<|im_start|>assistant\n<think>", True),
    ("<|im_start|>assistant\n", False),  # Qwen3 thinking: the model writes <think> itself
    ("<|im_start|>assistant\n<think>\n\n</think>\n\n", False),  # Qwen3, enable_thinking=false
    ("<|im_start|>user\nwhat is <think>?<|im_end|>\n<|im_start|>assistant\n", False),  # quoted by a user
])
def test_prompt_opens_reasoning(prompt, opened):
    assert prompt_opens_reasoning(prompt) is opened
    ids = list(prompt.encode())
    assert prompt_ids_open_reasoning(lambda tail: bytes(tail).decode(errors="replace"), ids) is opened


def byte_decode(ids) -> str:
    return bytes(ids).decode(errors="replace")


def test_reasoning_tokens_are_those_up_to_and_including_the_closing_marker():
    def count(text: str, opened: bool = False) -> int:
        parser = ReasoningParser(opened)
        parser.feed(text)
        parser.finish()
        return count_reasoning_tokens(parser, list(text.encode()), byte_decode)

    assert count(QWEN_STYLE) == len("<think>\nI add 2 and 2.\n</think>")
    assert count("I count.</think>Four.", opened=True) == len("I count.</think>")
    assert count("<think>\nstill thinking") == len("<think>\nstill thinking")  # never closed: all of them
    assert count("The answer is 4.") == 0
    assert count("Hi <think>x</think> y") == 0  # not a think block: content
    assert count("<think>a</think>b</think>c") == len("<think>a</think>")
    # multi-character tokens: the token that completes </think> is the last one counted
    vocab = ["<think>", "\n", "ab", "</th", "ink>", "\n\n", "Four."]
    ids = [0, 1, 2, 3, 4, 5, 6]
    parser = ReasoningParser(False)
    parser.feed("".join(vocab))
    assert count_reasoning_tokens(parser, ids, lambda tokens: "".join(vocab[t] for t in tokens)) == 5
    assert count_reasoning_tokens(ReasoningParser(True), [], byte_decode) == 0


def test_the_hold_back_rule_is_the_stop_strings_one():
    assert partial_match_len("abc</th", (THINK_END,)) == 4
    assert partial_match_len("abc<", (THINK_START, THINK_END)) == 1
    assert partial_match_len("abc", (THINK_END,)) == 0
    assert partial_match_len("xx</think>", (THINK_END,)) == len(THINK_END)
    assert partial_match_len("ab", ("abc", "b")) == 2
    stream_text = StreamingText(stop=("STOP",))
    assert stream_text.delta("hello ST", finished=False) == "hello "
    assert stream_text._holdback("hello ST") == partial_match_len("hello ST", ("STOP",)) == 2
