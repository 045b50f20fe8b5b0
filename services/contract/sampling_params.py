"""Per-request sampling and stopping parameters, validated once at the door."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

# A request body's default bound (the router's --max-request-bytes, the workers' alike): the sampling params a
# request carries to the workers (stop strings, a structured-output schema) come from a body no longer than it.
DEFAULT_MAX_REQUEST_BYTES = 4 * 1024 * 1024
# OpenAI's limit on logit_bias entries.
MAX_LOGIT_BIAS = 300
# OpenAI's limit on top_logprobs (alternatives per position); completions' logprobs get the same.
MAX_TOP_LOGPROBS = 20
# OpenAI's ranges of presence/frequency penalties and of one logit_bias value.
PENALTY_BOUNDS = (-2.0, 2.0)
LOGIT_BIAS_BOUNDS = (-100.0, 100.0)


# "grammar": llguidance grammar text the router built itself (tool calls: services.contract.tool_grammar).
STRUCTURED_KINDS = ("json_object", "json_schema", "grammar")


@dataclass(frozen=True)
class StructuredSpec:
    """A document every output must be a prefix of (``response_format``): any JSON object, or a JSON
    schema's instances (``schema`` is the schema's JSON text), or a grammar's (``schema`` is its text)."""

    kind: str
    schema: str = ""

    def validate(self) -> None:
        if self.kind not in STRUCTURED_KINDS:
            raise ValueError(f"structured output kind must be one of {STRUCTURED_KINDS}, got {self.kind!r}")
        if self.kind == "json_schema":
            try:
                schema = json.loads(self.schema)
            except (ValueError, TypeError):
                raise ValueError("a json_schema structured output needs the schema as JSON text") from None
            if not isinstance(schema, (dict, bool)):
                raise ValueError("a JSON schema must be an object (or a boolean)")
        if self.kind == "grammar" and not self.schema:
            raise ValueError("a grammar structured output needs the grammar's text")


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop.

    ``temperature == 0`` means greedy. ``top_k is None`` and ``top_p == 1.0`` disable those filters.
    ``seed`` makes a sampled request reproducible regardless of what it is batched with.

    Logit processing, in order (vLLM's): ``logit_bias`` (OpenAI: ``(token id, bias)`` pairs added to
    the logits), then ``repetition_penalty`` (HF/vLLM: for every id in the prompt or the output so
    far, positive logits are divided by it, negative ones multiplied; 1.0 = off), then
    ``frequency_penalty * count`` and ``presence_penalty`` (once per distinct id) subtracted for
    ids in the output so far (OpenAI). Greedy rows see all of them. Sampled rows then apply
    temperature, ``min_p`` (drop ids whose probability is below ``min_p`` times the top one; 0 = off),
    top-k and top-p. The defaults change nothing.

    ``logprobs`` reports the chosen token's log-softmax over the raw logits; ``top_logprobs`` (needs
    ``logprobs``) adds that many most likely alternatives per output token. ``prompt_logprobs`` (None =
    off) reports each prompt token's logprob given the tokens before it, with that many alternatives;
    such a request computes its whole prompt (the prefix cache holds no logits).

    ``structured`` constrains every token to keep the output a prefix of a document of its kind; the
    request finishes ("stop") when the document is complete.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_p: float = 0.0
    top_logprobs: int = 0
    prompt_logprobs: int | None = None
    structured: StructuredSpec | None = None
    # Keep the logits of every computed position (tests compare them with a reference model).
    return_logits: bool = False

    def __post_init__(self) -> None:
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def needs_history(self) -> bool:
        """Whether the logits depend on the tokens so far (the penalties): the engine must have them on the host."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def needs_resolved_tokens(self) -> bool:
        """Whether the next token's logits depend on this one on the host (penalties, a grammar): such a
        request's steps are not pipelined."""
        return self.needs_history or self.structured is not None

    @property
    def processes_logits(self) -> bool:
        """Whether the logits are changed before the greedy argmax (penalties or logit_bias)."""
        return self.needs_history or bool(self.logit_bias)

    def validate(self) -> None:
        """Raise ValueError naming the first invalid field."""
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not _is_number(self.temperature) or self.temperature < 0.0:
            raise ValueError(f"temperature must be a number >= 0, got {self.temperature!r}")
        if not _is_number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.top_k is not None and (not _is_int(self.top_k) or self.top_k < 1):
            raise ValueError(f"top_k must be None or an integer >= 1, got {self.top_k!r}")
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed must be None or an integer, got {self.seed!r}")
        if not isinstance(self.stop, tuple) or not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop must be a tuple of non-empty strings, got {self.stop!r}")
        if not isinstance(self.stop_token_ids, tuple) or not all(
            _is_int(t) and t >= 0 for t in self.stop_token_ids
        ):
            raise ValueError(f"stop_token_ids must be a tuple of token ids >= 0, got {self.stop_token_ids!r}")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens], got {self.min_tokens!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not PENALTY_BOUNDS[0] <= value <= PENALTY_BOUNDS[1]:
                raise ValueError(f"{name} must be in [-2, 2], got {value!r}")
        if not _is_number(self.repetition_penalty) or self.repetition_penalty <= 0.0:
            raise ValueError(f"repetition_penalty must be a number > 0, got {self.repetition_penalty!r}")
        if not _is_number(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if not _is_int(self.top_logprobs) or not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top_logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs!r}")
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs")
        if self.prompt_logprobs is not None and (
                not _is_int(self.prompt_logprobs) or not 0 <= self.prompt_logprobs <= MAX_TOP_LOGPROBS):
            raise ValueError(f"prompt_logprobs must be None or an integer in [0, {MAX_TOP_LOGPROBS}], "
                             f"got {self.prompt_logprobs!r}")
        if self.structured is not None:
            if not isinstance(self.structured, StructuredSpec):
                raise ValueError(f"structured must be a StructuredSpec, got {self.structured!r}")
            self.structured.validate()
        self._validate_logit_bias()

    def _validate_logit_bias(self) -> None:
        bias = self.logit_bias
        if not isinstance(bias, tuple) or not all(isinstance(pair, tuple) and len(pair) == 2 for pair in bias):
            raise ValueError(f"logit_bias must be a tuple of (token id, bias) pairs, got {bias!r}")
        if len(bias) > MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias has {len(bias)} entries, at most {MAX_LOGIT_BIAS} are allowed")
        for token_id, value in bias:
            if not _is_int(token_id) or token_id < 0:
                raise ValueError(f"logit_bias token ids must be integers >= 0, got {token_id!r}")
            if not _is_number(value) or not LOGIT_BIAS_BOUNDS[0] <= value <= LOGIT_BIAS_BOUNDS[1]:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {value!r} for token {token_id}")
        if len({token_id for token_id, _ in bias}) != len(bias):
            raise ValueError("logit_bias names a token id more than once")

    def check_vocab(self, vocab_size: int) -> None:
        """Raise ValueError naming ``logit_bias`` if it names an id outside ``[0, vocab_size)``."""
        bad = sorted(t for t, _ in self.logit_bias if t >= vocab_size)
        if bad:
            raise ValueError(f"logit_bias token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}")


def _is_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)
