"""SentencePiece vocabularies of GGUF files (``tokenizer.ggml.model == "llama"``) on the ``tokenizers`` library.

Llama-2, Mistral-v0.1, TinyLlama and Gemma files store the SentencePiece BPE model they were trained
with as a list of pieces, each with a score and a type, and usually no merge table. SentencePiece,
and llama.cpp which reads these files, encode text by merging, again and again, the adjacent pair
whose concatenation is the best-scoring piece; a character no piece spells becomes its UTF-8 bytes,
as the pieces ``<0x00>``..``<0xFF>``. The ``tokenizers`` BPE model does exactly that when its merges
are ranked by the score of the piece they produce, so that is what we give it.

A space is the piece character ``▁`` (U+2581). A vocabulary with ``add_space_prefix`` (Llama; not
Gemma) also gets a ``▁`` in front of its text, SentencePiece's dummy prefix, even when the text
already starts with a space. llama.cpp (like the normalizer of Llama-2's own tokenizer.json) puts
it at the start of every stretch of text between whole-matched tokens, so after ``<s>`` too, and so
do we. Decoding drops that one space from the start of the text again. Control, unknown and
user-defined pieces (``<s>``, Gemma's ``<start_of_turn>`` and its runs of literal spaces) are
matched whole in the raw text, never built by merges.

Where we part from transformers 5.23's GGUF tokenizer, we follow SentencePiece and llama.cpp: its
Llama-style tokenizer adds no ``▁`` to text that already starts with a space, nor after a special
token (``" Hello"`` is ``▁`` ``▁Hello`` in SentencePiece, ``▁Hello`` there); its Gemma tokenizer
builds Gemma's space runs by merges instead of matching them whole, which gives the same ids as
long as those tokens come early in the vocabulary, as they do in Gemma's.
"""

from __future__ import annotations

from collections.abc import Sequence

from gguf import TokenType
from tokenizers import AddedToken, decoders, models, normalizers
from tokenizers import Tokenizer as BackendTokenizer

from services.text.gguf_metadata import GGUFMetadata, split_merges

SPACE_PIECE = "\u2581"

# Architectures whose SentencePiece model has no dummy prefix, for files that predate the
# tokenizer.ggml.add_space_prefix key (llama.cpp writes False for these).
_NO_SPACE_PREFIX_ARCHITECTURES = frozenset({"gemma", "gemma2", "gemma3", "gemma3n", "gemma-embedding"})

# Pieces a merge can produce. Control, unknown, byte and unused pieces are never merge results in
# SentencePiece; user-defined ones are matched whole before merging, so allowing them changes nothing.
_MERGEABLE_TYPES = frozenset({TokenType.NORMAL, TokenType.USER_DEFINED})
# Matched whole and dropped by decode(skip_special_tokens=True).
_SPECIAL_TYPES = frozenset({TokenType.CONTROL, TokenType.UNKNOWN})


def sentencepiece_backend(meta: GGUFMetadata) -> BackendTokenizer:
    """The ``tokenizers`` tokenizer of a GGUF file whose ``tokenizer.ggml.model`` is ``"llama"``.

    The merges come from ``tokenizer.ggml.merges`` when the file has them (converted from a
    tokenizer.json), else from the scores. ``tokenizer.ggml.pre`` is ignored, as llama.cpp ignores it
    for this kind of vocabulary: SentencePiece does not split text before merging.
    """
    where = meta.where
    tokens: list[str] = meta.require("tokenizer.ggml.tokens")
    token_types = _token_types(meta.get("tokenizer.ggml.token_type"), len(tokens), where)
    file_merges: list[str] | None = meta.get("tokenizer.ggml.merges")
    if file_merges is not None:
        merges = split_merges(file_merges, where)
    else:
        scores = meta.require("tokenizer.ggml.scores")
        if len(scores) != len(tokens):
            raise ValueError(f"{where}: {len(scores)} token scores for {len(tokens)} tokens")
        merges = merges_by_score(tokens, scores, token_types)

    vocab = {token: index for index, token in enumerate(tokens)}
    unknown_id = _unknown_token_id(meta.get("tokenizer.ggml.unknown_token_id"), token_types, len(tokens), where)
    backend = BackendTokenizer(
        models.BPE(
            vocab,
            merges,
            unk_token=tokens[unknown_id] if unknown_id is not None else None,
            fuse_unk=True,
            byte_fallback=True,
        )
    )
    add_space_prefix = meta.get("tokenizer.ggml.add_space_prefix")
    if add_space_prefix is None:
        add_space_prefix = meta.get("general.architecture") not in _NO_SPACE_PREFIX_ARCHITECTURES
    _set_space_handling(backend, bool(add_space_prefix))
    end_of_generation = {meta.get(f"tokenizer.ggml.{kind}_token_id") for kind in ("eos", "eot", "eom")}
    _add_whole_tokens(backend, tokens, token_types, end_of_generation - {None})
    return backend


