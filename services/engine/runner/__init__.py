"""One rank's runtime and what runs a step on it (rank 0 and TP followers build it the same way).

``rank_runtime`` (model shard, KV layout, KV cache, runner, decode graphs), ``step`` (the values a step
passes around: ``Chunk``, ``StepLogits``, ``DeviceTokens``), ``model_runner`` (chunks in, logits out;
never sees the scheduler), ``cuda_graphs`` (captured decode steps) and ``sampler`` (tokens and
logprobs from logits, batched on the device).
"""
