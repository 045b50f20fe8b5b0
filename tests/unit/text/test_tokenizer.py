"""Tokenizer: GGUF and HF-directory loading, against transformers 4.57.6 as the reference."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import gguf
import pytest
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import pre_tokenizers

from services.text.tokenizer import GGUFMetadata, Tokenizer
from tests.gguf_files import finish
from tests.unit._smollm2 import smollm2_checkpoint, smollm2_tokenizer, transformers_tokenizer

TEXTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "  two leading spaces",
    "trailing spaces   ",
    "multiple    spaces   inside",
    " ",
    "",
    "line one\nline two\n\n\nline five\r\n",
    "\n\n1",
    "a  1",
    "12345 and 3.14 and 1,000,000 and -7e10",
    "Punctuation!?... (brackets) [x] {y} 'quotes' \"double\" it's don't we'll",
    "def f(x):\n    return x ** 2  # square\n\tif x: pass",
    "emoji 😀🎉👍🏽 and flags 🇫🇷",
    "中文测试，日本語のテキスト、한국어",
    "café naïve Ångström Straße",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "text<|im_end|>more text<|endoftext|>",
    "almost special <|im_start and <im_end|>",
]

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Tell me a joke about 日本."},
    ],
]


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return smollm2_tokenizer()


@pytest.fixture(scope="module")
def reference():
    return transformers_tokenizer()


@pytest.fixture(scope="module")
def saved_dir(tmp_path_factory, reference) -> Path:
    """What transformers writes for its GGUF tokenizer: tokenizer.json, config, chat_template.jinja."""
    directory = tmp_path_factory.mktemp("smollm2_hf")
    reference.save_pretrained(directory)
    return directory


def _hf_dir(tmp_path: Path, saved_dir: Path, config: dict, extra_files: dict[str, str] | None = None) -> Path:
    """A tokenizer directory holding the saved tokenizer.json and the given config files."""
    shutil.copy(saved_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    for name, text in (extra_files or {}).items():
        (tmp_path / name).write_text(text)
    return tmp_path


def smollm2_tokenizer_merges() -> list[str]:
    return GGUFMetadata(smollm2_checkpoint().reader).require("tokenizer.ggml.merges")


def _write_gguf(path: Path, **strings: str) -> Path:
    """A metadata-only GGUF file with a three-token vocabulary and the given tokenizer.ggml strings."""
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_token_list(["a", "b", "ab"])
    writer.add_token_merges(["a b"])
    for key, value in strings.items():
        writer.add_string(f"tokenizer.ggml.{key}", value)
    finish(writer)
    return path


# ------------------------------------------------------------------------------------------------
# GGUF tokenizer against transformers


@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_transformers(tokenizer, reference, text):
    expected = reference.encode(text, add_special_tokens=False)
    assert tokenizer.encode(text, add_special_tokens=False) == expected


def test_special_token_facts(tokenizer):
    assert tokenizer.vocab_size == 49152
    assert tokenizer.bos_token_id == 1
    assert tokenizer.eos_token_ids == frozenset({2})
    assert tokenizer.id_to_token(2) == "<|im_end|>"
    assert tokenizer.token_to_id("<|im_start|>") == 1
    assert tokenizer.id_to_token(10**9) is None
    # The GGUF says add_bos_token=False, so no BOS is added (transformers 4.57 adds one anyway).
    assert tokenizer.add_bos_token is False
    assert tokenizer.encode("Hello") == tokenizer.encode("Hello", add_special_tokens=False)


@pytest.mark.parametrize("text", TEXTS)
def test_decode_round_trips(tokenizer, text):
    assert tokenizer.decode(tokenizer.encode(text), skip_special_tokens=False) == text


def test_decode_skips_special_tokens(tokenizer):
    ids = tokenizer.encode("<|im_start|>assistant\nSure.<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2
    assert tokenizer.decode(ids) == "assistant\nSure."
    assert tokenizer.decode(ids, skip_special_tokens=False) == "<|im_start|>assistant\nSure.<|im_end|>"


def test_decode_does_not_clean_up_spaces(tokenizer, reference):
    # transformers 4.x's GGUF tokenizer cleaned up spaces (" ," -> ","); 5.x does not, nor do we:
    # decode inverts encode.
    ids = tokenizer.encode("a , b .")
    assert tokenizer.decode(ids) == "a , b ."
    assert reference.decode(ids) == "a , b ."


def test_decode_rejects_negative_ids(tokenizer):
    with pytest.raises(ValueError, match="non-negative"):
        tokenizer.decode([5, -1])


def test_transformers_differs_from_original_smollm2_split(tokenizer, reference, saved_dir):
    """Documents the one divergence from the original SmolLM2 tokenizer, which splits digits first."""
    original = BackendTokenizer.from_file(str(saved_dir / "tokenizer.json"))
    original.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    ours = tokenizer.encode("a  1", add_special_tokens=False)
    assert ours == reference.encode("a  1", add_special_tokens=False)
    assert [tokenizer.id_to_token(i) for i in ours] == ["a", "Ġ", "Ġ", "1"]
    assert original.encode("a  1", add_special_tokens=False).tokens == ["a", "ĠĠ", "1"]
    # Elsewhere digits come out one per token either way: the vocabulary has no digit merges.
    assert original.encode("x 12345", add_special_tokens=False).ids == tokenizer.encode("x 12345")


# ------------------------------------------------------------------------------------------------
# Chat template


@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_chat_template_matches_transformers(tokenizer, reference, messages):
    expected = reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert tokenizer.apply_chat_template(messages) == expected


def test_chat_template_without_generation_prompt(tokenizer, reference):
    messages = CONVERSATIONS[1]
    expected = reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=False)
    assert rendered == expected
    assert not rendered.endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize(
    "messages",
    [
        "hello",
        [],
        ["hello"],
        [{"content": "no role"}],
        [{"role": "user"}],
        [{"role": "user", "content": None}],
        [{"role": "user", "content": ["a", "list"]}],
        [{"role": 3, "content": "x"}],
        ({"role": "user", "content": "a tuple"},),
    ],
)
def test_bad_messages_raise(tokenizer, messages):
    with pytest.raises(ValueError, match="messages"):
        tokenizer.apply_chat_template(messages)


# ------------------------------------------------------------------------------------------------
# Hugging Face directories


def test_from_hf_dir_matches_transformers(saved_dir, reference):
    loaded = Tokenizer.from_hf_dir(saved_dir)
    for text in TEXTS:
        expected = reference.encode(text, add_special_tokens=False)
        assert loaded.encode(text, add_special_tokens=False) == expected
        # The saved config says add_bos_token=True, bos_token='<|im_start|>': both add it.
        assert loaded.encode(text) == reference.encode(text)
    assert loaded.chat_template == reference.chat_template
    for messages in CONVERSATIONS:
        expected = reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert loaded.apply_chat_template(messages) == expected


def test_from_hf_dir_reads_config_variants(tmp_path, saved_dir):
    template = "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{{ eos_token }}{% endfor %}"
    config = {
        "bos_token": {"content": "<|endoftext|>", "lstrip": False},
        "eos_token": "<|im_end|>",
        "add_bos_token": False,
    }
    directory = _hf_dir(
        tmp_path,
        saved_dir,
        config,
        {
            "chat_template.json": json.dumps({"chat_template": template}),
            "generation_config.json": json.dumps({"eos_token_id": [2, 0]}),
            "config.json": json.dumps({"eos_token_id": 2}),
        },
    )
    loaded = Tokenizer.from_hf_dir(directory)
    assert loaded.bos_token_id == 0
    assert loaded.eos_token_ids == frozenset({0, 2})
    assert loaded.add_bos_token is False
    assert loaded.apply_chat_template([{"role": "user", "content": "hi"}]) == "[user]hi<|im_end|>"


def test_from_hf_dir_template_in_tokenizer_config(tmp_path, saved_dir):
    config = {"chat_template": [{"name": "default", "template": "{{ messages[0]['content'] }}"}]}
    loaded = Tokenizer.from_hf_dir(_hf_dir(tmp_path, saved_dir, config))
    assert loaded.apply_chat_template([{"role": "user", "content": "x"}]) == "x"
    assert loaded.bos_token_id is None and loaded.eos_token_ids == frozenset()


def test_from_hf_dir_infers_add_bos_from_post_processor(tmp_path, saved_dir):
    # A tokenizer.json whose post-processor prepends <|im_start|> (as transformers 4.x wrote it).
    directory = _hf_dir(tmp_path, saved_dir, {"bos_token": "<|im_start|>"})
    data = json.loads((directory / "tokenizer.json").read_text())
    data["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": "<|im_start|>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {"<|im_start|>": {"id": "<|im_start|>", "ids": [1], "tokens": ["<|im_start|>"]}},
    }
    (directory / "tokenizer.json").write_text(json.dumps(data))
    loaded = Tokenizer.from_hf_dir(directory)
    assert loaded.add_bos_token is True
    assert loaded.encode("hi")[0] == 1


def test_missing_chat_template_raises(tmp_path, saved_dir):
    loaded = Tokenizer.from_hf_dir(_hf_dir(tmp_path, saved_dir, {}))
    assert loaded.chat_template is None
    with pytest.raises(ValueError, match="no chat template"):
        loaded.apply_chat_template([{"role": "user", "content": "hi"}])


def test_template_globals_and_filters(tmp_path, saved_dir):
    template = (
        "{{ strftime_now('%Y')|length }}|{{ messages[0] | tojson }}"
        "{% if messages|length > 1 %}{{ raise_exception('one message only') }}{% endif %}"
    )
    loaded = Tokenizer.from_hf_dir(_hf_dir(tmp_path, saved_dir, {}, {"chat_template.jinja": template}))
    assert loaded.apply_chat_template([{"role": "user", "content": "<é>"}]) == (
        '4|{"role": "user", "content": "<é>"}'
    )
    with pytest.raises(ValueError, match="one message only"):
        loaded.apply_chat_template([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])


def test_template_sandbox_blocks_unsafe_access(tmp_path, saved_dir):
    template = "{{ messages.__class__.__mro__ }}"
    loaded = Tokenizer.from_hf_dir(_hf_dir(tmp_path, saved_dir, {}, {"chat_template.jinja": template}))
    with pytest.raises(ValueError, match="failed to render"):
        loaded.apply_chat_template([{"role": "user", "content": "a"}])


def test_from_hf_dir_errors(tmp_path, saved_dir):
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.from_hf_dir(tmp_path / "nowhere")
    with pytest.raises(ValueError, match="not in the vocabulary"):
        Tokenizer.from_hf_dir(_hf_dir(tmp_path, saved_dir, {"eos_token": "<|no_such_token|>"}))


# ------------------------------------------------------------------------------------------------
# GGUF errors


def test_qwen2_pre_tokenizer_matches_transformers(tmp_path, tokenizer):
    """A qwen2-architecture GGUF (SmolLM2's first 3000 tokens) splits text the way transformers does."""
    import transformers
    tokens = [tokenizer.id_to_token(i) for i in range(3000)]
    vocab = set(tokens)
    merges = [
        merge
        for merge in smollm2_tokenizer_merges()
        if (pair := merge.split(" ")) and pair[0] in vocab and pair[1] in vocab and "".join(pair) in vocab
    ]
    writer = gguf.GGUFWriter(tmp_path / "qwen2.gguf", "qwen2")
    writer.add_token_list(tokens)
    writer.add_token_merges(merges)
    writer.add_token_types([3] * 17 + [1] * (len(tokens) - 17))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_eos_token_id(2)
    finish(writer)

    ours = Tokenizer.from_gguf(tmp_path / "qwen2.gguf")
    reference = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file="qwen2.gguf")
    for text in [*TEXTS, "I'M HERE'S", "x  \n\n  y", "1234567"]:
        assert ours.encode(text, add_special_tokens=False) == reference.encode(text, add_special_tokens=False)
    # Qwen2's own tokenizer.json normalizes to NFC, and so do we; transformers 5.23's GGUF converter
    # dropped that normalizer, so a decomposed accent is where the two part (4.57 agreed with us).
    decomposed = "cafe\u0301 (decomposed)"
    assert ours.encode(decomposed, add_special_tokens=False) == ours.encode("caf\u00e9 (decomposed)",
                                                                            add_special_tokens=False)


def test_from_gguf_minimal_vocabulary(tmp_path):
    loaded = Tokenizer.from_gguf(_write_gguf(tmp_path / "tiny.gguf", model="gpt2", pre="gpt2"))
    assert loaded.encode("abba") == [2, 1, 0]
    assert loaded.bos_token_id is None and loaded.chat_template is None


def test_from_gguf_rejects_other_tokenizer_models(tmp_path):
    path = _write_gguf(tmp_path / "wordpiece.gguf", model="bert")
    with pytest.raises(ValueError, match="tokenizer model 'bert' is not supported"):
        Tokenizer.from_gguf(path)


def test_from_gguf_rejects_unknown_pre_tokenizer(tmp_path):
    path = _write_gguf(tmp_path / "pre.gguf", model="gpt2", pre="no-such-pre")
    with pytest.raises(ValueError, match="pre-tokenizer 'no-such-pre'"):
        Tokenizer.from_gguf(path)


def test_from_gguf_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing.gguf"):
        Tokenizer.from_gguf(tmp_path / "missing.gguf")
