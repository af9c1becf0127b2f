"""The viewer's HTTP behaviour over a real round's store: pages, errors, escaping, token, read-only.

In-process (Starlette's TestClient over the same app ``tracerl ui`` serves) except the last test,
which runs the command itself.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import urllib.parse
from pathlib import Path

import httpx
import pytest
from starlette.testclient import TestClient
from tracerl_testing import BIN
from ui_testing import XSS_PROMPT, XSS_ROLLOUT, XSS_TASK, ensure_hostile_rollout, store_sql

from store.location import parse_store
from store.views import connect_readonly
from ui.app import COOKIE, UiConfig, make_app

pytestmark = pytest.mark.slow  # starts processes or builds models (make test-fast skips it)


@pytest.fixture(scope="module")
def store(real_store: Path) -> Path:
    ensure_hostile_rollout(real_store)
    return real_store


@pytest.fixture(scope="module")
def client(store: Path) -> TestClient:
    return TestClient(make_app(UiConfig(store=parse_store(store))), follow_redirects=False)


def _files(store: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(store)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in store.rglob("*") if p.is_file()}


def test_every_page_answers_from_the_store_and_never_writes_to_it(client, store):
    before = _files(store)
    rid = store_sql(store, "SELECT rollout_id FROM rollouts WHERE policy_version = 1 LIMIT 1")[0][0]
    task = store_sql(store, "SELECT task_id FROM rollouts WHERE rollout_id = ?", [rid])[0][0]
    pages = {"/rounds": "policy@0", "/rollouts": rid, f"/rollouts/{urllib.parse.quote(rid)}": "tracerl.gateway policy",
             f"/tasks/{task}": rid, "/doctor": "Quarantined records"}
    for path, needle in pages.items():
        r = client.get(path)
        assert r.status_code == 200, (path, r.text[:300])
        assert needle in r.text, path
        assert "script-src 'self'" in r.headers["content-security-policy"]
        assert r.headers["x-content-type-options"] == "nosniff"
    total = store_sql(store, "SELECT count(*) FROM rollouts")[0][0]
    assert re.search(rf'<b id="total">{total}</b>', client.get("/rollouts").text)
    assert client.get("/").headers["location"] == "/rounds"
    assert _files(store) == before  # nothing written, renamed or touched


def test_a_rollouts_calls_are_the_transitions_views_rows(store):
    from ui.pages import CALLS_SQL

    con = connect_readonly(parse_store(store))
    try:
        for (rid,) in con.execute("SELECT DISTINCT rollout_id FROM transitions").fetchall():
            view = con.execute("SELECT transition_id FROM transitions WHERE rollout_id = ? ORDER BY step, "
                               "transition_id", [rid]).fetchall()
            mine = con.execute(CALLS_SQL, {"id": rid}).fetchall()
            assert [r[0] for r in mine] == [r[0] for r in view] and view, rid
    finally:
        con.close()


@pytest.mark.parametrize("query, field", [("reward_min=abc", "reward_min"), ("version=x", "version"),
                                          ("sort=evil", "sort"), ("since=never", "since")])
def test_a_bad_filter_value_is_a_400_page_that_names_it(client, query, field):
    r = client.get(f"/rollouts?{query}")
    assert r.status_code == 400 and "text/html" in r.headers["content-type"]
    assert "Bad filter" in r.text and field in r.text


def test_unknown_pages_are_404_and_writes_are_refused(client):
    assert client.get("/rollouts/no-such-rollout").status_code == 404
    assert client.get("/nowhere").status_code == 404
    assert client.post("/rounds").status_code == 405


def test_strings_from_spans_reach_the_html_escaped(client):
    r = client.get(f"/rollouts/{urllib.parse.quote(XSS_ROLLOUT, safe='')}")
    assert r.status_code == 200
    assert "<script>window.__pwned" not in r.text and "<img src=x" not in r.text and "<b>agent</b>" not in r.text
    assert "&lt;script&gt;window.__pwned = 1" in r.text and "&lt;img src=x onerror=" in r.text
    assert "Why not <code>gateway</code>" in r.text  # retokenized: the reason and the fix are shown
    group = client.get(f"/tasks/{urllib.parse.quote(XSS_TASK, safe='')}").text
    assert XSS_TASK not in group and "task-&lt;i&gt;hostile&lt;/i&gt;" in group
    assert XSS_PROMPT not in client.get("/rollouts").text


def test_the_token_works_from_a_browser_once_then_as_an_httponly_cookie(store):
    c = TestClient(make_app(UiConfig(store=parse_store(store), token="s3cret")), follow_redirects=False)
    assert c.get("/rounds").status_code == 401
    assert c.get("/rounds?token=wrong").status_code == 401
    assert c.get("/healthz").status_code == 200
    r = c.get("/rollouts?token=s3cret&version=1")
    assert r.status_code == 303 and r.headers["location"] == "/rollouts?version=1"  # the key leaves the address
    cookie = r.headers["set-cookie"]
    assert cookie.startswith(f"{COOKIE}=") and "HttpOnly" in cookie and "SameSite=strict" in cookie
    assert "s3cret" not in cookie
    assert c.get("/rollouts?version=1").status_code == 200  # the client now sends the cookie
    fresh = TestClient(make_app(UiConfig(store=parse_store(store), token="s3cret")))
    assert fresh.get("/rounds", headers={"authorization": "Bearer s3cret"}).status_code == 200
    assert fresh.get("/rounds", headers={"authorization": "Bearer nope"}).status_code == 401


def test_the_demo_ends_with_the_viewer_command_and_its_url(real_store):
    out = (real_store.parent / "demo.out").read_text()
    assert out.rstrip().endswith(f"tracerl ui --store {real_store}      # then open http://127.0.0.1:8700/")


def test_tracerl_ui_prints_its_url_serves_it_and_stops_on_sigterm(store):
    help_text = subprocess.run([str(BIN / "tracerl"), "ui", "--help"], capture_output=True, text=True).stdout
    assert "--api-key" in help_text and "read-only" in help_text and "?token=" in help_text
    proc = subprocess.Popen([str(BIN / "tracerl"), "ui", "--store", str(store), "--listen", "127.0.0.1:0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "TRACERL_UI_API_KEY": ""})
    try:
        line = proc.stdout.readline()
        url = re.search(r"http://127\.0\.0\.1:\d+/", line).group(0)
        assert httpx.get(url + "rounds", timeout=30).status_code == 200
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
    assert proc.returncode == 0, proc.stderr.read()
    bad = subprocess.run([str(BIN / "tracerl"), "ui", "--store", str(store / "nope")], capture_output=True, text=True)
    assert bad.returncode == 2 and "not a directory" in bad.stderr
