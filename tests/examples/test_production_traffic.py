"""The simulated users of examples/production_service (traffic.py), the service's prompt layouts and run.py's
cron line: pure."""

from __future__ import annotations

import argparse
import importlib.util
import random
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "production_service"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"prod_{name}", EXAMPLE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


traffic = _load("traffic")
ANSWER = {"trace_id": "ab" * 16, "response_id": "chatcmpl-1"}


def test_only_the_feedback_rate_of_users_answer_late_within_the_delays():
    model = traffic.UserModel(feedback_rate=0.6, delay_min_s=10, delay_max_s=90, flip=0.0)
    rng = random.Random(7)
    verdicts = [traffic.verdict(1.0, ANSWER, n, model, rng) for n in range(2000)]
    given = [v for v in verdicts if v is not None]
    assert 0.55 < len(given) / len(verdicts) < 0.65
    assert all(10 <= v.delay_s <= 90 for v in given)
    assert max(v.delay_s for v in given) - min(v.delay_s for v in given) > 60  # spread, not one fixed delay
    assert all(v.body["value"] == 1.0 for v in given)  # no flips: the truth


def test_noisy_users_flip_the_graded_verdict_or_the_thumbs():
    rng = random.Random(3)
    graded = traffic.UserModel(feedback_rate=1.0, flip=0.25, key="trace_id")
    values = [traffic.verdict(0.2, ANSWER, n, graded, rng).body["value"] for n in range(2000)]
    assert sorted(set(values)) == pytest.approx([0.2, 0.8])
    assert 0.2 < sum(v > 0.5 for v in values) / len(values) < 0.3
    thumbs = traffic.UserModel(feedback_rate=1.0, flip=0.0, verdict="thumbs", key="response_id")
    assert traffic.verdict(1.0, ANSWER, 0, thumbs, rng).body == {"response_id": "chatcmpl-1", "thumbs": "up"}
    assert traffic.verdict(0.2, ANSWER, 0, thumbs, rng).body == {
        "response_id": "chatcmpl-1",
        "thumbs": "down",
    }


def test_mixed_keys_alternate_between_trace_id_and_response_id():
    model = traffic.UserModel(feedback_rate=1.0, flip=0.0, key="mixed")
    rng = random.Random(0)
    keys = [set(traffic.verdict(0.0, ANSWER, n, model, rng).body) - {"value"} for n in range(4)]
    assert keys == [{"trace_id"}, {"response_id"}, {"trace_id"}, {"response_id"}]


def test_questions_are_all_asked_once_before_any_repeats():
    qs = [{"id": f"q{i}"} for i in range(10)]
    stream = traffic.question_stream(qs, seed=1)
    first, second = [next(stream)["id"] for _ in range(10)], [next(stream)["id"] for _ in range(10)]
    assert sorted(first) == sorted(second) == sorted(q["id"] for q in qs)
    assert first != [q["id"] for q in qs]  # shuffled


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--feedback-rate", "1.5", "--requests", "1"], "--feedback-rate"),
        (["--delay-min-s", "9", "--delay-max-s", "3", "--requests", "1"], "--delay-min-s"),
        ([], "--duration-s"),
    ],
)
def test_bad_traffic_settings_are_usage_errors_naming_the_flag(argv, named, capsys):
    with pytest.raises(SystemExit) as e:
        traffic.main(["--service", "http://127.0.0.1:1", "--db", "x.db", *argv])
    assert e.value.code == 2 and named in capsys.readouterr().err


def test_the_layouts_put_the_question_where_the_issue_says(monkeypatch, tmp_path):
    db = tmp_path / "shop.db"
    db.write_bytes(b"")
    monkeypatch.setenv("SQL_SERVICE_DB", str(db))
    monkeypatch.setenv("OPENAI_API_KEY", "unused")
    monkeypatch.setattr(sys, "path", list(sys.path))
    service = _load("service")
    system = service.messages_for("system", "How many orders?")
    assert [m["role"] for m in system] == ["system", "user"]
    assert "Tables:" in system[0]["content"] and "Examples:" in system[0]["content"]
    assert system[1]["content"] == "Question: How many orders?"
    fewshot = service.messages_for("fewshot", "How many orders?")
    assert [m["role"] for m in fewshot] == ["system"] + ["user", "assistant"] * 3 + ["user"]
    assert fewshot[1] == service.messages_for("fewshot", "Another question?")[1]  # one first user message
    demo = service.messages_for("demo", "How many orders?")  # the demo writer's prompt, as its agent sends it
    assert demo == service.writer_messages("How many orders?")
    assert demo[0]["content"] == service.SYSTEM and demo[1]["content"].startswith(service.SCHEMA)
    assert [m["role"] for m in demo] == ["system"] + ["user", "assistant"] * 3 + ["user"]
    assert demo[-1]["content"] == "Question: How many orders?"
    with pytest.raises(ValueError, match="SQL_SERVICE_LAYOUT"):
        service.messages_for("chat", "q")


