"""The shopping simulator: search, open an item, select options, go back, buy; the
purchase, checked against a hidden structured request, is the outcome. The package is
``shopping_package`` (``closedloop.envs.shopping.package``).
"""

from closedloop.envs.shopping.expert import ShoppingExpert
from closedloop.envs.shopping.rules import ENV_VERSION, TOOLS, ShoppingRules
from closedloop.envs.shopping.tasks import CATALOG, FAMILY_ID, satisfies

__all__ = ["CATALOG", "ENV_VERSION", "FAMILY_ID", "TOOLS", "ShoppingExpert", "ShoppingRules",
           "satisfies"]
