"""closedloop: auditable reinforcement learning for LLM agents.

The package is layered (see docs/architecture.md); dependencies point downward only:
contracts -> envs -> verify -> policy -> rollout -> learn -> evaluate -> cli.
Importing this package has no side effects and imports no torch.
"""

__version__ = "0.1.0"
