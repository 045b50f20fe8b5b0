"""KV sent per prefill chunk, with a real prefill daemon and real NIXL between processes.

The prefill daemon computes in chunks of 8 tokens; this process reads each part ticket of ``PrefillStream``
into an engine of the other layout and block size (cross-layer 4 -> per-layer 8, and per-layer 8 ->
cross-layer 4), and its KV must equal, byte for byte, the KV a colocated engine of the prefill's
configuration computes. A prompt whose start this reader's prefix cache holds skips those parts (the READs
still notify); a prompt of one chunk gets one whole ticket. A Gemma-style model's sliding-window group
sends only the blocks the prompt's last window reads: its parts before the window move the full group's
bytes alone, exactly, and no block out of the window is pinned. Then the decode daemon's
``GenerateParts``: a prefill that dies mid-stream, or an abort on either side, leaves no block pinned or
reserved anywhere, and the request still completes (prefilled on the decode worker).
"""

from __future__ import annotations

import asyncio
import time
import uuid

import grpc
import pytest
import torch

from services.contract.sampling_params import SamplingParams
from services.contract.wire import sampling_to_proto
from services.engine.engine_config import EngineConfig
from services.engine.llm_engine import LLMEngine
from services.kv.nixl.agent import TransferAgent
from services.kv.ranks.kv_rank import LocalKVRank
from services.kv.reader.errors import TicketError
from services.kv.reader.puller import KVPuller
from services.kv.spec.layout import KVLayoutSpec, LayoutKind
from services.kv.spec.wire import prompt_hash
from services.launch.spawn import daemons
from services.proto_gen.pdserve.v1 import kv_pb2, worker_pb2, worker_pb2_grpc
from services.worker.kv_ranks import kv_identity
from tests.checkpoints import make_checkpoint

CHUNK = 8
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
PREFILL_ARGS = ("--kv-layout", "cross_layer", "--block-size", "4", "--num-kv-blocks", "256", "--dtype", "float32",
                "--max-num-batched-tokens", str(CHUNK), "--kv-lease-s", "60")
# The prefill daemon runs on its default device (CUDA where there is one); the colocated reference the
# pulled bytes are compared with runs there too, the reading engine on CPU.
PREFILL_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DECODE_ARGS = ("--kv-layout", "per_layer", "--block-size", "8", "--num-kv-blocks", "128", "--dtype", "float32")
# (prefill layout, prefill block size, reader layout, reader block size): each layout on each side, the
# coarser blocks on either; parts end on multiples of lcm(4, 8) = 8 tokens (one chunk) in both.
LAYOUT_PAIRS = {"P-cross4-R-per8": (LayoutKind.CROSS_LAYER, 4, LayoutKind.PER_LAYER, 8),
                "P-per8-R-cross4": (LayoutKind.PER_LAYER, 8, LayoutKind.CROSS_LAYER, 4)}


def _prefill_args(layout: LayoutKind, block_size: int) -> tuple[str, ...]:
    return ("--kv-layout", layout.value, "--block-size", str(block_size), "--num-kv-blocks", "256",
            "--dtype", "float32", "--max-num-batched-tokens", str(CHUNK), "--kv-lease-s", "60")


def _prompt(seed: int, n: int) -> list[int]:
    return [(37 * i + 11 * seed) % 300 + 3 for i in range(n)]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    directory, _ = make_checkpoint("llama", tmp_path_factory.mktemp("ckpt"))
    return str(directory)


def _engine(checkpoint: str, layout: LayoutKind, block_size: int, chunk: int = 2048, device: str = "cpu"
            ) -> LLMEngine:
    return LLMEngine(EngineConfig(model=checkpoint, device=device, dtype="float32", kv_layout=layout,
                                  block_size=block_size, num_kv_blocks=128, max_num_batched_tokens=chunk))


def _puller(reader: LLMEngine, agent: TransferAgent) -> KVPuller:
    """A puller reading into ``reader``'s KV through ``agent`` (this process: one TP rank)."""
    return KVPuller(engine_id="reader", identity=kv_identity(reader),
                    ranks=[LocalKVRank(agent, reader.kv_layout, reader.kv_cache.buffers)],
                    handshake_timeout_s=10, transfer_timeout_s=20)


def _token_kv(engine: LLMEngine, tables: list[list[int]], n: int) -> torch.Tensor:
    """Every layer's K and V of tokens 0..n-1, read through the request's block tables: [layers, 2, n, h, d]."""
    return torch.stack(list(_layer_kv(engine, tables, n).values()))


