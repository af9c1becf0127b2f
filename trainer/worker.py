"""One training rank, started by torchrun from ``trainer/launcher.py``: ``python -m trainer.worker WORK``.

Every rank loads the backend under torchrun's environment, reads all of the round's batches,
trains its share (``trainer.distributed``) and calls ``save``; rank 0 writes the checkpoint files
and ``result.json``. The torch backend gets a process group here (nccl on CUDA, one GPU per
``LOCAL_RANK``; gloo on CPU); the openrlhf backend makes its own, through DeepSpeed, from the same
variables (see the launcher's docstring). A rank that raises leaves its traceback in
``error-rank-<r>.txt`` for the parent's error message. Every rank ends its process group and then
exits deliberately (``exit_now``), never through interpreter finalisation.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import sys
import time
import traceback
from pathlib import Path

import torch

from trainer.backends.base import TrainMetrics
from trainer.checkpoint import write_json_atomic
from trainer.config import TrainSettings
from trainer.launcher import BATCHES, JOB, OUT, RESULT, STEP_PREFIX, die_with_parent
from trainer.packing import Batch


def main(argv: list[str] | None = None) -> int:
    work = Path((argv if argv is not None else sys.argv[1:])[0])
    rank = int(os.environ["RANK"])
    die_with_parent(signal.SIGKILL)  # torchrun killed hard: do not train on, orphaned
    if rank != 0:  # one voice: rank 0 streams progress to the parent, the others log to a file
        log = os.open(work / f"rank-{rank}.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(log, 1)
        os.dup2(log, 2)
    code = 0
    try:
        train(work, rank, int(os.environ.get("LOCAL_RANK", "0")))
    except BaseException:
        code = 1
        tb = traceback.format_exc()
        sys.stderr.write(tb)
        (work / f"error-rank-{rank}.txt").write_text(tb)
    exit_now(code)
    return code  # not reached


def exit_now(code: int) -> None:
    """End the rank here, skipping interpreter finalisation (``os._exit`` after flushing our output).

    After ``destroy_process_group`` gloo's threads are still running (two ``pt_gloo_runloop`` workers
    and the ``gloo_tcp_loop``: the backend is freed only with its last Python reference), beside
    tqdm's daemon monitor threads and the allocator's background thread. A normal exit tears all of
    them down during interpreter finalisation, in whatever order the interpreter frees modules and
    objects, and a C++ thread that touches Python state then (a gloo worker releasing a tensor has to
    take the GIL; pytorch/pytorch#179291) aborts the process: a rank that had finished its work
    exited with SIGABRT (seen once at load 6-7). Everything a rank leaves behind is on disk by now
    (checkpoint files, fsynced ``result.json``, the error file), so there is nothing left to finalise.
    """
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def train(work: Path, rank: int, local_rank: int) -> None:
    import torch.distributed as dist

    from trainer.backends import load_backend

    job = json.loads((work / JOB).read_text())
    settings = TrainSettings(**job["settings"])
    if settings.backend == "torch":
        init_process_group(settings, local_rank)
    t = time.perf_counter()
    backend = load_backend(settings.backend, settings, Path(job["base_model"]),
                           Path(job["parent"]) if job["parent"] else None)
    load_seconds = time.perf_counter() - t
    batches = [Batch.from_state(s) for s in torch.load(work / BATCHES, weights_only=True)]
    metrics = backend.train(batches, report_step if rank == 0 else None)
    backend.save(work / OUT)  # collective for DeepSpeed; rank 0 writes
    if rank == 0:
        write_json_atomic(work / RESULT, {"metrics": dataclasses.asdict(metrics),
                                          "adapter": bool(backend.adapter), "load_seconds": load_seconds})
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def init_process_group(settings: TrainSettings, local_rank: int) -> None:
    """nccl with one GPU per local rank (``CUDA_VISIBLE_DEVICES`` picks which), else gloo on CPU."""
    import torch.distributed as dist

    from trainer.backends.policy_model import pick_device

    if pick_device(settings.device).type == "cuda":
        torch.cuda.set_device(local_rank)
        settings.device = f"cuda:{local_rank}"
        dist.init_process_group("nccl")
    else:
        dist.init_process_group("gloo")


def report_step(step: int, m: TrainMetrics) -> None:
    """Rank 0's running metrics (its own share of the loss) after each optimizer step, for ``on_step``."""
    print(STEP_PREFIX + json.dumps({"step": step, "metrics": dataclasses.asdict(m)}), flush=True)


if __name__ == "__main__":
    sys.exit(main())
