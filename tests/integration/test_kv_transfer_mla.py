"""DeepSeek-V3 (MLA) KV over real NIXL between processes: a prefill daemon computes a prompt's latent rows,
this process pulls them into an engine of the other layout and block size, byte for byte what a colocated
engine of the prefill's configuration computes, and moving exactly one latent row per token and layer.

Both whole tickets (``Prefill``) and part tickets (``PrefillStream``, chunks of 8 tokens) are pulled, with
per-layer and cross-layer layouts on either side and the coarser blocks on either; the reader then decodes
from the pulled rows and must produce the colocated engine's greedy tokens, and nothing stays pinned.
"""

from __future__ import annotations

import asyncio
import uuid

import grpc
import pytest
import torch

from services.contract.sampling_params import SamplingParams
from services.contract.wire import sampling_to_proto
from services.engine.llm_engine import LLMEngine
from services.kv.nixl.agent import TransferAgent
from services.kv.ranks.kv_rank import LocalKVRank
from services.kv.reader.puller import KVPuller
from services.kv.spec.groups import AttentionKind
from services.kv.spec.layout import LayoutKind
from services.kv.spec.wire import prompt_hash
from services.launch.spawn import daemons
from services.proto_gen.pdserve.v1 import worker_pb2, worker_pb2_grpc
from services.worker.kv_ranks import kv_identity
from tests.checkpoints import make_checkpoint
from tests.integration.test_kv_parts import (
    CHUNK,
    GREEDY,
    LAYOUT_PAIRS,
    PREFILL_DEVICE,
    _engine,
    _wait_for,
    decode_pulled,
)

# Chunk, layout pairs, reading engine and greedy params are test_kv_parts.py's (a full-attention model).
ROW = 32 + 8  # kv_lora_rank + qk_rope_head_dim of tests/checkpoints.py's deepseek_v3


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory) -> str:
    directory, _ = make_checkpoint("deepseek_v3", tmp_path_factory.mktemp("deepseek_v3"))
    return str(directory)


def _rows(engine: LLMEngine, tables: list[list[int]], n: int) -> torch.Tensor:
    """Every layer's latent rows of tokens 0..n-1 through the request's block table: [layers, n, row]."""
    out = []
    for _layer, views in sorted(engine.kv_cache.views.items()):
        (rows,) = views  # an MLA layer has one view, no V
        bs = engine.kv_layout.groups[0].block_size
        out.append(torch.stack([rows[tables[0][t // bs], t % bs, 0] for t in range(n)]).cpu())
    return torch.stack(out)


def _colocated(checkpoint: str, prompt: list[int], layout: LayoutKind, block_size: int
               ) -> tuple[torch.Tensor, list[int]]:
    """The prefill's configuration run colocated: the prompt's rows after its prefill, and its greedy tokens."""
    engine = _engine(checkpoint, layout, block_size, chunk=CHUNK, device=PREFILL_DEVICE)
    held = engine.add_request("ref", prompt, SamplingParams(max_tokens=1, temperature=0.0), hold_kv_on_finish=True)
    while engine.has_unfinished_requests():
        engine.step()
    return _rows(engine, held.block_ids, len(prompt)), engine.generate([prompt], GREEDY)[0].token_ids


def _prompt(seed: int, n: int) -> list[int]:
    return [(41 * i + 13 * seed) % 300 + 3 for i in range(n)]


def _row_bytes(num_tokens: int) -> int:
    """One latent row per token and layer (3 layers, fp32): what a pull of ``num_tokens`` tokens moves."""
    return num_tokens * 3 * ROW * 4


@pytest.mark.parametrize("pair", list(LAYOUT_PAIRS), ids=list(LAYOUT_PAIRS))
def test_mla_rows_pulled_between_processes_are_byte_exact(deepseek: str, pair: str) -> None:
    prefill_layout, prefill_bs, reader_layout, reader_bs = LAYOUT_PAIRS[pair]
    reader = _engine(deepseek, reader_layout, reader_bs)
    (group,) = reader.kv_layout.groups
    assert group.kind is AttentionKind.MLA and reader.kv_layout.group_head_dim(0) == ROW
    agent = TransferAgent(f"mla-reader-{uuid.uuid4().hex[:8]}")
    try:
        puller = KVPuller(engine_id="reader", identity=kv_identity(reader),
                          ranks=[LocalKVRank(agent, reader.kv_layout, reader.kv_cache.buffers)],
                          handshake_timeout_s=10, transfer_timeout_s=20)
        args = ("--kv-layout", prefill_layout.value, "--block-size", str(prefill_bs), "--num-kv-blocks", "256",
                "--dtype", "float32", "--max-num-batched-tokens", str(CHUNK), "--kv-lease-s", "60")
        # (request id, prompt, as parts): 32 tokens end on every block; 37 leave a partial last block.
        cases = [("whole-32", _prompt(1, 32), False), ("whole-37", _prompt(2, 37), False),
                 ("parts-29", _prompt(3, 29), True)]
        with daemons(("prefill", deepseek, args)) as (p,):
            async def run_all() -> None:
                async with grpc.aio.insecure_channel(p.address) as channel:
                    stub = worker_pb2_grpc.PrefillWorkerStub(channel)
                    for rid, prompt, as_parts in cases:
                        request = worker_pb2.PrefillRequest(
                            request_id=rid, prompt_token_ids=prompt, params=sampling_to_proto(GREEDY),
                            reader_tp_size=1, reader_block_size=reader_bs)
                        if as_parts:
                            messages = [m async for m in stub.PrefillStream(request)]
                            final = messages[-1].final
                            tickets = [m.part for m in messages[:-1]] + [final.ticket]
                            assert len(tickets) == 4  # parts end at 8, 16, 24; the final has 24..28
                        else:
                            final = await stub.Prefill(request)
                            tickets = [final.ticket]
                        local = reader.add_request_with_external_kv(rid, prompt, GREEDY)
                        assert local.num_cached_tokens == 0
                        puller.take(tickets, prompt_hash(prompt))
                        for ticket in tickets:
                            result = await puller.pull(ticket, local.block_ids, ticket.part_start_token)
                            exact = _row_bytes(ticket.num_tokens - ticket.part_start_token)
                            padded = _row_bytes(-(-ticket.num_tokens // 4) * 4 - ticket.part_start_token)
                            assert exact <= result.num_bytes <= padded, (rid, result.num_bytes, exact)
                            if ticket.num_tokens % 4 == 0:
                                assert result.num_bytes == exact, (rid, result.num_bytes, exact)
                        rows, tokens = _colocated(deepseek, prompt, prefill_layout, prefill_bs)
                        assert torch.equal(_rows(reader, local.block_ids, len(prompt)), rows), rid
                        assert decode_pulled(reader, rid, final) == tokens, rid

            asyncio.run(run_all())
            info = _wait_for(p.address, "prefill", lambda i: i.kv_blocks_pinned == 0)
            assert info.kv_blocks_pinned == 0 and info.num_running == 0
    finally:
        agent.close()
