"""Sampler: greedy, temperature/top-k/top-p support and distribution, seeds, bans, logprobs, logit_bias,
penalties and min-p."""

from __future__ import annotations

import pytest
import torch

from services.contract.sampling_params import SamplingParams
from services.engine.runner import sampler
from services.engine.runner.sampler import (
    GrammarMasks,
    SamplerOutput,
    TokenHistory,
    make_generator,
    min_tokens_banned_ids,
    process_logits,
    sample,
)
from services.engine.structured.bitmask import allocate_bitmask, apply_bitmask

GREEDY = SamplingParams(temperature=0.0)
PLAIN = SamplingParams(temperature=1.0)

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _logits(num_rows: int, vocab_size: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(num_rows, vocab_size, generator=torch.Generator().manual_seed(seed)) * 3.0


def _draws(logits_row: torch.Tensor, params: SamplingParams, num_draws: int) -> torch.Tensor:
    """``num_draws`` samples of one row, drawn in one batched call."""
    torch.manual_seed(1234)
    out = sample(logits_row.expand(num_draws, -1), [params] * num_draws, [None] * num_draws)
    return torch.tensor(out.token_ids)


def _nucleus(probs: torch.Tensor, top_p: float) -> set[int]:
    """Reference top-p set: smallest highest-probability prefix whose mass reaches top_p."""
    order = torch.argsort(probs, descending=True).tolist()
    kept, mass = set(), 0.0
    for token_id in order:
        kept.add(token_id)
        mass += probs[token_id].item()
        if mass >= top_p:
            break
    return kept


def _chi_square(counts: torch.Tensor, expected_probs: torch.Tensor) -> float:
    expected = expected_probs * counts.sum()
    support = expected > 0
    return float((((counts - expected) ** 2)[support] / expected[support]).sum())


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_is_argmax_with_lowest_id_on_ties(device: str) -> None:
    logits = _logits(6, 50).to(device)
    logits[2, 7] = logits[2, 30] = 100.0
    out = sample(logits, [GREEDY] * 6, [None] * 6)
    assert isinstance(out, SamplerOutput)
    assert out.token_ids == logits.argmax(dim=-1).tolist()
    assert out.token_ids[2] == 7
    assert out.logprobs is None


def test_all_greedy_batch_uses_no_randomness_and_no_sort(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_sort(*args: object, **kwargs: object) -> None:
        raise AssertionError("greedy batch sorted the vocabulary")

    monkeypatch.setattr(torch, "sort", no_sort)
    state = torch.get_rng_state()
    sample(_logits(4, 20), [GREEDY, SamplingParams(temperature=0.0, top_k=3)] * 2, [None] * 4)
    assert torch.equal(state, torch.get_rng_state())


def test_plain_sampling_does_not_sort(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_sort(*args: object, **kwargs: object) -> None:
        raise AssertionError("no row uses top-k/top-p, yet the vocabulary was sorted")

    monkeypatch.setattr(torch, "sort", no_sort)
    out = sample(_logits(4, 20), [PLAIN, GREEDY, SamplingParams(temperature=0.5), PLAIN], [None] * 4)
    assert len(out.token_ids) == 4


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0, top_k=1),
        SamplingParams(temperature=2.0, top_p=1e-6),
        SamplingParams(temperature=0.7, top_k=5, top_p=1e-6),
    ],
    ids=["top_k=1", "tiny top_p", "top_k+tiny top_p"],
)
def test_degenerate_filters_equal_greedy(params: SamplingParams) -> None:
    logits = _logits(64, 100, seed=3)
    out = sample(logits, [params] * 64, [None] * 64)
    assert out.token_ids == logits.argmax(dim=-1).tolist()


def test_top_k_support() -> None:
    row = _logits(1, 40, seed=4)[0]
    tokens = _draws(row, SamplingParams(temperature=1.5, top_k=5), 4000)
    assert set(tokens.tolist()) == set(torch.topk(row, 5).indices.tolist())


