"""The request contract, torch-free: what a request asks for and gets back, shared by router and workers.

``sampling_params`` (``SamplingParams``, validated once, with the bounds the router's schema reuses),
``structured`` (a ``response_format`` spec as grammar text), ``outputs`` (logprob entries) and ``wire``
(the one conversion to and from the worker proto).
"""
