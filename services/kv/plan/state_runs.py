"""Which bytes of which owner rank's state slot a reading rank needs, between engines of any two TP sizes.

A state slot (``groups.StateGroupSpec``) holds, per Mamba2 layer, one TP rank's SSM state ``[heads, head_dim,
d_state]`` and conv window ``[x rows | B rows | C rows, d_conv - 1]``. A reading rank needs its own heads' SSM
rows and x rows, from whichever owner ranks hold those heads (a contiguous head range on both sides: one run per
layer and tensor per owner rank), and the B and C rows of its groups, each from ONE owner rank (the one holding the
reader's first head of that group): when a group spans ranks (Granite's one group) every owner rank has it, and
reading it once keeps the bytes moved at the ideal. Which conv row holds which channel on either side is
``MambaShape.rank_conv_rows``. Runs that continue each other on both sides are merged::

    model: 8 heads, 1 group; owner TP 1 -> reader TP 2, reader rank 1 of one layer:
        ssm  heads 4..7  <- owner heads 4..7                     one run
        conv x rows of heads 4..7, then B, then C                 x: one run; B, C: one run each (group 0)
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from services.kv.spec.groups import StateGroupSpec


@dataclass(frozen=True)
class StateRun:
    """``length`` bytes at ``src`` in the owner rank's slot to ``dst`` in the reading rank's slot."""

    src: int
    dst: int
    length: int


@functools.cache
def state_runs(owner: StateGroupSpec, owner_rank: int, reader: StateGroupSpec, reader_rank: int
               ) -> tuple[StateRun, ...]:
    """The runs reader rank ``reader_rank`` (of ``reader.tp_size``) reads from owner rank ``owner_rank`` (of
    ``owner.tp_size``); empty when that owner rank holds none of its state. Both specs are of one model. Cached:
    a pair of engines asks for the same runs on every pull (the exporter and the puller each)."""
    m = owner.mamba
    q, r = m.rank_heads(reader.tp_size, reader_rank), m.rank_heads(owner.tp_size, owner_rank)
    h0, h1 = max(q.start, r.start), min(q.stop, r.stop)
    if h0 >= h1:
        return ()
    ssm_row = owner.tensors[0].row_bytes  # one head
    conv_row = owner.tensors[1].row_bytes  # one conv channel
    # Conv rows this owner rank is the source of, as (owner row, reader row) runs of rows: the same in every layer.
    owner_rows = {channel: i for i, channel in enumerate(m.rank_conv_rows(owner.tp_size, owner_rank))}
    conv = merge_runs([StateRun(owner_rows[channel], i, 1)
                       for i, channel in enumerate(m.rank_conv_rows(reader.tp_size, reader_rank))
                       if m.conv_channel_head(channel, q.start) in r])
    runs = []
    for layer in owner.layer_ids:
        so, sr = owner.offset(layer, "ssm"), reader.offset(layer, "ssm")
        runs.append(StateRun(so + (h0 - r.start) * ssm_row, sr + (h0 - q.start) * ssm_row, (h1 - h0) * ssm_row))
        co, cr = owner.offset(layer, "conv"), reader.offset(layer, "conv")
        runs += [StateRun(co + c.src * conv_row, cr + c.dst * conv_row, c.length * conv_row) for c in conv]
    return tuple(merge_runs(runs))


def merge_runs(runs: list[StateRun]) -> list[StateRun]:
    """Runs in source order, each that continues its predecessor on both sides joined to it."""
    out: list[StateRun] = []
    for run in sorted(runs, key=lambda x: x.src):
        last = out[-1] if out else None
        if last is not None and last.src + last.length == run.src and last.dst + last.length == run.dst:
            out[-1] = StateRun(last.src, last.dst, last.length + run.length)
        else:
            out.append(run)
    return out


def state_owner_ranks(owner: StateGroupSpec, reader: StateGroupSpec, reader_rank: int) -> list[int]:
    """The owner ranks a reading rank reads state from."""
    return [r for r in range(owner.tp_size) if state_runs(owner, r, reader, reader_rank)]
