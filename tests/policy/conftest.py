"""Shared fixtures: the embedded tokenizer (no model load) and tiny random Llama models."""

import pytest
import torch

from closedloop.policy import ChatRenderer, build_tiny_model, load_embedded_tokenizer

TOOLS = [
    {"name": "read_file", "description": "Read a file.",
     "parameters": {"type": "object", "properties": {"path": {"type": "string"}},
                    "required": ["path"]}},
    {"name": "write_file", "description": "Write a file.",
     "parameters": {"type": "object",
                    "properties": {"path": {"type": "string"}, "content": {"type": "string"}},
                    "required": ["path", "content"]}},
]


@pytest.fixture(autouse=True)
def _one_torch_thread():
    """Run policy tests on one intra-op thread, restoring the setting afterwards.

    On the shared 2-core host, OpenMP threads spin-waiting for a descheduled sibling made small
    tensor ops ~4x slower (measured: a batch-8 SmolLM2 decode step 1.29 s with 2 threads vs
    0.29 s with 1 while other jobs ran). These tests check values, not speed.
    """
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tokenizer():
    return load_embedded_tokenizer()


@pytest.fixture(scope="session")
def tiny_model(tokenizer):
    return build_tiny_model(tokenizer, seed=0)


@pytest.fixture(scope="session")
def peaked_model(tokenizer):
    """A tiny model with peaked next-token distributions (top-p truncates a lot)."""
    return build_tiny_model(tokenizer, seed=1, init_std=0.3)


@pytest.fixture(scope="session")
def renderer(tokenizer):
    return ChatRenderer(tokenizer, "You repair files. Act with one tool call per turn.", TOOLS)
