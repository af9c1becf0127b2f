"""trainer: on-policy RL rounds from the store's transitions (see trainer/README.md).

Round k trains on transitions of policy@k (the base model is policy@0) and publishes policy@k+1.
Pure parts (``advantages``, ``loss``, ``dataset``) are separate from the orchestration
(``rounds``) and the backends (``backends.torch_backend``, ``backends.openrlhf``).
"""
