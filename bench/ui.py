"""Benchmark: `tracerl ui` page times on a large store, beside the bare DuckDB queries behind each page.

Builds a store of N transitions (default 1,000,000: 250k rollouts of 4 calls, 625 tasks x 8 samples
per policy version, 50 versions, 5 % of tasks held out) with Arrow columns built directly and
written by the converter's own writer (``span_to_transition.workers.write_transitions``), plus a
50-round manifest (``store.parquet.write_table_atomic``, as ``trainer.manifest.write_round``), its
checkpoint manifests and selection files. The spans table is left empty (building spans for 1M calls
is the converter's benchmark, ``bench/convert.py``), so the rollout page's span query is cheap here.

Then, in one run, for each page: the time of ``GET page`` through the real server (``ui.app.serve``,
HTTP keep-alive client in the same process) and the time of the bare DuckDB statements the page runs
(same SQL, same parameters, on a ``connect_readonly`` connection with the viewer's per-rollout table,
fetched to Python), interleaved, and prints p50/p95 of each and their ratio, plus the time to build
that per-rollout table (once per store version, in the background) and to list the tables' files
(the change signature every request checks).

    python bench/ui.py                       # 1M transitions
    python bench/ui.py --transitions 200000 --keep /tmp/ui-store
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
import urllib.parse
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

ROOT = Path(__file__).resolve().parents[1]
# this file is bench/ui.py: with bench/ on the path, `import ui` would find it instead of the ui package
sys.path[:] = [str(ROOT)] + [p for p in sys.path if Path(p or ".").resolve() != ROOT / "bench"]
sys.path.append(str(ROOT / "bench"))

from _shared import percentile  # noqa: E402

from schemas.tables import ROUNDS_SCHEMA, TRANSITIONS_SCHEMA  # noqa: E402
from span_to_transition.workers import write_transitions  # noqa: E402
from store.layout import StoreLayout  # noqa: E402
from store.location import parse_store  # noqa: E402
from store.parquet import write_table_atomic  # noqa: E402
from store.views import connect_readonly  # noqa: E402

CALLS = 4
GROUP = 8
TASKS = 625
T0 = 1_763_700_000_000_000_000
CHUNK = 100_000


def _join(*parts: object) -> pa.Array:
    return pc.binary_join_element_wise(
        *[p if isinstance(p, (pa.Array, pa.ChunkedArray)) else str(p) for p in parts], ""
    )


def build(store: Path, n: int, rounds: int) -> dict[str, float]:
    """Write ``n`` transitions (in chunks of 100k rows), the rounds manifest, checkpoints and selections."""
    layout = StoreLayout.at(store)
    n_roll = n // CALLS
    per_version = TASKS * GROUP * max(1, n_roll // (TASKS * GROUP * rounds))
    rng = np.random.default_rng(0)
    t = time.perf_counter()
    for lo in range(0, n, CHUNK):
        i = np.arange(lo, min(n, lo + CHUNK))
        r, step = i // CALLS, i % CALLS
        task = (r // GROUP) % TASKS
        version = np.minimum(r // per_version, rounds - 1)
        held = task % 20 == 0
        rs = pc.cast(pa.array(r), pa.string())
        task_id = pc.if_else(
            pa.array(held),
            _join("heldout-", pc.cast(pa.array(task), pa.string())),
            _join("task-", pc.cast(pa.array(task), pa.string())),
        )
        reward = np.round((r * 2654435761 % 1000) / 1000, 1)  # one reward per rollout (a hash: deterministic)
        k = len(i)
        table = pa.table(
            {
                "transition_id": _join("t-", pc.cast(pa.array(i), pa.string())),
                "rollout_id": _join("r-", rs),
                "task_id": task_id,
                "trace_id": _join("trace-", rs),
                "span_id": _join("s-", pc.cast(pa.array(i), pa.string())),
                "step": pa.array(step, pa.int32()),
                "agent_name": pa.array(np.where(step % 2 == 0, "writer", "rewriter"), pa.string()),
                "trainable": pa.array(np.ones(k, bool)),
                "model": _join("policy@", pc.cast(pa.array(version), pa.string())),
                "policy_version": pa.array(version, pa.int64()),
                "prompt_messages": _join(
                    '[{"role":"system","content":"You write SQL for the shop database."},'
                    '{"role":"user","content":"Question ',
                    rs,
                    " step ",
                    pc.cast(pa.array(step), pa.string()),
                    '"}]',
                ),
                "tools": pa.nulls(k, pa.string()),
                "response_message": _join(
                    '{"role":"assistant","content":"SELECT count(*) FROM orders WHERE id = ', rs, '"}'
                ),
                "finish_reason": pa.array(np.repeat("stop", k), pa.string()),
                "prompt_token_ids": pa.FixedSizeListArray.from_arrays(
                    pa.array(rng.integers(0, 300, k * 24), pa.int32()), 24
                ).cast(pa.list_(pa.int32())),
                "response_token_ids": pa.FixedSizeListArray.from_arrays(
                    pa.array(rng.integers(0, 300, k * 16), pa.int32()), 16
                ).cast(pa.list_(pa.int32())),
                "response_logprobs": pa.FixedSizeListArray.from_arrays(
                    pa.array(-rng.exponential(1.0, k * 16), pa.float32()), 16
                ).cast(pa.list_(pa.float32())),
                "token_source": pa.array(np.where(i % 97 == 0, "retokenized", "gateway"), pa.string()),
                "reward": pa.array(reward),
                "rollout_reward": pa.array(reward),
                "reward_source": pa.array(np.repeat("side_channel", k), pa.string()),
                "is_last": pa.array(step == CALLS - 1),
                "started_at": pa.array(T0 + r * 1_000_000_000 + step * 100_000_000, pa.int64()).cast(
                    TRANSITIONS_SCHEMA.field("started_at").type
                ),
                "ended_at": pa.array(
                    T0 + r * 1_000_000_000 + step * 100_000_000 + 90_000_000, pa.int64()
                ).cast(TRANSITIONS_SCHEMA.field("ended_at").type),
                "input_tokens": pa.array(np.full(k, 24), pa.int64()),
                "output_tokens": pa.array(np.full(k, 16), pa.int64()),
                "conversion": pa.array(np.ones(k, np.int64)),
            }
        )
        write_transitions(layout.location, table)
    t_tr = time.perf_counter() - t
    for v in range(rounds):
        ckpt = layout.checkpoints / f"policy-{v + 1:06d}"
        ckpt.mkdir(parents=True, exist_ok=True)
        (ckpt / "tracerl_checkpoint.json").write_text(
            json.dumps(
                {
                    "round": v,
                    "git_sha": "0123456789abcdef",
                    "settings": {"estimator": "grpo", "tasks": "^task-", "lr": 1e-5, "max_staleness": 0},
                }
            )
        )
        ids = [f"r-{x}" for x in range(v * per_version, min(n_roll, (v + 1) * per_version))]
        (layout.checkpoints / f"round-{v:06d}.json").write_text(json.dumps({"round": v, "rollout_ids": ids}))
        row = {
            "round": v,
            "policy_version": v,
            "base_model": "/nonexistent/base",
            "checkpoint_path": str(ckpt),
            "adapter": True,
            "n_rollouts": len(ids),
            "n_transitions": len(ids) * CALLS,
            "mean_reward": 0.4 + v / rounds / 2,
            "loss": 0.1 / (v + 1),
            "kl": 0.001 * v,
            "clip_fraction": 0.1,
            "timings": json.dumps({"train": 10.0}),
            "published_at": None,
            "status": "published",
            "metrics": None,
        }
        write_table_atomic(
            pa.Table.from_pylist([row], schema=ROUNDS_SCHEMA),
            layout.partition("rounds", "2026-11-21") / f"round-{v:06d}.parquet",
            "rounds",
        )
    return {"transitions_s": t_tr, "total_s": time.perf_counter() - t}


def bare_runners(store: Path) -> tuple[dict[str, Callable[[], object]], dict[str, str], Callable[[], None]]:
    """Per page: a function that runs the page's DuckDB statements bare, and the page's URL."""
    from span_to_transition.survey import gather
    from ui import pages
    from ui.filters import parse_query, rollouts_sql
    from ui.store import ROLLOUT_INDEX_SQL

    con = connect_readonly(parse_store(store))
    t = time.perf_counter()
    con.execute(ROLLOUT_INDEX_SQL)  # what the viewer's reader builds once per store version
    print(
        f"per-rollout table (ui_rollouts, built once per store version): {time.perf_counter() - t:.2f}s",
        flush=True,
    )
    from ui.store import store_signature

    loc, times = parse_store(store), []
    for _ in range(20):  # what every page request (and every live poll) lists before it answers
        t = time.perf_counter()
        n = len(store_signature(loc))
        times.append(time.perf_counter() - t)
    print(
        f"change signature ({n} table files, per request): {percentile(times, 0.5) * 1000:.2f}ms p50",
        flush=True,
    )

    def run(sql: str, params: object = None) -> list:
        return (con.execute(sql, params) if params is not None else con.execute(sql)).fetchall()

    rid = run("SELECT rollout_id FROM transitions WHERE step = 0 ORDER BY started_at DESC LIMIT 1")[0][0]
    task = run("SELECT task_id FROM transitions WHERE rollout_id = ? LIMIT 1", [rid])[0][0]

    def rounds() -> None:  # the per-request statements; the staleness join is kept per store version
        run("SELECT * EXCLUDE (date) FROM rounds ORDER BY round")
        run(pages.HELDOUT_SQL, {"re": "^task-"})

    def rollouts(params: dict[str, str]) -> Callable[[], None]:
        sql, p = rollouts_sql(parse_query(params))
        return lambda: run(sql, p)

    def rollout() -> None:
        run("SELECT * EXCLUDE (last_response) FROM ui_rollouts WHERE rollout_id = $id", {"id": rid})
        cur = con.execute(pages.CALLS_SQL, {"id": rid})
        at = [d[0] for d in cur.description].index("trace_id")
        run(pages.SPANS_SQL, {"id": rid, "traces": sorted({c[at] for c in cur.fetchall()})})
        run(pages.GROUP_SQL, {"task": task})  # (the rounds' estimators are kept per store version)

    def group() -> None:
        run(pages.GROUP_SQL, {"task": task})

    filtered = {"task": task, "reward_min": "0.5", "sort": "reward"}
    runners = {
        "rounds": rounds,
        "rollouts": rollouts({}),
        "rollouts filtered": rollouts(filtered),
        "rollouts page 40": rollouts({"page": "40"}),
        "rollout": rollout,
        "task group": group,
        "doctor": lambda: gather(loc),
    }
    urls = {
        "rounds": "/rounds",
        "rollouts": "/rollouts",
        "rollouts filtered": "/rollouts?" + urllib.parse.urlencode(filtered),
        "rollouts page 40": "/rollouts?page=40",
        "rollout": "/rollouts/" + urllib.parse.quote(rid, safe=""),
        "task group": "/tasks/" + urllib.parse.quote(task, safe=""),
        "doctor": "/doctor",
    }
    return runners, urls, con.close


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--transitions", type=int, default=1_000_000)
    ap.add_argument("--rounds", type=int, default=50)
    ap.add_argument("--repeats", type=int, default=15, help="timed requests per page (after one warm-up)")
    ap.add_argument("--keep", type=Path, help="build the store here (reused if it already holds transitions)")
    args = ap.parse_args()

    import httpx

    from ui.app import UiConfig, serve

    tmp = None
    store = args.keep or Path(tmp := tempfile.mkdtemp(prefix="bench-ui-"))
    try:
        if not (store / "transitions").exists():
            built = build(store, args.transitions, args.rounds)
            print(
                f"built {args.transitions:,} transitions in {built['transitions_s']:.1f}s "
                f"(store + manifest {built['total_s']:.1f}s): {store}",
                flush=True,
            )
        runners, urls, close = bare_runners(store)
        server = serve(UiConfig(store=parse_store(store)), port=0)
        client = httpx.Client(base_url=server.url, timeout=120)
        print(
            f"{'page':<18} {'server p50':>10} {'p95':>8}   {'bare p50':>9} {'p95':>8}   {'ratio p50':>9} {'p95':>6}"
        )
        try:
            for name, bare in runners.items():
                assert client.get(urls[name]).status_code == 200  # warm-up (first connection, caches)
                bare()
                page_s, bare_s = [], []
                for _ in range(args.repeats):
                    t = time.perf_counter()
                    r = client.get(urls[name])
                    page_s.append(time.perf_counter() - t)
                    assert r.status_code == 200, (name, r.status_code)
                    t = time.perf_counter()
                    bare()
                    bare_s.append(time.perf_counter() - t)
                p = [percentile(page_s, q) * 1000 for q in (0.5, 0.95)]
                b = [percentile(bare_s, q) * 1000 for q in (0.5, 0.95)]
                print(
                    f"{name:<18} {p[0]:>8.1f}ms {p[1]:>6.1f}ms   {b[0]:>7.1f}ms {b[1]:>6.1f}ms   "
                    f"{p[0] / b[0]:>8.2f}x {p[1] / b[1]:>5.2f}x",
                    flush=True,
                )
        finally:
            client.close()
            server.stop(grace_s=1)
            close()
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
