"""Shared fixtures: the embedded tokenizer (no model load) and tiny random Llama models."""

import pytest

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
