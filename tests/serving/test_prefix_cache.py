"""Prefix caching changes how much prefill runs, never what is sampled; stale prefixes are never reused."""

from __future__ import annotations

import httpx
import pytest
import torch

from serving.engine import GenerationJob, ModelEngine, SamplingParams
from serving.prefix_cache import Group, PrefixCache, common_prefix_len, plan_groups

from .helpers import recompute_logprobs
from .test_gateway import random_lora

HEAD = (
    "You write SQLite queries. Reply with one SQL query and nothing else. Tables: customers(id, name, city)"
)


# -- the pure parts -------------------------------------------------------------------------


def test_common_prefix_len_counts_the_shared_head():
    assert common_prefix_len([1, 2, 3], [1, 2, 4]) == 2
    assert common_prefix_len([1, 2], [1, 2, 3]) == 2
    assert common_prefix_len([], [1]) == 0 and common_prefix_len([5], [6]) == 0


def test_plan_groups_splits_two_families_and_keeps_their_own_long_prefixes():
    writer, rewriter = list(range(100)), list(range(60)) + [900] * 30
    prompts = [[*writer, 7, 1], [*writer, 8, 2], [*rewriter, 7], [*rewriter, 8, 3], [*writer, 9]]
    groups = plan_groups(prompts, [1] * 5, min_len=16)
    assert sorted((sorted(g.members), g.prefix_len) for g in groups) == [([0, 1, 4], 100), ([2, 3], 90)]
    # one group of all five would share only 60 tokens
    assert common_prefix_len(writer, rewriter) == 60


def test_plan_groups_leaves_at_least_one_token_of_every_prompt_to_run():
    p = list(range(40))
    assert plan_groups([p, [*p, 1, 2]], [1, 1], min_len=16) == [Group([0, 1], 39)]
    assert plan_groups([p], [3], min_len=16) == [Group([0], 39)]  # n=3 samples of one prompt


def test_plan_groups_gives_unrelated_prompts_their_own_prefix_or_none_when_short():
    long_a, long_b, short = [1] * 30, [2] * 30, [3] * 5
    groups = plan_groups([long_a, long_b, short], [1, 1, 1], min_len=16)
    assert sorted((g.members, g.prefix_len) for g in groups) == [([0], 29), ([1], 29), ([2], 0)]
    assert plan_groups([], [], min_len=16) == []


def test_plan_groups_uses_what_the_cache_holds():
    head = list(range(64))
    a, b = head + [100] * 10, head[:60] + [5] * 10
    # uncached, computing their 60 shared tokens once beats two lone prefixes of 73 and 69 tokens...
    assert plan_groups([a, b], [1, 1], min_len=16) == [Group([0, 1], 60)]

    def peek(tokens, limit):  # ...but not once the cache holds all 64 tokens of a's head
        return 64 if limit >= 64 and list(tokens[:64]) == head else 0

    groups = plan_groups([a, b], [1, 1], cached=peek, min_len=16)
    assert sorted((g.members, g.prefix_len) for g in groups) == [([0], 73), ([1], 69)]


def test_prefix_cache_finds_the_longest_aligned_prefix_within_the_limit():
    c = PrefixCache(max_bytes=1000, block=4)
    toks = list(range(20))
    assert c.store("s", toks[:8], "kv8", 10)
    assert c.store("s", toks[:16], "kv16", 10) and len(c) == 1  # it extends kv8, which goes
    assert not c.store("s", toks[:10], "kv10", 10)  # not block-aligned
    assert not c.store("s", toks[:12], "kv12", 10) and len(c) == 1  # kv16 already holds all of it
    assert c.lookup("s", toks) == (16, "kv16")
    assert c.lookup("s", toks, limit=15) == (12, "kv16")  # the caller slices the first 12
    assert c.lookup("s", [*toks[:9], 99]) == (8, "kv16")  # any leading blocks of an entry serve
    assert c.lookup("other scope", toks) == (0, None)
    assert c.lookup("s", [99, *toks]) == (0, None)
    assert (c.queries, c.hits, c.hit_tokens) == (5, 3, 36)
    assert c.scopes() == {"s"}


