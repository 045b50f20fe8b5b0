"""SentencePiece (``tokenizer.ggml.model == "llama"``) GGUF vocabularies: Llama-2 style and Gemma style.

Two references, on the same small GGUF files: transformers 5.23's own GGUF tokenizer
(``AutoTokenizer.from_pretrained(directory, gguf_file=...)``), and a plain re-statement of the
SentencePiece algorithm as llama.cpp runs it (``_sentencepiece_reference``). Where the two differ,
for Llama-style text that starts with a space or follows a special token, we equal SentencePiece,
and a test pins down that transformers drops exactly the ``▁`` pieces SentencePiece adds there.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest
import transformers

from services.text.detokenizer import IncrementalDetokenizer
from services.text.gguf_sentencepiece import merges_by_score
from services.text.long_text import MIN_SPLIT_CHARS
from services.text.tokenizer import Tokenizer
from tests.gguf_files import finish
from tests.unit.text._sentencepiece_reference import reference_encode
from tests.unit.text._sentencepiece_vocab import (
    SentencePieceVocab,
    gemma_style_vocab,
    llama_style_vocab,
    write_sentencepiece_gguf,
)

REPLACEMENT = "\ufffd"

# Every one of these encodes the same in transformers, SentencePiece and pdserve, in both styles.
TEXTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "trailing spaces   ",
    "double  spaces  inside",
    "multiple    spaces   inside",
    "",
    "line one\nline two\n\n\nline five\r\n",
    "Numbers 12345 and 3.14 and 1,000,000",
    "def f(x):\n    return x ** 2\n\tif x: pass",
    "emoji 😀🎉👍🏽 and flags 🇫🇷",
    "中文测试，日本語のテキスト、한국어",
    "café naïve Ångström Straße",
    "<start_of_turn>user\nHi there<end_of_turn>\n<start_of_turn>model\n",
    "text<end_of_turn>more text",
    "almost special <start_of_turn and <end_of_turn",
]
# Llama style: SentencePiece puts a ▁ in front of these stretches of text, transformers does not.
SPACE_PREFIX_TEXTS = [
    "  two leading spaces",
    " one leading space",
    " ",
    "<s>[INST] Hi there [/INST]</s>",
    "a</s>b",
    "<unk> x",
]

GEMMA_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "<start_of_turn>{{ 'model' if message['role'] == 'assistant' else message['role'] }}\n"
    "{{ message['content'] | trim }}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
LLAMA2_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'user' %}"
    "{{ bos_token + '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% else %}{{ ' ' + message['content'] + ' ' + eos_token }}{% endif %}{% endfor %}"
)
CONVERSATION = [
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "The capital of France is Paris."},
    {"role": "user", "content": "And of 日本? 😀"},
]


class Style:
    """One vocabulary written to one GGUF file, with our tokenizer and transformers' for it."""

    def __init__(self, directory: Path, name: str, vocab: SentencePieceVocab, add_space_prefix: bool,
                 **gguf_keys: object) -> None:
        self.vocab = vocab
        self.add_space_prefix = add_space_prefix
        path = write_sentencepiece_gguf(directory / f"{name}.gguf", vocab=vocab, **gguf_keys)
        self.ours = Tokenizer.from_gguf(path)
        self.reference = transformers.AutoTokenizer.from_pretrained(directory, gguf_file=path.name)

    def sentencepiece(self, text: str) -> list[int]:
        return reference_encode(text, self.vocab, add_space_prefix=self.add_space_prefix)


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Style:
    """Llama-2's layout and keys: <unk>/<s>/</s>, a space prefix (the key left out, as in older files)."""
    return Style(tmp_path_factory.mktemp("llama"), "llama", llama_style_vocab(), add_space_prefix=True,
                 architecture="llama", special_ids={"bos": 1, "eos": 2, "unknown": 0},
                 chat_template=LLAMA2_TEMPLATE)


