"""An agent that records one span with the plain OTel API and prints its task id: the SDK is whatever
``opentelemetry-instrument`` (or the fork launcher's ``initialize``) configured from the environment."""

import json
import os
import sys

from opentelemetry import trace

task = json.loads(sys.stdin.read() or os.environ["TRACERL_TASK"])
with trace.get_tracer("tests.traced_agent").start_as_current_span(
    "traced agent", attributes={"n": task["n"]}
):
    print(task["id"], sys.argv[1:], os.getpid())