def merges_by_score(
    tokens: Sequence[str], scores: Sequence[float], token_types: Sequence[int]
) -> list[tuple[str, str]]:
    """Every way to build a mergeable piece from two pieces, best-scoring result first.

    SentencePiece merges the adjacent pair whose concatenation scores best, whichever two pieces it
    is cut from; so each cut of a piece into two vocabulary pieces is a merge ranked by that piece's
    score. Equal scores rank by piece id (SentencePiece would take the leftmost pair instead; real
    vocabularies give their ordinary pieces distinct scores).
    """
    known = set(tokens)
    ranked: list[tuple[float, int, int]] = []
    for token_id, token in enumerate(tokens):
        if token_types[token_id] not in _MERGEABLE_TYPES:
            continue
        for cut in range(1, len(token)):
            if token[:cut] in known and token[cut:] in known:
                ranked.append((-scores[token_id], token_id, cut))
    ranked.sort()
    return [(tokens[token_id][:cut], tokens[token_id][cut:]) for _, token_id, cut in ranked]


def _token_types(types: list[int] | None, count: int, where: str) -> list[int]:
    """Per-token GGUF types; a file without them has only normal tokens."""
    if types is None:
        return [TokenType.NORMAL] * count
    if len(types) != count:
        raise ValueError(f"{where}: {len(types)} token types for {count} tokens")
    return types


def _unknown_token_id(token_id: int | None, token_types: list[int], count: int, where: str) -> int | None:
    """The id the file names, else its token typed unknown (SentencePiece's ``<unk>``), else none."""
    if token_id is None:
        token_id = next((i for i, kind in enumerate(token_types) if kind == TokenType.UNKNOWN), None)
    if token_id is not None and not 0 <= token_id < count:
        raise ValueError(f"{where}: unknown token id {token_id} is not in [0, {count})")
    return token_id


def _set_space_handling(backend: BackendTokenizer, add_space_prefix: bool) -> None:
    """Spaces become ``▁`` before merging and come back after; the prefix ``▁`` is dropped on decode.

    The normalizer runs once per stretch of text between whole-matched tokens, so the prefix lands
    at the start of the text and after each such token, where llama.cpp puts it.
    """
    to_space_piece = normalizers.Replace(" ", SPACE_PIECE)
    steps = [
        decoders.Replace(SPACE_PIECE, " "),
        decoders.ByteFallback(),  # <0xE4><0xB8><0xAD> -> "中"; an unfinished character decodes to U+FFFD
        decoders.Fuse(),
    ]
    if add_space_prefix:
        backend.normalizer = normalizers.Sequence([normalizers.Prepend(SPACE_PIECE), to_space_piece])
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    else:
        backend.normalizer = to_space_piece
    backend.decoder = decoders.Sequence(steps)


def _add_whole_tokens(
    backend: BackendTokenizer, tokens: list[str], token_types: list[int], end_of_generation: set[int]
) -> None:
    """Control, unknown and user-defined tokens are found in the raw text before anything else.

    Control and unknown ones (``<s>``, ``<unk>``) are special: ``decode(skip_special_tokens=True)``
    drops them. User-defined ones (Gemma's ``<start_of_turn>``, its runs of spaces) always decode,
    as llama.cpp renders them, except an end-of-generation one (a file typing ``<end_of_turn>``
    user-defined): that is special too, so the token a reply stops at adds no text, as llama.cpp
    makes it a control token.
    """
    special = [
        AddedToken(tokens[i], normalized=False, special=True)
        for i, kind in enumerate(token_types)
        if kind in _SPECIAL_TYPES or (kind == TokenType.USER_DEFINED and i in end_of_generation)
    ]
    user_defined = [
        AddedToken(tokens[i], normalized=False, special=False)
        for i, kind in enumerate(token_types)
        if kind == TokenType.USER_DEFINED and i not in end_of_generation
    ]
    if special:
        backend.add_special_tokens(special)
    if user_defined:
        backend.add_tokens(user_defined)
