"""Disaggregation inside one process: a prefill engine computes a prompt's KV, a decode engine with a
different layout and block size receives the bytes (planned by services/kv, copied by memcpy) and
continues. Greedy tokens must equal one engine doing both (the colocated reference)."""

from __future__ import annotations

import functools

import pytest

from services.contract.sampling_params import SamplingParams
from services.engine.engine_config import EngineConfig
from services.engine.llm_engine import LLMEngine
from services.kv.plan.planner import apply_plan, plan_transfer
from services.kv.spec.layout import BlockOrder, LayoutKind
from services.kv.spec.topology import RankRead, map_blocks
from tests.checkpoints import make_checkpoint

PROMPT = [(7 * i + 3) % 300 + 5 for i in range(37)]
GREEDY = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    directory, _ = make_checkpoint("qwen3", tmp_path_factory.mktemp("qwen3"))
    return str(directory)


def _engine(checkpoint: str, kind: LayoutKind, block_size: int) -> LLMEngine:
    return LLMEngine(EngineConfig(model=checkpoint, device="cpu", dtype="float32", kv_layout=kind,
                                  kv_block_order=BlockOrder.NHD, block_size=block_size, num_kv_blocks=64))


def _prefill(prefill: LLMEngine, request_id: str, prompt: list[int]):
    request = prefill.add_request(request_id, prompt, SamplingParams(max_tokens=1, temperature=0.0),
                                  hold_kv_on_finish=True)
    finals = []
    while prefill.has_unfinished_requests():
        finals += [o for o in prefill.step() if o.request_id == request_id and o.finished]
    return request, finals[0]


def _copy_kv(prefill: LLMEngine, decode: LLMEngine, src_blocks: list[int], dst_request) -> None:
    start = dst_request.num_cached_tokens
    pieces = map_blocks(src_blocks, prefill.kv_layout.block_size(0), dst_request.block_ids[0],
                        decode.kv_layout.block_size(0), dst_request.num_prompt_tokens, start)
    heads = prefill.kv_layout.num_kv_heads
    plan = plan_transfer(prefill.kv_layout, decode.kv_layout, 0, pieces, RankRead(0, (0, heads), (0, heads)))
    apply_plan(plan, prefill.kv_cache.buffers, decode.kv_cache.buffers)


def _decode_rest(decode: LLMEngine, request_id: str, first_token: int) -> list[int]:
    first = decode.complete_external_kv(request_id, first_token)
    tokens = list(first.new_token_ids)
    while decode.has_unfinished_requests():
        for out in decode.step():
            if out.request_id == request_id:
                tokens += out.new_token_ids
    return tokens


@pytest.mark.parametrize("prepared", [False, True], ids=["unprepared", "prepared"])
def test_decode_engine_resumes_from_transferred_kv(checkpoint: str, prepared: bool) -> None:
    """``prepared``: the prompt's block hashes computed while the KV is on the way (the decode worker's way);
    the completion then publishes the same prefix keys, so the second request's hit below is the same."""
    reference = _engine(checkpoint, LayoutKind.CROSS_LAYER, 4).generate([PROMPT], GREEDY)[0].token_ids

    prefill = _engine(checkpoint, LayoutKind.CROSS_LAYER, 4)
    decode = _engine(checkpoint, LayoutKind.PER_LAYER, 8)
    held, first = _prefill(prefill, "r1", PROMPT)
    assert first.token_ids == reference[:1]

    dst = decode.add_request_with_external_kv("r1", PROMPT, GREEDY)
    assert dst is not None and dst.num_cached_tokens == 0
    chain = decode.kv_manager.block_hashes.of(dst)._chains
    if prepared:
        decode.prepare_external_kv("r1")
        assert len(chain[8]) == len(PROMPT) // 8  # every full block hashed before the KV lands
        decode.prepare_external_kv("no-such-request")  # skipped, like a request aborted meanwhile
    _copy_kv(prefill, decode, held.block_ids[0], dst)
    assert prefill.release_held_kv("r1")
    assert prefill.kv_manager.pool(0).num_free_blocks == 64

    assert _decode_rest(decode, "r1", first.token_ids[0]) == reference

    # The decode side's own prefix cache now holds the prompt: a second request sharing it only
    # needs the blocks past the shared prefix.
    prompt2 = PROMPT[:32] + [11, 12, 13]
    reference2 = _engine(checkpoint, LayoutKind.CROSS_LAYER, 4).generate([prompt2], GREEDY)[0].token_ids
    held2, first2 = _prefill(prefill, "r2", prompt2)
    dst2 = decode.add_request_with_external_kv("r2", prompt2, GREEDY)
    assert dst2.num_cached_tokens == 32
    if prepared:
        decode.prepare_external_kv("r2")
    _copy_kv(prefill, decode, held2.block_ids[0], dst2)
    assert _decode_rest(decode, "r2", first2.token_ids[0]) == reference2