def test_top_p_support() -> None:
    row = _logits(1, 40, seed=5)[0] / 3.0
    allowed = _nucleus(torch.softmax(row / 0.8, dim=-1), 0.75)
    assert 1 < len(allowed) < 40
    tokens = _draws(row, SamplingParams(temperature=0.8, top_p=0.75), 4000)
    assert set(tokens.tolist()) == allowed


def test_top_p_applies_after_top_k() -> None:
    row = torch.tensor([4.0, 3.9, 3.8, 3.7, 0.0, -1.0])
    top_k_probs = torch.softmax(row[:3], dim=-1)
    allowed = _nucleus(top_k_probs, 0.5)
    assert allowed == {0, 1}
    tokens = _draws(row, SamplingParams(temperature=1.0, top_k=3, top_p=0.5), 3000)
    assert set(tokens.tolist()) == allowed


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.7),
        SamplingParams(temperature=1.3, top_k=5),
        SamplingParams(temperature=1.0, top_p=0.8),
    ],
    ids=["temperature", "top_k", "top_p"],
)
def test_empirical_distribution_matches_softmax(params: SamplingParams) -> None:
    row = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])
    scaled = row / params.temperature
    if params.top_k is not None:
        scaled = scaled.masked_fill(scaled < torch.topk(scaled, params.top_k).values[-1], float("-inf"))
    expected = torch.softmax(scaled, dim=-1)
    if params.top_p < 1.0:
        keep = torch.zeros(8, dtype=torch.bool)
        keep[list(_nucleus(expected, params.top_p))] = True
        expected = torch.where(keep, expected, 0.0)
        expected = expected / expected.sum()
    tokens = _draws(row, params, 20000)
    counts = torch.bincount(tokens, minlength=8).double()
    assert counts[expected == 0].sum() == 0
    # Fewer than 8 degrees of freedom: chi-square above 30 has p < 1e-4.
    assert _chi_square(counts, expected.double()) < 30.0


def test_seeded_rows_ignore_batch_companions_and_order() -> None:
    vocab_size = 200
    seeded = {
        "a": (SamplingParams(temperature=1.0, seed=11), _logits(1, vocab_size, seed=21)[0]),
        "b": (
            SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=12),
            _logits(1, vocab_size, seed=22)[0],
        ),
    }
    others = [
        (PLAIN, _logits(1, vocab_size, seed=30)[0]),
        (GREEDY, _logits(1, vocab_size, seed=31)[0]),
        (SamplingParams(top_k=3, seed=99), _logits(1, vocab_size, seed=32)[0]),
        (SamplingParams(top_p=0.5), _logits(1, vocab_size, seed=33)[0]),
    ]

    def run(layout: list[str | int], steps: int = 8) -> dict[str, list[int]]:
        """Sample ``steps`` steps of a batch laid out as named seeded rows and indices into others."""
        rows = [seeded[x] if isinstance(x, str) else others[x] for x in layout]
        generators = [make_generator(p.seed, "cpu") if p.seed is not None else None for p, _ in rows]
        logits = torch.stack([row_logits for _, row_logits in rows])
        tokens: dict[str, list[int]] = {name: [] for name in seeded}
        for _ in range(steps):
            out = sample(logits, [p for p, _ in rows], generators)
            for x, token_id in zip(layout, out.token_ids, strict=True):
                if isinstance(x, str):
                    tokens[x].append(token_id)
        return tokens

    alone_a = run(["a"])["a"]
    alone_b = run(["b"])["b"]
    for layout in (["a", "b"], ["b", 0, 1, "a"], [3, 2, "a", 0, "b", 1, 2]):
        got = run(layout)
        assert got["a"] == alone_a
        assert got["b"] == alone_b
    assert len(set(alone_a)) > 1  # really sampled, not a constant


