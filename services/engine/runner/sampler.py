"""Pick one token per row of a step's logits, batched, on whatever device the logits live.

One call per engine step. Rows are grouped by what they need so the common cases stay cheap:
an all-greedy batch is one argmax; logit_bias and the penalties touch only the rows that ask for
them (greedy ones too); the vocabulary sort runs only over rows with top-k/top-p.

Sampling uses the exponential-race trick: ``argmax(probs / q)`` with ``q ~ Exp(1)`` i.i.d. per
token draws from ``probs``. A seeded row's ``q`` comes from its own generator, so its tokens
depend on its seed and logits only, never on which rows share the batch or in what order.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch

from services.contract.outputs import TopLogprobs
from services.contract.sampling_params import SamplingParams
from services.engine.structured.bitmask import apply_bitmask

# Exp(1) draws can be exactly 0; dividing 0-probability tokens by 0 would give NaN, which argmax
# prefers over every number. Clamping keeps filtered tokens at probability 0.
_MIN_NOISE = torch.finfo(torch.float32).tiny


@dataclass(frozen=True)
class SamplerOutput:
    """One token per row, on the host.

    ``logprobs[i]`` is log-softmax of row ``i``'s raw logits (before temperature, top-k/top-p and
    min-tokens bans) at ``token_ids[i]``; it is computed for every row when any row asked for it,
    and is None when none did. ``top_logprobs`` likewise, over the same raw logits.
    """

    token_ids: list[int]
    logprobs: list[float] | None
    # Per row, the ``k`` most likely (token ids, logprobs), best first, where ``k`` is the largest
    # ``top_logprobs`` of the batch (callers cut each row to its own); None when no row asked.
    top_logprobs: list[TopLogprobs] | None = None


def top_logprobs_of(logits: torch.Tensor, k: int, log_normalizer: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, logprobs) [rows, k] of each row's ``k`` most likely tokens, best first.

    ``log_normalizer`` [rows, 1] is ``logsumexp(logits)`` when the caller has it already.
    """
    if log_normalizer is None:
        log_normalizer = torch.logsumexp(logits, dim=-1, keepdim=True)
    values, ids = logits.topk(k, dim=-1)
    return ids, values - log_normalizer


def make_generator(seed: int, device: torch.device | str) -> torch.Generator:
    """A generator for one seeded request; any Python int is accepted (taken modulo 2**64)."""
    generator = torch.Generator(device=device)
    generator.manual_seed(seed % 2**64)
    return generator


def min_tokens_banned_ids(
    params: SamplingParams, num_output_tokens: int, eos_token_ids: Collection[int]
) -> frozenset[int]:
    """Token ids that would end the request before it has ``min_tokens`` outputs, so must not be drawn.

    EOS counts only when it stops the request (``ignore_eos`` off), matching ``check_token_stop``.
    """
    if num_output_tokens >= params.min_tokens:
        return frozenset()
    banned = set(params.stop_token_ids)
    if not params.ignore_eos:
        banned.update(eos_token_ids)
    return frozenset(banned)


@dataclass(frozen=True)
class TokenHistory:
    """The tokens a penalised row has seen: its prompt, and its output so far (all real ids)."""

    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]


@dataclass(frozen=True)
class GrammarMasks:
    """Packed allowed-token masks (host int32 [len(rows), words]) for the batch rows ``rows``."""

    bitmask: torch.Tensor
    rows: list[int]


