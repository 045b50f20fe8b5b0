"""End to end: logit_bias, the penalties and min_p go from the OpenAI request through the router and
both workers (the prefill samples the first token, the decode the rest) and act as in a colocated engine."""

from __future__ import annotations

import pytest

from services.contract.sampling_params import SamplingParams
from services.engine.engine_config import EngineConfig
from services.engine.llm_engine import LLMEngine
from tests.checkpoints import make_checkpoint
from tests.e2e.stack import completion_tokens, http_client, stack

MAX_TOKENS = 16
PROMPTS = [[11, 42, 42, 7, 199, 23, 5, 88, 61, 3, 250, 17], [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17]]
# Values exact in float32 (the wire's type), so the colocated engine sees the same numbers.
PENALTIES = {"frequency_penalty": 2.0, "presence_penalty": 1.0, "repetition_penalty": 2.0}


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    directory, _ = make_checkpoint("qwen2", tmp_path_factory.mktemp("qwen2"))
    return str(directory)


def test_logit_bias_penalties_and_min_p_through_the_stack(model: str) -> None:
    engine = LLMEngine(EngineConfig(model=model, device="cpu", dtype="float32", num_kv_blocks=128))
    plain = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    penalised = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, **PENALTIES)
    unpenalised_ref = [o.token_ids for o in engine.generate(PROMPTS, plain)]
    penalised_ref = [o.token_ids for o in engine.generate(PROMPTS, penalised)]
    # The penalties change these greedy outputs.
    assert all(a != b for a, b in zip(unpenalised_ref, penalised_ref, strict=True))
    with stack(model) as s:
        for prompt, unpenalised, expected in zip(PROMPTS, unpenalised_ref, penalised_ref, strict=True):
            assert completion_tokens(s.url, prompt, MAX_TOKENS, False) == unpenalised
            for stream in (False, True):
                assert completion_tokens(s.url, prompt, MAX_TOKENS, stream, **PENALTIES) == expected
            # +100 forces a token at every step, the first (prefill) and the rest (decode).
            assert completion_tokens(s.url, prompt, MAX_TOKENS, False, logit_bias={"77": 100}) == [77] * MAX_TOKENS
            # -100 bans the greedy first token.
            banned = completion_tokens(s.url, prompt, 1, False, logit_bias={str(unpenalised[0]): -100})
            assert banned != unpenalised[:1]
            # min_p = 1 keeps only the most likely token: sampling becomes greedy.
            sampled = completion_tokens(s.url, prompt, MAX_TOKENS, False, temperature=1.0, min_p=1.0)
            assert sampled == unpenalised

        with http_client(timeout=60) as client:
            url = f"{s.url}/v1/completions"
            for body, param in [({"logit_bias": {"5": 200}}, "logit_bias"),
                                ({"frequency_penalty": 3}, "frequency_penalty"),
                                ({"repetition_penalty": 0}, "repetition_penalty"), ({"min_p": 2}, "min_p")]:
                response = client.post(url, json={"prompt": PROMPTS[0], "max_tokens": 2, **body})
                assert response.status_code == 400, response.text
                assert response.json()["error"]["param"] == param
            # No tokenizer here, so the router does not know the vocabulary: the worker refuses the id.
            response = client.post(url, json={"prompt": PROMPTS[0], "max_tokens": 2, "logit_bias": {"320": 5}})
            assert response.status_code == 400, response.text
            assert "logit_bias" in response.json()["error"]["message"]