def test_seeded_generator_advances_each_step() -> None:
    params = SamplingParams(temperature=1.0, seed=5)
    logits = _logits(1, 1000, seed=6)
    generator = make_generator(5, "cpu")
    tokens = [sample(logits, [params], [generator]).token_ids[0] for _ in range(10)]
    assert len(set(tokens)) > 1
    replay = make_generator(5, "cpu")
    assert tokens == [sample(logits, [params], [replay]).token_ids[0] for _ in range(10)]
    other_seed = make_generator(6, "cpu")
    assert tokens != [sample(logits, [params], [other_seed]).token_ids[0] for _ in range(10)]


def test_make_generator_accepts_any_int_seed() -> None:
    a = torch.rand(3, generator=make_generator(-1, "cpu"))
    b = torch.rand(3, generator=make_generator(2**64 - 1, "cpu"))
    assert torch.equal(a, b)
    torch.rand(3, generator=make_generator(2**80 + 7, "cpu"))


def test_banned_ids_are_never_sampled() -> None:
    logits = _logits(1, 30, seed=7)
    logits[0, 4] = logits[0, 9] = 50.0
    num_draws = 3000
    params = [SamplingParams(temperature=2.0), SamplingParams(temperature=1.0, top_k=2), GREEDY]
    for p in params:
        out = sample(logits.expand(num_draws, -1), [p] * num_draws, [None] * num_draws, [{4, 9}] * num_draws)
        assert not {4, 9} & set(out.token_ids)
    mixed = sample(logits.expand(2, -1), [GREEDY, GREEDY], [None, None], [{4, 9}, set()])
    assert mixed.token_ids[0] not in {4, 9} and mixed.token_ids[1] == 4


def test_min_tokens_banned_ids() -> None:
    params = SamplingParams(max_tokens=10, min_tokens=3, stop_token_ids=(7, 8))
    eos = frozenset({2})
    assert min_tokens_banned_ids(params, 0, eos) == {2, 7, 8}
    assert min_tokens_banned_ids(params, 2, eos) == {2, 7, 8}
    assert min_tokens_banned_ids(params, 3, eos) == frozenset()
    ignoring = SamplingParams(max_tokens=10, min_tokens=3, stop_token_ids=(7,), ignore_eos=True)
    assert min_tokens_banned_ids(ignoring, 0, eos) == {7}
    assert min_tokens_banned_ids(SamplingParams(), 0, eos) == frozenset()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_logprobs_are_raw_log_softmax_at_chosen_ids(dtype: torch.dtype) -> None:
    logits = _logits(5, 64, seed=8)
    logits[4, 3] = 20.0  # banned below: the logprob must still count its mass
    logits = logits.to(dtype)
    params = [
        SamplingParams(temperature=0.0, logprobs=True),
        SamplingParams(temperature=0.5, top_k=4),
        SamplingParams(temperature=2.0, top_p=0.3, logprobs=True),
        SamplingParams(temperature=1.0, seed=1),
        SamplingParams(temperature=0.0),
    ]
    generators = [None, None, None, make_generator(1, "cpu"), None]
    out = sample(logits, params, generators, [set(), set(), {0}, set(), {3}])
    assert out.logprobs is not None and len(out.logprobs) == 5
    expected = torch.log_softmax(logits.float(), dim=-1)[torch.arange(5), torch.tensor(out.token_ids)]
    torch.testing.assert_close(torch.tensor(out.logprobs, dtype=torch.float32), expected)
    assert out.token_ids[0] == logits.float()[0].argmax().item()
    assert all(isinstance(t, int) and 0 <= t < 64 for t in out.token_ids)


def test_zero_noise_never_picks_a_filtered_token(monkeypatch: pytest.MonkeyPatch) -> None:
    """Exp(1) draws can be exactly 0; 0/0 would be NaN, and argmax prefers NaN to any number."""
    monkeypatch.setattr(torch.Tensor, "exponential_", lambda self, *a, **k: self.zero_())
    logits = torch.tensor([[0.0, 5.0, 1.0, 4.0]])
    out = sample(logits, [SamplingParams(top_k=2)], [None], [{1}])
    assert out.token_ids == [3]


