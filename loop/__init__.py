"""The RL loop that ties the stages together: rollouts -> convert -> train -> publish, round after round.

``rounds.py`` is the on-policy and asynchronous schedule (``run_rounds``), ``ahead.py`` the batches of
rollouts that run ahead of training, ``watch.py`` the store queries that say when a round is complete.
The stages come in as plain callables (``rounds.Stages``), so the schedule is tested without processes,
and the CLI (``tracerl demo``) keeps its settings, processes and printing to itself.
"""
