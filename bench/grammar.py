"""Grammar libraries for ``response_format``, side by side on the real tokenizer (SmolLM2, 49,152 tokens).

For each installed library: tokenizer set-up, grammar compile time per schema, and per-token mask time
(mean and max) along a greedy walk that writes a valid document (at each step the smallest allowed
token id that keeps the walk short is taken, so every library sees the same kind of walk). Ratios are
against the fastest library in each column. Run: ``python bench/grammar.py``.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable

import torch

from services.text.default_model import default_model_path
from services.text.tokenizer import Tokenizer

SCHEMAS = {
    "json_object": None,
    "flat": {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
             "required": ["name", "age"], "additionalProperties": False},
    "nested": {"type": "object", "properties": {
        "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
        "point": {"type": "object", "properties": {"x": {"type": "number"}, "y": {"type": "number"}},
                  "required": ["x", "y"], "additionalProperties": False}},
        "required": ["city", "tags", "point"], "additionalProperties": False},
}
STEPS = 48


def _walk(allowed_ids: Callable[[], tuple[torch.Tensor, float]], accept: Callable[[int], None],
          done: Callable[[], bool], prefer: list[int]) -> list[float]:
    """Mask times (s) along a walk: prefer short closing tokens so documents end within STEPS.

    ``allowed_ids`` returns the allowed ids as a bool mask and the seconds the library took to make its
    mask (its own format: a packed bitmask, or a list of ids scattered into a bool tensor).
    """
    times = []
    for _ in range(STEPS):
        if done():
            break
        allowed, seconds = allowed_ids()
        times.append(seconds)
        choice = next((t for t in prefer if allowed[t]), None)
        if choice is None:
            choice = int(allowed.nonzero()[0, 0])
        accept(choice)
    return times


def _llguidance(tokenizer: Tokenizer, backend_json: str) -> dict:
    import llguidance
    import llguidance.torch as lltorch

    start = time.perf_counter()
    lltok = llguidance.LLTokenizer(backend_json, n_vocab=tokenizer.vocab_size,
                                   eos_token=sorted(tokenizer.eos_token_ids)[0])
    setup = time.perf_counter() - start
    out = {"setup_s": setup}
    prefer = _prefer(tokenizer)
    for name, schema in SCHEMAS.items():
        start = time.perf_counter()
        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            json.dumps(schema or {"type": "object"}), defaults={"whitespace_flexible": False})
        matcher = llguidance.LLMatcher(lltok, grammar)
        compile_s = time.perf_counter() - start
        assert not matcher.is_error(), matcher.get_error()
        bitmask = lltorch.allocate_token_bitmask(1, tokenizer.vocab_size)

        def allowed(matcher=matcher, bitmask=bitmask) -> tuple[torch.Tensor, float]:
            start = time.perf_counter()
            lltorch.fill_next_token_bitmask(matcher, bitmask, 0)
            seconds = time.perf_counter() - start
            return _unpack(bitmask[0], tokenizer.vocab_size), seconds

        times = _walk(allowed, matcher.consume_token, matcher.is_stopped, prefer)
        out[name] = (compile_s, times)
    return out


def _outlines(tokenizer: Tokenizer) -> dict:
    from outlines_core import Guide, Index, Vocabulary
    from outlines_core.json_schema import build_regex_from_schema

    start = time.perf_counter()
    eos = sorted(tokenizer.eos_token_ids)[0]
    pieces: dict[str, list[int]] = {}
    for token_id in range(tokenizer.vocab_size):
        if token_id in tokenizer.eos_token_ids:
            continue
        text = tokenizer.decode([token_id], skip_special_tokens=False)
        if text:
            pieces.setdefault(text, []).append(token_id)
    vocabulary = Vocabulary(eos, pieces)
    out = {"setup_s": time.perf_counter() - start}
    prefer = _prefer(tokenizer)
    for name, schema in SCHEMAS.items():
        start = time.perf_counter()
        # outlines-core has no free-form JSON: json_object is an object schema with any properties.
        regex = build_regex_from_schema(json.dumps(schema or {"type": "object"}))
        guide = Guide(Index(regex, vocabulary))
        compile_s = time.perf_counter() - start
        mask = torch.zeros(tokenizer.vocab_size, dtype=torch.bool)

        def allowed(mask=mask, guide=guide) -> tuple[torch.Tensor, float]:
            start = time.perf_counter()
            mask.zero_()
            mask[torch.tensor(guide.get_tokens(), dtype=torch.long)] = True
            return mask, time.perf_counter() - start

        times = _walk(allowed, guide.advance, guide.is_finished, prefer)
        out[name] = (compile_s, times)
    return out


def _unpack(words: torch.Tensor, vocab_size: int) -> torch.Tensor:
    bits = (words.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
    return bits.flatten()[:vocab_size].bool()


def _prefer(tokenizer: Tokenizer) -> list[int]:
    ids = []
    for text in ['"', '}', ']', '0', 'a', ',', ':', '{', '"P', 'Paris', '1', '.', '[']:
        ids += tokenizer.encode(text, add_special_tokens=False)[:1]
    return ids + sorted(tokenizer.eos_token_ids)


def main() -> None:
    tokenizer = Tokenizer.from_gguf(default_model_path())
    backend_json = tokenizer._backend.to_str()
    results = {}
    for name, run in (("llguidance", lambda: _llguidance(tokenizer, backend_json)),
                      ("outlines-core", lambda: _outlines(tokenizer))):
        try:
            results[name] = run()
        except ImportError as exc:
            print(f"{name}: not installed ({exc})")
    rows = []
    for library, r in results.items():
        row = {"library": library, "setup_s": r["setup_s"]}
        for schema in SCHEMAS:
            compile_s, times = r[schema]
            row[f"{schema}.compile_ms"] = compile_s * 1e3
            row[f"{schema}.mask_mean_us"] = statistics.mean(times) * 1e6
            row[f"{schema}.mask_max_us"] = max(times) * 1e6
            row[f"{schema}.steps"] = len(times)
        rows.append(row)
    columns = [c for c in rows[0] if c != "library"]
    for column in columns:
        best = min(r[column] for r in rows)
        print(f"{column:28s} " + "  ".join(f"{r['library']}={r[column]:10.2f} ({r[column] / best:5.1f}x)"
                                            for r in rows))


if __name__ == "__main__":
    main()
