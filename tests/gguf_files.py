"""Shared pieces of the tiny GGUF files the GGUF tests write: tensor shapes in llama.cpp's names."""

from __future__ import annotations

import gguf


def decoder_shapes(*, vocab: int, hidden: int, heads: int, kv_heads: int, head_dim: int, intermediate: int,
                   layers: int, tied: bool, qk_norm: bool,
                   layer_norms: tuple[str, ...] = ("attn_norm", "ffn_norm")) -> dict[str, tuple[int, ...]]:
    """Every tensor of a Llama-shaped decoder as llama.cpp names it: embeddings, output norm (and
    head unless tied), per block its ``layer_norms``, q/k/v/output, optional q/k norms, gate/up/down."""
    shapes = {"token_embd.weight": (vocab, hidden), "output_norm.weight": (hidden,)}
    if not tied:
        shapes["output.weight"] = (vocab, hidden)
    for layer in range(layers):
        block = f"blk.{layer}."
        shapes |= {block + f"{norm}.weight": (hidden,) for norm in layer_norms}
        shapes |= {
            block + "attn_q.weight": (heads * head_dim, hidden),
            block + "attn_k.weight": (kv_heads * head_dim, hidden),
            block + "attn_v.weight": (kv_heads * head_dim, hidden),
            block + "attn_output.weight": (hidden, heads * head_dim),
            block + "ffn_gate.weight": (intermediate, hidden),
            block + "ffn_up.weight": (intermediate, hidden),
            block + "ffn_down.weight": (hidden, intermediate),
        }
        if qk_norm:
            shapes |= {block + "attn_q_norm.weight": (head_dim,), block + "attn_k_norm.weight": (head_dim,)}
    return shapes


def finish(writer: gguf.GGUFWriter) -> None:
    """Write the header, metadata and tensors added so far, and close the file."""
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
