"""Ctrl-C ends a command with 130 even when it surfaces wrapped in a native library's error.

The demo once exited 1 on Ctrl-C (CI, 1 run in 3 here): the KeyboardInterrupt was raised while
DuckDB was reading an Arrow table through a Python callback, and DuckDB re-raised it as its own
InvalidInputException. The commands below reproduce both shapes with a real DuckDB callback."""

from __future__ import annotations

import signal
import sys
import types

import duckdb
import pyarrow as pa
import pytest

from tracerl import cli
from tracerl.signals import interrupt_on_signals


class _SignalOnRead:
    """An Arrow stream DuckDB pulls batches from; the signal arrives while DuckDB is inside the pull."""

    def __init__(self, sig: signal.Signals | None) -> None:
        self.sig = sig

    def __arrow_c_stream__(self, requested_schema=None):
        def batches():
            if self.sig is not None:
                signal.raise_signal(self.sig)
            yield pa.record_batch({"x": [1]})
            raise RuntimeError("a plain failure inside the callback")

        reader = pa.RecordBatchReader.from_batches(pa.schema({"x": pa.int64()}), batches())
        return reader.__arrow_c_stream__(requested_schema)


def _command(sig: signal.Signals | None) -> types.ModuleType:
    module = types.ModuleType("tracerl_fake_command")
    module.configure = lambda parser: None

    def run(args):
        with interrupt_on_signals():
            con = duckdb.connect()
            con.register("stream", _SignalOnRead(sig))
            con.execute("SELECT count(*) FROM stream").fetchall()

    module.run = run
    return module


@pytest.mark.parametrize(("sig", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 130), (None, 1)])
def test_a_signal_inside_a_duckdb_callback_exits_130_and_a_plain_failure_exits_1(monkeypatch, sig, code):
    module = _command(sig)
    monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setitem(cli.COMMANDS, "fake", (module.__name__, "a command that reads through DuckDB"))
    assert cli.main(["fake"]) == code
