"""The names the loss accepts, in a torch-free module.

``trainer/loss.py`` dispatches on these names; ``trainer/config.py`` offers them as the CLI's
choices. They live here, not in ``loss.py``, so ``tracerl train --help`` lists them without
importing torch.
"""

from __future__ import annotations

KL_ESTIMATORS = ("k1", "k2", "k3")
AGGREGATIONS = ("rollout", "sequence", "token")
IS_CORRECTIONS = ("off", "clip", "mask")
