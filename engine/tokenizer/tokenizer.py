"""Text ⇄ token ids for a model, built from GGUF metadata or a Hugging Face tokenizer.json directory.

Special-token text inside the text given to `encode` (say a literal "<|im_end|>") becomes that special token, as
transformers' tokenizers and llama.cpp's server (`parse_special`) do; `encode(..., parse_special=False)` keeps such
text literal (transformers' `split_special_tokens=True`), for callers that do not trust the text. In a chat
(`apply_chat_template`) only the template's own markers become special tokens; the messages' text stays text.
"""
from __future__ import annotations

import json
import logging
import re
import threading
from collections.abc import Sequence
from enum import IntEnum
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as _Backend

from engine.tokenizer.chat_encoding import SpecialText, encode_rendered
from engine.tokenizer.chat_template import ChatTemplate, fallback_chat_template
from engine.errors import ModelFormatError, UnsupportedModelError

__all__ = ["IncrementalDetokenizer", "TokenType", "Tokenizer"]

log = logging.getLogger(__name__)


class TokenType(IntEnum):
    """`tokenizer.ggml.token_type` values."""

    NORMAL = 1
    UNKNOWN = 2
    CONTROL = 3
    USER_DEFINED = 4
    UNUSED = 5
    BYTE = 6


# Tokens that end a turn besides EOS; the list llama.cpp uses for its end-of-generation set.
END_OF_TURN_TOKENS = frozenset({
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|eom_id|>", "<EOT>", "_<EOT>",
    "<｜end▁of▁sentence｜>", "<end_of_utterance>",
})
# gpt-oss's harmony format: its output ends with <|return|> (an answer) or <|call|> (a tool call), while <|end|> only
# ends one of its messages (the analysis before the answer): with both of these in the vocabulary they end a turn
# and <|end|> does not, as llama.cpp decides for gpt-oss.
HARMONY_END_TOKENS = ("<|return|>", "<|call|>")
HARMONY_MESSAGE_END = "<|end|>"


def end_of_turn_ids(ids: set[int], backend: _Backend) -> frozenset[int]:
    """The ids that end a generation: `ids` (the model's EOS and those its files list) and the end-of-turn tokens of
    the vocabulary, less harmony's message end where the vocabulary has harmony's own end tokens."""
    ends = set(ids) | {i for i in (backend.token_to_id(t) for t in END_OF_TURN_TOKENS) if i is not None}
    harmony = [backend.token_to_id(t) for t in HARMONY_END_TOKENS]
    if all(i is not None for i in harmony):
        ends = (ends | set(harmony)) - {backend.token_to_id(HARMONY_MESSAGE_END)}
    return frozenset(ends)

# Byte-level BPE pre-tokenizers by `tokenizer.ggml.pre`: the regexes llama.cpp splits with, in turn, and whether
# a word that is itself a token skips the merges. Names missing here fall back to GPT-2's split.
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
           r"|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
          r"|\s+(?!\S)|\s+")
