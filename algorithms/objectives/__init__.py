"""Policy objectives by name (``register_objective``) and ``objective_loss``, the policy's whole loss.

``behaviour``: the old log-probs, mismatch metrics and off-policy correction every objective
starts from. Registered: ``ppo_clip`` (PPO, clip-higher, dual clip), ``gspo``, ``gmpo``, ``cispo``, ``sapo``; each module's
doc gives its formula and paper.
"""

from . import cispo as _cispo  # noqa: F401  (registers)
from . import gmpo as _gmpo  # noqa: F401
from . import gspo as _gspo  # noqa: F401
from . import ppo as _ppo  # noqa: F401
from . import sapo as _sapo  # noqa: F401
from .behaviour import MAX_METRICS as BEHAVIOUR_MAX_METRICS
from .behaviour import Behaviour, behaviour, behaviour_mask
from .compose import objective_loss
from .registry import (
    OBJECTIVES,
    ObjectiveFn,
    ObjectiveInputs,
    check_objective,
    get_objective,
    list_objectives,
    objective_options,
    register_objective,
)

__all__ = ["BEHAVIOUR_MAX_METRICS", "OBJECTIVES", "Behaviour", "ObjectiveFn", "ObjectiveInputs", "behaviour",
           "behaviour_mask", "check_objective", "get_objective", "list_objectives", "objective_loss",
           "objective_options", "register_objective"]
