"""Tokenizer: a Hugging Face `tokenizers` backend built from GGUF metadata or an HF folder."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as Backend

from quill.chat_template import render_chat_template

# llama.cpp's tokenizer.ggml.token_type values.
_NORMAL, _CONTROL, _USER_DEFINED = 1, 3, 4

# Tokens that close a chat turn: when the template writes one, generation must stop there too.
_END_OF_TURN_MARKERS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>")

# An unpaired UTF-16 surrogate (JSON "\ud800" decodes to one): not Unicode text, no encoding takes it.
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")

# The split regexes, one per llama.cpp pre-tokenizer. Facts from llama.cpp's src/llama-vocab.cpp
# (llm_tokenizer_bpe: regex_exprs per LLAMA_VOCAB_PRE_TYPE_*; where llama.cpp rewrites a regex for its own
# engine, its comment keeps the original tokenizer.json regex, and that original is the one used here,
# since the `tokenizers` library runs it as the model's tokenizer.json does).
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Mistral's Tekken (Nemo, Small 3): case-aware words, single digits, "/" kept after punctuation.
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# o200k ("gpt-4o"; Phi-4-mini): Tekken's words with the contractions attached, digits in threes.
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@dataclass(frozen=True)
class _BytePreTokenizer:
    """How one byte-level vocabulary cuts text before BPE (mirrors the model's own tokenizer.json)."""

    split: str
    individual_digits: bool = False  # SmolLM/StarCoder isolate every digit before the regex
    nfc: bool = False  # Qwen2 normalizes to NFC first
    ignore_merges: bool = False  # Llama 3 takes a whole-word vocab hit before merging
    add_bos: bool = False  # llama.cpp's default when the file has no tokenizer.ggml.add_bos_token


# tokenizer.ggml.pre -> pre-tokenizer. Which names share a regex, and the ignore_merges / add_bos
# defaults, follow llama.cpp's src/llama-vocab.cpp (llama_vocab::impl::load); which name each family's
# GGUF carries follows convert_hf_to_gguf.py's get_vocab_base_pre (tokenizer hash -> name) and its
# _set_vocab_mistral ("tekken"):
#   Llama 3.x -> "llama-bpe"; Qwen2/2.5 -> "qwen2"; DeepSeek-R1-Distill-Qwen -> "deepseek-r1-qwen";
#   Mistral Nemo / Small 3 -> "tekken"; Phi-4-mini -> "gpt-4o"; Granite 3.x -> "refact";
#   SmolLM3 -> "smaug-bpe" (a Llama 3 vocabulary that adds no BOS; seen in llama.cpp PR 14581's log);
#   OLMo 2 -> "dbrx" (inferred: a cl100k vocabulary like DBRX's; the hash list names no OLMo 2);
#   SmolLM/SmolLM2 -> "smollm".
_BYTE_LEVEL_PRE = {
    **{name: _BytePreTokenizer(_GPT2_SPLIT) for name in ("default", "gpt2", "gpt-2", "olmo")},
    **{name: _BytePreTokenizer(_GPT2_SPLIT, individual_digits=True) for name in ("smollm", "starcoder", "refact")},
    **{
        name: _BytePreTokenizer(_LLAMA3_SPLIT, ignore_merges=True, add_bos=True)
        for name in ("llama-bpe", "llama3", "llama-v3")
    },
    # llama.cpp gives DBRX and Smaug Llama 3's regex but neither ignore_merges nor a default BOS.
    **{name: _BytePreTokenizer(_LLAMA3_SPLIT) for name in ("dbrx", "smaug-bpe")},
    # llama.cpp treats "deepseek-r1-qwen" (DeepSeek-R1-Distill-Qwen files) exactly as "qwen2" (llama-vocab.cpp)
    **{name: _BytePreTokenizer(_QWEN2_SPLIT, nfc=True) for name in ("qwen2", "deepseek-r1-qwen")},
    "tekken": _BytePreTokenizer(_TEKKEN_SPLIT, ignore_merges=True, add_bos=True),
    "gpt-4o": _BytePreTokenizer(_GPT4O_SPLIT),
}


def _byte_to_char() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map used to spell byte-level vocabularies."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    mapping = {b: chr(b) for b in printable}
    for offset, b in enumerate(b for b in range(256) if b not in mapping):
        mapping[b] = chr(256 + offset)
    return mapping


_BYTE_TO_CHAR = _byte_to_char()
_CHAR_TO_BYTE = {c: b for b, c in _BYTE_TO_CHAR.items()}
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _byte_level_pre(pre_name: str) -> _BytePreTokenizer:
    pre = _BYTE_LEVEL_PRE.get(pre_name)
    if pre is None:
        raise ValueError(f"tokenizer.ggml.pre {pre_name!r} is not supported; supported: {sorted(_BYTE_LEVEL_PRE)}")
    return pre


def _byte_level_backend(tokens: list[str], types: list[int], merges: list[str], pre: _BytePreTokenizer) -> Backend:
    vocab: dict[str, int] = {}
    for index, (token, kind) in enumerate(zip(tokens, types)):
        if kind == _NORMAL and not set(token) <= _CHAR_TO_BYTE.keys():
            # Some converters store plain text; BPE needs the byte-alphabet spelling.
            token = "".join(_BYTE_TO_CHAR[b] for b in token.encode("utf-8"))
        vocab.setdefault(token, index)
    pairs = [tuple(merge.split(" ", 1)) for merge in merges]
    backend = Backend(models.BPE(vocab, pairs, ignore_merges=pre.ignore_merges))
    if pre.nfc:
        backend.normalizer = normalizers.NFC()
    steps = [pre_tokenizers.Digits(individual_digits=True)] if pre.individual_digits else []
    steps += [
        pre_tokenizers.Split(Regex(pre.split), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ]
    backend.pre_tokenizer = pre_tokenizers.Sequence(steps)
    backend.decoder = decoders.ByteLevel()
    return backend


def _merges_from_scores(tokens: list[str], scores: list[float], types: list[int]) -> list[tuple[str, str]]:
    """SentencePiece merges pairs by the merged piece's score; rebuild that order as BPE merges."""
    vocab = {t: i for i, (t, kind) in enumerate(zip(tokens, types)) if kind == _NORMAL}
    candidates = []
    for merged, index in vocab.items():
        for cut in range(1, len(merged)):
            left, right = merged[:cut], merged[cut:]
            if left in vocab and right in vocab:
                candidates.append((-scores[index], -len(left), -len(right), vocab[left], vocab[right], left, right))
    candidates.sort()
    return [(c[5], c[6]) for c in candidates]


def _sentencepiece_backend(meta: dict, tokens: list[str], types: list[int]) -> Backend:
    scores = meta.get("tokenizer.ggml.scores")
    merges = meta.get("tokenizer.ggml.merges")
    if merges is None and scores is None:
        raise ValueError("a 'llama' (SentencePiece) GGUF vocabulary needs tokenizer.ggml.scores or .merges")
    vocab: dict[str, int] = {}
    for index, token in enumerate(tokens):
        vocab.setdefault(token, index)
    pairs = [tuple(m.split(" ", 1)) for m in merges] if merges else _merges_from_scores(tokens, scores, types)
    unk_id = meta.get("tokenizer.ggml.unknown_token_id")
    unk = tokens[int(unk_id)] if unk_id is not None and 0 <= int(unk_id) < len(tokens) else None
    backend = Backend(models.BPE(vocab, pairs, unk_token=unk, fuse_unk=True, byte_fallback=True))
    add_space_prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="\u2581", prepend_scheme="first" if add_space_prefix else "never", split=False
    )
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        steps.append(decoders.Strip(" ", 1, 0))
    backend.decoder = decoders.Sequence(steps)
    return backend


def _gguf_backend(meta: dict, tokens: list[str], types: list[int]) -> tuple[Backend, bool]:
    """The backend for tokenizer.ggml.model, and whether llama.cpp adds BOS when the file is silent."""
    model = meta.get("tokenizer.ggml.model")
    if model == "gpt2":
        merges = meta.get("tokenizer.ggml.merges")
        if merges is None:
            raise ValueError("a 'gpt2' (byte-level BPE) GGUF vocabulary needs tokenizer.ggml.merges")
        pre = _byte_level_pre(meta.get("tokenizer.ggml.pre", "default"))
        return _byte_level_backend(tokens, types, list(merges), pre), pre.add_bos
    if model == "llama":
        return _sentencepiece_backend(meta, tokens, types), True
    raise ValueError(
        f"tokenizer.ggml.model {model!r} is not supported; quill reads 'gpt2' (byte-level BPE) "
        "and 'llama' (SentencePiece)"
    )


def _rstrip_tokens(meta: dict, pairs: list[tuple[str, int]]) -> set[str]:
    """Added tokens that swallow the whitespace after them: Phi-3's (its tokenizer.json marks them rstrip).

    GGUF has no per-token flag for this; llama.cpp (src/llama-vocab.cpp, the "phi-3"/"phi3" branch on
    general.name) sets RSTRIP on every control/user-defined token but <unk>, <s> and <|endoftext|>.
    """
    name = str(meta.get("general.name") or "").lower()
    if "phi-3" not in name and "phi3" not in name:
        return set()
    return {t for t, k in pairs if k in (_CONTROL, _USER_DEFINED)} - {"<unk>", "<s>", "<|endoftext|>"}


def _gguf_special_tokens(meta: dict, tokens: list[str]) -> dict[str, str | None]:
    special = {}
    for name, key in (("bos", "bos"), ("eos", "eos"), ("unk", "unknown"), ("pad", "padding")):
        index = meta.get(f"tokenizer.ggml.{key}_token_id")
        if index is not None and not 0 <= int(index) < len(tokens):
            raise ValueError(f"tokenizer.ggml.{key}_token_id is {index}, outside the vocabulary of {len(tokens)}")
        special[f"{name}_token"] = tokens[int(index)] if index is not None else None
    return special


def _set_post_processor(backend: Backend, bos: str | None, eos: str | None, add_bos: bool, add_eos: bool) -> None:
    """Make encode(add_special_tokens=True) prepend BOS / append EOS exactly as the model asks."""
    head = f"{bos}:0 " if add_bos and bos else ""
    tail = f" {eos}:0" if add_eos and eos else ""
    specials = [(t, backend.token_to_id(t)) for t in {bos if head else None, eos if tail else None} if t]
    backend.post_processor = processors.TemplateProcessing(
        single=f"{head}$A:0{tail}",
        pair=f"{head}$A:0{tail} {head.replace(':0', ':1')}$B:1{tail.replace(':0', ':1')}",
        special_tokens=specials,
    )


def _token_content(value) -> str | None:
    # tokenizer_config.json writes a special token as a string or as a serialized AddedToken dict.
    return value.get("content") if isinstance(value, dict) else value


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _template_from_config(config: dict) -> str | None:
    template = config.get("chat_template")
    if isinstance(template, list):  # [{name, template}, ...]: the unnamed use is "default"
        named = {entry.get("name"): entry.get("template") for entry in template if isinstance(entry, dict)}
        return named.get("default")
    return template


def _hf_chat_template(root: Path, config: dict) -> str | None:
    """chat_template.jinja wins over chat_template.json, which wins over tokenizer_config.json."""
    if (root / "chat_template.jinja").is_file():
        return (root / "chat_template.jinja").read_text(encoding="utf-8")
    return _read_json(root / "chat_template.json").get("chat_template") or _template_from_config(config)


def _piece_style(decoder_state: bytes | None) -> str:
    text = decoder_state.decode() if decoder_state else ""
    if '"ByteLevel"' in text:
        return "byte_level"
    return "sentencepiece" if '"ByteFallback"' in text or '"Metaspace"' in text else "plain"


class Tokenizer:
    """Text <-> token ids for one model, plus its chat template and end-of-generation tokens."""

    def __init__(
        self,
        backend: Backend,
        *,
        special_tokens: dict[str, str | None],
        extra_eos_token_ids: tuple[int, ...] = (),
        chat_template: str | None = None,
        vocab_size: int | None = None,
    ):
        """vocab_size: 1 + the largest id, when known (a .quill file stores it): listing a 128k vocabulary
        to find it costs 0.15 s."""
        backend.no_truncation()  # a saved tokenizer.json may carry training-time truncation/padding
        backend.no_padding()
        self._backend = backend
        self.hf = backend  # the tokenizers.Tokenizer, for grammar engines that index the vocabulary
        self.special_tokens = {k: v for k, v in special_tokens.items() if v is not None}
        self.chat_template = chat_template
        self._added = backend.get_added_tokens_decoder()  # {id: AddedToken}
        self._special_ids = frozenset(i for i, t in self._added.items() if t.special)
        self.vocab_size = vocab_size or 1 + max(backend.get_vocab(with_added_tokens=True).values())
        self._piece_style = _piece_style(backend.decoder.__getstate__() if backend.decoder else None)
        bos = self.special_tokens.get("bos_token")
        self.bos_token_id = backend.token_to_id(bos) if bos else None
        self.adds_bos = self.bos_token_id is not None and backend.encode("").ids[:1] == [self.bos_token_id]
        self.eos_token_ids = self._collect_eos(extra_eos_token_ids)

    def _collect_eos(self, extra: tuple[int, ...]) -> tuple[int, ...]:
        eos = self.special_tokens.get("eos_token")
        candidates = [self._backend.token_to_id(eos) if eos else None, *extra]
        for marker in _END_OF_TURN_MARKERS:
            marker_id = self._backend.token_to_id(marker)
            if self.chat_template and marker in self.chat_template and marker_id in self._special_ids:
                candidates.append(marker_id)
        return tuple(dict.fromkeys(int(i) for i in candidates if i is not None and 0 <= int(i) < self.vocab_size))

    @classmethod
    def from_gguf_metadata(cls, meta: dict) -> "Tokenizer":
        """Build from GGUF key -> python value (tokenizer.ggml.*, tokenizer.chat_template; general.name if given)."""
        tokens = meta.get("tokenizer.ggml.tokens")
        if not tokens:
            raise ValueError("GGUF metadata has no tokenizer.ggml.tokens; this file carries no tokenizer")
        tokens = [str(t) for t in tokens]
        types = [int(t) for t in meta.get("tokenizer.ggml.token_type") or [_NORMAL] * len(tokens)]
        backend, default_add_bos = _gguf_backend(meta, tokens, types)
        pairs = list(zip(tokens, types))
        rstrip = _rstrip_tokens(meta, pairs)
        # Control tokens (<|im_end|>) are special: matched whole, skipped on decode. User-defined
        # ones (<think>) are matched whole but kept on decode, as llama.cpp and transformers do.
        backend.add_special_tokens([AddedToken(t, special=True, normalized=False, rstrip=t in rstrip)
                                    for t, k in pairs if k == _CONTROL])
        backend.add_tokens([AddedToken(t, special=False, normalized=False, rstrip=t in rstrip)
                            for t, k in pairs if k == _USER_DEFINED])
        special = _gguf_special_tokens(meta, tokens)
        add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", default_add_bos))
        add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))
        _set_post_processor(backend, special["bos_token"], special["eos_token"], add_bos, add_eos)
        extra = tuple(int(meta[k]) for k in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id") if k in meta)
        return cls(backend, special_tokens=special, extra_eos_token_ids=extra,
                   chat_template=meta.get("tokenizer.chat_template"))

    @classmethod
    def from_gguf_file(cls, path: str | Path) -> "Tokenizer":
        """Read only the tokenizer keys of a GGUF file and build from them."""
        import gguf  # local: only GGUF users pay for the import

        reader = gguf.GGUFReader(str(path))
        # general.name too: llama.cpp keys Phi-3's whitespace-swallowing special tokens on it.
        meta = {k: f.contents() for k, f in reader.fields.items()
                if k.startswith("tokenizer.") or k == "general.name"}
        return cls.from_gguf_metadata(meta)

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> "Tokenizer":
        """Build from a Hugging Face model folder (tokenizer.json + tokenizer_config.json ...)."""
        root = Path(path)
        if not (root / "tokenizer.json").is_file():
            raise FileNotFoundError(f"{root} has no tokenizer.json (quill needs the fast-tokenizer file)")
        backend = Backend.from_file(str(root / "tokenizer.json"))
        config = _read_json(root / "tokenizer_config.json")
        special = {k: _token_content(config.get(k)) for k in ("bos_token", "eos_token", "unk_token", "pad_token")}
        if "add_bos_token" in config or "add_eos_token" in config:
            # transformers rebuilds the post-processor from these flags when they are given.
            _set_post_processor(backend, special["bos_token"], special["eos_token"],
                                bool(config.get("add_bos_token")), bool(config.get("add_eos_token")))
        generation_eos = _read_json(root / "generation_config.json").get("eos_token_id")  # int | list | None
        extra = generation_eos if isinstance(generation_eos, list) else [generation_eos] * (generation_eos is not None)
        return cls(backend, special_tokens=special, extra_eos_token_ids=tuple(extra),
                   chat_template=_hf_chat_template(root, config))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; BOS/EOS added only where the model's tokenizer says so."""
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        surrogate = _LONE_SURROGATE.search(text)
        if surrogate is not None:
            raise ValueError(f"text contains a lone UTF-16 surrogate \\u{ord(surrogate.group()):04x} at character "
                             f"{surrogate.start():,}; text must be valid Unicode")
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        ids = list(ids)
        bad = [i for i in ids if not isinstance(i, int) or not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]!r} is not in [0, vocab_size={self.vocab_size})")
        return self._backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def id_to_piece(self, token_id: int) -> str:
        """The text of one token, bytes decoded (a lone partial UTF-8 byte shows as \\xNN)."""
        token = self._backend.id_to_token(token_id) if isinstance(token_id, int) and token_id >= 0 else None
        if token is None:
            raise ValueError(f"token id {token_id!r} is not in [0, vocab_size={self.vocab_size})")
        if token_id in self._added:
            return token
        if self._piece_style == "byte_level" and set(token) <= _CHAR_TO_BYTE.keys():
            return bytes(_CHAR_TO_BYTE[c] for c in token).decode("utf-8", errors="backslashreplace")
        if self._piece_style == "sentencepiece":
            byte = _BYTE_PIECE.fullmatch(token)
            if byte:
                return bytes([int(byte.group(1), 16)]).decode("utf-8", errors="backslashreplace")
            return token.replace("\u2581", " ")
        return token

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def is_special(self, token_id: int) -> bool:
        return token_id in self._special_ids

    def added_token_kind(self, text: str) -> str | None:
        """"special" when `text` is one added special token (skipped on decode, like <|im_end|>),
        "added" when one added non-special token (kept on decode, like Qwen's <tool_call>), else None."""
        token_id = self.added_token_id(text)
        if token_id is None:
            return None
        return "special" if token_id in self._special_ids else "added"

    def added_token_id(self, text: str) -> int | None:
        """The id of `text` when it is one added token (special or not), else None."""
        token_id = self._backend.token_to_id(text)
        return token_id if token_id in self._added else None

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> str:
        """Render a conversation to prompt text; kwargs (tools, documents, ...) reach the template."""
        template = kwargs.pop("chat_template", None) or self.chat_template
        return render_chat_template(template, messages, add_generation_prompt=add_generation_prompt,
                                    special_tokens=self.special_tokens, **kwargs)

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> list[int]:
        """Prompt ids for a conversation; BOS is added only if the model wants one and the template did not."""
        ids = self.encode(self.apply_chat_template(messages, add_generation_prompt, **kwargs), add_special_tokens=False)
        if self.adds_bos and ids[:1] != [self.bos_token_id]:
            ids.insert(0, self.bos_token_id)
        return ids