_GPT4O = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
          r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
          r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_TEKKEN = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
           r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
           r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_DEEPSEEK3 = (r"\p{N}{1,3}", r"[一-龥぀-ゟ゠-ヿ]+",
              r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
              r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_PRE_TOKENIZERS: dict[str, tuple[tuple[str, ...], bool]] = {
    **dict.fromkeys(("gpt-2", "gpt2", "phi-2", "mpt", "olmo", "jais", "exaone4", "roberta-bpe", "jina-es", "jina-de",
                     "jina-v1-en", "jina-v2-es", "jina-v2-de", "jina-v2-code", "gigachat", "mellum", "trillion",
                     "granite-docling"), ((_GPT2,), False)),
    **dict.fromkeys(("starcoder", "refact", "command-r", "smollm", "codeshell", "exaone", "minerva-7b"),
                    ((r"\p{N}", _GPT2), False)),
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2"),
                    ((_LLAMA3,), True)),
    **dict.fromkeys(("dbrx", "smaug-bpe", "chatglm-bpe", "glm4"), ((_LLAMA3,), False)),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "stablelm2", "megrez", "hunyuan", "kormo"), ((_QWEN2,), False)),
    **dict.fromkeys(("gpt-4o", "llama4", "minimax-m2"), ((_GPT4O,), False)),
    "tekken": ((_TEKKEN,), True),
    "deepseek-v3": (_DEEPSEEK3, False),
    "deepseek-coder": ((r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", r"[一-龥ࠀ-一가-퟿]+", r"\p{N}"), False),
    "default": ((r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"), False),
}
# Pre-tokenizers after which llama.cpp adds BOS unless the file says otherwise.
_BOS_BY_DEFAULT = {"llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2", "tekken"}

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte → printable character table that byte-level BPE vocabularies are spelled in."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {b: chr(b) for b in keep}, 0
    for b in range(256):
        if b not in table:
            table[b], extra = chr(256 + extra), extra + 1
    return table


_BYTE_DECODER = {c: b for b, c in _bytes_to_unicode().items()}


def _unique_names(tokens: Sequence[str]) -> list[str]:
    """The tokens as vocabulary keys: a repeated string keeps its first id, later copies get an unmatchable name."""
    names = list(tokens)
    if len(set(names)) == len(names):
        return names
    seen: set[str] = set()
    for i, t in enumerate(tokens):
        if t in seen:
            names[i] = f"<dup\x00{i}>"
        seen.add(t)
    log.warning("tokenizer vocabulary repeats token strings; later copies are unreachable by text")
    return names


def _sentencepiece_merges(names: list[str], types: Sequence[int], scores: Sequence[float],
                          vocab: dict[str, int]) -> list[tuple[str, str]]:
    """SentencePiece BPE as a merge list.

    SentencePiece merges, best score first, any adjacent pair whose concatenation is a piece. Listing every split
    of every normal piece into two pieces, ranked by the piece's score (ties broken as transformers'
    `generate_merges` does: longer left part first, then vocabulary order), makes a rank-based BPE reproduce it.
    """
    normal_type = int(TokenType.NORMAL)
    normal = [i for i, t in enumerate(types) if t == normal_type]
    if all(scores[a] > scores[b] for a, b in zip(normal, normal[1:])):
        # Pieces listed best first, as SentencePiece writes them: the vocabulary order is already the merge order.
        return [(p[:k], p[k:]) for p in [names[i] for i in normal]
                for k in range(len(p) - 1, 0, -1) if p[:k] in vocab and p[k:] in vocab]
    ranked = [(-scores[i], -k, k - len(p), i, p[:k], p[k:]) for i in normal if len(p := names[i]) > 1
              for k in range(1, len(p)) if p[:k] in vocab and p[k:] in vocab]
    ranked.sort()
    return [(r[4], r[5]) for r in ranked]


def _byte_level_backend(meta: dict[str, Any], names: list[str], types: Sequence[int],
                        vocab: dict[str, int]) -> tuple[_Backend, bool]:
    """GPT-2 style byte-level BPE with the file's merges, split into words as llama.cpp does for its `pre`."""
    pre = meta.get("tokenizer.ggml.pre") or "default"
    if pre not in _PRE_TOKENIZERS:
        log.warning("unknown pre-tokenizer %r: splitting words as GPT-2 does", pre)
    splits, ignore_merges = _PRE_TOKENIZERS.get(pre, ((_GPT2,), False))
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", ())]
    backend = _Backend(models.BPE(vocab, merges, ignore_merges=ignore_merges))
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in splits]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    backend.decoder = decoders.ByteLevel()
    return backend, False


def _sentencepiece_backend(meta: dict[str, Any], names: list[str], types: Sequence[int],
                           vocab: dict[str, int]) -> tuple[_Backend, bool]:
    """SentencePiece BPE with byte fallback; spaces are ▁, optionally with llama.cpp's prefix space."""
    scores = meta.get("tokenizer.ggml.scores")
    if scores is None:
        scores = [-float(i) for i in range(len(names))]
    unk = meta.get("tokenizer.ggml.unknown_token_id")
    backend = _Backend(models.BPE(
        vocab, _sentencepiece_merges(names, types, scores, vocab),
        unk_token=names[unk] if unk is not None and 0 <= unk < len(names) else None,
        byte_fallback=int(TokenType.BYTE) in types, fuse_unk=True))
    # llama.cpp puts the prefix space before every stretch of raw text, i.e. after each special token too.
    prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    replace = normalizers.Replace(" ", "▁")
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), replace] if prefix else [replace])
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    backend.decoder = decoders.Sequence(steps + [decoders.Strip(" ", 1, 0)] if prefix else steps)
    return backend, prefix