def test_input_logits_are_not_modified() -> None:
    logits = _logits(2, 16, seed=9)
    before = logits.clone()
    sample(logits, [SamplingParams(top_k=2, top_p=0.5), GREEDY], [None, None], [{1, 2}, {3}])
    assert torch.equal(logits, before)


@pytest.mark.parametrize("device", DEVICES)
def test_mixed_batch(device: str) -> None:
    vocab_size = 300
    params = [
        GREEDY,
        SamplingParams(temperature=0.9, seed=3),
        PLAIN,
        SamplingParams(temperature=1.0, top_k=4),
        SamplingParams(temperature=1.2, top_p=0.5),
        SamplingParams(temperature=0.0, seed=4, logprobs=True),
        SamplingParams(temperature=0.6, top_k=10, top_p=0.9, seed=5),
    ]
    logits = _logits(len(params), vocab_size, seed=10).to(device)
    generators = [make_generator(p.seed, device) if p.seed is not None else None for p in params]
    out = sample(logits, params, generators)
    assert len(out.token_ids) == len(params)
    assert out.logprobs is not None and len(out.logprobs) == len(params)
    argmax = logits.argmax(dim=-1).tolist()
    assert out.token_ids[0] == argmax[0] and out.token_ids[5] == argmax[5]
    assert out.token_ids[3] in torch.topk(logits[3], 4).indices.tolist()
    assert out.token_ids[4] in _nucleus(torch.softmax(logits[4].cpu() / 1.2, dim=-1), 0.5)
    assert out.token_ids[6] in torch.topk(logits[6], 10).indices.tolist()
    again = sample(logits[1:2], params[1:2], [make_generator(3, device)])
    assert again.token_ids[0] == out.token_ids[1]


def test_bad_inputs_raise_value_error() -> None:
    logits = _logits(2, 8)
    with pytest.raises(ValueError):
        sample(logits[0], [GREEDY], [None])
    with pytest.raises(ValueError):
        sample(logits, [GREEDY], [None, None])
    with pytest.raises(ValueError):
        sample(logits, [GREEDY, GREEDY], [None])
    with pytest.raises(ValueError):
        sample(logits, [GREEDY, GREEDY], [None, None], [set()])
    with pytest.raises(ValueError):
        sample(logits, [GREEDY, GREEDY], [None, None], [{8}, set()])
    with pytest.raises(ValueError):
        sample(logits.long(), [GREEDY, GREEDY], [None, None])


# ---- logit processing: logit_bias, penalties, min_p -------------------------------------------------
def _processed(logits: list[float], params: SamplingParams, prompt: list[int] = (), output: list[int] = ()) -> list:
    history = TokenHistory(list(prompt), list(output)) if params.needs_history else None
    return process_logits(torch.tensor([logits]), [params], [history])[0].tolist()


def test_presence_and_frequency_penalties_count_the_output_only() -> None:
    logits = [1.0, 2.0, -1.0, 0.5, 3.0]
    prompt, output = [4, 4, 0], [1, 1, 1, 2]
    assert _processed(logits, SamplingParams(presence_penalty=0.5), prompt, output) == [1.0, 1.5, -1.5, 0.5, 3.0]
    assert _processed(logits, SamplingParams(frequency_penalty=0.5), prompt, output) == [1.0, 0.5, -1.5, 0.5, 3.0]
    both = SamplingParams(presence_penalty=-1.0, frequency_penalty=2.0)
    assert _processed(logits, both, prompt, output) == [1.0, 2.0 + 1.0 - 6.0, -1.0 + 1.0 - 2.0, 0.5, 3.0]
    assert _processed(logits, SamplingParams(frequency_penalty=2.0), prompt, []) == logits


def test_repetition_penalty_covers_prompt_and_output_by_sign() -> None:
    logits = [1.0, 2.0, -1.0, 0.5, 3.0]
    params = SamplingParams(repetition_penalty=2.0)
    assert _processed(logits, params, prompt=[4, 2], output=[1, 1]) == [1.0, 1.0, -2.0, 0.5, 1.5]
    assert _processed(logits, SamplingParams(repetition_penalty=0.5), [0], []) == [2.0, 2.0, -1.0, 0.5, 3.0]
    # Applied first, then the OpenAI penalties (vLLM's order).
    mixed = SamplingParams(repetition_penalty=2.0, frequency_penalty=1.0)
    assert _processed(logits, mixed, [], [1, 1]) == [1.0, 1.0 - 2.0, -1.0, 0.5, 3.0]


