"""``--nproc N``: the round's optimisation runs in N ranks started by torchrun; the round stays here.

The parent process (``trainer/rounds.py``) keeps everything that makes a round safe to rerun: the
lock, the selection file, the dataset and batches, the ``rounds`` rows, the checkpoint manifest and
the publish. Only ``Backend.train`` and ``Backend.save`` move into the ranks, through a work
directory next to the checkpoint it will become::

    STORE/checkpoints/.policy-<k+1>.work.<id>/   removed after the round; after a kill, by the next
                                                 run's clean_temp_dirs (its name starts '.policy-')
        job.json            settings, base model, parent checkpoint
        batches.pt          Batch.state() of every micro-batch (each rank reads all of them: a step's
                            loss weights are normalised by the weight total of the whole step)
        out/                rank 0's save(); moved into write_checkpoint's temp dir, so the manifest
                            and the atomic rename are the same code as with one process
        result.json         rank 0: TrainMetrics summed over ranks, adapter, model load seconds
        error-rank-<r>.txt  traceback of a rank that raised
        rank-<r>.log        output of ranks > 0 (rank 0's goes to our stderr)

The command is ``python -m torch.distributed.run --nproc-per-node N --master-addr 127.0.0.1
--master-port P -m trainer.worker WORK``. torchrun gives each rank ``RANK``, ``LOCAL_RANK``,
``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT``, and on one node that is all the DeepSpeed path
needs too: OpenRLHF 0.11.2's ``DeepspeedStrategy.setup_distributed``
(openrlhf/utils/deepspeed/deepspeed.py) takes ``LOCAL_RANK`` for ``torch.cuda.set_device`` and calls
``deepspeed.init_distributed``, which in DeepSpeed 0.19.6 (deepspeed/comm/comm.py) skips its MPI
discovery when those five variables are set and initialises ``torch.distributed`` from them. So one
launcher serves both backends; the ``deepspeed`` launcher (which sets the same variables) is not
needed on a single machine.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from serving.processes import die_with_parent
from trainer.backends.base import StepCallback, TrainMetrics
from trainer.backends.policy_model import pick_device
from trainer.config import TrainSettings
from trainer.packing import Batch

JOB, BATCHES, OUT, RESULT = "job.json", "batches.pt", "out", "result.json"
STEP_PREFIX = "@@tracerl-step "
"""Rank 0 prints one such line (then JSON) per optimizer step; the parent turns it into ``on_step``."""

REPO = Path(__file__).resolve().parents[1]


class RankError(RuntimeError):
    """The ranks exited non-zero; the message names each failed rank's error and the output tail."""


@dataclass
class RankRun:
    """What the ranks produced: metrics over all ranks and rank 0's saved checkpoint files."""

    metrics: TrainMetrics
    adapter: bool
    load_seconds: float
    out_dir: Path

    def save(self, tmp: Path) -> None:
        """``write_checkpoint``'s ``save``: move rank 0's files into its temp dir (same filesystem)."""
        for p in self.out_dir.iterdir():
            os.replace(p, tmp / p.name)


@contextlib.contextmanager
def work_dir(final: Path) -> Iterator[Path]:
    """A fresh work dir beside ``final``; removed when the round is done with it, whatever happened."""
    final.parent.mkdir(parents=True, exist_ok=True)
    path = Path(tempfile.mkdtemp(prefix=f".{final.name}.work.", dir=final.parent))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def torchrun_command(nproc: int, work: Path, port: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
            "--master-addr", "127.0.0.1", "--master-port", str(port), "--max-restarts", "0",
            "-m", "trainer.worker", str(work)]


