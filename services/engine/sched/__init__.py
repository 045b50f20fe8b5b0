"""Scheduling, torch-free: ``request`` (a request's state), ``scheduler`` (continuous batching under
one token budget, chunked prefill, preemption; its docstring has the status -> container table) and
``stopping`` (stop tokens and length limits).
"""
