"""The Mamba2 mixer (Granite-4.0-H's state layers): torch reference of the chunked scan and the one-token step.

Per token ``u`` of one request, with its state (conv window ``w``, SSM state ``h`` [heads, head_dim, d_state])::

    z, xBC, dt = in_proj(u) split               gate, conv channels, one time step per head
    xBC        = silu(conv1d([w | xBC]))        depthwise causal conv over the last d_conv inputs
    x, B, C    = xBC split                      B, C: one d_state row per group, shared by its heads
    dt         = clamp(softplus(dt + dt_bias))  A = -exp(A_log)
    h          = exp(dt A) h + dt B x^T         per head
    y          = C h + D x
    out        = out_proj(rms_norm_per_group(y * silu(z)) * norm.weight)

A prefill chunk runs the same recurrence in its chunked (SSD) form: within a scan chunk of
``chunk_size`` tokens, outputs are an attention-like masked product of C and B with the decays
``exp(cumsum(dt A))`` between positions, plus the state carried in from the chunk before; the state
is then decayed across the chunk and the chunk's inputs added. A step whose chunks are all one
token (decode) runs the recurrence directly for all requests at once. The states live in the
engine's ``StatePool`` rows (``StateBatch`` says which); both paths update them in place.

On CUDA both forms run as Triton kernels (``use_state_kernels``): a prefill step's conv and chunked scan over all
its requests at once (``ops/causal_conv_triton.py``, ``ops/ssd_scan_triton.py``), a decode step's update in two
launches (``ops/mamba_decode_triton.py``). The torch code here is the CPU path and the tests' reference.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from services.engine import ops
from services.engine.kv_cache.state_pool import StateBatch
from services.engine.model_config.granite import MambaSpec
from services.engine.models.layers import Linear, copy_weight, param, row_parallel_bias
from services.engine.parallel import ParallelConfig, all_reduce
from services.engine.triton_support import triton_import_error


class Mamba2Mixer(nn.Module):
    """One Mamba2 layer's weights (HF names: ``in_proj``, ``conv1d``, ``dt_bias``, ``A_log``, ``D``,
    ``norm``, ``out_proj``) and its forward over a step's chunks.

    Under TP a rank holds its heads (``MambaSpec.for_rank``): their rows of ``in_proj`` (z, x, dt), the conv
    channels of their x and of their groups' B and C, their ``dt_bias``/``A_log``/``D``/norm weights and their
    columns of ``out_proj``, whose output is all-reduced. One group split over the ranks (Granite-4.0-H's
    ``n_groups`` 1) has its gated norm's mean square all-reduced too. ``spec`` is the rank's, ``full`` the model's.
    """

    def __init__(self, full: MambaSpec, hidden: int, eps: float, dtype: torch.dtype, device: torch.device,
                 parallel: ParallelConfig) -> None:
        super().__init__()
        spec = full.for_rank(parallel.tp_size, parallel.tp_rank)
        self.full = full
        self.spec = spec
        self.parallel = parallel
        self.split_norm_group = parallel.tp_size > 1 and full.n_groups == 1
        self.eps = eps
        self.in_proj = Linear(hidden, spec.in_proj_width, spec.proj_bias, dtype, device)
        self.conv_weight = param(spec.conv_dim, spec.d_conv, dtype=dtype, device=device)  # HF: [conv_dim, 1, d_conv]
        self.conv_bias = param(spec.conv_dim, dtype=dtype, device=device) if spec.conv_bias else None
        self.dt_bias = param(spec.num_heads, dtype=dtype, device=device)
        self.A_log = param(spec.num_heads, dtype=dtype, device=device)
        self.D = param(spec.num_heads, dtype=dtype, device=device)
        self.norm_weight = param(spec.intermediate_size, dtype=dtype, device=device)
        self.out_proj = Linear(spec.intermediate_size, hidden, spec.proj_bias, dtype, device)

    def hf_shapes(self) -> dict[str, tuple[int, ...]]:
        """HF name (after ``mamba.``) -> shape, for every tensor of the mixer (the model's, not the rank's)."""
        s, hidden = self.full, self.out_proj.weight.shape[0]
        shapes = {"in_proj.weight": (s.in_proj_width, hidden), "conv1d.weight": (s.conv_dim, 1, s.d_conv),
                  "dt_bias": (s.num_heads,), "A_log": (s.num_heads,), "D": (s.num_heads,),
                  "norm.weight": (s.intermediate_size,), "out_proj.weight": (hidden, s.intermediate_size)}
        if s.conv_bias:
            shapes["conv1d.bias"] = (s.conv_dim,)
        if s.proj_bias:
            shapes.update({"in_proj.bias": (s.in_proj_width,), "out_proj.bias": (hidden,)})
        return shapes

    def load(self, name: str, tail: str, tensor: torch.Tensor) -> None:
        """Copy this rank's part of the HF tensor ``tail`` (after ``mamba.``) into place."""
        module, _, kind = tail.partition(".")
        if module == "out_proj":
            tensor = self.parallel.shard(tensor, 1) if kind == "weight" else row_parallel_bias(tensor, self.parallel)
        elif self.parallel.tp_size > 1:
            rows = self._rows(module)
            tensor = tensor[rows.to(tensor.device)]
        return copy_weight(name, self._hf_tensor(tail), tensor)

    def _rows(self, module: str) -> torch.Tensor:
        """The model's rows of an HF tensor this rank holds: its heads' z, x and dt, its groups' B and C."""
        f = self.full
        heads, _ = f.rank_channels(self.parallel.tp_size, self.parallel.tp_rank)
        h = torch.tensor(list(heads))
        xbc = torch.tensor(f.state_shape().rank_conv_rows(self.parallel.tp_size, self.parallel.tp_rank))
        head_rows = xbc[: len(heads) * f.head_dim]  # x's channels first: z and the norm are indexed as x is
        if module == "in_proj":  # z, xBC, dt
            return torch.cat((head_rows, f.intermediate_size + xbc, f.intermediate_size + f.conv_dim + h))
        if module == "conv1d":
            return xbc
        return head_rows if module == "norm" else h  # dt_bias, A_log, D: per head

    def _hf_tensor(self, name: str) -> torch.Tensor:
        """The parameter an HF name (after ``mamba.``) loads into, viewed in the checkpoint's shape."""
        if name == "conv1d.weight":
            return self.conv_weight.view(self.spec.conv_dim, 1, self.spec.d_conv)
        module, _, kind = name.partition(".")
        if module in ("in_proj", "out_proj"):
            return getattr(getattr(self, module), kind)
        return {"conv1d": self.conv_bias, "norm": self.norm_weight}.get(module, getattr(self, name, None))

    def forward(self, x: torch.Tensor, query_lens: list[int] | None, states: StateBatch, conv_states: torch.Tensor,
                ssm_states: torch.Tensor) -> torch.Tensor:
        """[num_tokens, hidden] -> [num_tokens, hidden]; chunk i's rows are its ``query_lens[i]`` tokens (None: one
        token each, a decode step, which a CUDA graph may capture: nothing here then asks the host). With the kernels
        (``use_state_kernels``) a prefill step runs all its requests in one set of launches (``_chunks_fused``), a
        decode step in two (``_step_fused``); otherwise each request's chunk through ``_chunk``, the reference."""
        s = self.spec
        z, xbc, dt = self.in_proj(x).split([s.intermediate_size, s.conv_dim, s.num_heads], dim=-1)
        decode = query_lens is None or max(query_lens) == 1
        kernels = use_state_kernels(x)
        if kernels and not decode:  # the kernels start fresh requests from the zero state themselves
            gated = self._chunks_fused(xbc, dt, z, query_lens, states, conv_states, ssm_states)
            return all_reduce(self.out_proj(self._fused_norm(gated).to(x.dtype)), self.parallel)
        fresh = [slot for slot, f in zip(states.slots, states.fresh, strict=True) if f]
        if fresh:  # a request (re)starting at token 0 starts from the zero state
            rows = torch.tensor(fresh, device=x.device)
            conv_states[rows] = 0
            ssm_states[rows] = 0
        if kernels:
            gated = self._step_fused(xbc, dt, z, states.slots_tensor, conv_states, ssm_states)
            return all_reduce(self.out_proj(self._fused_norm(gated).to(x.dtype)), self.parallel)
        if decode:
            y = self._step(xbc, dt, states.slots_tensor, conv_states, ssm_states)
        else:
            start, outs = 0, []
            for n, slot in zip(query_lens, states.slots, strict=True):
                outs.append(self._chunk(xbc[start:start + n], dt[start:start + n], conv_states[slot], ssm_states[slot]))
                start += n
            y = torch.cat(outs)
        return all_reduce(self.out_proj(self._gated_norm(y, z).to(x.dtype)), self.parallel)

    # ---- the two forms of the recurrence ------------------------------------------------------
    def _chunk(self, xbc: torch.Tensor, dt: torch.Tensor, conv_state: torch.Tensor,
               ssm_state: torch.Tensor) -> torch.Tensor:
        """One request's chunk of L tokens from its state; updates both states. Returns y [L, inner] (fp32)."""
        s = self.spec
        window = torch.cat((conv_state, xbc.t()), dim=1)  # [conv_dim, d_conv - 1 + L]
        conv = F.conv1d(window.unsqueeze(0), self.conv_weight.unsqueeze(1), self.conv_bias, groups=s.conv_dim)[0]
        conv_state.copy_(window[:, -(s.d_conv - 1):])
        x, b, c = self._split_conv(F.silu(conv.t()))  # [L, heads, head_dim], [L, heads, d_state] x2
        dt = self._time_step(dt)  # [L, heads]
        y, final = ssd_scan(x, dt, self._a(), b, c, ssm_state, s.chunk_size)
        ssm_state.copy_(final)
        y = y + self.D.float()[:, None] * x
        return y.reshape(len(x), s.intermediate_size)

    def _step(self, xbc: torch.Tensor, dt: torch.Tensor, slots: torch.Tensor, conv_states: torch.Tensor,
              ssm_states: torch.Tensor) -> torch.Tensor:
        """One token for each of N requests (rows ``slots``); updates their states. Returns y [N, inner] (fp32)."""
        s = self.spec
        window = torch.cat((conv_states[slots], xbc.unsqueeze(-1).to(conv_states.dtype)), dim=-1)  # [N, C, d_conv]
        conv = (window * self.conv_weight).sum(-1)
        if self.conv_bias is not None:
            conv = conv + self.conv_bias
        conv_states[slots] = window[:, :, 1:]
        x, b, c = self._split_conv(F.silu(conv))  # [N, heads, head_dim], [N, heads, d_state] x2
        dt = self._time_step(dt)  # [N, heads]
        h = ssm_states[slots]  # [N, heads, head_dim, d_state]
        h = h * torch.exp(dt * self._a())[..., None, None] + (dt[..., None] * x)[..., None] * b[:, :, None, :]
        ssm_states[slots] = h
        y = torch.einsum("nhpd,nhd->nhp", h, c) + self.D.float()[:, None] * x
        return y.reshape(len(x), s.intermediate_size)

    def _step_fused(self, xbc: torch.Tensor, dt: torch.Tensor, z: torch.Tensor, slots: torch.Tensor,
                    conv_states: torch.Tensor, ssm_states: torch.Tensor) -> torch.Tensor:
        """``_step`` in two Triton launches (``ops/mamba_decode_triton.py``), the states updated in their slots
        without gathering them; returns ``y * silu(z)`` [N, inner] (fp32), the gated norm's input."""
        from services.engine.ops import mamba_decode_triton as kernels

        s = self.spec
        conv = kernels.conv_update(xbc, conv_states, slots, self.conv_weight, self.conv_bias)
        return kernels.selective_update(conv, dt, z, ssm_states, slots, self.dt_bias, self.A_log, self.D,
                                        s.n_groups, s.time_step_limit)

    def _chunks_fused(self, xbc: torch.Tensor, dt: torch.Tensor, z: torch.Tensor, query_lens: list[int],
                      states: StateBatch, conv_states: torch.Tensor, ssm_states: torch.Tensor) -> torch.Tensor:
        """``_chunk`` for every request of a prefill step at once in Triton (``ops/causal_conv_triton.py``, then
        ``ops/ssd_scan_triton.py``): the conv and the scan from each request's slots (the zero state when it
        starts at token 0), both states updated in place; returns ``y * silu(z)`` [tokens, inner] (fp32)."""
        from services.engine.ops import causal_conv_triton, ssd_scan_triton
        from services.engine.ops.scan_chunks import scan_chunks

        s = self.spec
        table = scan_chunks(query_lens, states.slots, states.fresh, s.chunk_size, xbc.device)
        conv = causal_conv_triton.causal_conv(xbc, conv_states, self.conv_weight, self.conv_bias, table)
        x, b, c = conv.split([s.intermediate_size, s.n_groups * s.d_state, s.n_groups * s.d_state], dim=-1)
        tokens = len(conv)
        return ssd_scan_triton.ssd_chunks(
            x.view(tokens, s.num_heads, s.head_dim), dt, self.A_log, b.view(tokens, s.n_groups, s.d_state),
            c.view(tokens, s.n_groups, s.d_state), ssm_states, table, dt_bias=self.dt_bias,
            dt_limit=s.time_step_limit, d_skip=self.D, z=z)

    def _fused_norm(self, gated: torch.Tensor) -> torch.Tensor:
        """The gated norm of ``_step_fused``'s output: one fused RMSNorm launch (``ops.rms_norm``, weight applied in
        fp32 as ``_group_norm`` does) when the norm's one group is on this rank, else ``_group_norm``."""
        if self.spec.n_groups == 1 and not self.split_norm_group:
            return ops.rms_norm(gated, self.norm_weight, self.eps, 0.0)
        return self._group_norm(gated)

    # ---- shared pieces ----------------------------------------------------------------------
    def _split_conv(self, xbc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Conv output [T, conv_dim] -> x [T, heads, head_dim], B and C [T, heads, d_state] (fp32; each group's
        row repeated for its heads)."""
        s = self.spec
        t = xbc.shape[0]
        x, b, c = xbc.float().split([s.intermediate_size, s.n_groups * s.d_state, s.n_groups * s.d_state], dim=-1)
        per_group = s.num_heads // s.n_groups
        b = b.view(t, s.n_groups, s.d_state).repeat_interleave(per_group, dim=1)
        c = c.view(t, s.n_groups, s.d_state).repeat_interleave(per_group, dim=1)
        return x.view(t, s.num_heads, s.head_dim), b, c

    def _time_step(self, dt: torch.Tensor) -> torch.Tensor:
        lo, hi = self.spec.time_step_limit
        return F.softplus(dt.float() + self.dt_bias.float()).clamp(lo, hi)

    def _a(self) -> torch.Tensor:
        return -torch.exp(self.A_log.float())

    def _gated_norm(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """``y * silu(z)``, RMS-normalised per group of ``inner / n_groups`` channels, times the weight (fp32)."""
        return self._group_norm(y * F.silu(z.float()))

    def _group_norm(self, gated: torch.Tensor) -> torch.Tensor:
        """The RMS norm of the gated ``y * silu(z)`` [N, inner] per group, times the weight (fp32)."""
        s = self.spec
        g = gated.view(len(gated), s.n_groups, -1)
        if self.split_norm_group:  # the one group's channels are spread over every rank
            mean_square = all_reduce(g.pow(2).sum(-1, keepdim=True), self.parallel) / self.full.intermediate_size
        else:
            mean_square = g.pow(2).mean(-1, keepdim=True)
        g = g * torch.rsqrt(mean_square + self.eps)
        return self.norm_weight.float() * g.view(len(gated), s.intermediate_size)


def use_state_kernels(x: torch.Tensor) -> bool:
    """Whether a step on ``x`` (decode or prefill) takes the Triton kernels: the fused ops' backend decides
    (``ops``): ``auto`` on CUDA when Triton imports, ``triton`` everywhere (CPU: under the interpreter, for
    tests), ``torch`` never."""
    backend = ops.get_backend()
    if backend == "torch" or x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return False
    return backend == "triton" or (x.is_cuda and triton_import_error() is None)


def ssd_scan(x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
             state: torch.Tensor, chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The selective scan of one sequence in chunks of ``chunk_size`` (without the D skip).

    x [L, heads, head_dim], dt [L, heads], a [heads] (negative), b/c [L, heads, d_state], state
    [heads, head_dim, d_state] (the state before token 0). Returns y [L, heads, head_dim] and the
    state after the last token, all fp32. Within a chunk, with ``cum`` the running sum of ``dt a``::

        y_t = sum_{s <= t} exp(cum_t - cum_s) (c_t . b_s) dt_s x_s  +  exp(cum_t) c_t . h_in
        h_out = exp(cum_last) h_in + sum_s exp(cum_last - cum_s) dt_s x_s b_s^T
    """
    h = state.float()
    outs = []
    for start in range(0, x.shape[0], chunk_size):
        xs, dts = x[start:start + chunk_size], dt[start:start + chunk_size]
        bs, cs = b[start:start + chunk_size], c[start:start + chunk_size]
        cum = torch.cumsum(dts * a, dim=0)  # [Q, heads]
        n = len(xs)
        causal = torch.ones(n, n, dtype=torch.bool, device=x.device).tril()
        gaps = (cum[:, None, :] - cum[None, :, :]).masked_fill(~causal[..., None], float("-inf"))  # [t, s, heads]
        scores = torch.einsum("thd,shd->tsh", cs, bs) * torch.exp(gaps)
        xdt = xs * dts[..., None]
        y = torch.einsum("tsh,shp->thp", scores, xdt)
        y = y + torch.einsum("thd,hpd->thp", cs, h) * torch.exp(cum)[..., None]
        decay_to_end = torch.exp(cum[-1][None, :] - cum)  # [Q, heads]
        h = h * torch.exp(cum[-1])[:, None, None] + torch.einsum("sh,shp,shd->hpd", decay_to_end, xdt, bs)
        outs.append(y)
    return torch.cat(outs), h
