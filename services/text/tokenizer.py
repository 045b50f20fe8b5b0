"""Text <-> token ids and chat-prompt rendering, on the fast Rust ``tokenizers`` library.

One ``Tokenizer`` serves both places a model can come from: a Hugging Face directory
(``tokenizer.json`` and friends) or a GGUF file, whose metadata holds the vocabulary, the merges (or
SentencePiece scores, see ``gguf_sentencepiece``) and the chat template. Special tokens (BOS, and EOS
for the rare GGUF asking for it) are added here, from ``add_bos_token``/``add_eos_token``, and never
by the backend's post-processor, so both sources behave the same way.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import gguf
import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as BackendTokenizer

# GGUFMetadata and open_gguf_reader are also imported from here (the weight loader, tests).
from services.text.gguf_metadata import GGUFMetadata, open_gguf_reader, split_merges
from services.text.gguf_sentencepiece import sentencepiece_backend
from services.text.long_text import MIN_SPLIT_CHARS, encode_long, encode_whole, splits_at_word_spaces

# GGUF token types (llama.cpp's llama_token_type).
_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4

# Qwen2's split pattern (also used by Qwen3): letters with one leading non-letter, single digits,
# punctuation runs with trailing newlines, newline runs, and whitespace.
_QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# tokenizer.ggml.pre values whose GGUF tokenizer transformers builds as plain GPT-2 byte-level BPE.
#
# "smollm": the original SmolLM2 tokenizer.json (and llama.cpp's "smollm" pre-tokenizer) first split
# every digit into its own piece, then applied the GPT-2 byte-level split. transformers 4.57.6, our
# declared reference, skips the digit split for a llama-architecture GGUF. The vocabulary has no merge
# involving an ASCII digit, so digits come out one per token either way; the two differ only in how a
# whitespace run before a digit is grouped: for "a  1" transformers gives ['a', 'Ġ', 'Ġ', '1'] and the
# original ['a', 'ĠĠ', '1'] (likewise "\n\n1"). We match transformers.
_GPT2_STYLE_PRE = frozenset({"default", "gpt2", "smollm"})
_QWEN2_STYLE_PRE = frozenset({"qwen2"})


class Tokenizer:
    """A fast tokenizer plus what serving needs around it: BOS/EOS ids and the chat template."""

    def __init__(
        self,
        backend: BackendTokenizer,
        *,
        bos_token_id: int | None,
        eos_token_id: int | None,
        extra_eos_token_ids: Iterable[int] = (),
        add_bos_token: bool,
        add_eos_token: bool = False,
        chat_template: str | None,
    ) -> None:
        """``eos_token_id`` is the template's ``eos_token``; generation stops at it and at the extras."""
        self._backend = backend
        self._vocab_size = backend.get_vocab_size(with_added_tokens=True)
        eos_token_ids = frozenset(extra_eos_token_ids) | ({eos_token_id} - {None})
        for token_id in [bos_token_id, *eos_token_ids]:
            if token_id is not None and not 0 <= token_id < self._vocab_size:
                raise ValueError(f"special token id {token_id} is not in [0, {self._vocab_size})")
        if add_bos_token and bos_token_id is None:
            raise ValueError("add_bos_token is set but the tokenizer has no BOS token")
        if add_eos_token and eos_token_id is None:
            raise ValueError("add_eos_token is set but the tokenizer has no EOS token")
        self._bos_token_id = bos_token_id
        self._eos_token_id = eos_token_id
        self._eos_token_ids = eos_token_ids
        self._add_bos_token = add_bos_token
        self._add_eos_token = add_eos_token
        self._chat_template = chat_template
        self._compiled_template: jinja2.Template | None = None
        self._splittable: bool | None = None

    # ----------------------------------------------------------------------------------------------
    # Construction

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> Tokenizer:
        """Load a Hugging Face tokenizer directory (``tokenizer.json`` is required)."""
        directory = Path(path)
        tokenizer_file = directory / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise FileNotFoundError(f"{directory}: no tokenizer.json (only fast tokenizers are supported)")
        backend = BackendTokenizer.from_file(str(tokenizer_file))
        config = _read_json(directory / "tokenizer_config.json")
        special_map = _read_json(directory / "special_tokens_map.json")

        bos_token = _token_content(config.get("bos_token", special_map.get("bos_token")))
        eos_token = _token_content(config.get("eos_token", special_map.get("eos_token")))
        bos_token_id = _token_id_of(backend, bos_token, directory)
        extra_eos_token_ids: set[int] = set()
        for model_file in ("generation_config.json", "config.json"):
            extra_eos_token_ids |= _int_set(_read_json(directory / model_file).get("eos_token_id"))

        add_bos_token = config.get("add_bos_token")
        if add_bos_token is None:
            # No explicit flag (typical of Llama 3): the post-processor in tokenizer.json decides.
            add_bos_token = _post_processor_adds(backend, bos_token_id)
        return cls(
            backend,
            bos_token_id=bos_token_id,
            eos_token_id=_token_id_of(backend, eos_token, directory),
            extra_eos_token_ids=extra_eos_token_ids,
            add_bos_token=bool(add_bos_token),
            chat_template=_hf_chat_template(directory, config),
        )

    @classmethod
    def from_gguf(cls, source: str | Path | gguf.GGUFReader) -> Tokenizer:
        """Build the tokenizer described by a GGUF file's ``tokenizer.*`` metadata.

        Two kinds of vocabulary: ``gpt2`` (byte-level BPE with merges: Qwen, SmolLM2, Llama-3) and
        ``llama`` (SentencePiece BPE with scores: Llama-2, Mistral-v0.1, TinyLlama, Gemma).
        """
        reader = source if isinstance(source, gguf.GGUFReader) else open_gguf_reader(source)
        meta = GGUFMetadata(reader)
        tokenizer_model = meta.get("tokenizer.ggml.model")
        if tokenizer_model == "gpt2":
            backend = _gguf_byte_level_bpe(meta)
        elif tokenizer_model == "llama":
            backend = sentencepiece_backend(meta)
        else:
            raise ValueError(
                f"{meta.where}: tokenizer model {tokenizer_model!r} is not supported "
                "(supported: 'gpt2', byte-level BPE, and 'llama', SentencePiece BPE)"
            )

        # llama.cpp also ends generation at the end-of-turn and end-of-message tokens.
        extra_eos_token_ids = {meta.get(f"tokenizer.ggml.{kind}_token_id") for kind in ("eot", "eom")}
        bos_token_id = meta.get("tokenizer.ggml.bos_token_id")
        eos_token_id = meta.get("tokenizer.ggml.eos_token_id")
        add_bos_token = meta.get("tokenizer.ggml.add_bos_token")
        if add_bos_token is None:
            # No flag: llama.cpp and transformers add BOS for SentencePiece vocabularies, not for byte-level ones.
            add_bos_token = tokenizer_model == "llama"
        return cls(
            backend,
            bos_token_id=bos_token_id,
            eos_token_id=eos_token_id,
            extra_eos_token_ids=extra_eos_token_ids - {None},
            add_bos_token=bool(add_bos_token) and bos_token_id is not None,
            add_eos_token=bool(meta.get("tokenizer.ggml.add_eos_token")) and eos_token_id is not None,
            chat_template=meta.get("tokenizer.chat_template"),
        )

    # ----------------------------------------------------------------------------------------------
    # Properties

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def bos_token_id(self) -> int | None:
        return self._bos_token_id

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self._eos_token_ids

    @property
    def chat_template(self) -> str | None:
        return self._chat_template

    @property
    def add_bos_token(self) -> bool:
        return self._add_bos_token

    # ----------------------------------------------------------------------------------------------
    # Encoding and decoding

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; special-token strings in it (``<|im_start|>``) map to their ids.

        ``add_special_tokens`` prepends BOS and appends EOS, each only when the model asks for it
        (``add_bos_token``, ``add_eos_token``; almost no model asks for EOS).
        """
        if not isinstance(text, str):
            raise ValueError(f"encode expects a str, got {type(text).__name__}")
        ids = encode_long(self._backend, text, self._splits_at_word_spaces()) if len(text) >= MIN_SPLIT_CHARS \
            else encode_whole(self._backend, text)
        if add_special_tokens and self._add_bos_token:
            ids = [self._bos_token_id, *ids]
        if add_special_tokens and self._add_eos_token:
            ids = [*ids, self._eos_token_id]
        return ids

    def _splits_at_word_spaces(self) -> bool:
        """Whether long texts may be encoded in pieces (``long_text.py``), checked on first use."""
        if self._splittable is None:
            self._splittable = splits_at_word_spaces(self._backend)
        return self._splittable

    def backend_json(self) -> str:
        """The ``tokenizers`` JSON of the vocabulary and its pre/post-processing (grammar libraries read it)."""
        return self._backend.to_str()

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; invalid UTF-8 byte runs become U+FFFD. Ids past the vocabulary are dropped."""
        ids = list(ids)
        if ids and min(ids) < 0:
            raise ValueError(f"token ids must be non-negative, got {min(ids)}")
        return self._backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary string of one id (byte-level form, e.g. 'Ġworld'); None if out of range."""
        if token_id < 0:
            raise ValueError(f"token ids must be non-negative, got {token_id}")
        return self._backend.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        """The id of one vocabulary string; None if it is not in the vocabulary."""
        return self._backend.token_to_id(token)

    # ----------------------------------------------------------------------------------------------
    # Chat template

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None, **template_vars: Any) -> str:
        """Render ``messages`` ([{"role": ..., "content": ...}]) into the model's prompt text.

        ``tools`` (OpenAI function tools) and ``template_vars`` (e.g. ``reasoning_effort``) are passed to the
        template as Hugging Face passes them; a template that does not read them ignores them.
        """
        if self._chat_template is None:
            raise ValueError("this model has no chat template; send a plain prompt instead")
        _check_messages(messages)
        template = self._template()
        try:
            return template.render(
                messages=messages,
                tools=tools or None,
                add_generation_prompt=add_generation_prompt,
                bos_token=self._token_text(self._bos_token_id),
                eos_token=self._token_text(self._eos_token_id),
                **template_vars,
            )
        except (jinja2.TemplateError, TypeError) as exc:  # TypeError: the template adds a str and a None, say
            raise ValueError(f"the chat template failed to render these messages: {exc}") from exc

    def _template(self) -> jinja2.Template:
        if self._compiled_template is None:
            try:
                self._compiled_template = _chat_environment().from_string(self._chat_template)
            except jinja2.TemplateError as exc:
                raise ValueError(f"this model's chat template does not compile: {exc}") from exc
        return self._compiled_template

    def _token_text(self, token_id: int | None) -> str:
        if token_id is None:
            return ""
        return self._backend.decode([token_id], skip_special_tokens=False)


# --------------------------------------------------------------------------------------------------
# Chat-template helpers


def _chat_environment() -> ImmutableSandboxedEnvironment:
    """A sandbox configured the way Hugging Face renders chat templates, so prompts match theirs."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_from_template
    env.globals["strftime_now"] = _strftime_now
    return env


