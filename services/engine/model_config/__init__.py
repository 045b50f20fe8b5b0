"""Reading a model's configuration into the frozen facts the engine computes with.

``hf`` (``ModelConfig`` from a Hugging Face config.json, per architecture), ``gemma`` (Gemma-2/3/4
specifics) and ``layers`` (per-layer attention facts: rope, KV shape, window, KV sharing).
"""