@dataclass(frozen=True)
class PendingSample:
    """Sampled tokens still on the device, their copy to the host under way.

    ``token_ids`` [rows] stays on the device, so the next step can read it without the host waiting
    (the engine's pipelined decode); ``result`` waits for the copy, once.
    """

    token_ids: torch.Tensor
    # The copy's target: int64 [rows]; or float64 [2 + 2k, rows]: ids, logprobs, then k rows of top ids
    # and k rows of top logprobs.
    host: torch.Tensor
    ready: torch.cuda.Event | None
    num_top: int = 0  # k

    def result(self) -> SamplerOutput:
        if self.ready is not None:
            self.ready.synchronize()
        if self.host.dim() == 1:
            return SamplerOutput(token_ids=self.host.tolist(), logprobs=None)
        rows = self.host.tolist()
        ids, logprobs, k = rows[0], rows[1], self.num_top
        top = None
        if k:
            top_ids, top_values = rows[2:2 + k], rows[2 + k:]
            top = [TopLogprobs(tuple(int(top_ids[j][i]) for j in range(k)), tuple(top_values[j][i] for j in range(k)))
                   for i in range(len(ids))]
        return SamplerOutput(token_ids=[int(t) for t in ids], logprobs=logprobs, top_logprobs=top)


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
    banned_token_ids: Sequence[Collection[int]] | None = None,
    histories: Sequence[TokenHistory | None] | None = None,
    grammar_masks: GrammarMasks | None = None,
) -> SamplerOutput:
    """Choose the next token for each row of ``logits`` [num_rows, vocab].

    ``generators[i]`` is row ``i``'s own generator (from ``make_generator``) or None for the
    device's default RNG; ``banned_token_ids[i]`` are ids row ``i`` must not get (see
    ``min_tokens_banned_ids``); ``histories[i]`` is required where ``params[i].needs_history``
    (the penalties); ``grammar_masks`` restrict their rows to what their grammars allow (after the bans,
    logit_bias and penalties). Returns after a single device-to-host copy.
    """
    return sample_async(logits, params, generators, banned_token_ids, histories, grammar_masks).result()


def sample_async(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
    banned_token_ids: Sequence[Collection[int]] | None = None,
    histories: Sequence[TokenHistory | None] | None = None,
    grammar_masks: GrammarMasks | None = None,
) -> PendingSample:
    """``sample`` without waiting: the tokens stay on the device and their host copy is started."""
    _check_inputs(logits, params, generators, banned_token_ids, histories)
    raw = logits.float()
    masked = _ban(raw, banned_token_ids) if banned_token_ids is not None else raw
    if any(p.processes_logits for p in params):
        masked = process_logits(masked if masked is not raw else raw.clone(), params, histories)
    if grammar_masks is not None:
        masked = apply_bitmask(masked if masked is not raw else raw.clone(), grammar_masks.bitmask, grammar_masks.rows)

    sampled_rows = [i for i, p in enumerate(params) if not p.greedy]
    if len(sampled_rows) == len(params):
        token_ids = _sample_rows(masked, params, generators)
    else:
        token_ids = masked.argmax(dim=-1)
        if sampled_rows:
            index = _to_device(sampled_rows, torch.long, masked.device)
            drawn = _sample_rows(
                masked.index_select(0, index),
                [params[i] for i in sampled_rows],
                [generators[i] for i in sampled_rows],
            )
            token_ids.index_copy_(0, index, drawn)

    out, num_top = token_ids, max((p.top_logprobs for p in params), default=0)
    if any(p.logprobs for p in params):
        log_normalizer = torch.logsumexp(raw, dim=-1, keepdim=True)
        logprobs = raw.gather(1, token_ids.unsqueeze(1)) - log_normalizer
        # Pack everything into one float64 tensor (exact for ids below 2**53) so the host waits once.
        parts = [token_ids.double().unsqueeze(0), logprobs.double().T]
        if num_top:
            top_ids, top_values = top_logprobs_of(raw, num_top, log_normalizer)
            parts += [top_ids.double().T, top_values.double().T]
        out = torch.cat(parts)
    if out.device.type != "cuda":
        return PendingSample(token_ids, out, None, num_top)
    host = torch.empty(out.shape, dtype=out.dtype, pin_memory=True)
    host.copy_(out, non_blocking=True)
    ready = torch.cuda.Event()
    ready.record(torch.cuda.current_stream(out.device))
    return PendingSample(token_ids, host, ready, num_top)


