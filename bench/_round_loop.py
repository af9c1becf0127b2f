"""The loop's side of a ``bench/round.py`` round: the stack as ``tracerl`` processes, the demo agents' rollouts
through the gateway (threads of the bench's process, rewards posted to the collector), their spans waited for
in the store and converted, then one training round with its publish, timed phase by phase.

Imported by ``bench/round.py`` with ``bench/`` on ``sys.path`` (the scripts are plain files, not a package).
"""

from __future__ import annotations

import contextlib
import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from _round_replay import reset_prefix_cache


def start_stack(
    model: Path,
    work: Path,
    threads: int,
    max_num_seqs: int,
    engine: str = "embedded",
    publish: str = "auto",
    lora_rank: int = 8,
):
    """collect, serve and gateway as `tracerl` processes on free ports (tracerl/stack.py, as the demo starts
    them); the caller stops the returned children."""
    from tracerl.stack import StackConfig
    from tracerl.stack import start_stack as start
    from tracerl.supervisor import Children

    serve_args = ["--max-num-seqs", str(max_num_seqs)]
    if engine == "vllm":  # as the demo runs it: merged full-weight publishes, unless LoRA is asked for
        serve_args += ["--max-model-len", "1024"]
        serve_args += (
            ["--max-lora-rank", str(max(16, lora_rank))] if publish == "lora" else ["--no-enable-lora"]
        )
    else:
        serve_args += ["--threads", str(threads)]
    cfg = StackConfig(
        store=str(work / "store"),
        logs=work / "logs",
        model=str(model),
        engine=engine,
        collect_args=("--segment-age-s", "0.2"),
        serve_args=tuple(serve_args),
        gateway_args=("--models-ttl-s", "0.5"),
        serve_timeout_s=600 if engine == "vllm" else 300,
    )
    children = Children()
    try:
        stack = start(cfg, children)
    except BaseException:
        children.stop_all()
        raise
    u = stack.urls
    urls = {"otlp": u.otlp, "collector": u.collector, "server": u.server, "gateway": f"{u.gateway}/v1"}
    return children, urls


def rollouts(
    agent, reward, tasks: list[dict], samples: int, collector: str
) -> tuple[list[str], list[list[list]]]:
    """Each (task, sample) as the demo agent's main(), in a thread; its trace id is its rollout id.
    Also the chat messages of each rollout's calls, in order (for the direct replay)."""
    import httpx
    from opentelemetry import trace

    tracer = trace.get_tracer("bench.round")

    def one(task: dict) -> tuple[str, list[list]]:
        letter = task["letter"]
        with tracer.start_as_current_span(
            "demo letter task", attributes={"tracerl.task_id": task["id"]}
        ) as root:
            writer = agent.user(agent.writer_prompt(letter))
            draft = agent.invoke_agent("writer", writer)
            rewriter = agent.user(agent.rewriter_prompt(letter, draft))
            final = agent.invoke_agent("rewriter", rewriter)
        rid = format(root.get_span_context().trace_id, "032x")
        value = reward.score(task, json.dumps({"letter": letter, "writer": draft, "final": final}))
        httpx.post(
            f"{collector}/v1/rewards", json={"rollout_id": rid, "value": value}, timeout=30
        ).raise_for_status()
        return rid, [writer, rewriter]

    with ThreadPoolExecutor(max_workers=len(tasks) * samples) as pool:
        out = list(pool.map(one, [t for t in tasks for _ in range(samples)]))
    return [o[0] for o in out], [o[1] for o in out]


def round_transitions(store: Path) -> list[dict]:
    from store.location import parse_store
    from store.views import connect_readonly

    con = connect_readonly(parse_store(store))
    try:
        cur = con.execute("""SELECT agent_name, rollout_id, task_id, reward, prompt_token_ids, response_token_ids
                             FROM transitions ORDER BY rollout_id, step""")
        names = [d[0] for d in cur.description]
        return [dict(zip(names, row)) for row in cur.fetchall()]
    finally:
        con.close()


@contextlib.contextmanager
def timed_merges(out: list[float]):
    """Within: each ``trainer.merge.merge_adapter`` call's seconds appended to ``out`` (the publisher imports it
    when it publishes), to split a merged publish into merge and reload."""
    import trainer.merge as merge

    real = merge.merge_adapter

    def timed(*args, **kwargs):
        t = time.perf_counter()
        try:
            return real(*args, **kwargs)
        finally:
            out.append(time.perf_counter() - t)

    merge.merge_adapter = timed
    try:
        yield
    finally:
        merge.merge_adapter = real


def generate_and_convert(
    ctx: dict, tasks: list[dict], samples: int, urls: dict, children, store: str
) -> tuple[dict, list[dict], list[list[list]]]:
    """The round's rollouts through the gateway, their spans waited for in the store, then converted:
    (figures, the round's transitions, each rollout's chat calls in order)."""
    from loop.watch import wait_for_round
    from span_to_transition.convert import ConvertConfig
    from span_to_transition.store import convert_store
    from store.location import parse_store

    r: dict = {}
    reset_prefix_cache(urls["server"])
    t0 = time.perf_counter()
    ids, calls = rollouts(ctx["agent"], ctx["reward"], tasks, samples, urls["collector"])
    r["generation_s"] = time.perf_counter() - t0
    ctx["provider"].force_flush()
    wait_for_round(parse_store(store), ids, len(ids), 120, children.check_alive)
    r["collect_wait_s"] = time.perf_counter() - t0 - r["generation_s"]
    t = time.perf_counter()
    convert_store(parse_store(store), ConvertConfig(quiet_s=0.0, workers=1))
    r["convert_s"] = time.perf_counter() - t
    round_ids = set(ids)
    rows = [row for row in round_transitions(Path(store)) if row["rollout_id"] in round_ids]
    r["generated_tokens"] = sum(len(row["response_token_ids"]) for row in rows)
    r["generation_tokens_per_s"] = r["generated_tokens"] / r["generation_s"]
    return r, rows, calls


def train_round(settings, server: str, publish: str) -> dict:
    """``run_once``: load, train, save, publish to ``server``; its seconds, its manifest timings, and the
    seconds of the adapter merge within a merged publish."""
    from trainer.publish import server_publisher
    from trainer.rounds import run_once

    r: dict = {}
    merges: list[float] = []
    t = time.perf_counter()
    with timed_merges(merges):
        outcome = run_once(settings, publisher=server_publisher(server, publish), log=lambda _m: None)
    r["train_round_s"] = time.perf_counter() - t
    r["publish_merge_s"] = sum(merges)
    if outcome.status != "published":
        raise RuntimeError(f"the round did not publish: {outcome.status} {outcome.message}")
    r["train_round_parts_s"] = json.loads(outcome.row.get("timings") or "{}")
    r["publish_s"] = r["train_round_parts_s"].get("publish", float("nan"))
    return r
