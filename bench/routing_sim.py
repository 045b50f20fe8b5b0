"""Routing simulator: KV-aware routing against least-outstanding and random at 8-256 prefill workers, the
scale these machines cannot hold, driving the router's own code.

    python bench/routing_sim.py                                  # 8/64/256 workers, every policy and workload
    python bench/routing_sim.py --workers 8 --requests-per-worker 8             # a second
    python bench/routing_sim.py --load 1.5 --json-out sim.jsonl

What is the router's own code (imported from ``services.router``, not copied): ``PairingPolicy.acquire``
and ``finish`` (the worker table, the router's outstanding counts and queued prefill work), for
KV-aware routing with a ``PrefixIndex`` and ``ScoringConfig`` (TTFT estimates, the overload valve,
predicted entries), for least-outstanding without an index. The index is fed only as a router's
subscriber feeds it: a ``KVSnapshotResponse`` per worker at the start, then ``KVEventBatch`` protos
(STORED / REMOVED block keys from ``services.contract.prefix_keys``, numbered, with the worker's
``WorkerLoad``) through ``PrefixIndex.apply_batch``, published every 20 ms (``BATCH_INTERVAL_S`` of
``services/worker/kv_events.py``) plus a network lag, and a load-only heartbeat every second.
``random`` picks a prefill worker uniformly (a baseline, not a router policy).

What is simulated: each prefill worker is an engine with a prefix cache of ``capacity`` blocks (LRU
over the same chained block keys) and a FCFS queue run in steps: a step takes queued prompts in order,
chunked, up to ``--max-batched-tokens``, and lasts ``max(step floor, tokens / prefill rate)``. A prompt's
cache hit is taken when it gets its first chunk (leading keys present, at most ``prompt - 1`` tokens);
its blocks are stored when its last chunk is done (evicting least recently used keys). TTFT is arrival
to the end of the prompt's last chunk. The rate a worker reports is measured as the engine measures it
(``services.engine.load.PrefillRate`` over its steps, so a worker running short chunks reports less than
one running long ones; each starts measured on one step of a typical prompt, as after a warm-up), or the
true rate with ``--true-rate``. Decode is not simulated: one decode worker (no block size, so the router
predicts nothing there) takes every request, and a multi-turn conversation's next turn arrives
``output_len`` decode steps plus a think time (exponential, mean ``--think-s``) after the previous prompt's
TTFT.

Costs, measured (``bench/RESULTS.md``, NVIDIA H100 80GB HBM3, 2026-11-23, dummy Llama-3.1-8B bf16):
prefill 2048 tokens in 53.79 ms (38,074 tok/s, the rate) and 512 tokens in 42.97 ms (host-bound: the
step floor), "fused elementwise kernels" run; a decode step at batch 32, 2k context, 10.13 ms, "pipelined
decode steps" run.

Workloads (``bench/routing_workloads.py``; sizes scale with the worker count N):
``shared-uniform`` / ``shared-zipf``: ``--groups-per-worker`` x N system prompts of ``--prefix-len`` plus a
``--question-len`` question each, uniform or Zipf(``--zipf-skew``) popularity; each worker's cache holds
``--groups-per-worker`` prefixes plus two requests' questions (1/N of the groups).
``multi-turn``: ``--conversations-per-worker`` x N conversations of ``--turns`` turns; a cache holds that
many whole conversations. Arrivals are Poisson at ``--load`` times the fleet's prefill capacity if nothing
were cached (N x rate / prompt tokens per request; multi-turn: per conversation, all its turns' prompts).

Reported per (workers, workload, policy): hit rate (cached / prompt tokens), cached / ideal (the ideal as
``routing_workloads`` defines it: each group's prefix, each turn's history, computed once), load
imbalance as max / median over workers of prompt tokens served, of tokens computed, of the
time-averaged queue (tokens to compute, waiting or in progress: a waiting prompt counts what its cache
hit at arrival leaves to compute, so a queue of cheap cache hits is not mistaken for overload) and of
the workers' mean TTFT, TTFT p50 / p90 / p99, and the prefill decision reasons. Everything runs in one
process, deterministic for a seed.
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import math
import random
import statistics
import sys
import time
from collections import Counter, OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import routing_workloads as wl  # noqa: E402
from bench._common import emit_json  # noqa: E402
from bench.serve import percentile  # noqa: E402
from services.contract.prefix_keys import cache_salt_for  # noqa: E402
from services.engine.load import PrefillRate  # noqa: E402
from services.proto_gen.pdserve.v1 import worker_pb2  # noqa: E402
from services.router.pairing import Assignment, PairingPolicy, Role, WorkerIdentity  # noqa: E402
from services.router.prefix_index import PrefixIndex, PromptKeys  # noqa: E402
from services.router.scoring import ScoringConfig  # noqa: E402

H100_PREFILL_TOKENS_PER_S = 2048 / 0.05379
H100_STEP_FLOOR_S = 0.04297
H100_DECODE_STEP_S = 0.01013
EVENT_INTERVAL_S = 0.02  # services/worker/kv_events.py BATCH_INTERVAL_S
HEARTBEAT_S = 1.0  # services/worker/kv_events.py HEARTBEAT_S
EXPIRE_EVERY_S = 2.0  # the router's health interval: discovery expires predicted entries that often
COMPAT_HASH = "sim"
POLICIES = ("kv-aware", "least-outstanding", "random")
WORKLOADS = ("shared-uniform", "shared-zipf", "multi-turn")


@dataclass(frozen=True)
class Costs:
    prefill_tokens_per_s: float = H100_PREFILL_TOKENS_PER_S
    step_floor_s: float = H100_STEP_FLOOR_S
    decode_step_s: float = H100_DECODE_STEP_S
    max_batched_tokens: int = 8192
    event_lag_s: float = 0.001  # worker to router, on top of the publish interval
    measured_rate: bool = True  # report the rate as the engine measures it (PrefillRate), else the true one


@dataclass
class Job:
    """One prompt through one prefill worker."""

    index: int
    keys: PromptKeys
    arrival_s: float
    ideal_tokens: int
    conversation: wl.Conversation | None = None
    turn: int = 0
    address: str = ""
    assignment: Assignment | None = None
    remaining: int | None = None  # tokens still to compute; None until its first chunk
    expected_hit: int = 0  # cached tokens when it was queued (the queue metric's estimate until admitted)
    cached_tokens: int = 0
    done_s: float | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.keys)


class SimPrefill:
    """A prefill engine: LRU prefix cache over block keys, a FCFS queue run in chunked steps, KV events."""

    def __init__(self, address: str, capacity_blocks: int, block_size: int, costs: Costs,
                 warm_up_tokens: int = 0) -> None:
        """``warm_up_tokens``: the rate starts measured on one step of that many prompt tokens (as after the
        real bench's warm-up), not unmeasured."""
        self.address = address
        self.capacity_blocks = capacity_blocks
        self.block_size = block_size
        self.salt = cache_salt_for(COMPAT_HASH)
        self.costs = costs
        self.rate = PrefillRate()
        if warm_up_tokens > 0:
            self.rate.observe(warm_up_tokens, max(costs.step_floor_s, warm_up_tokens / costs.prefill_tokens_per_s))
        self.cache: OrderedDict[bytes, None] = OrderedDict()
        self.queue: list[Job] = []
        self.busy = False
        self.pending: list[worker_pb2.KVCacheEvent] = []
        self.next_seq = 1
        self.publish_scheduled = False
        self.last_publish_s = 0.0
        self.prompt_tokens = self.computed_tokens = 0
        self._queue_tokens = 0
        self._queue_area = 0.0
        self._queue_since_s = 0.0

    # ---- queue ---------------------------------------------------------------------------------

    def enqueue(self, job: Job, now_s: float) -> None:
        self._account(now_s)
        self.queue.append(job)
        job.expected_hit = self._leading_hit(job) * self.block_size
        self._queue_tokens += job.num_tokens - job.expected_hit
        self.prompt_tokens += job.num_tokens

    def step(self) -> tuple[float, list[tuple[Job, int]]]:
        """The next step's duration and (job, tokens) chunks: queued prompts in order up to the budget."""
        budget, chunks = self.costs.max_batched_tokens, []
        for job in self.queue:
            if budget <= 0:
                break
            if job.remaining is None:
                self._admit(job)
            take = min(job.remaining, budget)
            budget -= take
            chunks.append((job, take))
        tokens = sum(take for _, take in chunks)
        return max(self.costs.step_floor_s, tokens / self.costs.prefill_tokens_per_s), chunks

    def finish_step(self, chunks: list[tuple[Job, int]], now_s: float, duration_s: float) -> list[Job]:
        """Apply a step's chunks; the jobs whose prompt is done (their blocks now cached)."""
        self._account(now_s)
        self.rate.observe(sum(take for _, take in chunks), duration_s)
        done = []
        for job, take in chunks:
            job.remaining -= take
            self.computed_tokens += take
            self._queue_tokens -= take
            if job.remaining == 0:
                job.done_s = now_s
                self._store(job)
                done.append(job)
        self.queue = [j for j in self.queue if j.done_s is None]
        return done

    def load(self) -> worker_pb2.WorkerLoad:
        waiting = [j for j in self.queue if j.remaining is None]
        return worker_pb2.WorkerLoad(
            num_running=len(self.queue) - len(waiting), num_waiting=len(waiting),
            waiting_prefill_tokens=sum(j.remaining if j.remaining is not None else j.num_tokens
                                       for j in self.queue),
            kv_blocks_free=max(self.capacity_blocks - len(self.cache), 0), kv_blocks_total=self.capacity_blocks,
            prefill_tokens_per_s=self.rate.tokens_per_s if self.costs.measured_rate else
            self.costs.prefill_tokens_per_s)

    def mean_queue_tokens(self, now_s: float) -> float:
        self._account(now_s)
        return self._queue_area / now_s if now_s > 0 else 0.0

    # ---- cache and events ----------------------------------------------------------------------

    def take_batch(self, now_s: float) -> worker_pb2.KVEventBatch:
        """Everything recorded since the last batch (nothing: a heartbeat), numbered, with the load."""
        events, self.pending = self.pending, []
        batch = worker_pb2.KVEventBatch(engine_id=self.address, epoch=1, first_seq=self.next_seq, events=events,
                                        load=self.load())
        self.next_seq += len(events)
        self.publish_scheduled, self.last_publish_s = False, now_s
        return batch

    def snapshot(self) -> worker_pb2.KVSnapshotResponse:
        return worker_pb2.KVSnapshotResponse(engine_id=self.address, epoch=1, seq=self.next_seq - 1,
                                             load=self.load())

    def _admit(self, job: Job) -> None:
        """The prompt's first chunk: its leading cached blocks are a hit (touched), the rest is computed."""
        hit = self._leading_hit(job)
        for key in job.keys.keys(self.block_size, self.salt)[:hit]:
            self.cache.move_to_end(key)
        job.cached_tokens = hit * self.block_size
        job.remaining = job.num_tokens - job.cached_tokens
        self._queue_tokens -= job.cached_tokens - job.expected_hit

    def _leading_hit(self, job: Job) -> int:
        """Leading blocks of the prompt in the cache now (at most ``prompt - 1`` tokens)."""
        limit = (job.num_tokens - 1) // self.block_size
        hit = 0
        for key in job.keys.keys(self.block_size, self.salt)[:limit]:
            if key not in self.cache:
                break
            hit += 1
        return hit

    def _store(self, job: Job) -> None:
        """Cache the prompt's blocks, freed tail first as the engine frees them (``KVCacheManager.free``): a
        prompt's last blocks are evicted before its first, so a shared prefix outlives the questions."""
        stored = []
        for key in reversed(job.keys.keys(self.block_size, self.salt)):
            if key in self.cache:
                self.cache.move_to_end(key)
            else:
                self.cache[key] = None
                stored.append(key)
        stored.reverse()
        removed = []
        while len(self.cache) > self.capacity_blocks:
            removed.append(self.cache.popitem(last=False)[0])
        for kind, keys in ((worker_pb2.KVCacheEvent.STORED, stored), (worker_pb2.KVCacheEvent.REMOVED, removed)):
            if keys:
                self.pending.append(worker_pb2.KVCacheEvent(kind=kind, group_id=0, tier=worker_pb2.KV_TIER_DEVICE,
                                                            block_size=self.block_size, block_keys=keys))

    def _account(self, now_s: float) -> None:
        self._queue_area += self._queue_tokens * (now_s - self._queue_since_s)
        self._queue_since_s = now_s


class SimRouter:
    """One router: the real ``PairingPolicy`` (with a ``PrefixIndex`` for KV-aware), or a random pick."""

    DECODE = "decode-0"

    def __init__(self, policy: str, addresses: Sequence[str], block_size: int, scoring: ScoringConfig,
                 seed: int) -> None:
        self.policy = policy
        self.index = PrefixIndex() if policy == "kv-aware" else None
        self.pairing = PairingPolicy(direct_decode_threshold=0, index=self.index, scoring=scoring)
        self.rng = random.Random(seed)
        self.addresses = list(addresses)
        self.decisions: Counter[str] = Counter()
        self.pairing.set_addresses(Role.PREFILL, self.addresses)
        for address in self.addresses:
            self.pairing.mark_healthy(Role.PREFILL, address, WorkerIdentity(
                engine_id=address, role="prefill", compat_hash=COMPAT_HASH, block_size=block_size, epoch=1))
        self.pairing.set_addresses(Role.DECODE, [self.DECODE])
        self.pairing.mark_healthy(Role.DECODE, self.DECODE, WorkerIdentity(
            engine_id=self.DECODE, role="decode", compat_hash=COMPAT_HASH, block_size=None, epoch=1))

    def route(self, job: Job, now_s: float) -> str:
        """The prefill worker for ``job``; counted on the policy until :meth:`finished`."""
        if self.policy == "random":
            self.decisions["random"] += 1
            return self.rng.choice(self.addresses)
        prompt = job.keys if self.index is not None else None
        assignment = self.pairing.acquire(job.num_tokens, prompt=prompt, now_s=now_s)
        if assignment is None or assignment.prefill is None:
            raise RuntimeError(f"the pairing policy gave no prefill worker: {assignment}")
        job.assignment = assignment
        self.decisions.update(reason for role, reason in assignment.decisions if role == Role.PREFILL.value)
        return assignment.prefill

    def finished(self, job: Job) -> None:
        if job.assignment is not None:
            self.pairing.finish(job.assignment)

    def sync(self, worker: SimPrefill, now_s: float) -> None:
        if self.index is not None:
            self.index.load_snapshot(worker.address, worker.snapshot(), now_s)

    def deliver(self, address: str, batch: worker_pb2.KVEventBatch, now_s: float) -> None:
        if self.index is not None:
            result = self.index.apply_batch(address, batch, now_s)
            if result.value != "applied":
                raise RuntimeError(f"index refused a batch from {address}: {result}")

    def expire(self, now_s: float) -> None:
        if self.index is not None:
            self.index.expire(now_s)


class Simulation:
    """The event loop: arrivals, engine steps, event batches and heartbeats, in simulated time."""

    def __init__(self, router: SimRouter, workers: Sequence[SimPrefill], costs: Costs, seed: int) -> None:
        self.router = router
        self.workers = {w.address: w for w in workers}
        self.costs = costs
        self.seed = seed
        self.jobs: list[Job] = []
        self.now_s = 0.0
        self._heap: list[tuple[float, int, str, object]] = []
        self._order = itertools.count()
        self._busy_events = 0  # events other than the periodic ticks still in the heap
        for worker in workers:
            router.sync(worker, 0.0)

    def add_request(self, request: wl.Request, ideal_tokens: int) -> None:
        job = Job(len(self.jobs), PromptKeys(request.prompt), request.arrival_s, ideal_tokens)
        self.jobs.append(job)
        self._at(request.arrival_s, "arrive", job)

    def add_conversation(self, conversation: wl.Conversation) -> None:
        self._turn(conversation, 0, conversation.messages[0], conversation.start_s, 0)

    def run(self) -> None:
        self._at(HEARTBEAT_S, "heartbeat", None, tick=True)
        self._at(EXPIRE_EVERY_S, "expire", None, tick=True)
        while self._heap:
            self.now_s, _, kind, payload = heapq.heappop(self._heap)
            if kind not in ("heartbeat", "expire"):
                self._busy_events -= 1
            getattr(self, f"_on_{kind}")(payload)

    # ---- handlers -------------------------------------------------------------------------------

    def _on_arrive(self, job: Job) -> None:
        job.address = self.router.route(job, self.now_s)
        worker = self.workers[job.address]
        worker.enqueue(job, self.now_s)
        if not worker.busy:
            self._start_step(worker)

    def _on_step(self, payload: tuple[SimPrefill, list[tuple[Job, int]], float]) -> None:
        worker, chunks, duration_s = payload
        for job in worker.finish_step(chunks, self.now_s, duration_s):
            self.router.finished(job)
            if job.conversation is not None:
                self._next_turn(job)
        if worker.pending and not worker.publish_scheduled:
            worker.publish_scheduled = True
            tick = (math.floor(self.now_s / EVENT_INTERVAL_S) + 1) * EVENT_INTERVAL_S
            self._at(tick + self.costs.event_lag_s, "publish", worker)
        worker.busy = False
        if worker.queue:
            self._start_step(worker)

    def _on_publish(self, worker: SimPrefill) -> None:
        self.router.deliver(worker.address, worker.take_batch(self.now_s), self.now_s)

    def _on_heartbeat(self, _: object) -> None:
        for worker in self.workers.values():
            if not worker.publish_scheduled and self.now_s - worker.last_publish_s >= HEARTBEAT_S:
                self.router.deliver(worker.address, worker.take_batch(self.now_s), self.now_s)
        if self._busy_events:
            self._at(self.now_s + HEARTBEAT_S, "heartbeat", None, tick=True)

    def _on_expire(self, _: object) -> None:
        self.router.expire(self.now_s)
        if self._busy_events:
            self._at(self.now_s + EXPIRE_EVERY_S, "expire", None, tick=True)

    # ---- inside ---------------------------------------------------------------------------------

    def _start_step(self, worker: SimPrefill) -> None:
        duration_s, chunks = worker.step()
        worker.busy = True
        self._at(self.now_s + duration_s, "step", (worker, chunks, duration_s))

    def _next_turn(self, job: Job) -> None:
        conversation, turn = job.conversation, job.turn + 1
        if turn >= len(conversation.messages):
            return
        rng = random.Random(f"{self.seed}-{conversation.conversation_id}-{job.turn}")
        answer = wl.random_tokens(rng, conversation.output_len)
        prompt = wl.next_prompt(job.keys.token_ids, answer, conversation.messages[turn])
        arrival_s = job.done_s + conversation.output_len * self.costs.decode_step_s + conversation.think_after(job.turn)
        self._turn(conversation, turn, prompt, arrival_s, job.num_tokens + len(answer))

    def _turn(self, conversation: wl.Conversation, turn: int, prompt: tuple[int, ...], arrival_s: float,
              history_len: int) -> None:
        block_size = next(iter(self.workers.values())).block_size
        job = Job(len(self.jobs), PromptKeys(prompt), arrival_s,
                  wl.cacheable_tokens(history_len, len(prompt), block_size), conversation, turn)
        self.jobs.append(job)
        self._at(arrival_s, "arrive", job)

    def _at(self, t: float, kind: str, payload: object, tick: bool = False) -> None:
        if not tick:
            self._busy_events += 1
        heapq.heappush(self._heap, (t, next(self._order), kind, payload))


# ---- one run ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SimParams:
    """Workload sizes (per worker, so every scale keeps the same cache pressure) and the offered load."""

    block_size: int = 16
    prefix_len: int = 2048
    question_len: int = 128
    groups_per_worker: int = 4
    requests_per_worker: int = 24
    zipf_skew: float = 1.0
    conversations_per_worker: int = 4
    turns: int = 6
    system_len: int = 1024
    message_len: int = 256
    output_len: int = 128
    think_s: float = 2.0
    load: float = 0.8
    seed: int = 0

    def turn_prompt_lens(self) -> list[int]:
        first = self.system_len + self.message_len
        return [first + t * (self.output_len + self.message_len) for t in range(self.turns)]


def capacity_blocks(workload: str, p: SimParams) -> int:
    """Each worker's cache: its share of the prefixes (or conversations) and two requests' own tokens."""
    if workload == "multi-turn":
        return wl.pool_blocks(p.conversations_per_worker, p.turn_prompt_lens()[-1],
                              p.message_len + p.output_len, p.block_size)
    return wl.pool_blocks(p.groups_per_worker, p.prefix_len, p.question_len, p.block_size)


def build(num_workers: int, workload: str, policy: str, p: SimParams, costs: Costs,
          scoring: ScoringConfig) -> Simulation:
    capacity = capacity_blocks(workload, p)
    typical = p.turn_prompt_lens()[0] if workload == "multi-turn" else p.prefix_len + p.question_len
    workers = [SimPrefill(f"prefill-{i}", capacity, p.block_size, costs, typical) for i in range(num_workers)]
    router = SimRouter(policy, [w.address for w in workers], p.block_size, scoring, p.seed)
    sim = Simulation(router, workers, costs, p.seed)
    fleet_tok_s = p.load * num_workers * costs.prefill_tokens_per_s
    if workload == "multi-turn":
        rate = fleet_tok_s / sum(p.turn_prompt_lens())
        for conversation in wl.multi_turn(p.conversations_per_worker * num_workers, p.turns, rate, p.system_len,
                                          p.message_len, p.output_len, p.think_s, p.seed):
            sim.add_conversation(conversation)
        return sim
    skew = p.zipf_skew if workload == "shared-zipf" else 0.0
    requests = wl.shared_prefix(p.requests_per_worker * num_workers, fleet_tok_s / (p.prefix_len + p.question_len),
                                p.groups_per_worker * num_workers, p.prefix_len, p.question_len, p.output_len,
                                skew, p.seed)
    for request, ideal in zip(requests, wl.ideal_cached_tokens(requests, p.block_size), strict=True):
        sim.add_request(request, ideal)
    return sim


def spread(values: Sequence[float]) -> float | None:
    """max / median (None when the median is 0: nothing to compare with)."""
    median = statistics.median(values)
    return max(values) / median if median > 0 else None


def summarize(sim: Simulation) -> dict:
    jobs = [j for j in sim.jobs if j.done_s is not None]
    if len(jobs) != len(sim.jobs):
        raise RuntimeError(f"{len(sim.jobs) - len(jobs)} simulated requests never finished")
    prompt = sum(j.num_tokens for j in jobs)
    cached = sum(j.cached_tokens for j in jobs)
    ideal = sum(j.ideal_tokens for j in jobs)
    workers = list(sim.workers.values())
    ttft = [j.done_s - j.arrival_s for j in jobs]
    by_worker: dict[str, list[float]] = {}
    for job in jobs:
        by_worker.setdefault(job.address, []).append(job.done_s - job.arrival_s)
    return {
        "requests": len(jobs), "prompt_tokens": prompt, "cached_tokens": cached, "ideal_tokens": ideal,
        "hit_rate": cached / prompt, "of_ideal": cached / ideal if ideal else None,
        "prompt_spread": spread([w.prompt_tokens for w in workers]),
        "computed_spread": spread([w.computed_tokens for w in workers]),
        "queue_spread": spread([w.mean_queue_tokens(sim.now_s) for w in workers]),
        "worker_ttft_spread": spread([statistics.mean(v) for v in by_worker.values()]),
        "ttft_p50_ms": percentile(ttft, 0.5) * 1e3, "ttft_p90_ms": percentile(ttft, 0.9) * 1e3,
        "ttft_p99_ms": percentile(ttft, 0.99) * 1e3,
        "duration_s": sim.now_s, "decisions": dict(sim.router.decisions),
        "capacity_blocks": workers[0].capacity_blocks,
    }


def run_one(num_workers: int, workload: str, policy: str, p: SimParams, costs: Costs,
            scoring: ScoringConfig) -> dict:
    started = time.perf_counter()
    sim = build(num_workers, workload, policy, p, costs, scoring)
    sim.run()
    row = {"kind": "sim", "workers": num_workers, "workload": workload, "policy": policy, **summarize(sim)}
    row["wall_s"] = time.perf_counter() - started
    return row


def runs(args: argparse.Namespace, p: SimParams, costs: Costs, scoring: ScoringConfig) -> Iterator[dict]:
    for n, workload, policy in itertools.product(args.workers, args.workloads, args.policies):
        row = run_one(n, workload, policy, p, costs, scoring)
        print(f"# {n} workers, {workload}, {policy}: {row['wall_s']:.1f} s", file=sys.stderr, flush=True)
        yield row


# ---- command line -------------------------------------------------------------------------------


def _csv(kind: type, allowed: Sequence[str] | None = None):
    def parse(text: str) -> list:
        items = [kind(x.strip()) for x in text.split(",") if x.strip()]
        bad = [x for x in items if allowed is not None and x not in allowed]
        if not items or bad:
            what = f" of {','.join(allowed)}" if allowed else ""
            raise argparse.ArgumentTypeError(f"expected a comma-separated list{what}")
        return items
    return parse


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    d = SimParams()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=_csv(int), default=[8, 64, 256], help="prefill worker counts (default 8,64,256)")
    ap.add_argument("--policies", type=_csv(str, POLICIES), default=list(POLICIES))
    ap.add_argument("--workloads", type=_csv(str, WORKLOADS), default=list(WORKLOADS))
    for name, value in vars(d).items():
        ap.add_argument(f"--{name.replace('_', '-')}", type=type(value), default=value, help=f"default {value}")
    ap.add_argument("--prefill-tokens-per-s", type=float, default=H100_PREFILL_TOKENS_PER_S,
                    help="each worker's prefill rate (default: measured, H100 8B 2k prefill)")
    ap.add_argument("--step-floor-s", type=float, default=H100_STEP_FLOOR_S)
    ap.add_argument("--max-batched-tokens", type=int, default=Costs.max_batched_tokens)
    ap.add_argument("--true-rate", action="store_true", help="workers report the true prefill rate instead of "
                    "measuring it as the engine does (services/engine/load.py PrefillRate over their steps)")
    ap.add_argument("--overload-queue-tokens", type=int, default=ScoringConfig.overload_queue_tokens,
                    help="the router's --kv-overload-queue-tokens (default as the router's)")
    ap.add_argument("--valve-gain", type=float, default=ScoringConfig.valve_gain,
                    help="the router's --kv-valve-gain (default as the router's)")
    ap.add_argument("--json", action="store_true", help="print JSON lines instead of the table")
    ap.add_argument("--json-out", default=None, help="also write the JSON lines here")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    p = SimParams(**{name: getattr(args, name) for name in vars(SimParams())})
    costs = Costs(args.prefill_tokens_per_s, args.step_floor_s, H100_DECODE_STEP_S, args.max_batched_tokens,
                  measured_rate=not args.true_rate)
    scoring = ScoringConfig(overload_queue_tokens=args.overload_queue_tokens, valve_gain=args.valve_gain)
    print(header(p, costs, scoring), file=sys.stderr if args.json else sys.stdout, flush=True)
    rows = list(runs(args, p, costs, scoring))
    if not emit_json(rows, args.json_out, args.json):
        print_table(rows)
    return 0


