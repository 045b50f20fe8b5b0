"""Why KV-content tests use a small random checkpoint (``tests/checkpoints.py``), not ``dummy:tiny``.

A test that compares greedy tokens after a pull, a transfer or a host-tier load with tokens computed
without it can only fail on wrong or missing KV if the model's output depends on what the KV holds.
The qwen2 checkpoint's does: two prompts that share only their last token are answered differently,
and a request whose prompt KV never arrived (blocks reserved, never written) strays from the
reference. ``dummy:tiny``'s does not: its greedy tokens follow from the last prompt token alone, so
the same two checks come out equal. That second half documents the reason for the switch; if the
dummy weights ever change so that it stops holding, relax it, but keep the first half.
"""

from __future__ import annotations

import pytest

from services.contract.sampling_params import SamplingParams
from services.engine.engine_config import EngineConfig
from services.engine.llm_engine import LLMEngine
from tests.checkpoints import make_checkpoint

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
# Same length, every token different but the last (ids below 320 fit the checkpoint's vocabulary).
A = [(7 * i + 3) % 300 + 10 for i in range(40)]
B = [(11 * i + 5) % 300 + 10 for i in range(39)] + [A[-1]]
C = [(13 * i + 1) % 300 + 10 for i in range(40)]  # shares no block with A or B: no prefix-cache hit


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    directory, _ = make_checkpoint("qwen2", tmp_path_factory.mktemp("qwen2"))
    return str(directory)


def _greedy_and_without_kv(model: str) -> tuple[list[int], list[int], list[int], list[int]]:
    """Greedy tokens of A and B; of C computed here; of C resumed from blocks never written (a pull
    that was skipped), with the right first token."""
    engine = LLMEngine(EngineConfig(model=model, device="cpu", dtype="float32", num_kv_blocks=32))
    a, b, c = (o.token_ids for o in engine.generate([A, B, C], GREEDY))
    engine.kv_manager.reset_prefix_cache()
    request = engine.add_request_with_external_kv("no-kv", C, GREEDY)
    assert request is not None and request.num_cached_tokens == 0
    tokens = list(engine.complete_external_kv("no-kv", c[0]).new_token_ids)
    while engine.has_unfinished_requests():
        tokens += [t for out in engine.step() if out.request_id == "no-kv" for t in out.new_token_ids]
    engine.close()
    assert len(tokens) == len(c)
    return a, b, c, tokens


def test_the_checkpoints_output_depends_on_the_whole_context(checkpoint: str) -> None:
    a, b, reference, without_kv = _greedy_and_without_kv(checkpoint)
    assert a != b
    assert without_kv != reference


def test_dummy_tiny_output_depends_only_on_the_last_token() -> None:
    a, b, reference, without_kv = _greedy_and_without_kv("dummy:tiny")
    assert a == b
    assert without_kv == reference
