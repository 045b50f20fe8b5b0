"""Small SentencePiece vocabularies laid out as Llama-2 and Gemma GGUF files lay theirs out, and the writer.

The pieces are learned from a short corpus with the ``tokenizers`` BPE trainer, spaces written as
``▁`` the SentencePiece way; each merged piece scores by its merge order (the first merge best), as a
SentencePiece BPE model scores its pieces. Around them go the control pieces, the 256 byte pieces
``<0x00>``..``<0xFF>`` and, for Gemma, user-defined pieces: the turn markers and runs of literal spaces.
"""

from __future__ import annotations

import functools
import json
import random
from dataclasses import dataclass, field
from pathlib import Path

import gguf
from gguf import TokenType
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import models, pre_tokenizers, trainers

from tests.gguf_files import finish

CORPUS = """\
The quick brown fox jumps over the lazy dog. Hello world! Hello there, how are you today?
Tokenizers split text into pieces, and the pieces into ids; the model only ever reads the ids.
A piece that is not in the vocabulary falls back to its bytes, one byte token for each byte.
def hello(name):
    return "Hello, " + name + "!"
for index in range(10):
    print(index, index * 2, "done")
Numbers such as 12345, 3.14159 and 1,000,000 appear in text, and so do dates like 2024-01-15.
User: What is the capital of France? Assistant: The capital of France is Paris.
She said that there were three things to remember: the start, the middle and the end of the story.
Spaces, tabs\tand newlines are text as well; they have to come back exactly as they went in.
café, naïve, résumé, über, Straße and Ångström are words with accents.
In the beginning there was the word, and the word was split into pieces by a tokenizer.
"""

_LEARNED_PIECES = 600


@dataclass
class SentencePieceVocab:
    """A GGUF SentencePiece vocabulary: parallel lists of pieces, scores and GGUF token types."""

    tokens: list[str] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)
    types: list[int] = field(default_factory=list)

    def add(self, token: str, score: float, kind: TokenType) -> int:
        self.tokens.append(token)
        self.scores.append(score)
        self.types.append(int(kind))
        return len(self.tokens) - 1

    def id_of(self, token: str) -> int:
        return self.tokens.index(token)


@functools.cache
def learned_pieces() -> tuple[tuple[str, float], ...]:
    """(piece, score): the merged pieces best first, then the single characters, scored lowest."""
    backend = BackendTokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=_LEARNED_PIECES, show_progress=False)
    backend.train_from_iterator(CORPUS.splitlines(keepends=True) * 4, trainer)
    model = json.loads(backend.to_str())["model"]
    merged = ["".join(merge) for merge in model["merges"]]
    characters = sorted(token for token in model["vocab"] if len(token) == 1)
    pieces = [*merged, *characters]
    return tuple((piece, -float(rank + 1)) for rank, piece in enumerate(pieces))


def _add_bytes(vocab: SentencePieceVocab) -> None:
    for byte in range(256):
        vocab.add(f"<0x{byte:02X}>", 0.0, TokenType.BYTE)


def llama_style_vocab(*, shuffle_pieces: bool = True) -> SentencePieceVocab:
    """Llama-2's layout: ``<unk> <s> </s>``, the byte pieces, then the learned pieces.

    ``shuffle_pieces`` stores the learned pieces out of score order (each keeps its score), so that a
    tokenizer ranking merges by position rather than by score gives other ids.
    """
    vocab = SentencePieceVocab()
    vocab.add("<unk>", 0.0, TokenType.UNKNOWN)
    vocab.add("<s>", 0.0, TokenType.CONTROL)
    vocab.add("</s>", 0.0, TokenType.CONTROL)
    _add_bytes(vocab)
    pieces = list(learned_pieces())
    if shuffle_pieces:
        random.Random(7).shuffle(pieces)
    for piece, score in pieces:
        vocab.add(piece, score, TokenType.NORMAL)
    return vocab


def gemma_style_vocab() -> SentencePieceVocab:
    """Gemma's layout: ``<pad> <eos> <bos> <unk> <mask>``, user-defined turn markers and space runs
    (stored with literal spaces and score -1000, as llama.cpp's converter writes them), the byte
    pieces, then the learned pieces in score order."""
    vocab = SentencePieceVocab()
    for token in ("<pad>", "<eos>", "<bos>"):
        vocab.add(token, 0.0, TokenType.CONTROL)
    vocab.add("<unk>", 0.0, TokenType.UNKNOWN)
    vocab.add("<mask>", 0.0, TokenType.CONTROL)
    for token in ("<start_of_turn>", "<end_of_turn>", "  ", "   ", "    "):
        vocab.add(token, -1000.0, TokenType.USER_DEFINED)
    _add_bytes(vocab)
    for piece, score in learned_pieces():
        vocab.add(piece, score, TokenType.NORMAL)
    return vocab


def write_sentencepiece_gguf(
    path: Path,
    architecture: str,
    vocab: SentencePieceVocab,
    *,
    special_ids: dict[str, int],
    flags: dict[str, bool] | None = None,
    merges: list[str] | None = None,
    chat_template: str | None = None,
) -> Path:
    """A metadata-only GGUF file with ``tokenizer.ggml.model = "llama"`` and this vocabulary.

    ``special_ids``: e.g. ``{"bos": 1, "eos": 2}`` for ``tokenizer.ggml.bos_token_id``...;
    ``flags``: e.g. ``{"add_space_prefix": False}`` for ``tokenizer.ggml.add_space_prefix``.
    """
    writer = gguf.GGUFWriter(path, architecture)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(vocab.tokens)
    writer.add_token_scores(vocab.scores)
    writer.add_token_types(vocab.types)
    for kind, token_id in special_ids.items():
        writer.add_uint32(f"tokenizer.ggml.{kind}_token_id", token_id)
    for key, value in (flags or {}).items():
        writer.add_bool(f"tokenizer.ggml.{key}", value)
    if merges is not None:
        writer.add_token_merges(merges)
    if chat_template is not None:
        writer.add_chat_template(chat_template)
    finish(writer)
    return path
