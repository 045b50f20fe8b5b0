"""Long texts encoded in pieces, on every core: ``tokenizers`` spreads a batch over its thread pool, one text not.

A router tokenizes every prompt before it can route it; a 200 KB prompt (~100K tokens) took 160 ms on one core,
all of it time to first token. Byte-level BPE tokenizers (Llama-3, Qwen, SmolLM2, gpt-oss, DeepSeek) split a text
into pre-tokens by a regex before any merge, a word after a space starts a new pre-token (`` ?\\p{L}+``), and merges
never cross pre-tokens: cutting a text just before a space that sits between two letters gives pieces whose ids,
joined, are the whole text's ids. That a tokenizer splits there is not assumed from its class but checked once per
tokenizer (:func:`splits_at_word_spaces`), on a sample text cut at every such space; one that fails (a normalizer
or prefix space that sees the cut, a regex that joins words, an added token holding a space) is encoded whole.

The batch call also releases the GIL (a single ``encode`` holds it), so the event loop's other requests go on
while a long prompt is encoded on a worker thread.
"""

from __future__ import annotations

import itertools
import re

from tokenizers import Tokenizer as BackendTokenizer

PIECE_CHARS = 4096  # a piece's length to aim for; the cut goes to the next word space after it
MIN_SPLIT_CHARS = 4 * PIECE_CHARS  # shorter texts are encoded whole: splitting would not pay
_WORD_SPACE = re.compile(r"[^\W\d_] [^\W\d_]")  # a space between two letters: the cut goes before the space

_SAMPLE = (
    "The quick brown fox jumps over the lazy dog's back, doesn't it? Numbers 12345 and 3.14159 sit beside "
    "words; URLs like https://example.com/a?b=c and emails a.b@c.de too.  Two  spaces,\ttabs\tand\nnew lines\n\n"
    "follow. Ünïcödé wörds, café naïve façade; Ελληνικά γράμματα εδώ; кириллица тоже есть; עברית כאן; العربية هنا; "
    "हिन्दी भी; 日本語の文 and 中文句子 mixed with English words; emoji 🙂 ok. CamelCaseWords and snake_case_names, "
    "x=y+z*2, (parenthesised words) [bracketed words] {braced words} \"quoted words\" 'single quoted' — dashes – too. "
    "I'm, you're, we've, they'll, he'd: contractions Everywhere AND CAPITALS Here. a b c d e f g h i j k l m n o p."
)


def word_space_cuts(text: str, piece_chars: int = PIECE_CHARS) -> list[int]:
    """Offsets (each just before a space between two letters) that cut ``text`` into pieces of about
    ``piece_chars``; the pieces are ``text[0:c0], text[c0:c1], ..., text[cN:]``."""
    cuts: list[int] = []
    pos = piece_chars
    while pos < len(text):
        match = _WORD_SPACE.search(text, pos - 1)
        if match is None:
            break
        cut = match.start() + 1
        cuts.append(cut)
        pos = cut + piece_chars
    return cuts


def encode_pieces(backend: BackendTokenizer, text: str, cuts: list[int]) -> list[int]:
    """The ids of ``text`` encoded as the pieces ``cuts`` make, in one batch call, joined."""
    bounds = [0, *cuts, len(text)]
    pieces = [text[a:b] for a, b in itertools.pairwise(bounds)]
    ids: list[int] = []
    for encoding in backend.encode_batch_fast(pieces, add_special_tokens=False):
        ids.extend(encoding.ids)
    return ids


def encode_whole(backend: BackendTokenizer, text: str) -> list[int]:
    """The ids of ``text`` in one piece (the batch call: no offsets computed, the GIL released)."""
    return backend.encode_batch_fast([text], add_special_tokens=False)[0].ids


def splits_at_word_spaces(backend: BackendTokenizer) -> bool:
    """Whether cutting before a space between two letters never changes ``backend``'s ids: checked on a sample
    of many scripts, cut at every such space, against the whole sample's ids."""
    if any(" " in token.content for token in backend.get_added_tokens_decoder().values()):
        return False
    cuts = word_space_cuts(_SAMPLE, piece_chars=1)
    return bool(cuts) and encode_pieces(backend, _SAMPLE, cuts) == encode_whole(backend, _SAMPLE)


def encode_long(backend: BackendTokenizer, text: str, splittable: bool) -> list[int]:
    """The ids of ``text``: in pieces on the thread pool when it is long and ``splittable``
    (:func:`splits_at_word_spaces`), whole otherwise."""
    if splittable and len(text) >= MIN_SPLIT_CHARS:
        cuts = word_space_cuts(text)
        if cuts:
            return encode_pieces(backend, text, cuts)
    return encode_whole(backend, text)
