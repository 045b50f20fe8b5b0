"""SentencePiece BPE encoding as llama.cpp runs it on a GGUF ``llama`` vocabulary, written plainly.

The reference the tokenizers-based implementation must equal where transformers' GGUF tokenizer
differs from SentencePiece (text that starts with a space, text after a special token, Gemma's runs
of spaces). It is slow (cubic in the length of a stretch of text) and only for short test strings:

1. Cut the text at control, unknown and user-defined pieces, longest piece first.
2. For each stretch of text between them: a space in front if the vocabulary adds a space prefix
   (at the start, and after a whole-matched piece), spaces to ``▁``, then start from single
   characters and merge, again and again, the adjacent pair whose concatenation is the
   best-scoring piece, the leftmost pair on equal scores.
3. A character no piece spells becomes its UTF-8 bytes as ``<0xNN>`` pieces.
"""

from __future__ import annotations

from gguf import TokenType

from tests.unit.text._sentencepiece_vocab import SentencePieceVocab

_WHOLE_TYPES = {TokenType.CONTROL, TokenType.UNKNOWN, TokenType.USER_DEFINED}
_MERGEABLE_TYPES = {TokenType.NORMAL, TokenType.USER_DEFINED}


def reference_encode(text: str, vocab: SentencePieceVocab, *, add_space_prefix: bool) -> list[int]:
    ids = {token: index for index, token in enumerate(vocab.tokens)}
    output: list[int] = []
    after_whole_piece = True
    for is_whole, fragment in _cut_at_whole_pieces(text, vocab):
        if is_whole:
            output.append(ids[fragment])
            after_whole_piece = True
            continue
        if add_space_prefix and after_whole_piece:
            fragment = " " + fragment
        after_whole_piece = False
        output.extend(_merge(fragment.replace(" ", "\u2581"), vocab, ids))
    return output


def _cut_at_whole_pieces(text: str, vocab: SentencePieceVocab) -> list[tuple[bool, str]]:
    whole = sorted(
        {token for token, kind in zip(vocab.tokens, vocab.types, strict=True) if kind in _WHOLE_TYPES},
        key=len,
        reverse=True,
    )
    fragments = [(False, text)]
    for piece in whole:
        cut: list[tuple[bool, str]] = []
        for is_whole, fragment in fragments:
            if is_whole:
                cut.append((True, fragment))
                continue
            parts = fragment.split(piece)
            for index, part in enumerate(parts):
                if index:
                    cut.append((True, piece))
                if part:
                    cut.append((False, part))
        fragments = cut
    return fragments


def _merge(text: str, vocab: SentencePieceVocab, ids: dict[str, int]) -> list[int]:
    symbols = list(text)
    while True:
        best, best_score = None, 0.0
        for left in range(len(symbols) - 1):
            token_id = ids.get(symbols[left] + symbols[left + 1])
            if token_id is None or vocab.types[token_id] not in _MERGEABLE_TYPES:
                continue
            if best is None or vocab.scores[token_id] > best_score:
                best, best_score = left, vocab.scores[token_id]
        if best is None:
            break
        symbols[best : best + 2] = [symbols[best] + symbols[best + 1]]
    output: list[int] = []
    for symbol in symbols:
        if symbol in ids:
            output.append(ids[symbol])
        else:
            output.extend(ids[f"<0x{byte:02X}>"] for byte in symbol.encode("utf-8"))
    return output
