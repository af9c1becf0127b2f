"""Tasks and the plan: which agent runs happen, in which order, under which rollout ids.

Pure functions: a JSONL file becomes ``Task``s (a bad line names FILE:LINE), tasks become ``Job``s
(task-major, so a task's group of samples is started together), a job gets a unique rollout id.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import secrets
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from options import UsageError

MAX_ID_CHARS = 200  # the collector accepts rollout ids up to 256 characters


@dataclass(frozen=True)
class Task:
    """One line of the tasks file: its id, its fields, and where it came from (for messages)."""

    id: str
    data: dict[str, Any]
    line: int


def task_id_for(data: Mapping[str, Any]) -> str:
    """A stable id for a task without one: the hash of its canonical JSON, same across runs."""
    canon = json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return "t-" + hashlib.blake2b(canon.encode(), digest_size=8).hexdigest()


def parse_tasks(lines: Iterable[str], source: str = "tasks") -> list[Task]:
    """Parse JSONL tasks; any bad line fails the whole file before a single agent starts.

    Skipping a bad line would silently shrink the dataset (and spend compute on a run the user
    did not mean); so every problem is collected and reported together, each as
    ``FILE:LINE: what is wrong``, and the run does not start. Blank lines are ignored.
    """
    tasks: list[Task] = []
    errors: list[str] = []
    seen: dict[str, int] = {}
    for lineno, raw in enumerate(lines, start=1):
        text = raw.strip()
        if not text:
            continue
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            errors.append(f"{source}:{lineno}: not valid JSON ({e.msg} at column {e.colno}): {_clip(text, 60)}")
            continue
        if not isinstance(data, dict):
            errors.append(f"{source}:{lineno}: expected a JSON object, got {type(data).__name__}: {_clip(text, 60)}")
            continue
        if "id" in data:
            tid = data["id"]
            if isinstance(tid, bool) or not isinstance(tid, (str, int)) or str(tid) == "":
                errors.append(f"{source}:{lineno}: 'id' must be a non-empty string or integer, got {tid!r}")
                continue
            tid = str(tid)
            if len(tid) > MAX_ID_CHARS:
                errors.append(f"{source}:{lineno}: 'id' is {len(tid)} characters; the limit is {MAX_ID_CHARS}")
                continue
        else:
            tid = task_id_for(data)
        if tid in seen:
            errors.append(f"{source}:{lineno}: task id {tid!r} repeats line {seen[tid]}; give each task a "
                          f"unique 'id' (use -n for several samples of one task)")
            continue
        seen[tid] = lineno
        tasks.append(Task(tid, data, lineno))
    if errors:
        shown = errors[:20] + ([f"... and {len(errors) - 20} more"] if len(errors) > 20 else [])
        raise UsageError(f"{len(errors)} bad line(s) in {source}; fix them and rerun:\n  " + "\n  ".join(shown))
    if not tasks:
        raise UsageError(f"{source} holds no tasks; write one JSON object per line, e.g. "
                         '{"id": "t1", "question": "..."}')
    return tasks


def load_tasks(path: str) -> list[Task]:
    """Read and parse the tasks file, naming the file when it cannot be read."""
    p = Path(path)
    if not path:
        raise UsageError("--tasks FILE is required (JSONL, one JSON object per line)")
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as e:
        raise UsageError(f"cannot read --tasks {path}: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise UsageError(f"--tasks {path} is not UTF-8 text: {e}") from None
    return parse_tasks(text.splitlines(), source=path)


def _clip(text: str, n: int) -> str:
    return text if len(text) <= n else text[: n - 1] + "…"


# ------------------------------------------------------------------------------------------ plan
@dataclass(frozen=True)
class Job:
    """One (task, sample) to run; ``index`` orders the plan (all samples of a task are adjacent)."""

    index: int
    task: Task
    sample: int


def plan_jobs(tasks: list[Task], n: int) -> list[Job]:
    """Task-major order, so a task's group of samples completes early (the trainer can start on it)."""
    return [Job(i * n + s, t, s) for i, t in enumerate(tasks) for s in range(n)]


def job_stream(tasks: list[Task], n: int, max_rollouts: int = 0) -> Iterator[Job]:
    """Continuous mode: the plan over and over (cycle c runs samples c*n .. c*n+n-1 of each task, a
    group started together), until ``max_rollouts`` jobs (0: without end)."""
    if not tasks or n < 1:
        return
    i = 0
    for cycle in itertools.count():
        for t in tasks:
            for s in range(n):
                if max_rollouts and i >= max_rollouts:
                    return
                yield Job(i, t, cycle * n + s)
                i += 1


def rollout_id_for(run_id: str, job: Job, attempt: int) -> str:
    """Unique per attempt, so spans of a failed attempt never mix into the retry's rollout."""
    base = f"{run_id}-{job.index:05d}"
    return base if attempt == 0 else f"{base}-a{attempt}"


def new_run_id(now: datetime | None = None) -> str:
    """Time-sortable and unique across concurrent drivers: ``YYYYmmddTHHMMSSZ-xxxx``."""
    now = now or datetime.now(timezone.utc)
    return now.strftime("%Y%m%dT%H%M%SZ") + "-" + secrets.token_hex(2)


