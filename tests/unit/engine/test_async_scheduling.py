"""Pipelined decode steps (``EngineConfig.async_scheduling``): the next decode-graph step is launched
before the previous one's tokens reach the host. On CPU the decode graphs run uncaptured (the same
static-buffer forward), which exercises the same pipeline; tokens must equal the unpipelined engine
through stops, seeded sampling, preemption and aborts, and nothing may be left allocated."""

from __future__ import annotations

import os
import random

import pytest

from services.contract.sampling_params import SamplingParams
from services.engine.engine_config import EngineConfig
from services.engine.llm_engine import LLMEngine
from services.engine.runner.cuda_graphs import DecodeGraphRunner
from services.engine.runner.step import DeviceTokens
from services.engine.sched.scheduler_output import PLACEHOLDER_TOKEN

DEVICE = os.environ.get("PDSERVE_TEST_DEVICE", "cpu")
PROMPTS = [[random.Random(i).randrange(100, 3000) for _ in range(20 + 7 * i)] for i in range(6)]


def _engine(async_scheduling: bool, num_kv_blocks: int = 256) -> LLMEngine:
    """On CUDA (``PDSERVE_TEST_DEVICE=cuda``, the GPU machine) the engine's own captured graphs."""
    engine = LLMEngine(EngineConfig(model="dummy:tiny", device=DEVICE, dtype="float32", max_num_seqs=8,
                                    num_kv_blocks=num_kv_blocks, async_scheduling=async_scheduling))
    if engine.device.type != "cuda":
        engine.runner.decode_graphs = DecodeGraphRunner(engine.model, engine.kv_cache, 8, engine.max_model_len,
                                                        capture=False)
    return engine


def _params() -> list[SamplingParams]:
    """Lengths that differ, stop tokens met mid-stream, logprobs.

    Random weights repeat one token greedily; banning it for ``min_tokens`` outputs (a stop token
    is banned until then) makes it come back, and stop the request, at a chosen step.
    """
    greedy = [o.token_ids for o in _engine(False).generate(
        PROMPTS, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))]
    params = [SamplingParams(max_tokens=10 + i, temperature=0.0, ignore_eos=True, logprobs=True)
              if i % 2 == 0 else
              SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=True,
                             stop_token_ids=(greedy[i][0],), min_tokens=2 + i)
              for i in range(len(PROMPTS))]
    return params


@pytest.fixture(scope="module")
def params() -> list[SamplingParams]:
    return _params()


@pytest.fixture
def injections(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts steps whose input tokens were taken on the device from the step before."""
    rows: list[int] = []
    real = DeviceTokens.copy_into

    def spy(self, input_ids):
        rows.append(len(self.rows))
        real(self, input_ids)

    monkeypatch.setattr(DeviceTokens, "copy_into", spy)
    return rows


@pytest.mark.parametrize("num_kv_blocks", [256, 12])  # 12: the pool forces preemptions
def test_pipelined_decode_gives_the_same_tokens(params: list[SamplingParams], num_kv_blocks: int,
                                                injections: list[int]) -> None:
    expected = _engine(False, num_kv_blocks).generate(PROMPTS, params)
    engine = _engine(True, num_kv_blocks)
    got = engine.generate(PROMPTS, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    assert [o.finish_reason for o in got] == [o.finish_reason for o in expected]
    # A stop met mid-stream, with the next step already in flight.
    assert any(o.finish_reason == "stop" and 2 < len(o.token_ids) < 16 for o in got)
    for a, b in zip(got, expected, strict=True):
        if b.logprobs:  # the batch a row ran in may differ by a stopped row: rounding only
            assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)
    assert injections and max(injections) > 1  # steps really were pipelined
    while engine.has_step_in_flight:  # the last launched step (rows that had all stopped) drains
        engine.step()
    assert all(s.num_used == 0 for s in engine.kv_manager.stats())


def test_a_seeded_sampled_request_draws_the_same_tokens(injections: list[int]) -> None:
    """Alone, so every step's batch is the same in both modes (a sampled row can flip on the last
    bit of its logits, which a batch that differs by a stopped row may change)."""
    params = SamplingParams(max_tokens=14, temperature=0.9, top_p=0.9, seed=7, ignore_eos=True)
    expected = _engine(False).generate([PROMPTS[4]], params)[0].token_ids
    assert _engine(True).generate([PROMPTS[4]], params)[0].token_ids == expected
    assert injections


def test_async_scheduling_off_never_pipelines(params: list[SamplingParams], injections: list[int]) -> None:
    engine = _engine(False)
    engine.generate(PROMPTS, params)
    assert not injections and not engine.has_step_in_flight


def test_an_abort_while_a_step_is_in_flight_leaks_nothing(params: list[SamplingParams]) -> None:
    expected = _engine(False).generate(PROMPTS[:3], params[:3])
    engine = _engine(True)
    for i in range(4):
        engine.add_request(f"r{i}", PROMPTS[i], params[i])
    done: dict[str, list[int]] = {}
    for _ in range(6):
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.token_ids
    assert engine.has_step_in_flight
    assert engine.abort_request("r3")
    while engine.has_unfinished_requests() or engine.has_step_in_flight:
        for out in engine.step():
            assert out.request_id != "r3"
            if out.finished:
                done[out.request_id] = out.token_ids
    assert [done[f"r{i}"] for i in range(3)] == [o.token_ids for o in expected]
    assert all(PLACEHOLDER_TOKEN not in tokens for tokens in done.values())
    assert all(s.num_used == 0 for s in engine.kv_manager.stats())


def test_penalised_requests_give_the_same_tokens_and_are_not_pipelined(injections: list[int]) -> None:
    """Penalties need every output token on the host: steps with such a row wait for the previous one
    (the history includes what would still be a placeholder), and tokens equal the unpipelined engine.
    Rows without penalties (logit_bias, min_p need no history) still pipeline."""
    penalised = [SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, frequency_penalty=2.0,
                                presence_penalty=0.5),
                 SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, repetition_penalty=1.5),
                 SamplingParams(max_tokens=12, temperature=0.8, seed=3, ignore_eos=True, presence_penalty=1.5,
                                min_p=0.05)]
    prompts = PROMPTS[:3]
    sync, pipelined = _engine(False), _engine(True)
    expected = [o.token_ids for o in sync.generate(prompts, penalised)]
    plain = [o.token_ids for o in sync.generate(
        prompts, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))]
    # The frequency penalty bites (random weights repeat one token); on some weights (CUDA's) the repetition
    # penalty alone does not move row 1's argmax, so only row 0 is required to change.
    assert expected[0] != plain[0]
    assert [o.token_ids for o in pipelined.generate(prompts, penalised)] == expected
    assert not injections  # every step had a penalised row: none was pipelined

    biased = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logit_bias=((prompts[0][0], 100.0),))
    got = pipelined.generate(prompts[:2], biased)
    assert all(o.token_ids == [prompts[0][0]] * 12 for o in got)
    assert injections  # logit_bias needs no history: pipelined as before


def test_a_penalised_row_beside_plain_rows_gets_its_real_history(params: list[SamplingParams]) -> None:
    penalised = SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True, frequency_penalty=1.0)
    mixed = [*params[:3], penalised]
    prompts = PROMPTS[:4]
    expected = [o.token_ids for o in _engine(False).generate(prompts, mixed)]
    engine = _engine(True)
    assert [o.token_ids for o in engine.generate(prompts, mixed)] == expected
    while engine.has_step_in_flight:
        engine.step()
    assert all(s.num_used == 0 for s in engine.kv_manager.stats())