def test_logit_bias_adds_to_the_named_ids() -> None:
    logits = [1.0, 2.0, -1.0, 0.5]
    assert _processed(logits, SamplingParams(logit_bias=((0, 1.5), (3, -0.5)))) == [2.5, 2.0, -1.0, 0.0]


@pytest.mark.parametrize("device", DEVICES)
def test_logit_bias_forces_and_bans_tokens_greedy_and_sampled(device: str) -> None:
    logits = _logits(4, 40, seed=11).to(device)
    top = logits.argmax(dim=-1).tolist()
    forced = [SamplingParams(temperature=0.0, logit_bias=((17, 100.0),)),
              SamplingParams(temperature=1.0, logit_bias=((17, 100.0),))]
    banned = [SamplingParams(temperature=0.0, logit_bias=((top[2], -100.0),)), GREEDY]
    out = sample(logits, forced + banned, [None] * 4)
    assert out.token_ids[:2] == [17, 17]
    assert out.token_ids[2] != top[2] and out.token_ids[2] == logits[2].topk(2).indices[1].item()
    assert out.token_ids[3] == top[3]  # rows that ask for nothing are untouched
    draws = _draws(logits[0].cpu(), SamplingParams(temperature=1.0, logit_bias=((17, 100.0),)), 500)
    assert set(draws.tolist()) == {17}


@pytest.mark.parametrize("device", DEVICES)
def test_penalties_change_greedy_rows_in_a_mixed_batch(device: str) -> None:
    logits = torch.tensor([[3.0, 2.9, 0.0, -1.0]] * 3, device=device)
    history = TokenHistory([2], [0])
    params = [SamplingParams(temperature=0.0, frequency_penalty=0.2), GREEDY,
              SamplingParams(temperature=0.0, repetition_penalty=1.1)]
    out = sample(logits, params, [None] * 3, None, [history, None, history])
    assert out.token_ids == [1, 0, 1]  # 3.0 - 0.2 < 2.9; 3.0 / 1.1 < 2.9


def test_min_p_drops_tokens_below_a_fraction_of_the_top_probability() -> None:
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log()
    draws = _draws(logits, SamplingParams(temperature=1.0, min_p=0.35), 4000)  # threshold 0.175
    assert set(draws.tolist()) == {0, 1}
    counts = torch.bincount(draws, minlength=4).float()
    assert _chi_square(counts, torch.tensor([0.625, 0.375, 0.0, 0.0])) < 20.0
    assert set(_draws(logits, SamplingParams(temperature=1.0, min_p=0.0), 4000).tolist()) == {0, 1, 2, 3}
    # After temperature: at T = 0.5 the probabilities are 0.5^2 : 0.3^2 : ... so 0.15 falls below 0.1 * max too.
    assert set(_draws(logits, SamplingParams(temperature=0.5, min_p=0.1), 4000).tolist()) == {0, 1}
    assert set(_draws(logits, SamplingParams(temperature=1.0, min_p=1.0), 500).tolist()) == {0}


def test_min_p_applies_only_to_the_rows_that_ask() -> None:
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log().expand(2000, -1)
    params = [SamplingParams(min_p=0.5), PLAIN] * 1000
    torch.manual_seed(5)
    tokens = torch.tensor(sample(logits, params, [None] * 2000).token_ids)
    assert set(tokens[0::2].tolist()) == {0, 1} and set(tokens[1::2].tolist()) == {0, 1, 2, 3}