_BUILDERS = {"gpt2": _byte_level_backend, "llama": _sentencepiece_backend}


def _gguf_backend(meta: dict[str, Any]) -> tuple[_Backend, bool, bool]:
    """(tokenizers backend, byte-level?, strip the decoded text's leading space?) for GGUF tokenizer metadata."""
    kind = meta.get("tokenizer.ggml.model")
    if kind not in _BUILDERS:
        raise UnsupportedModelError(f"unsupported GGUF tokenizer model {kind!r} (supported: {', '.join(_BUILDERS)})")
    tokens = meta.get("tokenizer.ggml.tokens")
    if tokens is None or len(tokens) == 0:
        raise ModelFormatError("GGUF metadata has no tokenizer.ggml.tokens")
    types = meta.get("tokenizer.ggml.token_type")
    if types is None:
        types = [int(TokenType.NORMAL)] * len(tokens)
    names = _unique_names(tokens)
    vocab = {t: i for i, t in enumerate(names)}
    try:
        backend, strip = _BUILDERS[kind](meta, names, types, vocab)
    except Exception as e:  # tokenizers reports e.g. a merge of tokens missing from the vocabulary as a bare Exception
        raise ModelFormatError(f"GGUF tokenizer metadata is malformed: {e}") from e
    # Control tokens are special; user-defined ones (gemma's "  ", "\n\n", "<div>") are ordinary text matched whole
    # in the raw text, longest first, as llama.cpp does. (SentencePiece matches them after spaces become ▁, which
    # differs only for a literal ▁ in the input.)
    special, user = (int(TokenType.CONTROL), int(TokenType.UNKNOWN)), int(TokenType.USER_DEFINED)
    backend.add_special_tokens([AddedToken(names[i], special=True, normalized=False) for i, t in enumerate(types)
                                if t in special])
    backend.add_tokens([AddedToken(names[i], special=False, normalized=False) for i, t in enumerate(types)
                        if t == user])
    return backend, kind == "gpt2", strip


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json / special_tokens_map.json spell it: a string or an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def pretrained_chat_template(path: Path, config: dict[str, Any] | None = None) -> str | None:
    """The chat template a Hugging Face directory ships (tokenizer_config.json, then chat_template.jinja, then
    chat_template.json), or None; `config`: tokenizer_config.json when already read."""
    template = (_read_json(path / "tokenizer_config.json") if config is None else config).get("chat_template")
    if isinstance(template, list):  # named templates: use the default one
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    if template is None and (path / "chat_template.jinja").is_file():
        template = (path / "chat_template.jinja").read_text(encoding="utf-8")
    if template is None:
        template = _read_json(path / "chat_template.json").get("chat_template")
    return template


def _decoder_steps(backend: _Backend) -> list[dict[str, Any]]:
    if backend.decoder is None:
        return []
    state = json.loads(backend.decoder.__getstate__())
    return state.get("decoders", [state]) if state.get("type") == "Sequence" else [state]


def _strips_leading_space(steps: list[dict[str, Any]]) -> bool:
    for step in steps:
        if step.get("type") == "Strip" and step.get("content") == " " and step.get("start", 0) >= 1:
            return True
        if step.get("type") == "Metaspace":
            return step.get("prepend_scheme", "always" if step.get("add_prefix_space", True) else "never") != "never"
    return False


