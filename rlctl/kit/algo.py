"""The pure tensor maths a plugin may use, through the kit: every name of rlctl.algo, the same objects.

What this is: ``from rlctl.kit.algo import ppo_clip_loss`` for plugins
(estimators, learners, samplers), so that a plugin's rlctl imports are
``rlctl``, ``rlctl.contracts`` and ``rlctl.kit`` and nothing else. The
functions live in rlctl.algo, whose ``__init__`` lists them once; this module
re-exports exactly that list.

What this is not: a second implementation (``rlctl.kit.algo.X is rlctl.algo.X``).
"""

from rlctl.algo import *  # noqa: F401,F403 - the published list, re-exported as is
from rlctl.algo import __all__  # noqa: F401
