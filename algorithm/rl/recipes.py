"""Algorithms by name (``FULMEN_TRAIN_ALGORITHM``): each a :class:`Recipe` of defaults for the training pieces.

One name selects a paper's whole recipe; every piece stays its own setting, and a piece set explicitly wins over
the recipe's default (``FULMEN_TRAIN_ALGORITHM=dapo FULMEN_TRAIN_CLIP_EPS_HIGH=0.3`` is DAPO with a wider
clip-higher). The recipes:

===========  =========  ===========  ===========  ======================  ========  ========
algorithm    estimator  policy_loss  aggregation  clip_eps / clip_high    dynamic   overlong
===========  =========  ===========  ===========  ======================  ========  ========
``grpo``     grpo       ppo_clip     token_mean   0.2 / (= clip_eps)      no        no
``dr_grpo``  dr_grpo    ppo_clip     token_mean   0.2 / (= clip_eps)      no        no
``rloo``     rloo       ppo_clip     token_mean   0.2 / (= clip_eps)      no        no
``dapo``     grpo       dapo         token_mean   0.2 / 0.28              yes       yes
``gspo``     grpo       gspo         seq_mean     3e-4 / 4e-4             no        no
``cispo``    grpo       cispo        token_mean   1.0 / 3.0               no        no
===========  =========  ===========  ===========  ======================  ========  ========

(dynamic: DAPO's dynamic sampling, ``dynamic_sampling``; overlong: its soft overlong punishment,
``overlong_shaping``, which also needs ``overlong_max_tokens``.) DAPO, GSPO and CISPO all compare answers to
the same prompt as GRPO does, so their estimator is ``grpo``; the names are algorithms here, not advantage
estimators (``FULMEN_TRAIN_ESTIMATOR=dapo`` is refused with a pointer to ``FULMEN_TRAIN_ALGORITHM``).

Imports no torch (``fulmen config show`` reads this): the piece names are plain strings, checked against the
torch registries when the trainer starts (``fulmen.algorithm.service.run.check_training_settings``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from enum import StrEnum

from fulmen.algorithm.rl.registry import Registry

__all__ = ["ALGORITHMS", "Algorithm", "Recipe"]


class Algorithm(StrEnum):
    """The built-in algorithms."""

    GRPO = "grpo"
    DR_GRPO = "dr_grpo"
    RLOO = "rloo"
    DAPO = "dapo"
    GSPO = "gspo"
    CISPO = "cispo"


@dataclass(frozen=True)
class Recipe:
    """Defaults for the ``TrainSection`` fields of the same names (see the module docstring's table)."""

    estimator: str
    policy_loss: str
    loss_aggregation: str = "token_mean"
    clip_eps: float = 0.2
    clip_eps_high: float | None = None
    dynamic_sampling: bool = False
    overlong_shaping: bool = False

    def settings(self) -> dict[str, object]:
        """The defaults by field name."""
        return asdict(self)


ALGORITHMS: Registry[Recipe] = Registry("algorithm")
for _name, _recipe in (
    (Algorithm.GRPO, Recipe("grpo", "ppo_clip")),
    (Algorithm.DR_GRPO, Recipe("dr_grpo", "ppo_clip")),
    (Algorithm.RLOO, Recipe("rloo", "ppo_clip")),
    (Algorithm.DAPO, Recipe("grpo", "dapo", clip_eps_high=0.28, dynamic_sampling=True, overlong_shaping=True)),
    (Algorithm.GSPO, Recipe("grpo", "gspo", loss_aggregation="seq_mean", clip_eps=3e-4, clip_eps_high=4e-4)),
    (Algorithm.CISPO, Recipe("grpo", "cispo", clip_eps=1.0, clip_eps_high=3.0)),
):
    ALGORITHMS.register(_name)(_recipe)