def header(p: SimParams, costs: Costs, scoring: ScoringConfig) -> str:
    return (f"# routing_sim: prefill {costs.prefill_tokens_per_s:.0f} tok/s per worker, step floor "
            f"{costs.step_floor_s * 1e3:.2f} ms, <= {costs.max_batched_tokens} tokens a step, reported rate "
            f"{'measured (PrefillRate)' if costs.measured_rate else 'true'}; load {p.load:g} of the "
            f"no-cache capacity; block {p.block_size}; overload valve {scoring.overload_queue_tokens} queued tokens, "
            f"gain {scoring.valve_gain:g}\n"
            f"# shared: {p.groups_per_worker} groups/worker x {p.prefix_len}-token prefix + {p.question_len}-token "
            f"question, {p.requests_per_worker} requests/worker, zipf skew {p.zipf_skew:g}; multi-turn: "
            f"{p.conversations_per_worker} conversations/worker x {p.turns} turns, system {p.system_len}, message "
            f"{p.message_len}, answer {p.output_len} tokens")


def _fmt(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def print_table(rows: list[dict]) -> None:
    cols = (("workers", 7), ("workload", 14), ("policy", 17), ("reqs", 6), ("hit", 6), ("/ideal", 6),
            ("prompt max/med", 14), ("computed", 8), ("queue", 6), ("TTFT", 6), ("TTFT p50", 9), ("p90", 6),
            ("p99 ms", 7))
    print(" ".join(f"{name:>{width}}" for name, width in cols) + "  prefill reasons")
    for r in rows:
        cells = (r["workers"], r["workload"], r["policy"], r["requests"], _fmt(r["hit_rate"], ".3f"),
                 _fmt(r["of_ideal"], ".3f"), _fmt(r["prompt_spread"], ".2f"), _fmt(r["computed_spread"], ".2f"),
                 _fmt(r["queue_spread"], ".2f"), _fmt(r["worker_ttft_spread"], ".2f"), _fmt(r["ttft_p50_ms"], ".1f"),
                 _fmt(r["ttft_p90_ms"], ".1f"), _fmt(r["ttft_p99_ms"], ".1f"))
        reasons = " ".join(f"{k}={v}" for k, v in sorted(r["decisions"].items()))
        print(" ".join(f"{c!s:>{width}}" for c, (_, width) in zip(cells, cols, strict=True)) + f"  {reasons}")


if __name__ == "__main__":
    sys.exit(main())