def _check_inputs(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
    banned_token_ids: Sequence[Collection[int]] | None,
    histories: Sequence[TokenHistory | None] | None,
) -> None:
    if logits.dim() != 2 or not logits.is_floating_point():
        raise ValueError(f"logits must be a 2-D float tensor, got {logits.dtype} {tuple(logits.shape)}")
    num_rows, vocab_size = logits.shape
    if vocab_size == 0:
        raise ValueError("logits have an empty vocabulary")
    if len(params) != num_rows or len(generators) != num_rows:
        raise ValueError(f"{num_rows} logit rows but {len(params)} params and {len(generators)} generators")
    for row, p in enumerate(params):
        if p.logit_bias and max(t for t, _ in p.logit_bias) >= vocab_size:
            raise ValueError(f"row {row}: logit_bias ids outside vocab of {vocab_size}")
        if p.needs_history and (histories is None or len(histories) != num_rows or histories[row] is None):
            raise ValueError(f"row {row}: penalties need the row's token history")
    if banned_token_ids is None:
        return
    if len(banned_token_ids) != num_rows:
        raise ValueError(f"{num_rows} logit rows but {len(banned_token_ids)} banned-id sets")
    for row, banned in enumerate(banned_token_ids):
        if any(not 0 <= t < vocab_size for t in banned):
            raise ValueError(f"row {row}: banned ids {sorted(banned)} outside vocab of {vocab_size}")


def _ban(logits: torch.Tensor, banned_token_ids: Sequence[Collection[int]]) -> torch.Tensor:
    """A copy of ``logits`` with each row's banned ids at -inf (the input is left untouched)."""
    rows = [row for row, banned in enumerate(banned_token_ids) for _ in banned]
    if not rows:
        return logits
    cols = [t for banned in banned_token_ids for t in banned]
    masked = logits.clone()
    masked[_to_device(rows, torch.long, logits.device), _to_device(cols, torch.long, logits.device)] = -math.inf
    return masked


def process_logits(logits: torch.Tensor, params: Sequence[SamplingParams],
             histories: Sequence[TokenHistory | None] | None) -> torch.Tensor:
    """logit_bias, then the penalties, in place on ``logits`` (pass a copy), for the rows that ask only.

    ``histories[i]`` is needed where ``params[i].needs_history``. Returns ``logits``.
    """
    device = logits.device
    bias = [(row, t, b) for row, p in enumerate(params) for t, b in p.logit_bias]
    if bias:
        bias_rows, bias_cols, bias_values = zip(*bias, strict=True)
        logits.index_put_(
            (_to_device(list(bias_rows), torch.long, device), _to_device(list(bias_cols), torch.long, device)),
            _to_device(list(bias_values), torch.float32, device), accumulate=True)
    penalised = [row for row, p in enumerate(params) if p.needs_history]
    if not penalised:
        return logits
    assert histories is not None  # _check_inputs
    vocab_size = logits.shape[1]
    index = _to_device(penalised, torch.long, device)
    rows = logits.index_select(0, index)
    output_counts = _bincount_rows([histories[r].output_token_ids for r in penalised], vocab_size, device)
    seen_in_output = output_counts > 0
    repetition = [params[r].repetition_penalty for r in penalised]
    if any(x != 1.0 for x in repetition):
        prompt_seen = _bincount_rows([histories[r].prompt_token_ids for r in penalised], vocab_size, device) > 0
        factor = _to_device(repetition, torch.float32, device).unsqueeze(1)
        penalised_logits = torch.where(rows > 0, rows / factor, rows * factor)
        rows = torch.where(prompt_seen | seen_in_output, penalised_logits, rows)
    frequency = _to_device([params[r].frequency_penalty for r in penalised], torch.float32, device).unsqueeze(1)
    presence = _to_device([params[r].presence_penalty for r in penalised], torch.float32, device).unsqueeze(1)
    rows = rows - frequency * output_counts - presence * seen_in_output
    return logits.index_copy_(0, index, rows)


