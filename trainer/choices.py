"""The names the loss and the publisher accept, in a module that imports nothing.

``trainer/loss.py`` and ``trainer/publish.py`` dispatch on these names; ``trainer/config.py`` offers
them as the CLI's choices. They live here, not beside their code, so ``tracerl train --help`` lists
them without importing torch or the HTTP client.
"""

from __future__ import annotations

KL_ESTIMATORS = ("k1", "k2", "k3")
AGGREGATIONS = ("rollout", "sequence", "token")
IS_CORRECTIONS = ("off", "clip", "mask")
PUBLISH_MODES = ("auto", "lora", "full")