def test_failed_pull_recomputes_locally(checkpoint: str) -> None:
    reference = _engine(checkpoint, LayoutKind.CROSS_LAYER, 4).generate([PROMPT], GREEDY)[0].token_ids
    decode = _engine(checkpoint, LayoutKind.PER_LAYER, 8)
    assert decode.add_request_with_external_kv("r", PROMPT, GREEDY) is not None
    decode.fail_external_kv("r")  # the KV never came: the prompt is prefilled here
    tokens = []
    while decode.has_unfinished_requests():
        tokens += [t for o in decode.step() for t in o.new_token_ids]
    assert tokens == reference
    assert decode.kv_manager.pool(0).num_free_blocks == 64


def test_a_quarantined_pull_keeps_its_blocks_until_released_and_frees_its_id(checkpoint: str) -> None:
    """A READ that could not be cancelled: its blocks stay out of the pool (none may go to another
    request), the request id is free at once (the prompt is prefilled under it), release frees them."""
    reference = _engine(checkpoint, LayoutKind.CROSS_LAYER, 4).generate([PROMPT], GREEDY)[0].token_ids
    decode = _engine(checkpoint, LayoutKind.PER_LAYER, 8)
    reserved = decode.add_request_with_external_kv("r", PROMPT, GREEDY)
    blocks = set(reserved.block_ids[0])
    key = decode.quarantine_external_kv("r")
    assert decode.kv_manager.pool(0).num_free_blocks == 64 - len(blocks) and decode.scheduler.pulls.num_quarantined == 1
    decode.add_request("r", PROMPT, GREEDY)  # the same id, prefilled here while the blocks stay aside
    tokens = []
    while decode.has_unfinished_requests():
        step = decode.step()
        tokens += [t for o in step for t in o.new_token_ids]
        running = [set(r.block_ids[0]) for r in decode.scheduler._running]  # noqa: SLF001
        assert all(not (b & blocks) for b in running), "a quarantined block went to another request"
    assert tokens == reference
    assert decode.kv_manager.pool(0).num_free_blocks == 64 - len(blocks)
    assert decode.release_quarantined_kv(key) and not decode.release_quarantined_kv(key)
    assert decode.kv_manager.pool(0).num_free_blocks == 64 and decode.scheduler.pulls.num_quarantined == 0


def test_bad_first_token_is_refused(checkpoint: str) -> None:
    decode = _engine(checkpoint, LayoutKind.PER_LAYER, 8)
    decode.add_request_with_external_kv("r", PROMPT, GREEDY)
    with pytest.raises(ValueError, match="vocabulary"):
        decode.complete_external_kv("r", 10**9)


def test_parts_pulled_so_far_are_published_before_the_request_completes(checkpoint: str) -> None:
    """KV sent per chunk: the blocks of the parts pulled so far go into the prefix cache at once, so a request
    sharing them hits them while the first still waits for its last part; both decode like one engine."""
    make = functools.partial(_engine, checkpoint, LayoutKind.CROSS_LAYER, 4)
    reference = make().generate([PROMPT], GREEDY)[0].token_ids
    sharer = PROMPT[:20] + [11, 12, 13]
    reference2 = make().generate([sharer], GREEDY)[0].token_ids

    prefill, decode = make(), _engine(checkpoint, LayoutKind.PER_LAYER, 8)
    held, first = _prefill(prefill, "r1", PROMPT)
    dst = decode.add_request_with_external_kv("r1", PROMPT, GREEDY)
    _copy_kv(prefill, decode, held.block_ids[0], dst)  # the bytes of every part; the engine is told of 24 tokens
    decode.prepare_external_kv("r1", 24)
    second = decode.add_request("r2", sharer, GREEDY)
    tokens2 = []
    for _ in range(100):  # r1 waits for its KV all along: step until r2 is done
        outs = [o for o in decode.step() if o.request_id == "r2"]
        tokens2 += [t for o in outs for t in o.new_token_ids]
        assert second.num_cached_tokens == 16  # the full 8-token blocks of the 20 shared tokens: r1 still waits
        if any(o.finished for o in outs):
            break
    assert tokens2 == reference2
    assert _decode_rest(decode, "r1", first.token_ids[0]) == reference
