"""The speed-of-light floors of bench/engine.py for every model family, mixtures of experts and state layers
included.

* Prefill: matmul FLOPs on the parameters a token really uses (a MoE layer: the router, the shared experts and
  the ``k`` routed experts it picks, not all of them) plus causal attention over the attention layers only
  (state layers have none; an MLA head's score and value widths are ``qk_head_dim`` and ``v_head_dim``).
* Decode: the bytes a step must read once: every weight (in the format the model holds it: MXFP4 experts at 4.25
  bits) except the routed experts no token of the batch picked
  (under uniform routing a batch of ``b`` tokens reads ``E * (1 - (1 - k/E)^b)`` of ``E`` experts per layer:
  ``k`` at batch 1), the KV of every context token as the engine's KV-cache groups hold it (an MLA group: one
  latent row per token and layer), and each request's state slot (Mamba2 layers).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RoutedExperts:
    """A model's routed experts: how many layers have them, ``num_experts`` each of ``params_per_expert``,
    ``top_k`` picked per token."""

    num_layers: int
    num_experts: int
    top_k: int
    params_per_expert: int

    def expected_read(self, tokens: int) -> float:
        """Experts per layer a batch of ``tokens`` tokens picks at least once, under uniform routing."""
        return self.num_experts * (1 - (1 - self.top_k / self.num_experts) ** tokens)


def routed_experts(mc) -> RoutedExperts | None:
    """The routed experts of a DeepSeek-V3, Qwen3-MoE, gpt-oss or Granite-4.0-H MoE config (None for a dense
    model)."""
    h = mc.hidden_size
    if mc.moe is not None:
        m = mc.moe
        layers = sum(m.is_moe_layer(i) for i in range(mc.num_layers))
        return RoutedExperts(layers, m.n_routed_experts, m.num_experts_per_tok, 3 * h * m.moe_intermediate_size)
    if mc.qwen3_moe is not None:
        q = mc.qwen3_moe
        layers = sum(q.is_moe_layer(i) for i in range(mc.num_layers))
        return RoutedExperts(layers, q.num_experts, q.num_experts_per_tok, 3 * h * q.moe_intermediate_size)
    if mc.gpt_oss is not None:  # every layer; gate/up and down with their biases
        g, i = mc.gpt_oss, mc.intermediate_size
        return RoutedExperts(mc.num_layers, g.num_experts, g.num_experts_per_tok, 3 * h * i + 2 * i + h)
    experts = mc.granite.experts if mc.granite is not None else None
    if experts is None:
        return None
    return RoutedExperts(mc.num_layers, experts.num_local_experts, experts.num_experts_per_tok,
                         3 * h * experts.intermediate_size)


def active_parameters(mc) -> int:
    """Parameters one token's forward pass multiplies with: all but the routed experts it does not pick."""
    routed = routed_experts(mc)
    unused = 0 if routed is None else routed.num_layers * (routed.num_experts - routed.top_k) * routed.params_per_expert
    return mc.num_parameters - unused


def prefill_flops(mc, tokens: int) -> float:
    """Matmul FLOPs of one causal prompt on the active parameters (2 per parameter per token), plus attention's
    scores and values over the causal half, in the attention layers."""
    widths = mc.mla.qk_head_dim + mc.mla.v_head_dim if mc.mla is not None else 2 * mc.head_dim
    attention_layers = mc.num_layers - len(mc.state_layer_ids)
    return 2 * active_parameters(mc) * tokens + widths * tokens * tokens * mc.num_heads * attention_layers


def kv_bytes_per_token(engine) -> int:
    """Bytes one context token occupies in the engine's KV-cache groups (every layer's K and V, or one latent row
    per layer in an MLA group): what a decode step reads per token of context."""
    layout = engine.kv_layout
    return sum(layout.block_bytes(g.group_id) // g.block_size for g in layout.groups)


def decode_floor_bytes(engine, weight_bytes: int, batch: int, context: int, dtype_bytes: int) -> float:
    """Bytes a decode step of ``batch`` requests at ``context`` tokens must read: the weights less the routed
    experts no request picks, the context's KV and each request's state slot."""
    routed = routed_experts(engine.model_config)
    unread = 0.0
    if routed is not None:
        unread = routed.num_layers * (routed.num_experts - routed.expected_read(batch)) * \
            expert_bytes(engine, routed, dtype_bytes)
    pool = engine.runtime.state_pool
    state = pool.spec.slot_bytes if pool is not None else 0
    return weight_bytes - unread + batch * (context * kv_bytes_per_token(engine) + state)


def expert_bytes(engine, routed: RoutedExperts, dtype_bytes: int) -> float:
    """Bytes one routed expert's weights take as the model holds them (MXFP4 experts: their blocks, scales and
    biases), read off its expert modules; ``params_per_expert`` at ``dtype_bytes`` where it has none."""
    from services.engine.models.moe import RoutedExperts as ExpertsModule

    modules = [m for m in engine.model.modules() if isinstance(m, ExpertsModule)]
    if not modules:
        return routed.params_per_expert * dtype_bytes
    total = sum(p.numel() * p.element_size() for m in modules for p in m.parameters())
    return total / sum(m.num_experts for m in modules)
