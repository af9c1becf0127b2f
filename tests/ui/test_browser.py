"""The viewer in a real headless browser (Debian's chromium + chromedriver, driven by Selenium).

One server and one browser for the module, over a store made by a real round (``conftest.py``).
They click from the rounds to a rollout to one of its calls, check each response token's colour
against its logprob in the store (and, switched, against its advantage), hover a token, open the
task's group, watch a new rollout appear without a reload, and load a rollout whose spans are
hostile HTML: it must render as text and run nothing. Set TRACERL_UI_SHOTS=DIR to keep a
screenshot of each page.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import tempfile
import urllib.parse
from collections.abc import Iterator
from pathlib import Path

import pytest
from ui_testing import XSS_PROMPT, XSS_REPLY, XSS_TASK, add_rollout, ensure_hostile_rollout, store_sql

from store.location import parse_store
from ui.app import UiConfig, serve
from ui.colors import ADVANTAGE_SCALE, LOGPROB_SCALE, advantage_bucket, logprob_bucket

pytestmark = pytest.mark.slow  # starts processes or builds models (make test-fast skips it)

CHROMIUM, CHROMEDRIVER = shutil.which("chromium"), shutil.which("chromedriver")


def _rgb(hex_colour: str) -> str:
    h = hex_colour.lstrip("#")
    return "rgba({}, {}, {}, 1)".format(*(int(h[i:i + 2], 16) for i in (0, 2, 4)))  # as Selenium reports it


@pytest.fixture(scope="module")
def server(real_store: Path) -> Iterator[str]:
    running = serve(UiConfig(store=parse_store(real_store), poll_s=0.5), port=0)
    yield running.url
    running.stop(grace_s=1)


@pytest.fixture(scope="module")
def browser() -> Iterator:
    if not (CHROMIUM and CHROMEDRIVER):
        why = "chromium and chromedriver are not installed (apt-get install -y chromium chromium-driver)"
        if os.environ.get("CI"):
            pytest.fail(f"{why}; CI must run the browser tests (.ci/run installs them)")
        pytest.skip(why)
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    profile = tempfile.mkdtemp(prefix="tracerl-ui-chromium-")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                "--no-first-run", f"--user-data-dir={profile}", "--window-size=1360,1000"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(options=options, service=Service(CHROMEDRIVER))
    driver.implicitly_wait(5)
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


def now(driver, css: str) -> list:
    """The elements matching ``css`` on the page as it is (no implicit wait: an empty list is an answer)."""
    from selenium.webdriver.common.by import By

    driver.implicitly_wait(0)
    try:
        return driver.find_elements(By.CSS_SELECTOR, css)
    finally:
        driver.implicitly_wait(5)


@contextlib.contextmanager
def navigating(driver, timeout_s: float = 15) -> Iterator[None]:
    """Wait, after the block, until the page it left is gone and the next one has loaded.

    A form's ``submit()`` and some clicks return before the browser has left the page, so a
    lookup right after them can find the old page's element (or one that goes stale under it).
    """
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as EC
    from selenium.webdriver.support.ui import WebDriverWait

    old = driver.find_element(By.TAG_NAME, "html")
    yield
    WebDriverWait(driver, timeout_s, 0.05).until(EC.staleness_of(old))
    WebDriverWait(driver, timeout_s, 0.05).until(
        lambda drv: drv.execute_script("return document.readyState") == "complete")


def shot(driver, name: str) -> None:
    out = os.environ.get("TRACERL_UI_SHOTS")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        driver.save_screenshot(str(Path(out) / f"{name}.png"))


def _trained_rollout(store: Path) -> tuple[str, float]:
    """A rollout round 0 trained on, and the grpo advantage its group of two gives it: ±1/√2."""
    sel = json.loads((store / "checkpoints" / "round-000000.json").read_text())
    rid, task, reward = store_sql(store, """SELECT rollout_id, task_id, reward FROM rollouts WHERE rollout_id IN
        (SELECT rollout_id FROM transitions WHERE transition_id IN (SELECT unnest(?::VARCHAR[])))
        ORDER BY rollout_id LIMIT 1""", [sel["transition_ids"]])[0]
    other = store_sql(store, "SELECT reward FROM rollouts WHERE task_id = ? AND coalesce(policy_version, 0) = 0 "
                        "AND rollout_id <> ?", [task, rid])
    assert len(other) == 1 and other[0][0] != reward  # a group of two with a spread: why it was trained on
    return rid, math.copysign(1 / math.sqrt(2), reward - other[0][0])


def test_rounds_to_rollout_to_call_tokens_coloured_by_logprob_then_by_advantage(server, browser, real_store):
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By

    rid, advantage = _trained_rollout(real_store)
    d = browser
    d.get(server + "/rounds")
    assert d.find_element(By.CSS_SELECTOR, "#rounds tbody tr .badge").text == "published"
    assert len(d.find_elements(By.CSS_SELECTOR, ".chart svg")) == 5
    shot(d, "rounds")
    with navigating(d):
        d.find_element(By.CSS_SELECTOR, "a.round-link").click()  # round 0 trained on policy@0
    assert urllib.parse.urlparse(d.current_url).query == "version=0"
    shot(d, "rollouts")
    with navigating(d):
        d.find_element(By.LINK_TEXT, rid).click()
    assert d.find_element(By.ID, "rollout-advantage").text == f"{advantage:+.3f}"
    d.find_element(By.CSS_SELECTOR, "a.tl-call rect").click()  # an LLM call's bar in the timeline
    target = d.execute_script("return document.querySelector(':target').id")
    assert target.startswith("call-") and d.current_url.endswith("#" + target)
    tid = target.removeprefix("call-")
    ids, logprobs = store_sql(real_store, "SELECT response_token_ids, response_logprobs FROM transitions "
                                     "WHERE transition_id = ?", [tid])[0]
    tokens = d.find_elements(By.CSS_SELECTOR, f"#{target} .tokens .tok")
    assert len(tokens) == len(ids) > 0
    for tok, token_id, lp in zip(tokens, ids, logprobs):
        bucket = logprob_bucket(lp)
        assert f"lp-{bucket}" in tok.get_attribute("class").split()
        assert tok.value_of_css_property("background-color") == _rgb(LOGPROB_SCALE[bucket].background)
        assert tok.get_attribute("data-id") == str(token_id)
    ActionChains(d).move_to_element(tokens[0]).perform()
    assert f"id {ids[0]} " in d.find_element(By.ID, "tokinfo").text
    shot(d, "rollout")
    d.find_element(By.ID, "by-adv").click()
    want = _rgb(ADVANTAGE_SCALE[advantage_bucket(advantage)].background)
    assert {t.value_of_css_property("background-color") for t in tokens} == {want}
    assert d.find_element(By.CSS_SELECTOR, ".legend-adv").is_displayed()
    assert not d.find_element(By.CSS_SELECTOR, ".legend-lp").is_displayed()
    shot(d, "rollout-advantage")

    with navigating(d):
        d.find_element(By.CSS_SELECTOR, ".crumbs a.task-link").click()  # the task's group
    task = store_sql(real_store, "SELECT task_id FROM rollouts WHERE rollout_id = ?", [rid])[0][0]
    n = store_sql(real_store, "SELECT count(*) FROM rollouts WHERE task_id = ?", [task])[0][0]
    assert len(d.find_elements(By.CSS_SELECTOR, ".card")) == n
    v0 = {c.find_element(By.CSS_SELECTOR, ".rollout-link").text: c.find_element(By.CSS_SELECTOR, ".advantage").text
          for c in d.find_elements(By.CSS_SELECTOR, "#version-0 .card")}
    assert v0[rid] == f"{advantage:+.3f}" and sorted(v0.values()) == sorted([f"{advantage:+.3f}", f"{-advantage:+.3f}"])
    shot(d, "group")


def test_new_rollouts_appear_while_the_page_is_open(server, browser, real_store):
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    d = browser
    d.get(server + "/rollouts")
    before = int(d.find_element(By.ID, "total").text)
    d.execute_script("window.__same_page = true")
    add_rollout(real_store, rollout_id="live-1", task_id="task-live", prompt_text="hello", reply="hi")
    WebDriverWait(d, 20, 0.2, ignored_exceptions=(StaleElementReferenceException,)).until(
        lambda drv: drv.find_element(By.ID, "total").text == str(before + 1))  # (the swap replaces the element)
    assert d.execute_script("return window.__same_page") is True  # updated in place, not reloaded
    assert d.find_elements(By.LINK_TEXT, "live-1")


def test_hostile_html_in_spans_renders_as_text_and_runs_nothing(server, browser, real_store):
    from selenium.common.exceptions import NoAlertPresentException
    from selenium.webdriver.common.by import By

    ensure_hostile_rollout(real_store)
    d = browser
    d.get(server + "/rollouts")
    d.get_log("browser")  # start from an empty console
    field = d.find_element(By.NAME, "task")
    field.clear()
    field.send_keys(XSS_TASK)
    with navigating(d):
        field.submit()
    assert d.find_element(By.ID, "total").text == "1"
    with navigating(d):
        d.find_element(By.CSS_SELECTOR, "a.rollout-link").click()
    prompt = d.find_element(By.CSS_SELECTOR, "details.prompt")
    if prompt.get_attribute("open") is None:  # a rollout of one call shows its prompt open
        prompt.find_element(By.TAG_NAME, "summary").click()
    main = d.find_element(By.ID, "main")
    assert XSS_PROMPT in main.text and XSS_REPLY in main.text and "<b>agent</b>" in main.text
    # no element made from span strings (<script>, <img>, <u> of the agent span, <i> of the task id, <b>)
    assert now(d, "main img, main script, main u, main i:not(.sw)") == []
    assert [b.text for b in d.find_elements(By.CSS_SELECTOR, "main b")] == ["Why not gateway:"]
    assert d.find_element(By.CSS_SELECTOR, ".span-row.error")  # the failed tool span, flagged
    assert "retokenized" in d.find_element(By.CSS_SELECTOR, ".call .badge").text
    shot(d, "hostile-rollout")
    with navigating(d):
        d.find_element(By.CSS_SELECTOR, ".crumbs a.task-link").click()
    assert XSS_TASK in d.find_element(By.TAG_NAME, "h1").text
    assert d.execute_script("return window.__pwned === undefined")
    with pytest.raises(NoAlertPresentException):
        d.switch_to.alert.text  # noqa: B018  (raises when no alert is open)
    console = d.get_log("browser")
    assert console == [], console  # nothing ran, nothing was blocked, nothing failed to load


def test_a_bad_filter_value_is_a_400_page(server, browser):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    d = browser
    d.get(server + "/rollouts?task=letter-a")  # a filtered table: this page will not change under the test
    d.get_log("browser")
    field = d.find_element(By.NAME, "reward_min")
    field.send_keys("abc")
    with navigating(d):
        field.submit()
    assert d.find_element(By.TAG_NAME, "h1").text == "400 · Bad request"
    assert "reward_min must be a number" in d.find_element(By.ID, "error-message").text
    assert "reward_min=abc" in d.current_url and "task=letter-a" in d.current_url
    seen: list[str] = []  # Chrome reports the failed load on its console, not always at once
    WebDriverWait(d, 10, 0.2).until(
        lambda drv: seen.extend(e["message"] for e in drv.get_log("browser")) or any("status of 400" in m for m in seen))
    shot(d, "bad-filter")


def test_the_doctor_page_shows_what_doctor_finds_with_each_fix(server, browser, real_store):
    from selenium.webdriver.common.by import By

    from span_to_transition.doctor import diagnose
    from span_to_transition.survey import gather

    findings = diagnose(gather(parse_store(real_store)))
    d = browser
    d.get(server + "/doctor")
    d.find_element(By.TAG_NAME, "h1")  # the page is there
    assert [h.text for h in now(d, ".finding h3")] == [f.problem for f in findings]
    assert [x.text for x in now(d, ".finding .fix")] == [f.fix for f in findings]
    if not findings:
        assert d.find_element(By.ID, "healthy")
    shot(d, "doctor")
