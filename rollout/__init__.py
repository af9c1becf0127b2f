"""The rollout stage: run an unchanged agent per task and sample, configured by env vars; score and post rewards."""
