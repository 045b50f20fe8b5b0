"""The HTTP front of pdserve: OpenAI-compatible API, pairing of prefill and decode workers, discovery.

It knows the workers only through the gRPC contract (``proto/pdserve/v1/worker.proto``) and imports
no engine code that needs torch: the tokenizer is loaded on its own (``tokenizing.py``).
"""