def _bincount_rows(token_ids: list[Sequence[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """float32 [len(token_ids), vocab_size]: how often each id occurs in each row's list."""
    width = max((len(ids) for ids in token_ids), default=0)
    # Pad with vocab_size: an extra column that is dropped.
    padded = torch.full((len(token_ids), max(width, 1)), vocab_size, dtype=torch.long)
    for row, ids in enumerate(token_ids):
        if ids:
            padded[row, :len(ids)] = torch.as_tensor(ids, dtype=torch.long)
    padded = padded.to(device, non_blocking=True)
    counts = torch.zeros(len(token_ids), vocab_size + 1, dtype=torch.float32, device=device)
    counts.scatter_add_(1, padded, torch.ones_like(padded, dtype=torch.float32))
    return counts[:, :vocab_size]


def _sample_rows(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
) -> torch.Tensor:
    """Temperature, then min-p, then top-k, then top-p, then one draw per row; every row has temperature > 0."""
    temperatures = _to_device([p.temperature for p in params], torch.float32, logits.device)
    scaled = logits / temperatures.unsqueeze(1)
    if any(p.min_p > 0.0 for p in params):
        scaled = _min_p(scaled, params)
    filtered_rows = [i for i, p in enumerate(params) if p.top_k is not None or p.top_p < 1.0]
    if filtered_rows:
        scaled = _filter_rows(scaled, filtered_rows, params)
    probs = scaled.softmax(dim=-1)
    noise = _exponential_noise(probs, generators)
    return probs.div_(noise).argmax(dim=-1)


def _min_p(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Set to -inf every token whose probability is below ``min_p`` times its row's top probability.

    Rows with ``min_p == 0`` keep everything (no probability is below 0).
    """
    min_p = _to_device([p.min_p for p in params], torch.float32, logits.device).unsqueeze(1)
    probs = logits.softmax(dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p
    return logits.masked_fill(probs < threshold, -math.inf)


def _filter_rows(logits: torch.Tensor, rows: list[int], params: Sequence[SamplingParams]) -> torch.Tensor:
    """Apply top-k/top-p to ``rows`` only, leaving the other rows unsorted and untouched."""
    vocab_size = logits.shape[1]
    top_k = [params[i].top_k or vocab_size for i in rows]
    # top_p == 1.0 must keep everything even where float cumsums overshoot 1; inf never cuts.
    top_p = [params[i].top_p if params[i].top_p < 1.0 else math.inf for i in rows]
    top_k_t = _to_device(top_k, torch.long, logits.device)
    top_p_t = _to_device(top_p, torch.float32, logits.device)
    if len(rows) == logits.shape[0]:
        return _top_k_top_p(logits, top_k_t, top_p_t)
    index = _to_device(rows, torch.long, logits.device)
    filtered = _top_k_top_p(logits.index_select(0, index), top_k_t, top_p_t)
    return logits.index_copy(0, index, filtered)


def _top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Set to -inf every token outside the row's top-k and then outside its top-p nucleus.

    In sorted order, token ``r`` survives top-p when the probability mass strictly before it is
    below ``top_p``: that keeps the smallest prefix reaching ``top_p``, and always rank 0::

        probs      0.5  0.3  0.15  0.05      top_p = 0.8
        mass before 0.0  0.5  0.8   0.95  -> keep ranks 0, 1
    """
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True, stable=True)
    ranks = torch.arange(logits.shape[1], device=logits.device)
    sorted_logits = sorted_logits.masked_fill(ranks >= top_k.unsqueeze(1), -math.inf)
    sorted_probs = sorted_logits.softmax(dim=-1)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    sorted_logits = sorted_logits.masked_fill(mass_before >= top_p.unsqueeze(1), -math.inf)
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def _exponential_noise(probs: torch.Tensor, generators: Sequence[torch.Generator | None]) -> torch.Tensor:
    """Exp(1) noise shaped like ``probs``: seeded rows from their own generator, one draw per step."""
    noise = torch.empty_like(probs)
    if any(g is None for g in generators):
        noise.exponential_()
    for row, generator in enumerate(generators):
        if generator is not None:
            noise[row].exponential_(generator=generator)
    return noise.clamp_min_(_MIN_NOISE)


def _to_device(values: list[int] | list[float], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small host list as a tensor on ``device``, copied without waiting on the device."""
    return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)