def test_prefix_cache_checks_tokens_not_just_hashes(monkeypatch):
    from serving import prefix_cache

    c = PrefixCache(max_bytes=1000, block=2)
    monkeypatch.setattr(prefix_cache, "block_hashes", lambda tokens, block: [7] * (len(tokens) // block))
    c.store("s", [1, 2, 3, 4], "a", 10)
    assert c.lookup("s", [1, 2, 9, 9, 0]) == (2, "a")  # the same fake hash at block 2: tokens decide
    assert c.lookup("s", [5, 6, 3, 4, 0]) == (0, None)


def test_prefix_cache_evicts_least_recently_used_to_stay_under_its_bytes():
    c = PrefixCache(max_bytes=25, block=2)
    c.store("s", [1, 1], "a", 10)
    c.store("s", [2, 2], "b", 10)
    c.lookup("s", [1, 1, 5])  # touch a: b is now the oldest
    c.store("s", [3, 3], "c", 10)
    assert c.peek("s", [1, 1]) == 2 and c.peek("s", [2, 2]) == 0 and c.peek("s", [3, 3]) == 2
    assert c.bytes == 20 and len(c) == 2
    assert not c.store("s", [4, 4], "huge", 26) and len(c) == 2
    assert c.drop(lambda scope: scope == "s") == 2 and c.bytes == 0
    c.store("t", [1, 1], "a", 10)
    c.clear()
    assert len(c) == 0 and c.bytes == 0


# -- the engine -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engines(tiny_model_dir):
    return ModelEngine(str(tiny_model_dir)), ModelEngine(str(tiny_model_dir), enable_prefix_caching=False)


def _ids(tok, text):
    return tok.encode(text, add_special_tokens=False)


def _same(cached_out, plain_out):
    """Same token ids, logprobs within float noise."""
    for a, b in zip(cached_out, plain_out, strict=True):
        assert not isinstance(a, Exception) and not isinstance(b, Exception)
        assert [c.token_ids for c in a] == [c.token_ids for c in b]
        for ca, cb in zip(a, b, strict=True):
            assert ca.logprobs == pytest.approx(cb.logprobs, abs=1e-4)
            assert (ca.text, ca.finish_reason) == (cb.text, cb.finish_reason)


def _differ(a, b) -> bool:
    """Two outputs of the same prompts differ by more than float noise (tokens or logprobs)."""
    pairs = [(ca, cb) for oa, ob in zip(a, b, strict=True) for ca, cb in zip(oa, ob, strict=True)]
    return any(
        ca.token_ids != cb.token_ids or max(abs(x - y) for x, y in zip(ca.logprobs, cb.logprobs)) > 1e-3
        for ca, cb in pairs
    )


def _jobs(prompts, adapter=None, **kw):
    kw = {"max_tokens": 10, "temperature": 1.0, **kw}
    return [GenerationJob(p, SamplingParams(seed=i, **kw), adapter) for i, p in enumerate(prompts)]


def test_cached_prefixes_sample_exactly_what_the_plain_pass_samples(engines, reference_model):
    on, off = engines
    tok = on.tokenizer
    prompts = [_ids(tok, f"{HEAD} Question: {q}?") for q in ("how many", "list all", "what is")]
    on.reset_prefix_cache()
    first = on.generate_batch(_jobs(prompts, n=2))
    assert on.prefix_cache.hits == 0 and len(on.prefix_cache) >= 1
    _same(first, off.generate_batch(_jobs(prompts, n=2)))
    for job, out in zip(_jobs(prompts), first, strict=True):  # against an independent forward pass
        for c in out:
            assert c.logprobs == pytest.approx(
                recompute_logprobs(reference_model, job.prompt_ids, c.token_ids), abs=1e-4
            )
    # the next batch, new questions and greedy: the head now comes from the cache
    later = [_ids(tok, f"{HEAD} Question: {q}?") for q in ("who lives in Paris", "name the city")]
    _same(on.generate_batch(_jobs(later, temperature=0)), off.generate_batch(_jobs(later, temperature=0)))
    assert on.prefix_cache.hits >= 1 and on.prefix_cache.hit_tokens >= 64


def test_prompts_that_share_nothing_and_a_prompt_that_is_all_prefix(engines):
    on, off = engines
    tok = on.tokenizer
    on.reset_prefix_cache()
    unrelated = [
        _ids(tok, "hi"),
        _ids(tok, "def add(a, b): return a + b " * 3),
        _ids(tok, "The quick brown fox"),
    ]
    _same(on.generate_batch(_jobs(unrelated)), off.generate_batch(_jobs(unrelated)))
    head = _ids(tok, HEAD)[:48]
    with_more = [[*head, 5, 6, 7], [*head, 6, 7, 8, 9]]
    _same(on.generate_batch(_jobs(with_more)), off.generate_batch(_jobs(with_more)))
    assert on.prefix_cache.peek(on._cache_scope(None), head) == 48  # the cache holds all of ``head``...
    # ...yet a prompt that is exactly ``head`` still runs its last token, for its first logits
    for batch in ([head], [head, [*head, 5]], [head, *with_more]):
        _same(on.generate_batch(_jobs(batch, n=2)), off.generate_batch(_jobs(batch, n=2)))


def test_cached_tensors_are_never_written_by_later_decoding(engines):
    on, _ = engines
    tok = on.tokenizer
    on.reset_prefix_cache()
    prompts = [_ids(tok, f"{HEAD} Question: {q}?") for q in ("a", "b")]
    on.generate_batch(_jobs(prompts))
    entries = list(on.prefix_cache._entries.values())
    before = [[(k.clone(), v.clone()) for k, v in e.value] for e in entries]
    on.generate_batch(_jobs([*prompts, prompts[0] + [3, 4]], max_tokens=20, n=3))
    assert on.prefix_cache.hits >= 1
    for e, snap in zip(entries, before, strict=True):
        for (k, v), (k0, v0) in zip(e.value, snap, strict=True):
            assert torch.equal(k, k0) and torch.equal(v, v0)


def test_adapters_never_share_prefixes_and_a_reloaded_adapter_misses_its_old_ones(tiny_model_dir, tmp_path):
    on = ModelEngine(str(tiny_model_dir))
    off = ModelEngine(str(tiny_model_dir), enable_prefix_caching=False)
    lora1, lora2 = (
        random_lora(tiny_model_dir, tmp_path / "l1", 1),
        random_lora(tiny_model_dir, tmp_path / "l2", 2),
    )
    for eng in (on, off):
        eng.load_lora("a", str(lora1))
    prompts = [_ids(on.tokenizer, f"{HEAD} Question: {q}?") for q in ("how many", "list all")]
    greedy = {"temperature": 0}
    base = on.generate_batch(_jobs(prompts, **greedy))
    _same(base, off.generate_batch(_jobs(prompts, **greedy)))
    with_a = on.generate_batch(_jobs(prompts, "a", **greedy))
    _same(with_a, off.generate_batch(_jobs(prompts, "a", **greedy)))
    assert _differ(with_a, base)
    assert {scope[0] for scope in on.prefix_cache.scopes()} == {None, "a"}
    # the same name, new weights: nothing cached under the old load may be used
    for eng in (on, off):
        eng.load_lora("a", str(lora2), load_inplace=True)
    hits = on.prefix_cache.hits
    reloaded = on.generate_batch(_jobs(prompts, "a", **greedy))
    _same(reloaded, off.generate_batch(_jobs(prompts, "a", **greedy)))
    assert _differ(reloaded, with_a)
    assert on.prefix_cache.hits == hits  # a miss: the old load's prefixes were dropped and scoped out
    on.unload_lora("a")
    assert {scope[0] for scope in on.prefix_cache.scopes()} == {None}
    _same(on.generate_batch(_jobs(prompts, **greedy)), base)  # the base model's prefixes stay valid


def test_new_weights_and_reset_empty_the_cache(tiny_model_dir, tmp_path):
    from serving.server import EmbeddedServer
    from serving.tiny_model import build_tiny_model

    other = build_tiny_model(tmp_path / "other", seed=5)
    server = EmbeddedServer.start(str(tiny_model_dir))
    eng, off = server.engine, ModelEngine(str(tiny_model_dir), enable_prefix_caching=False)
    try:
        prompts = [_ids(eng.tokenizer, f"{HEAD} Question: {q}?") for q in ("how many", "list all")]
        before = eng.generate_batch(_jobs(prompts, temperature=0))
        assert len(eng.prefix_cache) >= 1
        r = httpx.post(
            server.url + "/collective_rpc",
            json={"method": "reload_weights", "kwargs": {"weights_path": str(other)}},
        )
        assert r.status_code == 200 and len(eng.prefix_cache) == 0
        off.reload_weights(str(other))
        after = eng.generate_batch(_jobs(prompts, temperature=0))
        _same(after, off.generate_batch(_jobs(prompts, temperature=0)))
        assert _differ(after, before)
        assert len(eng.prefix_cache) >= 1
        resets = eng.prefix_cache_resets
        r = httpx.post(server.url + "/reset_prefix_cache", json={})
        assert r.status_code == 200 and len(eng.prefix_cache) == 0 and eng.prefix_cache.bytes == 0
        assert eng.prefix_cache_resets == resets + 1
    finally:
        server.stop()


def test_serve_flags_turn_the_cache_off_and_size_it(tiny_model_dir):
    from serving.server import EmbeddedServer, ServeOptions

    server = EmbeddedServer.start(str(tiny_model_dir), options=ServeOptions(enable_prefix_caching=False))
    try:
        assert server.engine.prefix_cache is None
        r = httpx.post(server.url + "/reset_prefix_cache", json={})  # still answers, as vLLM does
        assert r.status_code == 200
    finally:
        server.stop()
    server = EmbeddedServer.start(str(tiny_model_dir), options=ServeOptions(prefix_cache_mb=1.5))
    try:
        assert server.engine.prefix_cache.max_bytes == int(1.5 * 2**20)
    finally:
        server.stop()


@pytest.fixture
def one_thread():
    """One torch thread, as `tracerl serve` runs: two threads on two busy cores are many times slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_smollm2_writer_prompts_match_with_and_without_the_cache(monkeypatch, one_thread):
    """The real model and the demo's real prompts (greedy): the cache must not change a token."""
    import importlib.util
    from pathlib import Path

    from real_model import real_model_dir

    demo = Path(__file__).resolve().parents[2] / "examples" / "demo"
    monkeypatch.syspath_prepend(str(demo))  # the agent imports its folder's genai_chat
    spec = importlib.util.spec_from_file_location("demo_sql_agent_for_prefix_cache", demo / "sql_agent.py")
    sql_agent = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sql_agent)
    eng = ModelEngine(str(real_model_dir()))
    prompts = [
        eng.render_chat(sql_agent.writer_messages(q))
        for q in (
            "How many customers live in Paris?",
            "List the names of the products that cost more than 20.",
            "What is the average price of the products in category Books?",
        )
    ]
    jobs = _jobs(prompts, max_tokens=4, temperature=0)
    cached = eng.generate_batch(jobs)
    again = eng.generate_batch(_jobs(prompts[::-1], max_tokens=4, temperature=0))  # all from the cache now
    assert eng.prefix_cache.hits >= 1
    cache, eng.prefix_cache = eng.prefix_cache, None
    try:
        plain = eng.generate_batch(jobs)
    finally:
        eng.prefix_cache = cache
    _same(cached, plain)
    _same(again[::-1], plain)


def test_a_sliding_window_model_falls_back_to_the_plain_pass():
    """Sliding-window layers keep only the window's KV: a prefix of them cannot be laid under other rows."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from serving.prefill import prefill

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        use_sliding_window=True,
        sliding_window=8,
        max_window_layers=0,
    )
    model = Qwen2ForCausalLM(config).eval()
    head = list(range(1, 40))
    prompts = [[*head, 41, 42], [*head, 43]]
    cache = PrefixCache(2**20)
    with torch.inference_mode():
        got = prefill(model, prompts, [0, 0, 1], 0, cache, "scope")[0].logits
        want = prefill(model, prompts, [0, 0, 1], 0)[0].logits
        assert not cache.usable and len(cache) == 0
        assert torch.allclose(got, want, atol=1e-5)
        assert torch.allclose(
            prefill(model, prompts, [0, 1], 0, cache, "scope")[0].logits, want[[0, 2]], atol=1e-5
        )


def test_tracerl_serve_flags_reach_the_engine(tiny_model_dir, monkeypatch, capsys):
    from serving import server as server_module
    from tracerl.cli import main

    seen = {}

    def fake_start(model_dir, **kw):
        seen.update(kw)
        raise RuntimeError("stopped before serving")  # the CLI reports it and exits 1

    monkeypatch.setattr(server_module.EmbeddedServer, "start", staticmethod(fake_start))
    args = ["serve", "--engine", "embedded", "--model", str(tiny_model_dir)]
    assert main([*args, "--no-enable-prefix-caching", "--prefix-cache-mb", "64"]) == 1
    assert not seen["options"].enable_prefix_caching and seen["options"].prefix_cache_mb == 64
    assert main(args) == 1
    assert seen["options"].enable_prefix_caching and seen["options"].prefix_cache_mb == 256
    assert main(["serve", "--engine", "embedded", "--model", str(tiny_model_dir), "--prefix-cache-mb", "-1"]) == 2
    assert "--prefix-cache-mb -1.0 must be >= 0" in capsys.readouterr().err


def test_the_bench_runs_both_engines_on_the_demo_prompts(tiny_model_dir, one_thread):
    """bench/prefix_cache.py stays runnable (its figures come from running it on SmolLM2, not from here)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "bench" / "prefix_cache.py"
    spec = importlib.util.spec_from_file_location("tracerl_bench_prefix_cache", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    r = bench.run(tiny_model_dir, questions=4, batch=2, max_tokens=3, threads=1)
    assert r["same_tokens"] == "8/8" and set(r["seconds"]) == {"cache", "plain"}
    assert r["cache"]["hits"] >= 3 and r["speedup"] > 0
