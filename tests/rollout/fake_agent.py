"""A stand-in agent process whose behaviour the task chooses, so one script covers every case.

It knows nothing of tracerl beyond what the driver promises: the task JSON on stdin (or as the
last argument) and in TRACERL_TASK. Task field ``do``:
  ok     print ``answer`` (default "42") and exit 0
  env    also write its environment, argv and stdin as JSON to ``out``
  crash  write to stderr and exit 3
  flaky  crash on the first attempt (marker file ``out`` absent), succeed on the next
  hang   start a child that sleeps, write both pids to ``out``, then sleep forever
  sleep  append "start/end monotonic-time" lines to ``out`` around a ``secs`` sleep
"""

import json
import os
import subprocess
import sys
import time

stdin_text = sys.stdin.read() if not sys.stdin.isatty() else ""
task = json.loads(os.environ["TRACERL_TASK"])
do = task.get("do", "ok")
if do == "env":
    with open(task["out"], "w") as f:
        json.dump({"env": dict(os.environ), "argv": sys.argv[1:], "stdin": stdin_text}, f)
elif do == "crash":
    print("agent blew up: boom", file=sys.stderr)
    sys.exit(3)
elif do == "flaky":
    if not os.path.exists(task["out"]):
        open(task["out"], "w").close()
        print("first attempt fails", file=sys.stderr)
        sys.exit(1)
elif do == "hang":
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    with open(task["out"], "w") as f:
        json.dump({"agent": os.getpid(), "child": child.pid}, f)
    time.sleep(300)
elif do == "sleep":
    with open(task["out"], "a") as f:
        f.write(f"start {time.monotonic()}\n")
    time.sleep(task["secs"])
    with open(task["out"], "a") as f:
        f.write(f"end {time.monotonic()}\n")
print(task.get("answer", "42"))
