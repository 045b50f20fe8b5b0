"""FP8 checkpoints: ``registry`` parses ``quantization_config`` into a frozen ``scheme.QuantScheme`` (one
parser per format: ``finegrained_fp8``, ``compressed_tensors``, ``fbgemm_fp8``); ``stream`` pairs each FP8
weight with its scales and ``dequantize`` multiplies them out in float32; ``kv_scales`` reads the per-layer
KV-cache scales some checkpoints store; ``patterns`` matches the configs' module lists."""
