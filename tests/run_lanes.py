"""``make test``: the whole suite as two lanes at once, the slow one in the foreground and the fast one beside it.

Run one after another on 2 cores, the suite kept one core busy on average (load 1.1-1.3): most slow tests
wait on the processes they start. The fast lane (``-m "not slow"``, ``TRACERL_FAST_LANE=1``: it starts no
process and builds no model, ``tests/conftest.py``, so it binds no port a slow test's process could want)
runs beside it at a lower priority, on what the slow lane leaves idle, its output kept in a file and
printed at the end. Together they are every test exactly once (the ``slow`` mark splits them). The exit
status is the first failing lane's, or 0; a lane the arguments leave empty (pytest's 5, no tests collected)
is not a failure unless both are.

    python tests/run_lanes.py [pytest args for both lanes]
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NO_TESTS = 5  # pytest.ExitCode.NO_TESTS_COLLECTED
FAST_NICE = 5  # the slow lane's timing-sensitive tests (deadlines, leases) keep their share of the cores


def main(args: list[str]) -> int:
    pytest = [sys.executable, "-m", "pytest", "-q", *args]
    with tempfile.NamedTemporaryFile("w+", prefix="tracerl-fast-lane-", suffix=".log") as log:
        fast = subprocess.Popen(
            ["nice", "-n", str(FAST_NICE), *pytest, "-m", "not slow", "-p", "no:cacheprovider"],
            cwd=ROOT, env={**os.environ, "TRACERL_FAST_LANE": "1"}, stdout=log, stderr=subprocess.STDOUT,
        )
        try:
            print("the fast lane runs beside the slow one; its output follows the slow lane's", flush=True)
            slow = subprocess.run([*pytest, "-m", "slow"], cwd=ROOT).returncode
            fast_rc = fast.wait()
        except BaseException:
            fast.kill()
            fast.wait()
            raise
        log.seek(0)
        print("\n---- the fast lane (-m 'not slow') ----", flush=True)
        sys.stdout.write(log.read())
    if slow == fast_rc == NO_TESTS:
        return NO_TESTS
    for lane, rc in (("slow", slow), ("fast", fast_rc)):
        if rc not in (0, NO_TESTS):
            print(f"the {lane} lane failed (pytest exit status {rc})", file=sys.stderr)
            return rc
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
