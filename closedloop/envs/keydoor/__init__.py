"""Key-and-door (docs/environments.md, built-in packages): the exit colour hidden until
``inspect``, macro-actions with durations, phase masks that never reveal the colour. The
package is ``keydoor_package`` (``closedloop.envs.keydoor.package``); the rules, tasks,
verifier and expert are its modules.
"""

from closedloop.envs.keydoor.expert import KeyDoorExpert
from closedloop.envs.keydoor.rules import ACTIONS, DURATIONS, ENV_VERSION, KeyDoorRules, available
from closedloop.envs.keydoor.tasks import CATALOG, FAMILY_ID

__all__ = ["ACTIONS", "CATALOG", "DURATIONS", "ENV_VERSION", "FAMILY_ID", "KeyDoorExpert",
           "KeyDoorRules", "available"]
