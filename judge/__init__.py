"""An LLM judge for agents without a reward function: ``tracerl judge`` (see README.md in this directory).

Pure logic: ``trajectories`` (transitions -> what the judge reads), ``prompts`` (group and pointwise
prompts, the rubric hash), ``parse`` (answer -> scores or a failure), ``groups`` (which rollouts are
judged together), ``rows`` (rewards rows). I/O shell: ``client`` (the endpoint), ``stage`` (one pass).
"""
