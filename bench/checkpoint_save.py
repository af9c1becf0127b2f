"""Checkpoint save time against a bare ``safetensors`` write of the same tensors (issue #32.3: <= 1.2x).

"Ours, on the critical path" is what a round waits for before it publishes: ``stage_checkpoint`` with
``TorchBackend.save`` (weights as the engine loads them: bf16 when training in bf16, as on CUDA;
config; the pending manifest; rename; no fsync: the engine reads the page cache). Timed apart, as
they run beside the publish: the durable completion (``complete_checkpoint``: fsync of the files and
directories, then the manifest, atomically) and then the resume state (fp32 master weights and AdamW
moments, ``write_resume_state``). "In line" is the save this replaced (``write_checkpoint``: stage and
complete before the publish). "Before" is the trainer's older save: ``save_pretrained`` of the fp32
model plus ``torch.save`` of the optimizer, in line.
"Bare" is ``safetensors.torch.save_file`` of the served tensors alone (no fsync, no manifest), the
reference: cast from the trained fp32 weights inside the timing, as any writer of the served file
must; the same write of tensors cast beforehand is printed beside it; "bare + fsync" is it made durable.
Each is best of ``--repeats``, interleaved (bare and ours side by side, their order alternating), each
started with no dirty pages (``os.sync`` untimed, as a round's save follows minutes of training, not
another write); the page cache is shared, so the model should be well below free memory.

    python bench/checkpoint_save.py                    # ~0.15B-parameter Qwen2 shape on CPU
    python bench/checkpoint_save.py --hidden 1536 --layers 28 --vocab 151936   # the 1.5B shape
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from trainer.backends.torch_backend import OPTIMIZER_FILE, TorchBackend
from trainer.checkpoint import complete_checkpoint, stage_checkpoint, write_checkpoint
from trainer.config import TrainSettings


def build_backend(
    hidden: int, layers: int, vocab: int, served: torch.dtype | None, device: str = "cpu"
) -> TorchBackend:
    """A Qwen2 model with random weights and one AdamW step taken (so the moments exist)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(
        hidden_size=hidden,
        intermediate_size=hidden * 35 // 6,
        num_hidden_layers=layers,
        num_attention_heads=max(1, hidden // 128),
        num_key_value_heads=max(1, hidden // 768),
        vocab_size=vocab,
        tie_word_embeddings=True,
    )
    model = Qwen2ForCausalLM(cfg).to(device)
    backend = TorchBackend(model, None, TrainSettings(progress=False), torch.device(device))
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    backend.optimizer.step()
    backend.optimizer.zero_grad(set_to_none=True)
    backend.served_dtype = served
    return backend


def report(times: dict[str, list[float]]) -> None:
    """Best of each (the machine may be shared), ours against bare, and what runs beside the publish."""
    best = {k: min(v) for k, v in times.items()}
    med = {k: statistics.median(v) for k, v in times.items()}
    paired = statistics.median(o / b for o, b in zip(times["ours"], times["bare"]))  # side by side in time
    bare_s = best["bare"]
    precast_s = f"  (already cast: {best['precast']:.2f} s)" if "precast" in best else ""
    print(f"  bare save_file of the served tensors (cast included) {bare_s:7.2f} s{precast_s}")
    print(
        f"  ours, on the critical path (weights, config, pending manifest, rename) {best['ours']:7.2f} s"
        f"  = {best['ours'] / bare_s:.2f}x bare (target <= 1.2x)"
    )
    print(
        f"    median of each repeat's ours/bare {paired:.2f}x; "
        f"medians: ours {med['ours']:.2f} s, bare {med['bare']:.2f} s = {med['ours'] / med['bare']:.2f}x; "
        f"each run (s): bare {' '.join(f'{x:.2f}' for x in times['bare'])}, "
        f"ours {' '.join(f'{x:.2f}' for x in times['ours'])}"
    )
    if "durable" in times:
        print(f"  ours, beside the publish: durable completion (fsync, manifest) {best['durable']:7.2f} s")
        print(f"  ours, beside the publish: resume state after it          {best['resume']:7.2f} s")
        print(f"  bare save_file + fsync                                   {best['fsync']:7.2f} s")
        print(
            f"  in line (the critical path before: stage + fsync + manifest) {best['inline']:7.2f} s"
            f"  = {best['inline'] / bare_s:.2f}x bare, {best['inline'] / best['fsync']:.2f}x bare + fsync"
        )
        if "before" in best:
            print(
                f"  older: save_pretrained fp32 + optimizer, in line {best['before']:7.2f} s "
                f"= {best['before'] / bare_s:.2f}x bare"
            )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--served", default="bf16", choices=["bf16", "fp32"], help="served weights' precision")
    p.add_argument("--repeats", type=int, default=5)  # best of: the machine may be shared
    p.add_argument(
        "--device", default="cpu", help="where the trained weights live (cuda: the copy to host is timed)"
    )
    p.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    p.add_argument(
        "--pair-only",
        action="store_true",
        help="time only bare and ours (cheap enough for many --repeats on a loaded machine)",
    )
    p.add_argument(
        "--skip-older",
        action="store_true",
        help="skip the older save_pretrained + optimizer line (the slowest, and the most bytes written)",
    )
    args = p.parse_args()
    served = torch.bfloat16 if args.served == "bf16" else None
    backend = build_backend(args.hidden, args.layers, args.vocab, served, args.device)
    n = sum(t.numel() for t in backend.model.parameters())
    root = Path(tempfile.mkdtemp(prefix="ckpt-bench.", dir=args.dir))
    from safetensors.torch import save_file

    def served_tensors() -> dict[str, torch.Tensor]:
        state, seen = {}, set()
        for name, t in backend.model.state_dict().items():
            if t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                state[name] = t.to(served).contiguous() if served is not None else t.contiguous()
        return state

    precast = served_tensors()

    def bare(i: int) -> None:  # the served tensors from the trained (fp32) model: the cast is part of it
        save_file(served_tensors(), str(root / f"bare-{i}.safetensors"), metadata={"format": "pt"})

    def bare_fsync(i: int) -> None:  # the same, made durable as a checkpoint must be (fsync)
        path = root / f"durable-{i}.safetensors"
        save_file(served_tensors(), str(path), metadata={"format": "pt"})
        with open(path, "rb") as f:
            os.fsync(f.fileno())

    def bare_precast(i: int) -> None:  # the same file, tensors already cast (a lower bound)
        save_file(precast, str(root / f"precast-{i}.safetensors"), metadata={"format": "pt"})

    def ours(i: int) -> None:  # the round's critical path: publishable, not yet durable
        backend.defer_resume_state = True
        stage_checkpoint(root / f"ours-{i}", backend.save, {"round": i})

    def durable(i: int) -> None:  # beside the publish, right after a stage (nothing flushed between)
        complete_checkpoint(root / f"round-{i}")

    def resume(i: int) -> None:  # beside the publish, after the completion
        backend.write_resume_state(root / f"round-{i}")

    def inline(i: int) -> None:  # the critical path before: stage and complete, then publish
        backend.defer_resume_state = True
        write_checkpoint(root / f"inline-{i}", backend.save, {"round": i})

    def before(i: int) -> None:
        out = root / f"before-{i}"
        out.mkdir()
        backend.model.save_pretrained(out)
        torch.save(backend.optimizer.state_dict(), out / OPTIMIZER_FILE)

    fns = {
        "bare": bare,
        "ours": ours,
        "precast": bare_precast,
        "fsync": bare_fsync,
        "inline": inline,
    }
    times: dict[str, list[float]] = {name: [] for name in [*fns, "durable", "resume", "before"]}

    def timed(name: str, fn: Callable[[int], None], i: int, flush: bool = True) -> None:
        if flush:
            os.sync()
        t = time.perf_counter()
        fn(i)
        times[name].append(time.perf_counter() - t)

    for i in range(args.repeats):
        # bare and ours side by side, in alternating order: the page cache grows through a repeat
        order = ["bare", "ours"] if i % 2 == 0 else ["ours", "bare"]
        for name in order if args.pair_only else [*order, "precast", "fsync", "inline"]:
            timed(name, fns[name], i)
        if args.pair_only:
            for d in root.iterdir():
                shutil.rmtree(d) if d.is_dir() else d.unlink()
            continue
        # as in a round: a stage (untimed: "ours" above), then beside the publish the completion and the
        # resume state, with nothing flushed between
        os.sync()
        backend.defer_resume_state = True
        stage_checkpoint(root / f"round-{i}", backend.save, {"round": i})
        timed("durable", durable, i, flush=False)
        timed("resume", resume, i, flush=False)
        if not args.skip_older:
            timed("before", before, i)
        for d in root.iterdir():  # keep the disk and page cache small between repeats
            shutil.rmtree(d) if d.is_dir() else d.unlink()
    times = {k: v for k, v in times.items() if v}
    size = sum(t.numel() * t.element_size() for t in precast.values()) / 2**20
    print(
        f"model {n / 1e6:.0f}M parameters, served {args.served} ({size:.0f} MiB); best of {args.repeats}, "
        f"load {os.getloadavg()[0]:.2f} ({os.cpu_count()} cores), device {args.device}, disk {root}"
    )
    report(times)
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
