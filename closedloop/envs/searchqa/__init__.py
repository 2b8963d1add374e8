"""SearchQA, a ReAct environment: ``search`` and ``answer`` over a small fictional corpus shipped
in the package, retrieved with BM25 (``bm25s``, local), answers matched strictly (padding and
hedging fail). The package is ``searchqa_package`` (``closedloop.envs.searchqa.package``).
"""

from closedloop.envs.searchqa.matching import is_correct, normalize
from closedloop.envs.searchqa.rules import ENV_VERSION, TOOLS, SearchQARules

__all__ = ["ENV_VERSION", "TOOLS", "SearchQARules", "is_correct", "normalize"]