class Tokenizer:
    """A model's tokenizer: encode/decode, chat template, special tokens, and per-token bytes."""

    def __init__(self, backend: _Backend, *, bos_token_id: int | None, eos_token_id: int | None,
                 end_token_ids: frozenset[int], add_bos_token: bool, chat_template: str | None,
                 byte_level: bool, strip_leading_space: bool, unk_token_id: int | None = None,
                 pad_token_id: int | None = None, frame_with_post_processor: bool = False) -> None:
        self.backend = backend
        # Special tokens come from the backend's post-processor (BERT's [CLS] ... [SEP]) rather than `add_bos_token`.
        self.frame_with_post_processor = frame_with_post_processor
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        self.bos_token_id, self.eos_token_id = bos_token_id, eos_token_id
        self.end_token_ids: frozenset[int] = end_token_ids
        self.add_bos_token = add_bos_token
        self._byte_level = byte_level
        self._byte_fallback = bool(getattr(backend.model, "byte_fallback", False))
        self._strip_leading_space = strip_leading_space
        added = backend.get_added_tokens_decoder()
        self._added_text = {i: t.content for i, t in added.items()}
        self.special_token_ids: frozenset[int] = frozenset(i for i, t in added.items() if t.special)
        self._special_by_id = {i: self._added_text[i] for i in self.special_token_ids}
        self._bytes: list[bytes | None] = [None] * self.vocab_size
        self._literal: _Backend | None = None
        self._special_text: SpecialText | None = None
        self._literal_lock = threading.Lock()
        names = {"bos_token": bos_token_id, "eos_token": eos_token_id, "unk_token": unk_token_id,
                 "pad_token": pad_token_id}
        self._template_tokens = {k: self.id_to_token(i) for k, i in names.items() if i is not None}
        self.set_chat_template(chat_template)

    # Picklable, for the engine process to hand its tokenizer to the HTTP process (server/process/client.py): what
    # is built on first use (the literal backend, the special-text finder, token bytes) is built again there; the
    # lock and the compiled chat template cannot travel.
    _UNPICKLED = ("_literal", "_special_text", "_literal_lock", "_chat")

    def __getstate__(self) -> dict[str, Any]:
        state = {k: v for k, v in self.__dict__.items() if k not in self._UNPICKLED}
        state["_bytes"] = [None] * self.vocab_size
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._literal, self._special_text, self._literal_lock = None, None, threading.Lock()
        self.set_chat_template(state["chat_template"])

    @classmethod
    def from_gguf_metadata(cls, meta: dict[str, Any]) -> Tokenizer:
        """The tokenizer described by a GGUF file's `tokenizer.*` metadata."""
        backend, byte_level, strip = _gguf_backend(meta)
        tokens = meta["tokenizer.ggml.tokens"]

        def token_id(key: str) -> int | None:
            i = meta.get(f"tokenizer.ggml.{key}")
            return i if i is not None and 0 <= i < len(tokens) else None

        bos, eos = token_id("bos_token_id"), token_id("eos_token_id")
        pre = meta.get("tokenizer.ggml.pre")
        default_bos = meta.get("tokenizer.ggml.model") == "llama" or pre in _BOS_BY_DEFAULT
        ends = {i for i in (eos, token_id("eot_token_id"), token_id("eom_token_id")) if i is not None}
        return cls(backend, bos_token_id=bos, eos_token_id=eos, end_token_ids=end_of_turn_ids(ends, backend),
                   add_bos_token=bool(meta.get("tokenizer.ggml.add_bos_token", default_bos)) and bos is not None,
                   chat_template=meta.get("tokenizer.chat_template"), byte_level=byte_level,
                   strip_leading_space=strip, unk_token_id=token_id("unknown_token_id"),
                   pad_token_id=token_id("padding_token_id"))

    @classmethod
    def from_pretrained_dir(cls, path: str | Path) -> Tokenizer:
        """A Hugging Face tokenizer directory: tokenizer.json, plus the config files transformers reads beside it."""
        path = Path(path)
        if not (path / "tokenizer.json").is_file():
            raise ModelFormatError(f"{path}: no tokenizer.json")
        try:
            backend = _Backend.from_file(str(path / "tokenizer.json"))
        except Exception as e:
            raise ModelFormatError(f"{path / 'tokenizer.json'}: {e}") from e
        # Some files (sentence-transformers' among them) pad and truncate every encoding to a fixed length: the
        # engine lays out its own batches, and a text too long is the caller's to refuse, never cut silently.
        backend.no_truncation()
        backend.no_padding()
        config = _read_json(path / "tokenizer_config.json")
        special_map = _read_json(path / "special_tokens_map.json")
        generation = _read_json(path / "generation_config.json")

        def token_id(name: str) -> int | None:
            text = _token_text(config.get(name)) or _token_text(special_map.get(name))
            if text is not None:
                return backend.token_to_id(text)
            fallback = generation.get(f"{name}_id")
            return fallback[0] if isinstance(fallback, list) and fallback else fallback

        bos, eos = token_id("bos_token"), token_id("eos_token")
        listed = generation.get("eos_token_id")
        ends = {eos, *(listed if isinstance(listed, list) else [listed])} - {None}
        add_bos = config.get("add_bos_token")
        framing = backend.encode("", add_special_tokens=True).ids
        if add_bos is None:  # transformers 5 states it only through the post-processor
            add_bos = bos is not None and framing[:1] == [bos]
        template = pretrained_chat_template(path, config)
        steps = _decoder_steps(backend)
        return cls(backend, bos_token_id=bos, eos_token_id=eos, end_token_ids=end_of_turn_ids(ends, backend),
                   add_bos_token=bool(add_bos) and bos is not None, chat_template=template,
                   byte_level=any(s.get("type") == "ByteLevel" for s in steps),
                   strip_leading_space=_strips_leading_space(steps), unk_token_id=token_id("unk_token"),
                   pad_token_id=token_id("pad_token"),
                   # BERT's [CLS] text [SEP]: a post-processor whose tokens do not start with a BOS frames the text
                   # (a leading BOS stays `add_bos_token`'s, and no EOS is ever appended to a prompt)
                   frame_with_post_processor=bool(framing) and framing[:1] != [bos])

    def set_chat_template(self, source: str | None) -> None:
        """Use `source` as the chat template (None: the fallback for this vocabulary); compiled here, once."""
        if source is None:
            source = fallback_chat_template(lambda t: self.backend.token_to_id(t) is not None)
        self._chat = ChatTemplate(source)
        self.chat_template: str = source

    def encode(self, text: str, add_special_tokens: bool = True, *, parse_special: bool = True) -> list[int]:
        """Token ids of `text`; with `add_special_tokens`, BOS first when the model adds one (`add_bos_token`), or
        the framing of the post-processor (`frame_with_post_processor`)."""
        backend = self.backend if parse_special else self._literal_backend()
        if self.frame_with_post_processor:
            return backend.encode(text, add_special_tokens=add_special_tokens).ids
        ids = backend.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos_token:
            ids.insert(0, self.bos_token_id)
        return ids

    def _literal_backend(self) -> _Backend:
        """A copy of the backend that reads special-token text as plain text (built on first use)."""
        with self._literal_lock:
            if self._literal is None:
                literal = _Backend.from_str(self.backend.to_str())
                literal.encode_special_tokens = True
                self._literal = literal
            return self._literal

    def _encode_literal(self, text: str) -> list[int]:
        return self.encode(text, add_special_tokens=False, parse_special=False)

    def _special_text_finder(self) -> SpecialText:
        """The special tokens' text, to protect chats from (built on first use)."""
        with self._literal_lock:
            if self._special_text is None:
                self._special_text = SpecialText(self._special_by_id.values(), avoid=self._added_text.values())
            return self._special_text

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            tokenize: bool = True, *, parse_special_in_messages: bool = False,
                            **kwargs: Any) -> list[int] | str:
        """The conversation rendered by the chat template, as ids (tokenize=True) or text.

        Special-token text that the template writes becomes special ids; the same text inside the conversation
        (message contents, names, tool calls, tools, documents) is tokenized as text, so that no message can end
        its turn or open another. `parse_special_in_messages` makes it special ids too, as llama-server, vLLM and
        transformers do: for trusted callers only. BOS is added only when the model adds one and the template did
        not already write it.
        """
        variables = {**self._template_tokens, **kwargs}
        if not tokenize or parse_special_in_messages:
            text = self._chat.render(messages, add_generation_prompt=add_generation_prompt, **variables)
            if not tokenize:
                return text
            ids = self.backend.encode(text, add_special_tokens=False).ids
        else:
            chat = self._special_text_finder().protect(messages, variables, avoid=[self._chat.source])
            text = self._chat.render(chat.messages, add_generation_prompt=add_generation_prompt, **chat.variables)
            ids = encode_rendered(text, chat.restore, self.backend, self._encode_literal, self._special_by_id)
        bos_text = self._template_tokens.get("bos_token")
        if self.add_bos_token and not (bos_text and text.startswith(bos_text)):
            ids.insert(0, self.bos_token_id)
        return ids

    def id_to_token(self, i: int) -> str:
        """The vocabulary's spelling of token `i` ("Ġthe", "▁the", "<0x0A>"); "" for an id outside it."""
        return self.backend.id_to_token(i) or ""

    def token_bytes(self, i: int) -> bytes:
        """The UTF-8 bytes token `i` contributes to decoded text (b"" for an id outside the vocabulary)."""
        if not 0 <= i < self.vocab_size:
            return b""
        cached = self._bytes[i]
        if cached is None:
            cached = self._bytes[i] = self._compute_bytes(i)
        return cached

    def _compute_bytes(self, i: int) -> bytes:
        added = self._added_text.get(i)
        if added is not None:  # added tokens are stored as the text they stand for
            return added.encode()
        token = self.backend.id_to_token(i)
        if token is None:
            return b""
        if self._byte_level:
            return b"".join(bytes((_BYTE_DECODER[c],)) if c in _BYTE_DECODER else c.encode() for c in token)
        if self._byte_fallback and (m := _BYTE_TOKEN.fullmatch(token)):
            return bytes((int(m[1], 16),))
        return token.replace("▁", " ").encode()

    def detokenizer(self, skip_special_tokens: bool = False) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self, skip_special_tokens)


