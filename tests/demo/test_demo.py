"""`tracerl demo`: the whole loop (serve, collect, gateway, rollouts, convert, train, publish) for real.

The end-to-end test runs the installed command with tiny settings (2 rounds of 8 rollouts) and
checks that its table is the trainer's manifest of real rounds: round 1's rollouts were served by
policy@1 (per the gateway's span and per the transitions), and the printed numbers are the
manifest's. The other tests check the failure paths a user meets first: ports in use, a store
that already holds data, Ctrl-C.
"""

from __future__ import annotations

import contextlib
import json
import re
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
from tracerl_testing import BIN, tracerl

from options import UsageError
from store.layout import StoreLayout
from store.location import parse_store
from store.views import connect_readonly
from tracerl.demo_config import DemoConfig, validate
from tracerl.demo_output import TABLE_HEADER, RoundResult, format_row, parse_table
from tracerl.demo_tasks import letter_task
from trainer.manifest import read_rounds


@pytest.mark.slow
def test_two_round_demo_trains_on_real_rounds_and_serves_the_new_policy(tmp_path):
    work = tmp_path / "work"
    proc = tracerl("demo", "--tiny", "--rounds", "2", "--rollouts-per-round", "8", "--workdir", str(work),
                   "--no-final-eval", timeout=600)  # a hang guard, not a speed bound: the demo prints its own time
    out = proc.stdout
    store = work / "store"

    rounds = read_rounds(StoreLayout.at(store).location)
    assert sorted(rounds) == [0, 1]
    assert [(r["policy_version"], r["status"]) for r in rounds.values()] == [(0, "published"), (1, "published")]
    assert all(r["n_rollouts"] >= 2 and r["loss"] is not None for r in rounds.values())

    con = connect_readonly(parse_store(store))
    # transitions: 8 rollouts of the base (recorded as plain 'policy': no version), 8 of policy@1
    by_version = dict(con.execute("""SELECT coalesce(policy_version, 0), count(DISTINCT rollout_id)
                                     FROM transitions GROUP BY 1""").fetchall())
    assert by_version == {0: 8, 1: 8}
    # the gateway tagged every call of round 1 with the version the server reported
    tags = dict(con.execute("""SELECT coalesce(attributes['tracerl.policy_version'], 'none'), count(*) FROM spans
                               WHERE attributes['tracerl.gateway'] = 'true' GROUP BY 1""").fetchall())
    assert tags == {"none": 16, "1": 16}  # 8 rollouts x (writer + rewriter) per round
    assert con.execute("SELECT count(*) FROM transitions WHERE token_source <> 'gateway'").fetchone()[0] == 0
    # round 1 trained on exactly policy@1's rollouts, recorded before training
    sel = json.loads((store / "checkpoints" / "round-000001.json").read_text())
    v1 = {r for (r,) in con.execute("SELECT DISTINCT rollout_id FROM transitions WHERE policy_version = 1").fetchall()}
    assert set(sel["rollout_ids"]) == v1  # all 8 were complete and rewarded: none left out, none foreign
    # trained on all of them but the groups whose rewards did not vary (no signal; recorded as used)
    dataset = json.loads((Path(rounds[1]["checkpoint_path"]) / "tracerl_checkpoint.json").read_text())["dataset"]
    assert rounds[1]["n_rollouts"] + dataset["n_rollouts_zero_variance"] == len(v1)

    # the printed table is the manifest
    table = parse_table(out)
    assert [row["round"] for row in table] == ["0", "1"]
    for row in table:
        m = rounds[int(row["round"])]
        assert row["policy"] == f"policy@{m['policy_version']}"
        assert int(row["rollouts"]) == m["n_rollouts"]
        assert row["mean_reward"] == f"{m['mean_reward']:.3f}"
        assert row["loss"] == f"{m['loss']:.4f}" and row["kl"] == f"{m['kl']:.4f}"
    assert (work / "reward-curve.png").stat().st_size > 1000
    assert f'tracerl sql --store {store} "SELECT round' in out
    assert "tracerl demo: 2 rounds in" in out
    assert out.rstrip().endswith(f"tracerl ui --store {store}      # then open http://127.0.0.1:8700/")


