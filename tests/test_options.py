"""options/: settings built from one another by field name, not copied by hand."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from collector_exporter.collector import CollectorSettings
from options import add_options, from_args, from_fields, opt
from rollout.driver import Driver, RolloutConfig
from store.location import parse_store


@dataclasses.dataclass
class _Flags:
    a: int = opt(1, "a")
    b: str = opt("x", "b")
    only_here: float = opt(0.5, "not a field of the target")


@dataclasses.dataclass
class _Target:
    a: int
    b: str = "default"
    c: list[int] = dataclasses.field(default_factory=list)
    derived: int = dataclasses.field(init=False, default=0)


def test_from_fields_copies_same_named_fields_and_overrides_win():
    t = from_fields(_Target, _Flags(a=7, b="y"), c=[1])
    assert (t.a, t.b, t.c, t.derived) == (7, "y", [1], 0)
    assert from_fields(_Target, _Flags(), b="given").b == "given"


def test_from_fields_still_refuses_a_missing_required_field():
    with pytest.raises(TypeError, match="'a'"):
        from_fields(_Target, object())


def _parsed(cls: type, argv: list[str]):
    parser = argparse.ArgumentParser()
    add_options(parser, cls)
    return from_args(cls, parser.parse_args(argv))


def test_every_rollout_flag_reaches_the_driver(tmp_path):
    """A flag added to RolloutConfig reaches the Driver by name, or the command consumes it (listed here)."""
    consumed = {
        "tasks": "parsed into Driver.tasks",
        "reward": "loaded into Driver.reward_fn",
        "store": "parsed into Driver.store",
    }
    driver_fields = {f.name for f in dataclasses.fields(Driver)}
    dropped = {f.name for f in dataclasses.fields(RolloutConfig)} - driver_fields - set(consumed)
    assert not dropped, f"RolloutConfig flags the Driver never sees: {sorted(dropped)}"
    cfg = _parsed(
        RolloutConfig,
        [
            "-n",
            "3",
            "--concurrency",
            "2",
            "--timeout-s",
            "9",
            "--retries",
            "0",
            "--task-via",
            "arg",
            "--gateway",
            "",
            "--continuous",
            "--max-rollouts",
            "5",
            "--otlp-protocol",
            "http/protobuf",
            "--otlp",
            "http://127.0.0.1:4318",
        ],
    )
    store = parse_store(tmp_path)
    d = from_fields(Driver, cfg, command=["agent"], tasks=[], reward_fn=None, store=store)
    same = driver_fields & {f.name for f in dataclasses.fields(RolloutConfig)} - set(consumed)
    assert {n: getattr(d, n) for n in same} == {n: getattr(cfg, n) for n in same}
    assert (d.n, d.task_via, d.continuous, d.store) == (3, "arg", True, store)


def test_the_collectors_settings_come_from_its_flags_by_name():
    from tracerl.commands.collect import CollectConfig

    cfg = _parsed(CollectConfig, ["--store", "/s", "--wal", "/w", "--token", "k"])
    s = from_fields(CollectorSettings, cfg, grpc=None, max_backlog_bytes=cfg.max_backlog_mb << 20)
    assert (s.store, s.wal, s.token, s.grpc, s.max_backlog_bytes) == (
        "/s",
        "/w",
        "k",
        None,
        cfg.max_backlog_mb << 20,
    )
