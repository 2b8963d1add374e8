"""Rule-driven text environments: ``SimEnv`` over a pure ``Rules`` and an immutable
``SimState``, and the task catalogs (versioned families, content-hashed ids) they draw from.

Key-and-door, the shopping simulator and SearchQA are built on these; ``rules_package`` is the
short route from rules, a catalog, a grade and an expert plan to an ``EnvPackage``.
"""

from closedloop.contracts.package import Opening, Outcome, Rules
from closedloop.envs.sim.catalog import SimFamily, SimTask, TaskCatalog, TaskDraft, make_task_id
from closedloop.envs.sim.env import SimEnv, error_observation, error_outcome
from closedloop.envs.sim.scoring import Grade
from closedloop.envs.sim.simple import rules_package
from closedloop.envs.sim.state import SIM_STATE_FORMAT, SimCounters, SimState, decode_sim_state

__all__ = ["SIM_STATE_FORMAT", "Grade", "Opening", "Outcome", "Rules", "SimCounters", "SimEnv",
           "SimFamily", "SimState", "SimTask", "TaskCatalog", "TaskDraft", "decode_sim_state",
           "error_observation", "error_outcome", "make_task_id", "rules_package"]
