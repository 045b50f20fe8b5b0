"""Where weights come from: ``source`` resolves ``--model`` to a config, a weight source and a
tokenizer; ``weights`` reads safetensors (single or sharded) or makes seeded dummy weights; ``gguf``
reads a GGUF checkpoint as HF-named float32 tensors; ``quant/`` reads FP8 checkpoints' quantization schemes
and dequantizes their weights as they stream in.
"""