def _complete_prefix(buf: bytes) -> int:
    """Length of `buf` without a trailing UTF-8 sequence that more bytes could still complete."""
    n = len(buf)
    for back in range(1, min(4, n) + 1):
        b = buf[n - back]
        if b & 0xC0 != 0x80:  # the last character's first byte
            need = 2 if b >> 5 == 0b110 else 3 if b >> 4 == 0b1110 else 4 if b >> 3 == 0b11110 else 1
            return n - back if need > back else n
    return n


class IncrementalDetokenizer:
    """Streams text as ids arrive; the pieces concatenate to `Tokenizer.decode` of all the ids."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False) -> None:
        self._tokenizer = tokenizer
        self._skip = tokenizer.special_token_ids if skip_special_tokens else frozenset()
        self._pending = b""
        self._strip = tokenizer._strip_leading_space  # SentencePiece's prefix space, dropped once at the start
        self._token_bytes = tokenizer.token_bytes

    def push(self, token_id: int) -> str:
        """Newly completed text; bytes of a character that is not complete yet are held back."""
        if token_id in self._skip:
            return ""
        buf = self._token_bytes(token_id)
        if self._pending:
            buf = self._pending + buf
        # Called per generated token: most end on an ASCII byte, which leaves no character incomplete.
        if buf and buf[-1] >= 0x80 and (cut := _complete_prefix(buf)) < len(buf):
            self._pending = buf[cut:]
            buf = buf[:cut]
        else:
            self._pending = b""
        text = buf.decode("utf-8", errors="replace")
        return self._emit(text) if self._strip else text

    def flush(self) -> str:
        """What is still held back, with incomplete bytes decoded as U+FFFD."""
        buf, self._pending = self._pending, b""
        return self._emit(buf.decode("utf-8", errors="replace"))

    def _emit(self, text: str) -> str:
        if self._strip and text:
            self._strip = False
            if text.startswith(" "):
                return text[1:]
        return text
