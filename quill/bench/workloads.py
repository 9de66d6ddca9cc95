"""Deterministic request sets for `quill bench serve`: shared-prefix chat, random prompts, JSONL files."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

WORKLOAD_NAMES = ("chat-shared-prefix", "chat-multi-prefix", "random", "file:F.jsonl")

# Plain words so any tokenizer splits them near one token each; order and choice come from the seed.
WORDS = (
    "the a of and to in is that it for on with as was by at from this be are or an not have "
    "which one all their there been has more when will would who so if out up into than its "
    "time only new some could these two may first then do any like now over such our after "
    "also most made many before must through back years where much way well down should "
    "because each just those people how too little state good very make world still own see "
    "men work long here between both life being under never day same another know while last "
    "might great old year off come since against go came right used take three house small "
    "river garden window market letter engine signal bridge forest question answer number "
    "machine memory story music water light stone paper city road winter summer morning "
    "evening table kitchen doctor teacher student village island mountain valley harbor "
    "careful quiet bright heavy simple quick early late warm cold open closed green silver "
    "builds carries follows measures explains remembers changes travels listens watches"
).split()

QUESTION_TOPICS = ("summarize", "explain", "list the main points of", "describe the tone of",
                   "give three questions about", "rewrite in simpler words")

SHARED_PREFIX_CHARS = 1600  # about 400 tokens at ~4 characters per token


@dataclass(frozen=True)
class BenchRequest:
    """One chat request of a workload: messages and its output length."""

    messages: tuple[dict, ...]
    max_tokens: int


def make_sentence(rng: random.Random, min_words: int = 8, max_words: int = 16) -> str:
    words = [rng.choice(WORDS) for _ in range(rng.randint(min_words, max_words))]
    return " ".join(words).capitalize() + "."


def make_text(rng: random.Random, num_chars: int) -> str:
    """English-ish sentences until at least num_chars characters."""
    sentences: list[str] = []
    length = 0
    while length < num_chars:
        sentence = make_sentence(rng)
        sentences.append(sentence)
        length += len(sentence) + 1
    return " ".join(sentences)


def make_words(rng: random.Random, num_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(num_words))


def chat_shared_prefix(num_requests: int, max_tokens: int, seed: int) -> list[BenchRequest]:
    """One ~400-token system prompt shared by all requests, plus a short distinct question each."""
    return multi_prefix_chat(num_requests, max_tokens, seed, num_prefixes=1)


def multi_prefix_chat(num_requests: int, max_tokens: int, seed: int, num_prefixes: int = 4) -> list[BenchRequest]:
    """`num_prefixes` distinct ~400-token system prompts (one per team); each request takes one of
    them at random (seeded) and adds a short distinct question."""
    rng = random.Random(seed)
    if num_prefixes == 1:
        systems = ["You are a careful assistant. Use this document to answer.\n\n" + make_text(rng, SHARED_PREFIX_CHARS)]
    else:
        systems = [f"You are the assistant of team {team + 1}. Use this document to answer.\n\n"
                   + make_text(rng, SHARED_PREFIX_CHARS) for team in range(num_prefixes)]
    requests = []
    for index in range(num_requests):
        system = systems[0] if num_prefixes == 1 else rng.choice(systems)
        topic = rng.choice(QUESTION_TOPICS)
        # The index makes every question distinct even when the random words repeat.
        question = f"Question {index + 1}: {topic} the part about {rng.choice(WORDS)} and {rng.choice(WORDS)}."
        messages = ({"role": "system", "content": system}, {"role": "user", "content": question})
        requests.append(BenchRequest(messages, max_tokens))
    return requests


def random_prompts(num_requests: int, max_tokens: int, seed: int, word_range: tuple[int, int]) -> list[BenchRequest]:
    """Prompts of a seeded random length (in words) drawn from the word list."""
    rng = random.Random(seed)
    low, high = word_range
    return [
        BenchRequest(({"role": "user", "content": make_words(rng, rng.randint(low, high))},), max_tokens)
        for _ in range(num_requests)
    ]


def parse_jsonl_line(line: str, where: str, max_tokens: int) -> BenchRequest:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{where}: not valid JSON ({exc.msg})") from None
    if not isinstance(record, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(record).__name__}")
    if "messages" in record:
        messages = record["messages"]
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages) or not messages:
            raise ValueError(f"{where}: 'messages' must be a non-empty list of objects")
    elif isinstance(record.get("prompt"), str):
        messages = [{"role": "user", "content": record["prompt"]}]
    else:
        raise ValueError(f"{where}: needs 'messages' (list) or 'prompt' (string)")
    own_max = record.get("max_tokens", max_tokens)
    if not isinstance(own_max, int) or isinstance(own_max, bool) or own_max < 1:
        raise ValueError(f"{where}: max_tokens must be a positive integer, got {own_max!r}")
    return BenchRequest(tuple(messages), own_max)


def from_jsonl(path: str | Path, num_requests: int, max_tokens: int) -> list[BenchRequest]:
    """The first num_requests lines of a JSONL file, cycling when the file has fewer."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"workload file {str(path)!r} does not exist")
    records = [
        parse_jsonl_line(line, f"{path}:{number}", max_tokens)
        for number, line in enumerate(path.read_text().splitlines(), start=1)
        if line.strip()
    ]
    if not records:
        raise ValueError(f"workload file {str(path)!r} has no requests")
    return [records[index % len(records)] for index in range(num_requests)]


def build_workload(spec: str, num_requests: int, max_tokens: int, seed: int,
                   random_words: tuple[int, int] = (32, 256)) -> list[BenchRequest]:
    """The request list for a --workload value."""
    if spec == "chat-shared-prefix":
        return chat_shared_prefix(num_requests, max_tokens, seed)
    if spec == "chat-multi-prefix":
        return multi_prefix_chat(num_requests, max_tokens, seed)
    if spec == "random":
        return random_prompts(num_requests, max_tokens, seed, random_words)
    if spec.startswith("file:") and len(spec) > len("file:"):
        return from_jsonl(spec[len("file:"):], num_requests, max_tokens)
    raise ValueError(f"unknown --workload {spec!r}; use one of {', '.join(WORKLOAD_NAMES)}")