def _layer_kv(engine: LLMEngine, tables: list[list[int]], n: int) -> dict[int, torch.Tensor]:
    """Per layer with KV of its own, K and V of tokens 0..n-1 through the request's block tables: [2, n, h, d]
    (a sliding group's tokens before its window are read through placeholders: compare only the window)."""
    out = {}
    for layer, (k, v) in sorted(engine.kv_cache.views.items()):
        group = engine.kv_layout.group_of_layer(layer)
        bs, table = group.block_size, tables[group.group_id]
        out[layer] = torch.stack([torch.stack([view[table[t // bs], t % bs] for t in range(n)])
                                  for view in (k, v)]).cpu()
    return out


def _colocated_run(engine: LLMEngine, prompt: list[int], final_chunk_cap: tuple[int, int] | None = None
                   ) -> tuple[LLMEngine, list[list[int]], list[int]]:
    """``prompt`` prefilled on ``engine`` with its blocks held (its last chunk capped as a prefill worker's
    ``--kv-final-part-tokens`` caps it), and its greedy tokens: (engine, tables, tokens)."""
    held = engine.add_request("ref", prompt, SamplingParams(max_tokens=1, temperature=0.0),
                              hold_kv_on_finish=True, final_chunk_cap=final_chunk_cap)
    while engine.has_unfinished_requests():
        engine.step()
    return engine, held.block_ids, engine.generate([prompt], GREEDY)[0].token_ids


def _colocated(checkpoint: str, prompt: list[int], layout: LayoutKind = LayoutKind.CROSS_LAYER,
               block_size: int = 4, chunk: int = CHUNK, final_chunk_cap: tuple[int, int] | None = None
               ) -> tuple[torch.Tensor, list[int]]:
    """The prefill's configuration run colocated: the prompt's KV after its prefill, and its greedy tokens."""
    engine, tables, tokens = _colocated_run(
        _engine(checkpoint, layout, block_size, chunk=chunk, device=PREFILL_DEVICE), prompt, final_chunk_cap)
    return _token_kv(engine, tables, len(prompt)), tokens


async def _prefill_parts(stub: worker_pb2_grpc.PrefillWorkerStub, rid: str, prompt: list[int],
                         reader_block_size: int = 8) -> list[worker_pb2.PrefillPart]:
    return [m async for m in stub.PrefillStream(worker_pb2.PrefillRequest(
        request_id=rid, prompt_token_ids=prompt, params=sampling_to_proto(GREEDY), reader_tp_size=1,
        reader_block_size=reader_block_size))]


def _tickets(messages: list[worker_pb2.PrefillPart], num_parts: int, num_tokens: int) -> list:
    """The part tickets then the final answer's, checked to follow each other and to be ``num_parts`` + 1."""
    tickets = [m.part for m in messages[:-1]] + [messages[-1].final.ticket]
    assert [m.HasField("final") for m in messages] == [False] * num_parts + [True]
    assert [t.part_start_token for t in tickets] == [0] + [t.num_tokens for t in tickets[:-1]]
    assert all(t.num_tokens % CHUNK == 0 for t in tickets[:-1])  # each part ends with a chunk (and a block)
    assert tickets[-1].num_tokens == num_tokens
    # A whole ticket (one chunk) says nothing of parts; a part ticket names the whole prompt.
    assert [t.num_prompt_tokens for t in tickets] == [num_tokens if num_parts else 0] * len(tickets)
    return tickets


async def _info(address: str, role: str) -> worker_pb2.WorkerInfo:
    async with grpc.aio.insecure_channel(address) as ch:
        stub = (worker_pb2_grpc.PrefillWorkerStub if role == "prefill" else worker_pb2_grpc.DecodeWorkerStub)(ch)
        return await stub.Info(worker_pb2.InfoRequest())


def decode_pulled(reader: LLMEngine, request_id: str, final: worker_pb2.PrefillResponse) -> list[int]:
    """The reader's tokens for a request whose KV it pulled: the prefill's first token, then its own greedy rest."""
    out = list(reader.complete_external_kv(request_id, final.first_token_id, final.first_logprob).new_token_ids)
    while reader.has_unfinished_requests():
        out += [t for o in reader.step() for t in o.new_token_ids]
    return out


def _wait_for(address: str, role: str, done, timeout_s: float = 10.0) -> worker_pb2.WorkerInfo:
    deadline = time.monotonic() + timeout_s
    while True:
        info = asyncio.run(_info(address, role))
        if done(info) or time.monotonic() > deadline:
            return info
        time.sleep(0.1)


@pytest.mark.parametrize("pair", list(LAYOUT_PAIRS), ids=list(LAYOUT_PAIRS))
def test_parts_pulled_as_they_come_are_byte_exact(checkpoint: str, pair: str) -> None:
    """Each part pulled as it comes, or (a reader behind its parts) the queued ones read in one pull (``earlier``):
    one READ per pair from the first one's start, checked against the sum of the parts' digests (the digest is on: a
    wrong sum fails the pull), and every part's own notification sent, so nothing stays pinned. Parts that do not
    continue each other, or one not signed as it is, are refused before anything is read."""
    prefill_layout, prefill_bs, reader_layout, reader_bs = LAYOUT_PAIRS[pair]
    reader = _engine(checkpoint, reader_layout, reader_bs)
    agent = TransferAgent(f"parts-reader-{uuid.uuid4().hex[:8]}")
    try:
        puller = _puller(reader, agent)
        long, held_here, held_too = _prompt(1, 37), _prompt(5, 24), _prompt(15, 24)
        reader.generate([held_here, held_too], GREEDY)  # in this reader's prefix cache only
        # (request, prompt, parts, its prefix cached here, the tickets each pull reads: one each when None)
        cases = [("long", long, 4, 0, None),  # parts end at 8, 16, 24, 32; the final has 32..36
                 # Both prefix caches hold its first 16 tokens: the prefill computes 16..23 (a part), then the rest.
                 ("shared", long[:16] + _prompt(2, 14), 1, 16, None),
                 # The reader holds 24 tokens: its first three parts are skipped (empty READs, still notifying).
                 ("skipped", held_here + _prompt(6, 13), 4, 24, None),
                 ("short", _prompt(3, 6), 0, 0, None),  # one chunk: one whole ticket, one pull
                 ("one-chunk", _prompt(7, CHUNK), 0, 0, None),  # exactly one chunk: no part either
                 ("middle", _prompt(11, 37), 4, 0, [[0], [1, 2, 3], [4]]),  # three parts queued behind the first
                 ("all", _prompt(12, 37), 4, 0, [[0, 1, 2, 3, 4]]),  # every part with the final one
                 ("cached", held_too + _prompt(16, 13), 4, 24, [[0, 1, 2, 3, 4]])]  # three parts held here
        with daemons(("prefill", checkpoint, _prefill_args(prefill_layout, prefill_bs))) as (p,):
            async def run_all() -> None:
                async with grpc.aio.insecure_channel(p.address) as channel:
                    stub = worker_pb2_grpc.PrefillWorkerStub(channel)
                    for rid, prompt, num_parts, num_cached, pulls in cases:
                        messages = await _prefill_parts(stub, rid, prompt, reader_bs)
                        tickets = _tickets(messages, num_parts, len(prompt))
                        puller.take(tickets, prompt_hash(prompt))  # as they arrive, for their prompt
                        request = reader.add_request_with_external_kv(rid, prompt, GREEDY)
                        assert request.num_cached_tokens == num_cached
                        if rid == "middle":
                            with pytest.raises(ValueError, match="not consecutive parts"):
                                await puller.pull(tickets[3], request.block_ids, 8, earlier=[tickets[1]])
                            forged = kv_pb2.TransferTicket()
                            forged.CopyFrom(tickets[1])
                            forged.num_tokens += CHUNK
                            with pytest.raises(TicketError, match="not signed"):
                                await puller.pull(tickets[3], request.block_ids, 8, earlier=[forged, tickets[2]])
                        for batch in pulls or [[i] for i in range(len(tickets))]:
                            parts = [tickets[i] for i in batch]
                            start = max(num_cached, parts[0].part_start_token)
                            result = await puller.pull(parts[-1], request.block_ids, min(start, parts[-1].num_tokens),
                                                       earlier=parts[:-1])
                            assert result.num_reads == 1
                            assert (result.num_bytes == 0) == (parts[-1].num_tokens <= num_cached)
                        kv, tokens = _colocated(checkpoint, prompt, prefill_layout, prefill_bs)
                        pulled = _token_kv(reader, request.block_ids, len(prompt))
                        # Every pulled token byte for byte; the reader's own cached prefix (computed in one chunk,
                        # not the prefill's chunks of 8) to rounding.
                        assert torch.equal(pulled[:, :, num_cached:], kv[:, :, num_cached:]), rid
                        torch.testing.assert_close(pulled[:, :, :num_cached], kv[:, :, :num_cached])
                        final = messages[-1].final
                        assert decode_pulled(reader, rid, final) == tokens, rid

            asyncio.run(run_all())
            # Every part was read (the skipped ones' empty READs notify too, and so do the parts read with a later
            # one): nothing stays pinned.
            info = _wait_for(p.address, "prefill", lambda i: i.kv_blocks_pinned == 0)
            assert info.kv_blocks_pinned == 0 and info.num_running == 0
    finally:
        agent.close()


def test_a_long_prompt_ends_with_a_short_final_part(checkpoint: str) -> None:
    """``--kv-final-part-tokens 8`` with chunks of 16: a 45-token prompt runs 16, 16, 8 (the last multiple of
    8 that leaves at most 8) and 5 tokens, so its parts end at 16, 32 and 40 and the final ticket, the one a
    decode worker waits for after the first token, holds 5 tokens. Pulled part by part, the KV equals byte for
    byte a colocated engine chunking the same way, and the greedy tokens follow."""
    prompt = _prompt(8, 45)
    reader = _engine(checkpoint, LayoutKind.PER_LAYER, 8)
    agent = TransferAgent(f"parts-reader-{uuid.uuid4().hex[:8]}")
    args = (*_prefill_args(LayoutKind.CROSS_LAYER, 4), "--max-num-batched-tokens", "16", "--kv-final-part-tokens", "8")
    try:
        puller = _puller(reader, agent)
        with daemons(("prefill", checkpoint, args)) as (p,):
            async def run() -> worker_pb2.PrefillResponse:
                async with grpc.aio.insecure_channel(p.address) as channel:
                    messages = await _prefill_parts(worker_pb2_grpc.PrefillWorkerStub(channel), "capped", prompt)
                tickets = _tickets(messages, 3, len(prompt))
                puller.take(tickets, prompt_hash(prompt))
                assert [t.num_tokens for t in tickets] == [16, 32, 40, 45]
                request = reader.add_request_with_external_kv("capped", prompt, GREEDY)
                for ticket in tickets:
                    await puller.pull(ticket, request.block_ids, ticket.part_start_token)
                return messages[-1].final

            final = asyncio.run(run())
        kv, tokens = _colocated(checkpoint, prompt, chunk=16, final_chunk_cap=(8, 8))
        assert torch.equal(_token_kv(reader, reader.scheduler.get_request("capped").block_ids, len(prompt)), kv)
        assert decode_pulled(reader, "capped", final) == tokens
    finally:
        agent.close()


@pytest.fixture(scope="module")
def gemma(tmp_path_factory) -> str:
    directory, _ = make_checkpoint("gemma4", tmp_path_factory.mktemp("gemma4"))
    return str(directory)


def _moved_bytes(layout: KVLayoutSpec, window_start: dict[int, int], begin: int, end: int) -> int:
    """Bytes a pull of tokens ``begin .. end`` moves into ``layout``: every token of a full group, a sliding
    group's from its window's start (``window_start``) only."""
    return sum(max(end - max(begin, window_start.get(g.group_id, 0)), 0) * layout.block_bytes(g.group_id)
               // g.block_size for g in layout.groups)


@pytest.mark.parametrize("pair", list(LAYOUT_PAIRS), ids=list(LAYOUT_PAIRS))
def test_sliding_window_parts_send_only_the_last_window(gemma: str, pair: str) -> None:
    """Gemma-4-like (a sliding group of window 16 beside a full group, KV-shared layers): a 53-token prompt
    in parts of 8. Each part moves exactly the full group's new tokens and, of the sliding group, only
    those in the last window (the later of the two sides' kept blocks: from token 36); the parts before it
    pin no sliding block; the pulled KV of every window token equals the colocated engine's to the bit."""
    prefill_layout, prefill_bs, reader_layout, reader_bs = LAYOUT_PAIRS[pair]
    prompt, twin = _prompt(8, 53), _prompt(9, 53)  # twin: the same length, nothing in common
    reader = _engine(gemma, reader_layout, reader_bs)
    sliding = [g for g in reader.kv_layout.groups if g.sliding_window is not None]
    assert len(sliding) == 1 and len(reader.kv_layout.groups) == 2 and sliding[0].sliding_window == 16
    # The window's first key is token 53 - 16 = 37: blocks of 4 keep it from token 36, blocks of 8 from 32.
    window_start = {sliding[0].group_id: 36}
    agent = TransferAgent(f"parts-gemma-{uuid.uuid4().hex[:8]}")
    try:
        puller = _puller(reader, agent)
        with daemons(("prefill", gemma, _prefill_args(prefill_layout, prefill_bs))) as (p,):
            async def run() -> None:
                async with grpc.aio.insecure_channel(p.address) as channel:
                    stub = worker_pb2_grpc.PrefillWorkerStub(channel)
                    # What a whole ticket of such a prompt holds pinned (the finished request's blocks) ...
                    await stub.Prefill(worker_pb2.PrefillRequest(
                        request_id="twin", prompt_token_ids=twin, params=sampling_to_proto(GREEDY),
                        reader_tp_size=1, reader_block_size=reader_bs))
                    held_whole = (await stub.Info(worker_pb2.InfoRequest())).kv_blocks_pinned
                    await stub.Release(worker_pb2.ReleaseRequest(request_id="twin"))
                    messages = await _prefill_parts(stub, "gemma", prompt, reader_bs)
                    tickets = _tickets(messages, 6, len(prompt))  # parts end at 8, ..., 48; the final has 48..52
                    puller.take(tickets, prompt_hash(prompt))
                    # ... and what the parts pin on top: the full group's blocks of tokens 0..47, and of the
                    # sliding group only those of the last window (tokens 36..47, blocks of 4 or 8 on this side).
                    first_kept = 37 // prefill_bs * prefill_bs
                    pinned_parts = (await stub.Info(worker_pb2.InfoRequest())).kv_blocks_pinned - held_whole
                    assert pinned_parts == 48 // prefill_bs + (48 - first_kept) // prefill_bs, pinned_parts
                    request = reader.add_request_with_external_kv("gemma", prompt, GREEDY)
                    for ticket in tickets:
                        result = await puller.pull(ticket, request.block_ids, ticket.part_start_token)
                        begin, end = ticket.part_start_token, ticket.num_tokens
                        exact = _moved_bytes(reader.kv_layout, window_start, begin, end)
                        if end < len(prompt):
                            assert result.num_bytes == exact, (begin, end, result.num_bytes, exact)
                        else:  # the prompt's last block is padded to the reader's block
                            padded = -(-end // reader_bs) * reader_bs
                            assert exact <= result.num_bytes <= _moved_bytes(reader.kv_layout, window_start,
                                                                              begin, padded), result.num_bytes

                    engine, tables, tokens = _colocated_run(
                        _engine(gemma, prefill_layout, prefill_bs, chunk=CHUNK, device=PREFILL_DEVICE), prompt)
                    reference = _layer_kv(engine, tables, len(prompt))
                    pulled = _layer_kv(reader, request.block_ids, len(prompt))
                    for layer, kv in reference.items():
                        group = reader.kv_layout.group_of_layer(layer)
                        first = len(prompt) - group.sliding_window if group.sliding_window else 0
                        assert torch.equal(pulled[layer][:, first:], kv[:, first:]), (layer, group.label)
                    final = messages[-1].final
                    out = list(reader.complete_external_kv("gemma", final.first_token_id,
                                                           final.first_logprob).new_token_ids)
                    while reader.has_unfinished_requests():
                        out += [t for o in reader.step() for t in o.new_token_ids]
                    assert out == tokens

            asyncio.run(run())
            info = _wait_for(p.address, "prefill", lambda i: i.kv_blocks_pinned == 0)
            assert info.kv_blocks_pinned == 0 and info.num_running == 0
    finally:
        agent.close()


async def _relay_then(prefill: str, decode: str, rid: str, prompt: list[int], after_first_part) -> list[int]:
    """PrefillStream into GenerateParts by hand, one part relayed, then ``after_first_part(prefill call,
    parts queue, decode call)``; the decode stream's tokens (none when it was cancelled)."""
    async with grpc.aio.insecure_channel(prefill) as pc, grpc.aio.insecure_channel(decode) as dc:
        prefill_call = worker_pb2_grpc.PrefillWorkerStub(pc).PrefillStream(worker_pb2.PrefillRequest(
            request_id=rid, prompt_token_ids=prompt, params=sampling_to_proto(GREEDY), reader_tp_size=1,
            reader_block_size=8))
        first = await prefill_call.read()
        assert first.HasField("part") and first.part.num_tokens == CHUNK
        parts: asyncio.Queue = asyncio.Queue()
        parts.put_nowait(worker_pb2.GenerateInput(start=worker_pb2.GenerateRequest(
            request_id=rid, prompt_token_ids=prompt, params=sampling_to_proto(GREEDY))))
        parts.put_nowait(worker_pb2.GenerateInput(part=first.part))

        async def inputs():
            while (item := await parts.get()) is not None:
                yield item

        decode_call = worker_pb2_grpc.DecodeWorkerStub(dc).GenerateParts(inputs())
        await after_first_part(prefill_call, parts, decode_call)
        if decode_call.cancelled():
            return []
        return [t async for chunk in decode_call for t in chunk.token_ids]


def test_prefill_dying_mid_stream_or_an_abort_frees_every_block(checkpoint: str) -> None:
    prompt = _prompt(4, 150)  # many chunks: the prefill is still computing when its first part is read
    _, reference = _colocated(checkpoint, prompt)
    with daemons(("prefill", checkpoint, PREFILL_ARGS), ("decode", checkpoint, DECODE_ARGS),
                 ("prefill", checkpoint, PREFILL_ARGS)) as (p, d, doomed):
        free_at_start = asyncio.run(_info(d.address, "decode")).kv_blocks_free

        async def kill_prefill(prefill_call, parts, decode_call) -> None:
            doomed.kill()  # the prefill worker dies mid-stream: its parts end before the last one
            prefill_call.cancel()
            parts.put_nowait(None)

        # The decode worker drops its reservation and prefills the prompt itself: the request completes.
        assert asyncio.run(_relay_then(doomed.address, d.address, "dies", prompt, kill_prefill)) == reference

        async def abort_both(prefill_call, parts, decode_call) -> None:
            prefill_call.cancel()  # the router's client went away: both calls end mid-stream
            await asyncio.sleep(0.2)  # the first part is being pulled, or was
            decode_call.cancel()

        asyncio.run(_relay_then(p.address, d.address, "aborted", prompt, abort_both))
        info = _wait_for(p.address, "prefill", lambda i: i.kv_blocks_pinned == 0 and i.num_running == 0)
        assert (info.kv_blocks_pinned, info.num_running, info.num_waiting) == (0, 0, 0)
        info = _wait_for(d.address, "decode", lambda i: i.kv_blocks_free == free_at_start and i.num_running == 0)
        assert (info.kv_blocks_free, info.num_running, info.num_waiting) == (free_at_start, 0, 0)


def test_a_refused_strict_request_ends_after_its_input_with_its_status(checkpoint: str) -> None:
    """Under require_pull a part the decode worker refuses ends the call FAILED_PRECONDITION with the reason,
    but only once the caller's input ended: a client still writing parts when the status came would lose it
    (gRPC asyncio reports INTERNAL "Internal error from Core" instead, and the router a broken worker)."""
    prompt = _prompt(5, 40)
    with daemons(("decode", checkpoint, DECODE_ARGS)) as (d,):
        free_at_start = asyncio.run(_info(d.address, "decode")).kv_blocks_free

        async def refused() -> tuple[grpc.StatusCode, str]:
            async with grpc.aio.insecure_channel(d.address) as channel:
                parts: asyncio.Queue = asyncio.Queue()
                parts.put_nowait(worker_pb2.GenerateInput(start=worker_pb2.GenerateRequest(
                    request_id="strict", prompt_token_ids=prompt, params=sampling_to_proto(GREEDY),
                    require_pull=True)))
                # Another request's part: refused before any pull, which fails a strict request at once.
                stray = worker_pb2.GenerateInput(part=kv_pb2.TransferTicket(
                    request_id="someone-else", num_tokens=CHUNK, num_prompt_tokens=len(prompt)))
                parts.put_nowait(stray)

                async def inputs():
                    while (item := await parts.get()) is not None:
                        yield item

                call = worker_pb2_grpc.DecodeWorkerStub(channel).GenerateParts(inputs())
                await asyncio.sleep(1.0)
                assert not call.done()  # refused already, but the caller is still sending
                for _ in range(20):  # the prefill's later parts, relayed back to back
                    parts.put_nowait(stray)
                parts.put_nowait(None)
                with pytest.raises(grpc.aio.AioRpcError) as refusal:
                    async for _ in call:
                        pass
                return refusal.value.code(), refusal.value.details()

        code, details = asyncio.run(refused())
        assert code == grpc.StatusCode.FAILED_PRECONDITION, details
        assert "the KV pull is required" in details and "'someone-else'" in details, details
        info = _wait_for(d.address, "decode", lambda i: i.kv_blocks_free == free_at_start and i.num_running == 0)
        assert (info.kv_blocks_free, info.num_running, info.num_waiting) == (free_at_start, 0, 0)
