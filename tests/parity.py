"""Shared steps of the parity tests: HF's greedy reference, running an engine to the end, comparing."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from services.contract.sampling_params import SamplingParams
from services.engine.llm_engine import LLMEngine
from services.engine.output_processor import RequestOutput
from services.engine.request import Request
from tests.checkpoints import make_checkpoint


@dataclass
class Reference:
    checkpoint: str
    prompts: list[list[int]]
    tokens: list[list[int]]  # HF greedy continuation of each prompt
    logits: list[torch.Tensor]  # HF logits over prompt + continuation[:-1]


def hf_reference(arch: str, directory: Path, prompt_lens: Sequence[int], num_tokens: int, *, seed: int,
                 shared_from: int, shared_len: int) -> Reference:
    """A random ``arch`` checkpoint in ``directory`` and HF's greedy reference on seeded prompts.

    Every prompt after prompt ``shared_from`` starts with its first ``shared_len`` tokens, so a
    batch of them shares a prefix (in-batch prefix sharing, then prefix-cache hits on a rerun).
    """
    checkpoint, hf = make_checkpoint(arch, directory)
    return reference_of(checkpoint, hf, prompt_lens, num_tokens, seed=seed, shared_from=shared_from,
                        shared_len=shared_len)


def reference_of(checkpoint: Path, hf, prompt_lens: Sequence[int], num_tokens: int, *, seed: int,
                 shared_from: int, shared_len: int) -> Reference:
    """HF's greedy reference of ``hf`` (saved at ``checkpoint``) on seeded prompts, those after prompt
    ``shared_from`` starting with its first ``shared_len`` tokens (as :func:`hf_reference`)."""
    rng = random.Random(seed)
    vocab = hf.config.vocab_size
    prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in prompt_lens]
    for prompt in prompts[shared_from + 1:]:
        prompt[:shared_len] = prompts[shared_from][:shared_len]
    tokens, logits = hf_greedy(hf, prompts, num_tokens)
    return Reference(str(checkpoint), prompts, tokens, logits)


def hf_greedy(hf, prompts: Sequence[Sequence[int]], num_tokens: int) -> tuple[list[list[int]], list[torch.Tensor]]:
    """HF's greedy continuation of each prompt and its logits over prompt + continuation[:-1].

    EOS is not a stop (like ``ignore_eos``): every continuation has ``num_tokens`` tokens.
    """
    hf.generation_config.eos_token_id = None
    tokens, logits = [], []
    with torch.no_grad():
        for p in prompts:
            out = hf.generate(
                torch.tensor([list(p)]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                max_new_tokens=num_tokens, do_sample=False, pad_token_id=0,
            )
            cont = out[0, len(p):].tolist()
            tokens.append(cont)
            logits.append(hf(torch.tensor([list(p) + cont[:-1]])).logits[0].float())
    return tokens, logits


def run_to_completion(engine: LLMEngine, prompts: Sequence[Sequence[int]],
                      params: SamplingParams) -> tuple[list[Request], list[RequestOutput]]:
    """Add every prompt, step until all finish; the requests and their final outputs, in order."""
    requests = [engine.add_request(f"r{i}", list(p), params) for i, p in enumerate(prompts)]
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    return requests, [finals[r.request_id] for r in requests]


def assert_matches(tokens: Sequence[Sequence[int]], logits: Sequence[torch.Tensor],
                   outputs: Sequence[RequestOutput], rel_tol: float = 1e-4) -> None:
    """Greedy tokens identical and logits within ``rel_tol`` (max abs error / max abs value).

    Every position past a prompt's cached prefix must have been computed at least once.
    """
    for i, out in enumerate(outputs):
        assert out.token_ids == tokens[i], f"prompt {i}: greedy tokens differ from HF"
        expected = logits[i]
        seen = torch.zeros(len(expected), dtype=torch.bool)
        for start, chunk in out.logits:
            end = start + len(chunk)
            rel = (chunk - expected[start:end]).abs().max() / expected[start:end].abs().max()
            assert rel < rel_tol, f"prompt {i} positions {start}..{end}: relative error {rel:.2e}"
            seen[start:end] = True
        assert seen[out.num_cached_tokens:].all()