def rank_env(settings: TrainSettings) -> dict[str, str]:
    """The ranks import this checkout's ``trainer``; gloo binds the loopback interface, since all ranks
    are on this machine (otherwise gloo binds whatever the hostname resolves to, maybe not reachable).
    The openrlhf backend on CPU gets DeepSpeed's CPU accelerator even where CUDA is present."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if settings.backend == "openrlhf" and pick_device(settings.device).type == "cpu":
        env["DS_ACCELERATOR"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    loopback = next((name for _, name in socket.if_nameindex() if name.startswith("lo")), None)
    if loopback and "GLOO_SOCKET_IFNAME" not in env:
        env["GLOO_SOCKET_IFNAME"] = loopback
    return env


def train_ranks(settings: TrainSettings, base_model: Path, parent: Path | None, batches: Sequence[Batch],
                work: Path, on_step: StepCallback | None = None) -> RankRun:
    """Train ``batches`` in ``settings.nproc`` ranks; raises ``RankError`` if any rank fails."""
    job = {"settings": dataclasses.asdict(settings), "base_model": str(base_model),
           "parent": str(parent) if parent else None}
    (work / JOB).write_text(json.dumps(job))
    torch.save([b.state() for b in batches], work / BATCHES)
    (work / OUT).mkdir()
    # die_with_parent: a kill -9 of tracerl train kills torchrun at once, and its ranks die with it (each
    # has its own PDEATHSIG, worker.py), instead of training on while the rerun trains the same round again.
    # SIGKILL, not SIGTERM: torchrun's graceful stop gives the ranks 30 s and then tears down its store,
    # and once (CI, loaded machine) it outlived the ranks by more than 30 s; the parent is gone, so there
    # is nobody to stop gracefully for, and the rerun removes the work dir.
    parent = os.getpid()
    proc = subprocess.Popen(torchrun_command(settings.nproc, work, free_port()), cwd=REPO, env=rank_env(settings),
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            preexec_fn=lambda: die_with_parent(signal.SIGKILL, parent))
    tail: deque[str] = deque(maxlen=40)
    try:
        assert proc.stdout is not None
        _stream(proc.stdout.fileno(), on_step, tail)
        rc = proc.wait()
    finally:
        if proc.poll() is None:  # we are being interrupted: do not leave ranks behind
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    if rc != 0 or not (work / RESULT).exists():
        raise RankError(failure_message(work, settings.nproc, rc, "".join(tail)))
    result = json.loads((work / RESULT).read_text())
    return RankRun(metrics=TrainMetrics(**result["metrics"]), adapter=bool(result["adapter"]),
                   load_seconds=float(result["load_seconds"]), out_dir=work / OUT)


def _stream(fd: int, on_step: StepCallback | None, tail: deque[str]) -> None:
    """Copy the ranks' output (rank 0's, the others are quiet) to our stderr, keep its tail for an
    error message, and turn step lines into ``on_step`` calls. Split on \\r too: progress bars."""
    pending = b""
    while chunk := os.read(fd, 1 << 16):
        pending += chunk
        *pieces, pending = re.split(rb"(?<=[\r\n])", pending)
        for piece in pieces:
            _handle(piece.decode(errors="replace"), on_step, tail)
    if pending:
        _handle(pending.decode(errors="replace"), on_step, tail)


def _handle(text: str, on_step: StepCallback | None, tail: deque[str]) -> None:
    i = text.find(STEP_PREFIX)
    if i >= 0:  # may follow a progress bar fragment written without a newline
        event = json.loads(text[i + len(STEP_PREFIX):])
        text = text[:i]
        if on_step is not None:
            on_step(event["step"], TrainMetrics(**event["metrics"]))
    if text:
        sys.stderr.write(text)
        sys.stderr.flush()
        tail.append(text)


def failure_message(work: Path, nproc: int, rc: int, tail: str) -> str:
    """Name each rank that raised with its exception line, then the last lines of what it printed."""
    lines = [f"training in {nproc} ranks failed (torchrun exit status {rc})"]
    for err in sorted(work.glob("error-rank-*.txt"), key=lambda p: int(p.stem.rsplit("-", 1)[1])):
        rank = err.stem.rsplit("-", 1)[1]
        tb = err.read_text().strip().splitlines()
        lines.append(f"rank {rank}: {tb[-1] if tb else '(empty traceback)'}")
        lines += ["    " + t for t in tb[-12:-1]]
    if len(lines) == 1:
        lines.append("no rank reported a Python exception (killed? see torchrun's output below)")
    lines.append("last output of rank 0 and torchrun:")
    lines += ["    " + t for t in tail.strip().splitlines()[-20:]]
    return "\n".join(lines)
