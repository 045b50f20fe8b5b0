"""Text, torch-free: what the router and the engine both need to turn token ids into a client's text.

``tokenizer`` (encode, decode, chat templates, from a HF directory or a GGUF file; ``gguf_metadata``
opens the file, ``gguf_sentencepiece`` builds its SentencePiece vocabularies), ``detokenizer``
(incremental, never half a character), ``stop_strings`` (cut at a stop string, never showing part of
one), ``stream`` (the two together: the one ``TextStream`` engine and router use), ``model_ref`` (what a
``--model`` argument names, and its tokenizer) and ``default_model`` (the bundled small model); ``tool_calls``
and ``reasoning`` (sub-packages, one module per format: a model's text read into tool calls, and into
reasoning and answer, streamed; ``markers`` and ``harmony`` are what they share).
"""
