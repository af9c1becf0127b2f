"""The converter's lease on object storage: conditional create, renew and takeover of one object.

The bucket is served by moto's standalone server, a stand-in for S3 on 127.0.0.1 (s3_server.py) that
implements S3's conditional writes (``If-None-Match: *``, ``If-Match``); the lease reaches it through
boto3's real client, configured only by the standard AWS variables. On local disk the lock is flock.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from store.lease import LeaseLost, ObjectLease, hold
from store.location import parse_store

pytestmark = pytest.mark.slow  # starts processes or builds models (make test-fast skips it)

REPO = Path(__file__).parents[2]


def test_of_two_contenders_one_wins_and_the_other_waits_for_its_release(s3_store):
    loc = parse_store(s3_store)
    a, b = ObjectLease.at(loc, "transitions/_state", ttl_s=30), ObjectLease.at(loc, "transitions/_state", ttl_s=30)
    assert a.try_take() and not b.try_take()
    record, _ = b.read()
    assert record["holder"] == a.holder
    a.release()
    assert b.try_take() and not a.try_take()


def test_an_object_that_is_no_lease_record_is_named_never_taken(s3_store):
    """Garbage at the lease's key (not a torn read: it stays garbage over every re-read) is an error naming
    the object; ``try_take`` must not treat it as free or as held."""
    loc = parse_store(s3_store)
    a = ObjectLease.at(loc, "garbage", ttl_s=30)
    a.client.put_object(Bucket=a.bucket, Key=a.key, Body=b'{"holder": "half-writt')
    with pytest.raises(RuntimeError, match="holds no lease record"):
        a.try_take()
    a.client.put_object(Bucket=a.bucket, Key=a.key, Body=b'["not", "a", "record"]')
    with pytest.raises(RuntimeError, match=r"garbage\.lease holds no lease record"):
        a.read()


def test_renewal_keeps_the_lease_and_a_stale_etag_cannot_renew(s3_store):
    loc = parse_store(s3_store)
    a = ObjectLease.at(loc, "x", ttl_s=30)
    assert a.try_take()
    first = a.read()[0]["expires_at"]
    time.sleep(0.05)
    a.renew()
    assert a.read()[0]["expires_at"] > first
    stale = ObjectLease(a.client, a.bucket, a.key, a.holder, a.ttl_s, etag='"0000"')
    with pytest.raises(LeaseLost):
        stale.renew()


def test_two_takers_of_one_expired_lease_cannot_both_win(s3_store):
    """Both read the expired record's ETag; the first conditional replace wins, the second gets 412."""
    loc = parse_store(s3_store)
    dead = ObjectLease.at(loc, "x", ttl_s=0.2)
    assert dead.try_take()
    time.sleep(0.3)
    b, c = ObjectLease.at(loc, "x", ttl_s=30), ObjectLease.at(loc, "x", ttl_s=30)
    _, expired_etag = b.read()
    assert b._put(b._record(), IfMatch=expired_etag) is not None
    assert c._put(c._record(), IfMatch=expired_etag) is None
    with pytest.raises(LeaseLost):
        dead.renew()  # the old holder learns it lost the lease


def test_a_holder_killed_with_sigkill_is_taken_over_after_expiry_and_not_before(s3_store):
    """A real process holds the lease through ``hold`` (renewing every ttl/3), then gets ``kill -9``."""
    ttl = 3.0
    code = textwrap.dedent(f"""
        import sys, time
        from store.lease import hold
        from store.location import parse_store
        with hold(parse_store({s3_store!r}), "transitions/_state", ttl_s={ttl}) as held:
            print("held", flush=True)
            time.sleep(600)
    """)
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        assert child.stdout.readline().strip() == "held"
        loc = parse_store(s3_store)
        taker = ObjectLease.at(loc, "transitions/_state", ttl_s=ttl)
        time.sleep(ttl * 1.5)  # past the first expiry: only renewal keeps it held
        assert not taker.try_take()
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=10)
        killed_at = time.time()
        expires_at = taker.read()[0]["expires_at"]
        assert expires_at > killed_at and not taker.try_take()  # not before its expiry
        time.sleep(max(0.0, expires_at - time.time()) + 0.1)
        assert taker.try_take()  # after it
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


def test_hold_waits_for_the_holder_on_a_bucket_and_on_local_disk(s3_store, tmp_path):
    for loc in (parse_store(s3_store), parse_store(tmp_path / "store")):
        order: list[str] = []
        with hold(loc, "transitions/_state", ttl_s=30) as held:
            t = threading.Thread(target=_second, args=(loc, order))
            t.start()
            time.sleep(0.5)
            order.append("first done")
            held.confirm()
        t.join(timeout=30)
        assert order == ["first done", "second"], loc.uri


def _second(loc, order: list[str]) -> None:
    with hold(loc, "transitions/_state", ttl_s=30):
        order.append("second")


def test_a_lease_held_by_another_times_out_with_its_holder_named(s3_store):
    loc = parse_store(s3_store)
    other = ObjectLease.at(loc, "transitions/_state", ttl_s=30)
    assert other.try_take()
    with pytest.raises(TimeoutError, match=other.holder), hold(loc, "transitions/_state", wait_s=0.5):
        pass
