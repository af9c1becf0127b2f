"""`tracerl judge` as a user runs it (a process each): usage errors and --help, --once against an
unreachable judge (exit 1, text and --json), --watch until SIGTERM; and the judge in `tracerl doctor`
and `tracerl report`. The same behaviour in-process is test_stage.py's."""

from __future__ import annotations

import json
import signal
import subprocess
import time

import pytest
from tracerl_testing import BIN, free_port, tracerl

from judge.config import JudgeSettings
from judge.stage import run_once

from .store_rig import answer, good_judge, make_store, scripted_judge

pytestmark = pytest.mark.slow  # every test here starts `tracerl`


def test_usage_errors_name_the_fix_and_help_teaches(tmp_path):
    proc = tracerl("judge", "--store", str(tmp_path), check=False)
    assert proc.returncode == 2 and "--judge-model is required" in proc.stderr
    proc = tracerl("judge", "--store", str(tmp_path), "--judge-model", "m", check=False)
    assert proc.returncode == 2 and "tracerl convert --missing-reward keep" in proc.stderr
    help_text = tracerl("judge", "--help").stdout
    assert (
        "--missing-reward keep" in help_text and "RULER" in help_text and "--judge-concurrency" in help_text
    )


def test_once_exits_1_and_says_the_rollouts_wait_when_the_judge_is_unreachable(tmp_path):
    make_store(tmp_path)
    closed = f"http://127.0.0.1:{free_port()}/v1"
    common = ["judge", "--store", str(tmp_path), "--judge-url", closed, "--judge-model", "m"]
    proc = tracerl(*common, "--once", check=False)
    assert proc.returncode == 1 and "unreachable" in proc.stdout and "wait for the next pass" in proc.stdout
    as_json = tracerl(*common, "--json", check=False)
    got = json.loads(as_json.stdout)
    assert (as_json.returncode, got["unavailable"], got["rows_written"]) == (1, {"unreachable": 2}, 0)


def test_watch_judges_as_rollouts_arrive_and_stops_on_sigterm(tmp_path):
    make_store(tmp_path, tasks=1)
    with scripted_judge(good_judge) as (url, seen):
        cmd = [str(BIN / "tracerl"), "judge", "--watch", "--every-s", "0.2", "--group-wait-s", "0",
               "--store", str(tmp_path), "--judge-url", url, "--judge-model", "m"]  # fmt: skip
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 60
        while not list(tmp_path.glob("rewards/*/judge-*.parquet")) and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(0.5)  # a few more passes: nothing new to judge
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert len(seen) == 1 and len(list(tmp_path.glob("rewards/*/judge-*.parquet"))) == 1


def test_doctor_and_report_show_the_judge(tmp_path):
    make_store(tmp_path, tasks=2)

    def judge(
        body, n
    ):  # one at a time: the first group's answer and its retry are prose, the other is scored
        return (200, answer("Trajectory 1 is the best.")) if n <= 2 else good_judge(body, n)

    with scripted_judge(judge) as (url, _):
        stats = run_once(JudgeSettings(store=str(tmp_path), judge_url=url, judge_model="m", group_wait_s=0,
                                       judge_concurrency=1))  # fmt: skip
    assert (stats.failures, stats.rows_written) == ({"no_json": 1}, 3)
    doctor = tracerl("doctor", "--store", str(tmp_path), "--quiet-s", "0", check=False)
    assert doctor.returncode == 1 and "judge answers that could not be used" in doctor.stdout
    assert "no_json 1" in doctor.stdout and "--retry-failed" in doctor.stdout
    report = tracerl("report", "--store", str(tmp_path), "--no-plot").stdout
    assert "judge (source=judge rewards" in report and "no rounds" in report
