"""Top logprobs and prompt logprobs from the engine, checked against log-softmax of the model's own logits."""

from __future__ import annotations

import os

import pytest
import torch

from services.contract.sampling_params import SamplingParams
from services.engine.engine_config import EngineConfig
from services.engine.llm_engine import LLMEngine
from services.engine.runner.sampler import sample
from tests.checkpoints import make_checkpoint

PROMPT = [(5 * i + 11) % 250 + 3 for i in range(29)]
# The GPU machine runs this file with PDSERVE_TEST_DEVICE=cuda: CUDA graphs and pipelined decode.
DEVICE = os.environ.get("PDSERVE_TEST_DEVICE", "cpu")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    directory, _ = make_checkpoint("llama", tmp_path_factory.mktemp("llama"))
    return str(directory)


def _engine(checkpoint: str, prefix_caching: bool) -> LLMEngine:
    # Small step budget: the prompt is prefilled in chunks, so prompt logprobs cross chunk boundaries.
    return LLMEngine(EngineConfig(model=checkpoint, device=DEVICE, dtype="float32", block_size=4, num_kv_blocks=128,
                                  max_num_batched_tokens=8, enable_prefix_caching=prefix_caching))


@pytest.fixture(scope="module")
def engine(checkpoint: str) -> LLMEngine:
    return _engine(checkpoint, prefix_caching=True)


@pytest.fixture(scope="module")
def reference_engine(checkpoint: str) -> LLMEngine:
    """Computes every position each time: its return_logits cover the whole prompt."""
    return _engine(checkpoint, prefix_caching=False)


def _reference_logprobs(engine: LLMEngine, prompt: list[int], max_tokens: int) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens and log-softmax rows [prompt + output - 1, vocab] from a return_logits run."""
    out = engine.generate([prompt], SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                                                   return_logits=True))[0]
    rows = {}
    for start, logits in out.logits:
        for i in range(logits.shape[0]):
            rows[start + i] = logits[i]
    ordered = torch.stack([rows[p] for p in sorted(rows)]).float()
    return out.token_ids, ordered.log_softmax(dim=-1)


def test_top_logprobs_are_the_most_likely_tokens_at_each_output_position(engine: LLMEngine,
                                                                         reference_engine: LLMEngine) -> None:
    tokens, reference = _reference_logprobs(reference_engine, PROMPT, 6)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=True, top_logprobs=5)
    out = engine.generate([PROMPT], params)[0]
    assert out.token_ids == tokens
    assert len(out.top_logprobs) == 6
    for i, entry in enumerate(out.top_logprobs):
        row = reference[len(PROMPT) - 1 + i]
        values, ids = row.topk(5)
        assert list(entry.token_ids) == ids.tolist()
        assert entry.logprobs == pytest.approx(values.tolist(), abs=1e-4)
        # Greedy: the chosen token is the best alternative, with the same logprob.
        assert entry.token_ids[0] == out.token_ids[i]
        assert entry.logprobs[0] == pytest.approx(out.logprobs[i], abs=1e-5)


def test_rows_get_their_own_number_of_alternatives_in_one_batch(engine: LLMEngine) -> None:
    params = [SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, logprobs=True, top_logprobs=k)
              for k in (1, 20, 0)]
    outs = engine.generate([PROMPT, PROMPT[:11], PROMPT[3:]], params)
    assert [len(e.token_ids) for e in outs[0].top_logprobs] == [1, 1, 1]
    assert [len(e.token_ids) for e in outs[1].top_logprobs] == [20, 20, 20]
    assert outs[2].top_logprobs is None and len(outs[2].logprobs) == 3


def test_prompt_logprobs_score_each_prompt_token_across_chunks_and_skip_the_prefix_cache(
        engine: LLMEngine, reference_engine: LLMEngine) -> None:
    _, reference = _reference_logprobs(reference_engine, PROMPT, 1)
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True, prompt_logprobs=3)
    for _ in range(2):  # the second run would be a prefix-cache hit without prompt logprobs
        out = engine.generate([PROMPT], params)[0]
        assert out.num_cached_tokens == 0
        entries = out.prompt_logprobs
        assert entries is not None and len(entries) == len(PROMPT) and entries[0] is None
        for position in range(1, len(PROMPT)):
            row = reference[position - 1]
            entry = entries[position]
            assert entry.token_ids[0] == PROMPT[position]
            assert entry.logprobs[0] == pytest.approx(row[PROMPT[position]].item(), abs=1e-4)
            values, ids = row.topk(3)
            assert list(entry.token_ids[1:]) == ids.tolist()
            assert entry.logprobs[1:] == pytest.approx(values.tolist(), abs=1e-4)


def test_prompt_logprobs_zero_gives_only_the_prompt_tokens_own(engine: LLMEngine) -> None:
    out = engine.generate([PROMPT[:9]], SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0))[0]
    assert [len(e.token_ids) for e in out.prompt_logprobs[1:]] == [1] * 8


def test_external_first_token_gets_an_empty_entry(engine: LLMEngine) -> None:
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, logprobs=True, top_logprobs=2)
    request = engine.add_request_with_external_kv("ext", PROMPT, params)
    assert request is not None
    first = engine.complete_external_kv("ext", PROMPT[0], -1.5)
    assert first.top_logprobs is not None and first.top_logprobs[0].token_ids == ()
    engine.abort_request("ext")
    while engine.has_unfinished_requests():
        engine.step()


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
def test_sampler_top_logprobs_match_log_softmax_for_sampled_rows(device: str) -> None:
    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    params = [SamplingParams(temperature=0.7, logprobs=True, top_logprobs=4),
              SamplingParams(temperature=0.0, logprobs=True, top_logprobs=2),
              SamplingParams(temperature=0.0, logprobs=True)]
    out = sample(logits.to(device), params, [None] * 3)
    reference = logits.log_softmax(dim=-1)
    for row in range(3):
        values, ids = reference[row].topk(4)
        assert list(out.top_logprobs[row].token_ids) == ids.tolist()
        assert out.top_logprobs[row].logprobs == pytest.approx(values.tolist(), abs=1e-5)
        assert out.logprobs[row] == pytest.approx(reference[row, out.token_ids[row]].item(), abs=1e-5)


@pytest.mark.parametrize("fields", [{"top_logprobs": 21, "logprobs": True}, {"top_logprobs": 2},
                                    {"prompt_logprobs": -1}, {"prompt_logprobs": 21}])
def test_bad_logprob_counts_are_refused(fields: dict) -> None:
    with pytest.raises(ValueError, match="logprobs"):
        SamplingParams(**fields)