def _tojson(value: Any, indent: int | None = None, separators: Any = None, sort_keys: bool = False) -> str:
    # Jinja's own tojson HTML-escapes '<' and '&', which would change prompts; templates expect plain JSON.
    return json.dumps(value, ensure_ascii=False, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_from_template(message: str) -> None:
    raise ValueError(f"the chat template rejected the messages: {message}")


def _strftime_now(format_string: str) -> str:
    return datetime.now().strftime(format_string)


def _check_messages(messages: Any) -> None:
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list of {'role': str, 'content': str} dicts")
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ValueError(f"messages[{index}] must be a dict, got {type(message).__name__}")
        if not isinstance(message.get("role"), str):
            raise ValueError(f"messages[{index}]['role'] must be a str, got {message.get('role')!r}")
        content = message.get("content")
        # An assistant turn that only calls tools has no content (None), as Hugging Face templates expect.
        if not isinstance(content, str) and not (content is None and message.get("tool_calls")):
            raise ValueError(f"messages[{index}]['content'] must be a str, got {content!r}")


# --------------------------------------------------------------------------------------------------
# Hugging Face directory helpers


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON ({exc})") from exc
    if not isinstance(value, dict):
        raise ValueError(f"{path}: expected a JSON object at the top level")
    return value


def _token_content(token: Any) -> str | None:
    """A special token as written in tokenizer_config.json: a string or an AddedToken dict."""
    if token is None or isinstance(token, str):
        return token
    if isinstance(token, dict) and isinstance(token.get("content"), str):
        return token["content"]
    raise ValueError(f"cannot read special token {token!r}: expected a string or {{'content': ...}}")


def _token_id_of(backend: BackendTokenizer, token: str | None, where: Path) -> int | None:
    if token is None:
        return None
    token_id = backend.token_to_id(token)
    if token_id is None:
        raise ValueError(f"{where}: special token {token!r} is not in the vocabulary")
    return token_id


def _int_set(value: Any) -> set[int]:
    if value is None:
        return set()
    if isinstance(value, int):
        return {value}
    if isinstance(value, list) and all(isinstance(v, int) for v in value):
        return set(value)
    raise ValueError(f"eos_token_id must be an int or a list of ints, got {value!r}")


def _post_processor_adds(backend: BackendTokenizer, token_id: int | None) -> bool:
    if token_id is None:
        return False
    with_special = backend.encode("a", add_special_tokens=True).ids
    without = backend.encode("a", add_special_tokens=False).ids
    return len(with_special) > len(without) and with_special[0] == token_id


def _hf_chat_template(directory: Path, config: dict) -> str | None:
    """The chat template, from chat_template.jinja, chat_template.json or tokenizer_config.json."""
    jinja_file = directory / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = _read_json(directory / "chat_template.json").get("chat_template", config.get("chat_template"))
    if isinstance(template, list):
        # Several named templates: serving uses the one named "default".
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        if "default" not in named:
            raise ValueError(f"{directory}: named chat templates {sorted(map(str, named))} lack a 'default'")
        template = named["default"]
    if template is not None and not isinstance(template, str):
        raise ValueError(f"{directory}: chat_template must be a string, got {type(template).__name__}")
    return template


# --------------------------------------------------------------------------------------------------
# GGUF helpers


def _gguf_byte_level_bpe(meta: GGUFMetadata) -> BackendTokenizer:
    """The ``tokenizers`` tokenizer of a GGUF file whose ``tokenizer.ggml.model`` is ``"gpt2"``."""
    tokens: list[str] = meta.require("tokenizer.ggml.tokens")
    merges: list[str] = meta.require("tokenizer.ggml.merges")
    token_types: list[int] = meta.get("tokenizer.ggml.token_type") or []
    backend = _byte_level_bpe(tokens, merges, meta.get("tokenizer.ggml.unknown_token_id"), meta.where)
    _set_pre_tokenizer(backend, meta.get("tokenizer.ggml.pre") or "default", meta.where)
    _add_gguf_special_tokens(backend, tokens, token_types)
    return backend


def _byte_level_bpe(
    tokens: list[str], merges: list[str], unknown_token_id: int | None, where: str
) -> BackendTokenizer:
    vocab = {token: index for index, token in enumerate(tokens)}
    merge_pairs = split_merges(merges, where)
    unk_token = tokens[unknown_token_id] if unknown_token_id is not None else None
    backend = BackendTokenizer(
        models.BPE(vocab, merge_pairs, unk_token=unk_token, fuse_unk=True, byte_fallback=True)
    )
    backend.decoder = decoders.ByteLevel()
    return backend


def _set_pre_tokenizer(backend: BackendTokenizer, pre_name: str, where: str) -> None:
    """Choose the split that transformers uses for this ``tokenizer.ggml.pre`` value."""
    if pre_name in _GPT2_STYLE_PRE:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    elif pre_name in _QWEN2_STYLE_PRE:
        backend.normalizer = normalizers.NFC()
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_QWEN2_PATTERN), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    else:
        supported = sorted(_GPT2_STYLE_PRE | _QWEN2_STYLE_PRE)
        raise ValueError(f"{where}: pre-tokenizer {pre_name!r} is not supported (supported: {supported})")


def _add_gguf_special_tokens(backend: BackendTokenizer, tokens: list[str], token_types: list[int]) -> None:
    """Make control and user-defined tokens atomic, so their text never goes through BPE.

    Control tokens (<|im_start|>) are special: dropped by ``decode(skip_special_tokens=True)``.
    User-defined tokens (e.g. Qwen's <tool_call>) are matched the same way but always decoded,
    as llama.cpp renders them and as Hugging Face marks them (``special: false``).
    """
    control = [AddedToken(tokens[i], normalized=False, special=True)
               for i, kind in enumerate(token_types) if kind == _TOKEN_TYPE_CONTROL]
    user_defined = [AddedToken(tokens[i], normalized=False, special=False)
                    for i, kind in enumerate(token_types) if kind == _TOKEN_TYPE_USER_DEFINED]
    if control:
        backend.add_special_tokens(control)
    if user_defined:
        backend.add_tokens(user_defined)
