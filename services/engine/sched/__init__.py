"""Scheduling, torch-free: ``scheduler`` (continuous batching under one token budget, chunked prefill,
preemption; its docstring has the status -> container table), ``scheduler_output`` (what one step runs),
``pulls`` (requests whose KV another worker computed) and ``stopping`` (stop tokens and length limits).
"""
