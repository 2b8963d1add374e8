"""The engine tests share the policy tests' fixtures: the embedded tokenizer, tiny models."""

from tests.policy.conftest import (  # noqa: F401 -- fixtures, found by name
    TOOLS,
    _one_torch_thread,
    peaked_model,
    renderer,
    tiny_model,
    tokenizer,
)