@pytest.fixture(scope="module")
def gemma(tmp_path_factory) -> Style:
    """Gemma-2's layout and keys: no space prefix, user-defined turn markers, <end_of_turn> as EOT."""
    vocab = gemma_style_vocab()
    return Style(tmp_path_factory.mktemp("gemma"), "gemma", vocab, add_space_prefix=False,
                 architecture="gemma2",
                 special_ids={"bos": 2, "eos": 1, "unknown": 3, "padding": 0, "eot": vocab.id_of("<end_of_turn>")},
                 flags={"add_space_prefix": False, "add_bos_token": True, "add_eos_token": False},
                 chat_template=GEMMA_TEMPLATE)


@pytest.fixture(scope="module", params=["llama", "gemma"])
def style(request) -> Style:
    return request.getfixturevalue(request.param)


def _pieces(vocab: SentencePieceVocab, ids: list[int]) -> str:
    return "".join(vocab.tokens[i] for i in ids)


# ------------------------------------------------------------------------------------------------
# Encoding


@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_transformers(style, text):
    expected = style.reference.encode(text, add_special_tokens=False)
    assert style.ours.encode(text, add_special_tokens=False) == expected


@pytest.mark.parametrize("text", TEXTS + SPACE_PREFIX_TEXTS)
def test_encode_matches_sentencepiece(style, text):
    assert style.ours.encode(text, add_special_tokens=False) == style.sentencepiece(text)


@pytest.mark.parametrize("text", SPACE_PREFIX_TEXTS)
def test_transformers_leaves_out_the_space_prefix(llama, text):
    """SentencePiece (Llama-2's tokenizer.model, and llama.cpp) writes " one" as ▁▁one and puts a ▁
    after <s>; transformers' GGUF tokenizer does neither. Each of these texts has one such place."""
    ours = _pieces(llama.vocab, llama.ours.encode(text, add_special_tokens=False))
    theirs = _pieces(llama.vocab, llama.reference.encode(text, add_special_tokens=False))
    assert ours.count("\u2581") == theirs.count("\u2581") + 1
    assert ours.replace("\u2581", "") == theirs.replace("\u2581", "")


def test_gemma_whole_tokens_and_no_space_prefix(gemma):
    vocab = gemma.vocab
    ids = gemma.ours.encode("<start_of_turn>user\nHi<end_of_turn>", add_special_tokens=False)
    assert ids[0] == vocab.id_of("<start_of_turn>") and ids[-1] == vocab.id_of("<end_of_turn>")
    # Runs of spaces are Gemma's own user-defined tokens, stored with literal spaces.
    assert gemma.ours.encode("a    b", add_special_tokens=False) == [
        vocab.id_of("a"), vocab.id_of("    "), vocab.id_of("b")]
    assert vocab.tokens[gemma.ours.encode("The", add_special_tokens=False)[0]] == "T"  # no ▁ in front


def test_byte_fallback(style):
    ids = style.ours.encode("😀", add_special_tokens=False)
    byte_ids = [style.vocab.id_of(f"<0x{b:02X}>") for b in "😀".encode()]
    assert ids[-4:] == byte_ids
    assert style.ours.decode(byte_ids[:2]) == REPLACEMENT * 2  # half a character


def test_merges_rank_by_score_not_by_position(llama):
    """The Llama-style file stores its pieces shuffled: only ranking by score gives transformers' ids."""
    vocab = llama.vocab
    merges = merges_by_score(vocab.tokens, vocab.scores, vocab.types)
    scores = [vocab.scores[vocab.id_of(left + right)] for left, right in merges]
    assert scores == sorted(scores, reverse=True)
    positions = [vocab.id_of(left + right) for left, right in merges]
    assert positions != sorted(positions)