def test_no_processing_keeps_the_single_argmax(monkeypatch: pytest.MonkeyPatch) -> None:
    """Default params never reach the logit processing (the all-greedy fast path is one argmax)."""
    def fail(*args: object, **kwargs: object) -> None:
        raise AssertionError("logit processing ran for rows that asked for none")

    monkeypatch.setattr(sampler, "process_logits", fail)
    logits = _logits(3, 20)
    assert sample(logits, [GREEDY] * 3, [None] * 3).token_ids == logits.argmax(dim=-1).tolist()


def test_processing_leaves_the_input_and_logprobs_raw() -> None:
    logits = _logits(2, 16, seed=12)
    before = logits.clone()
    params = [SamplingParams(temperature=0.0, logit_bias=((5, 100.0),), logprobs=True),
              SamplingParams(temperature=0.0, presence_penalty=1.0, min_p=0.5)]
    out = sample(logits, params, [None, None], None, [None, TokenHistory([], [3])])
    assert torch.equal(logits, before) and out.token_ids[0] == 5
    assert out.logprobs[0] == pytest.approx(torch.log_softmax(logits[0], dim=-1)[5].item(), abs=1e-6)


def test_processing_bad_inputs_raise_value_error() -> None:
    logits = _logits(1, 8)
    with pytest.raises(ValueError, match="history"):
        sample(logits, [SamplingParams(frequency_penalty=1.0)], [None])
    with pytest.raises(ValueError, match="logit_bias"):
        sample(logits, [SamplingParams(logit_bias=((8, 1.0),))], [None])


@pytest.mark.parametrize(("fields", "name"), [
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -2.1}, "frequency_penalty"),
    ({"frequency_penalty": float("nan")}, "frequency_penalty"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"repetition_penalty": float("inf")}, "repetition_penalty"),
    ({"min_p": 1.1}, "min_p"),
    ({"min_p": -0.5}, "min_p"),
    ({"logit_bias": {1: 2.0}}, "logit_bias"),
    ({"logit_bias": ((1, 101.0),)}, "logit_bias"),
    ({"logit_bias": ((-1, 1.0),)}, "logit_bias"),
    ({"logit_bias": ((1, 1.0), (1, 2.0))}, "logit_bias"),
    ({"logit_bias": tuple((i, 1.0) for i in range(301))}, "logit_bias"),
])
def test_sampling_params_validation(fields: dict, name: str) -> None:
    with pytest.raises(ValueError, match=name):
        SamplingParams(**fields)


def test_sampling_params_defaults_and_vocab_check() -> None:
    p = SamplingParams()
    assert not p.needs_history and not p.processes_logits and p.min_p == 0.0
    assert SamplingParams(logit_bias=((3, 1.0),)).processes_logits
    assert not SamplingParams(logit_bias=((3, 1.0),)).needs_history
    assert SamplingParams(repetition_penalty=1.2).needs_history
    biased = SamplingParams(logit_bias=((3, 1.0), (9, -1.0)))
    biased.check_vocab(10)
    with pytest.raises(ValueError, match="logit_bias"):
        biased.check_vocab(9)


@pytest.mark.parametrize("device", DEVICES)
def test_grammar_bitmask_keeps_exactly_the_allowed_tokens_of_its_rows(device: str) -> None:
    logits = torch.zeros(3, 70, device=device)
    bitmask = allocate_bitmask(1, 70)
    bitmask.zero_()
    for token in (0, 31, 32, 69):  # bit 31 is the int32 sign bit
        bitmask[0, token // 32] |= 1 << (token % 32) if token % 32 != 31 else -(2**31)
    apply_bitmask(logits, bitmask, [1])
    assert torch.isfinite(logits[1]).nonzero().flatten().tolist() == [0, 31, 32, 69]
    assert torch.isfinite(logits[0]).all() and torch.isfinite(logits[2]).all()
    # Through the sampler: the masked row can only draw an allowed token, greedy or sampled.
    out = sample(torch.randn(2, 70, device=device), [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0)],
                 [None, None], grammar_masks=GrammarMasks(bitmask.expand(2, -1).clone(), [0, 1]))
    assert set(out.token_ids) <= {0, 31, 32, 69}