def test_the_cron_line_caps_rounds_and_trains_with_the_demos_settings(monkeypatch):
    from tracerl.commands import train
    from tracerl.demo_tasks import PRESETS

    monkeypatch.setattr(sys, "path", list(sys.path))
    run = _load("run")
    args = run.parse_args(["--max-rollouts", "24", "--min-rollouts", "12"])
    cmd = run.train_cmd(args, Path("/s"), Path("/m"), "http://127.0.0.1:1")
    parser = argparse.ArgumentParser()
    train.configure(parser)
    parsed = parser.parse_args(cmd[2:])  # what `tracerl train` makes of it
    assert (parsed.once, parsed.max_rollouts, parsed.min_rollouts) == (True, 24, 12)
    sql = PRESETS["sql"]  # the real demo's learning settings, which took SmolLM2 from 0.042 to 0.233 held-out
    assert (parsed.lr, parsed.lora_rank, parsed.epochs, parsed.steps_per_epoch) == (
        sql["lr"],
        sql["lora_rank"],
        sql["epochs"],
        sql["steps_per_epoch"],
    )


def test_a_round_cap_below_min_rollouts_is_a_usage_error(monkeypatch, capsys):
    monkeypatch.setattr(sys, "path", list(sys.path))
    run = _load("run")
    with pytest.raises(SystemExit) as e:
        run.parse_args(["--max-rollouts", "8", "--min-rollouts", "16"])
    assert e.value.code == 2 and "--max-rollouts 8 < --min-rollouts 16" in capsys.readouterr().err


def test_cron_fires_on_its_period_and_a_long_run_skips_the_firings_it_overlapped(monkeypatch):
    monkeypatch.setattr(sys, "path", list(sys.path))
    run = _load("run")
    assert run.until_next_fire(100.0, 100.0, 60) == 60  # the first firing, a period after the start
    assert run.until_next_fire(100.0, 130.0, 60) == 30  # a short run: the next minute as planned
    assert run.until_next_fire(100.0, 100.0 + 5 * 60 + 20, 60) == 40  # a 5-minute round: the next minute mark


def test_the_stack_is_started_as_a_team_runs_it_and_each_command_accepts_its_flags(monkeypatch, tmp_path):
    from tracerl.commands import collect, gateway, serve
    from tracerl.stack import StackPorts, stack_argvs

    monkeypatch.setattr(sys, "path", list(sys.path))
    run = _load("run")
    cfg = run.stack_config(Path("/m"), Path("/s"), tmp_path, max_num_seqs=16)
    argvs = stack_argvs(cfg, StackPorts(grpc=1001, http=1002, serve=1003, gateway=1004))
    parsed = {}
    for name, command in (("collect", collect), ("serve", serve), ("gateway", gateway)):
        parser = argparse.ArgumentParser()
        command.configure(parser)
        parsed[name] = parser.parse_args(argvs[name][2:])  # what `tracerl <name>` makes of it
    c, s, g = parsed["collect"], parsed["serve"], parsed["gateway"]
    assert (c.store, c.convert, c.quiet_s, c.segment_age_s) == ("/s", True, 5, 0.5)
    # vLLM on CPU as the demo: fp32, full-weight publishes (no LoRA), a batch of at least the users
    assert (s.engine, s.model, s.dtype, s.enable_lora, s.max_model_len, s.max_num_seqs) == (
        "vllm", "/m", "float32", False, 1024, 16)  # fmt: skip
    assert (g.upstream, g.otlp) == ("http://127.0.0.1:1003", "http://127.0.0.1:1001")
    assert cfg.serve_timeout_s == 900 and cfg.stop_grace_s == 30