def test_merges_from_the_file_win_over_scores(tmp_path, llama):
    """A file converted from a tokenizer.json carries its merges; their order ranks, as in transformers."""
    vocab = llama_style_vocab(shuffle_pieces=False)
    by_score = [f"{left} {right}" for left, right in merges_by_score(vocab.tokens, vocab.scores, vocab.types)]
    reordered = by_score[len(by_score) // 2:] + by_score[: len(by_score) // 2]
    style = Style(tmp_path, "merges", vocab, add_space_prefix=True, architecture="llama",
                  special_ids={"bos": 1, "eos": 2, "unknown": 0}, merges=reordered)
    changed = 0
    for text in TEXTS:
        ours = style.ours.encode(text, add_special_tokens=False)
        assert ours == style.reference.encode(text, add_special_tokens=False)
        changed += ours != reference_encode(text, vocab, add_space_prefix=True)
    assert changed > 0


# ------------------------------------------------------------------------------------------------
# Decoding


@pytest.mark.parametrize("text", [t for t in TEXTS + SPACE_PREFIX_TEXTS if "<" not in t])
def test_decode_round_trips(style, text):
    """Leading spaces too: decoding drops only the one ▁ the space prefix added."""
    assert style.ours.decode(style.ours.encode(text)) == text


@pytest.mark.parametrize("text", TEXTS + SPACE_PREFIX_TEXTS)
def test_decode_matches_transformers(style, text):
    ids = style.ours.encode(text)
    expected = style.reference.decode(ids, skip_special_tokens=False)
    assert style.ours.decode(ids, skip_special_tokens=False) == expected
    if "<end_of_turn>" not in text:  # ours is special as Gemma's EOT, see below
        assert style.ours.decode(ids) == style.reference.decode(ids, skip_special_tokens=True)


def test_end_of_turn_adds_no_text(gemma):
    """<end_of_turn> is typed user-defined here but is the EOT token: a reply ends at it, so decoding
    drops it (llama.cpp makes it a control token); <start_of_turn> stays text."""
    vocab = gemma.vocab
    assert gemma.ours.eos_token_ids == {vocab.id_of("<eos>"), vocab.id_of("<end_of_turn>")}
    ids = gemma.ours.encode("<start_of_turn>Hi<end_of_turn>", add_special_tokens=False)
    assert gemma.ours.decode(ids) == "<start_of_turn>Hi"
    assert gemma.ours.decode(ids, skip_special_tokens=False) == "<start_of_turn>Hi<end_of_turn>"


@pytest.mark.parametrize("with_prompt", [True, False])
def test_streamed_text_is_the_decoded_text(style, with_prompt):
    """Byte-fallback characters are held until complete; the ▁ of the first output token shows as a
    space after a prompt (the text continues it) and is dropped with no prompt (the text starts)."""
    reply = "Hi 😀 and 日本語!"
    prompt = style.ours.encode("User: Say hi.") if with_prompt else []
    ids = [*style.ours.encode(reply, add_special_tokens=False), min(style.ours.eos_token_ids)]
    detokenizer = IncrementalDetokenizer(style.ours, prompt)
    deltas = [detokenizer.step([i]) for i in ids] + [detokenizer.flush()]
    leading = " " if style.add_space_prefix and with_prompt else ""
    assert "".join(deltas) == leading + reply == detokenizer.text
    assert all(REPLACEMENT not in delta for delta in deltas)
    assert len([d for d in deltas if d]) < len(ids)


# ------------------------------------------------------------------------------------------------
# Special tokens, flags and defaults


def test_special_token_facts(llama, gemma):
    assert llama.ours.vocab_size == len(llama.vocab.tokens)
    assert llama.ours.bos_token_id == 1 and llama.ours.eos_token_ids == {2}
    # No add_bos_token key: a SentencePiece vocabulary gets BOS, as in llama.cpp and transformers.
    assert llama.ours.add_bos_token
    assert llama.ours.encode("Hello") == llama.reference.encode("Hello")
    assert gemma.ours.encode("Hello") == gemma.reference.encode("Hello")
    assert gemma.ours.encode("Hello")[0] == gemma.vocab.id_of("<bos>")


def test_add_eos_token(tmp_path):
    vocab = llama_style_vocab()
    path = write_sentencepiece_gguf(tmp_path / "eos.gguf", "llama", vocab, special_ids={"bos": 1, "eos": 2},
                                    flags={"add_bos_token": False, "add_eos_token": True})
    tokenizer = Tokenizer.from_gguf(path)
    assert tokenizer.encode("Hello") == [*reference_encode("Hello", vocab, add_space_prefix=True), 2]
    assert tokenizer.encode("Hello", add_special_tokens=False)[-1] != 2


@pytest.mark.parametrize(
    ("architecture", "flags", "prefixed"),
    [
        ("llama", {}, True),
        ("gemma3", {}, False),  # older Gemma files lack the key; Gemma has no dummy prefix
        ("gemma3", {"add_space_prefix": True}, True),
        ("llama", {"add_space_prefix": False}, False),
    ],
)
def test_space_prefix_from_metadata_else_architecture(tmp_path, architecture, flags, prefixed):
    vocab = llama_style_vocab()
    path = write_sentencepiece_gguf(tmp_path / "prefix.gguf", architecture, vocab, special_ids={"bos": 1},
                                    flags=flags)
    tokenizer = Tokenizer.from_gguf(path)
    first = vocab.tokens[tokenizer.encode("quick brown", add_special_tokens=False)[0]]
    assert first.startswith("\u2581") == prefixed
    assert tokenizer.decode(tokenizer.encode(" quick  brown")) == " quick  brown"


# ------------------------------------------------------------------------------------------------
# Chat templates


def test_gemma_chat_template_matches_transformers(gemma):
    prompt = gemma.ours.apply_chat_template(CONVERSATION)
    assert prompt == gemma.reference.apply_chat_template(CONVERSATION, tokenize=False, add_generation_prompt=True)
    assert prompt.startswith("<bos><start_of_turn>user\n") and prompt.endswith("<start_of_turn>model\n")
    assert gemma.ours.encode(prompt, add_special_tokens=False) == gemma.reference.encode(
        prompt, add_special_tokens=False)


def test_llama2_chat_template_matches_transformers(llama):
    prompt = llama.ours.apply_chat_template(CONVERSATION, add_generation_prompt=False)
    assert prompt == llama.reference.apply_chat_template(CONVERSATION, tokenize=False)
    assert prompt.startswith("<s>[INST] What")
    assert llama.ours.encode(prompt, add_special_tokens=False) == llama.sentencepiece(prompt)


# ------------------------------------------------------------------------------------------------
# Errors


@pytest.mark.parametrize("model", ["bert", "t5", "rwkv", "gemma4"])
def test_other_vocabularies_are_refused_by_name(tmp_path, model):
    writer = gguf.GGUFWriter(tmp_path / "other.gguf", "llama")
    writer.add_tokenizer_model(model)
    writer.add_token_list(["a", "b"])
    finish(writer)
    with pytest.raises(ValueError, match=f"tokenizer model '{model}' is not supported"):
        Tokenizer.from_gguf(tmp_path / "other.gguf")


def test_scores_are_required_without_merges(tmp_path):
    writer = gguf.GGUFWriter(tmp_path / "noscores.gguf", "llama")
    writer.add_tokenizer_model("llama")
    writer.add_token_list(["<unk>", "a", "b", "ab"])
    finish(writer)
    with pytest.raises(ValueError, match="tokenizer.ggml.scores"):
        Tokenizer.from_gguf(tmp_path / "noscores.gguf")


def test_mismatched_scores_are_refused(tmp_path):
    vocab = llama_style_vocab()
    vocab.scores.pop()
    with pytest.raises(ValueError, match="token scores for"):
        Tokenizer.from_gguf(write_sentencepiece_gguf(tmp_path / "short.gguf", "llama", vocab, special_ids={}))


def test_long_texts_get_the_whole_texts_ids(style):
    """A prompt long enough for the pieces path (long_text.py) encodes as it does whole, whether or not the
    vocabulary passes the pieces check (a space prefix sees the cut)."""
    text = " ".join(t for t in TEXTS if "<" not in t)
    text = " ".join([text] * (2 * MIN_SPLIT_CHARS // len(text) + 1))
    assert style.ours.encode(text, add_special_tokens=False) == \
        style.ours._backend.encode(text, add_special_tokens=False).ids