@pytest.mark.slow
def test_a_port_in_use_names_the_flag_to_change(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        proc = tracerl("demo", "--workdir", str(tmp_path), "--gateway-port", str(port), check=False)
    assert proc.returncode == 2, proc.stderr
    assert f"port {port}" in proc.stderr and "--gateway-port" in proc.stderr
    assert not (tmp_path / "logs").exists()  # nothing was started


@pytest.mark.slow
def test_a_store_with_data_is_refused_and_the_fix_named(tmp_path):
    store = tmp_path / "mine"
    (store / "spans").mkdir(parents=True)
    proc = tracerl("demo", "--workdir", str(tmp_path), "--store", str(store), check=False)
    assert proc.returncode == 2 and "already holds data" in proc.stderr and "--store" in proc.stderr


@pytest.mark.slow
def test_bad_rollouts_per_round_is_a_usage_error(tmp_path):
    proc = tracerl("demo", "--tiny", "--workdir", str(tmp_path), "--rollouts-per-round", "6", check=False)
    assert proc.returncode == 2 and "multiple of the 4 tasks" in proc.stderr


def test_a_negative_max_staleness_is_a_usage_error_before_anything_starts():
    cfg = DemoConfig(tiny=True, max_staleness=-1).resolved()
    with pytest.raises(UsageError, match="--max-staleness must be >= 0"):
        validate(cfg, letter_task(cfg.letters, cfg.rollouts_per_round))


def test_table_rows_round_trip_through_the_parser():
    rows = [RoundResult(0, "policy@0", 8, 0.1234, -0.05, 0.0, 12.3), RoundResult(1, "policy@1", 6, None, None, None, 1)]
    text = "preamble\n" + TABLE_HEADER + "\n" + "\n".join(format_row(r) + "   (extra)" for r in rows) + "\n\nafter"
    got = parse_table(text)
    assert got == [
        {"round": "0", "policy": "policy@0", "rollouts": "8", "mean_reward": "0.123", "loss": "-0.0500",
         "kl": "0.0000", "seconds": "12.3"},
        {"round": "1", "policy": "policy@1", "rollouts": "6", "mean_reward": "-", "loss": "-", "kl": "-",
         "seconds": "1.0"},
    ]


def _port_closed(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


LEGACY_PORTS = (4317, 4318, 8000, 8100)  # the demo's fixed ports before: a local Jaeger often holds 4317/4318


@contextlib.contextmanager
def occupied(ports: tuple[int, ...]):
    """Hold each port on 127.0.0.1 with a listening socket; a port someone else holds is occupied already."""
    with contextlib.ExitStack() as stack:
        for port in ports:
            s = stack.enter_context(socket.socket())
            with contextlib.suppress(OSError):
                s.bind(("127.0.0.1", port))
                s.listen()
        yield


@pytest.mark.slow
@pytest.mark.parametrize("stop", ["ctrl-c", "ctrl-c twice"])
def test_demo_starts_on_free_ports_it_prints_and_ctrl_c_stops_every_process(tmp_path, stop):
    """A second Ctrl-C while the demo stops its servers must not leave them running (it used to cut the
    stop short)."""
    with occupied(LEGACY_PORTS):
        proc = subprocess.Popen([str(BIN / "tracerl"), "demo", "--tiny", "--workdir", str(tmp_path), "--rollouts-per-round",
                                 "8"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        ports: list[int] = []
        seen = []
        try:
            for line in proc.stdout:  # wait until the round table starts: every server is up
                seen.append(line)
                if line.startswith("[demo] ports on 127.0.0.1:"):
                    ports = [int(p) for p in re.findall(r"\b(\d+)\b", line.split(":", 1)[1])]
                if line.split() == list(TABLE_HEADER.split()):
                    break
            time.sleep(2)  # agents are running now
            proc.send_signal(signal.SIGINT)
            if stop == "ctrl-c twice":
                for line in proc.stdout:  # the second one arrives while the servers are being stopped
                    seen.append(line)
                    if "stopping gateway, server and collector" in line:
                        proc.send_signal(signal.SIGINT)
                        break
            proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            seen.append(proc.stdout.read())  # what it said while stopping: the failure's cause, if any
    assert proc.returncode == 130, "".join(seen)
    assert len(ports) == 4 and not set(ports) & set(LEGACY_PORTS), "".join(seen)
    assert all(_port_closed(p) for p in ports)
    agents = subprocess.run(["pgrep", "-f", str(tmp_path)], capture_output=True, text=True).stdout.split()
    assert agents == []  # no server or agent process still runs with the demo's paths
