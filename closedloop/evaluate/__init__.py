"""Evaluation: statistics (pass@k, pass^k, Wilson and bootstrap intervals), held-out and
retain evaluation summaries, the go/no-go gates and the core report.

Importing this package imports only the statistics; the rest is imported from its modules
(``closedloop.evaluate.gates``, ``closedloop.evaluate.report``, ...), which load torch.
"""

from closedloop.errors import EmptySampleError, StatsInputError
from closedloop.evaluate.stats import (
    BootstrapCI,
    bootstrap_mean_ci,
    paired_bootstrap_ci,
    pass_at_k,
    pass_hat_k,
    wilson_interval,
)

__all__ = [  # noqa: RUF022 -- grouped by module, sorted within each group
    # statistics (closedloop.evaluate.stats)
    "BootstrapCI",
    "bootstrap_mean_ci",
    "paired_bootstrap_ci",
    "pass_at_k",
    "pass_hat_k",
    "wilson_interval",
    # errors
    "EmptySampleError",
    "StatsInputError",
]
