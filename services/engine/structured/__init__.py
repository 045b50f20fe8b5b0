"""Constrained decoding (``response_format``): a grammar per request masks the tokens that would leave it.

``services.contract.structured`` turns a request's spec into grammar text (torch-free: the router checks
specs with it); ``backend.py`` is the interface a grammar library implements, one file per library,
named in ``compiler.BACKENDS``; ``GrammarCompiler`` makes matchers on its own threads so neither the
event loop nor the engine's step loop waits for them; ``bitmask.py`` applies the packed masks to a
step's logits.
"""
