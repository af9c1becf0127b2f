"""One writer at a time: ``flock`` on local disk, a lease object with conditional writes on S3.

The converter holds this while it reads the ledger, writes transitions and saves the ledger, so the
collector's ``--convert`` loop and a manual ``tracerl convert`` (or two hosts) take turns.

- Local disk: ``fcntl.flock`` on a file beside the state, as before; the kernel drops it when the
  holder dies, so there is nothing to expire.
- Object storage: an object (``<name>.lease``) holding the holder's id and an expiry. It is taken
  with a conditional create (``If-None-Match: *``), renewed by a background thread with a
  conditional replace on the ETag the holder last wrote (``If-Match``), and taken over, once its
  expiry has passed, with a conditional replace on the ETag the taker read, so of two takers of
  one expired lease only the first PUT wins and the other gets 412. Each record carries a fresh
  nonce, so no two writes have the same bytes (and ETag). Released by replacing it, on the
  holder's ETag, with a record that has already expired. A holder killed with ``kill -9`` stops
  renewing and is taken over after at most ``ttl_s``.

``pyarrow.fs`` has no conditional put, so this one object is written with boto3 (whose
``put_object`` takes ``IfNoneMatch`` / ``IfMatch``), configured like pyarrow: the standard AWS
variables (``AWS_ENDPOINT_URL``, keys, region) or the URI's ``endpoint_override`` / ``scheme``.
Every other byte of the store still goes through ``store/atomic.py``.

Expiry is wall-clock time written by the holder and read by the taker: hosts' clocks must agree to
well within ``ttl_s`` (NTP does). A holder checks (``Held.confirm``, one more conditional renewal)
right before it commits, so a holder that lost its lease while paused fails instead of committing.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import random
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

from store.location import StoreLocation

DEFAULT_TTL_S = float(os.environ.get("TRACERL_LEASE_TTL_S", "30"))
"""How long a lease outlives its holder's last renewal (renewed every third of it)."""
_LOST_CODES = {"PreconditionFailed", "ConditionalRequestConflict", "NoSuchKey", "412", "409", "404"}


class LeaseLost(RuntimeError):
    """The holder's conditional renewal failed: another holder took the lease after it expired."""


def holder_id() -> str:
    """Who holds a lease, for messages and for ``tracerl status``: host, pid and a random suffix."""
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def s3_client(loc: StoreLocation) -> Any:
    """A boto3 S3 client for the same endpoint, region and credentials as ``loc``'s pyarrow file system."""
    try:
        import boto3
    except ImportError:
        raise RuntimeError("a lease on an s3:// store needs boto3 (conditional PUTs): pip install 'tracerl[s3]'") from None

    query = {k: v[-1] for k, v in parse_qs(urlsplit(loc.uri).query).items()}
    endpoint = query.get("endpoint_override")
    if endpoint and "://" not in endpoint:
        endpoint = f"{query.get('scheme', 'https')}://{endpoint}"
    region = query.get("region") or getattr(loc.fs, "region", None) or None
    return boto3.client("s3", endpoint_url=endpoint, region_name=region)


@dataclass
class ObjectLease:
    """The lease object ``key`` in ``bucket``: try, renew and release it with conditional PUTs."""

    client: Any
    bucket: str
    key: str
    holder: str = field(default_factory=holder_id)
    ttl_s: float = DEFAULT_TTL_S
    etag: str | None = None  # of the record this holder last wrote; None when not held

    @classmethod
    def at(cls, loc: StoreLocation, name: str, ttl_s: float = DEFAULT_TTL_S, holder: str | None = None) -> ObjectLease:
        """The lease ``<name>.lease`` below ``loc``'s root (an s3:// store)."""
        bucket, _, key = loc.path(f"{name}.lease").partition("/")
        return cls(s3_client(loc), bucket, key, holder or holder_id(), ttl_s)

    def read(self, attempts: int = 3) -> tuple[dict[str, Any] | None, str | None]:
        """The current record and its ETag, or (None, None) when no lease object exists.

        A body that does not parse is read again (up to ``attempts`` GETs): S3's GET is atomic with a PUT,
        but S3-compatible stand-ins (moto's server) can serve a body torn by a concurrent PUT. A body that
        still does not parse is not a lease record: an error naming the object, never a guess."""
        for attempt in range(attempts):
            try:
                r = self.client.get_object(Bucket=self.bucket, Key=self.key)
            except self.client.exceptions.NoSuchKey:
                return None, None
            body = r["Body"].read()
            try:
                record = json.loads(body)
            except ValueError as e:
                if attempt + 1 < attempts:
                    time.sleep(0.05 * (attempt + 1))
                    continue
                raise RuntimeError(f"lease s3://{self.bucket}/{self.key} holds no lease record ({e}: "
                                   f"{body[:80]!r}); delete it if no tracerl process writes there") from None
            if not isinstance(record, dict) or "expires_at" not in record:
                raise RuntimeError(f"lease s3://{self.bucket}/{self.key} holds no lease record: {body[:80]!r}")
            return record, r["ETag"]
        raise AssertionError("unreachable")

    def try_take(self) -> bool:
        """Take the lease if nobody holds it or its holder's expiry has passed; False if it is held."""
        record, etag = self.read()
        if record is None:
            self.etag = self._put(self._record(), IfNoneMatch="*")
        elif float(record["expires_at"]) <= time.time():
            self.etag = self._put(self._record(), IfMatch=etag)
        else:
            return False
        return self.etag is not None

    def renew(self) -> None:
        """Push the expiry ``ttl_s`` ahead; LeaseLost if anyone wrote the lease since this holder did."""
        if self.etag is None or (etag := self._put(self._record(), IfMatch=self.etag)) is None:
            self.etag = None
            raise LeaseLost(f"lease s3://{self.bucket}/{self.key} was taken over from {self.holder}")
        self.etag = etag

    def release(self) -> None:
        """Hand the lease back (an already expired record, on this holder's ETag); a lost lease is left alone."""
        if self.etag is not None:
            self._put(self._record(expires_at=0.0), IfMatch=self.etag)
            self.etag = None

    def _record(self, expires_at: float | None = None) -> bytes:
        exp = time.time() + self.ttl_s if expires_at is None else expires_at
        return json.dumps({"holder": self.holder, "expires_at": exp, "nonce": uuid.uuid4().hex}).encode()

    def _put(self, body: bytes, **condition: str) -> str | None:
        """The new ETag, or None when the condition failed; any other failure raises (never taken as held)."""
        from botocore.exceptions import ClientError

        try:
            return self.client.put_object(Bucket=self.bucket, Key=self.key, Body=body,
                                          ContentType="application/json", **condition)["ETag"]
        except ClientError as e:
            if str(e.response.get("Error", {}).get("Code")) in _LOST_CODES:
                return None
            raise


class Held:
    """What a holder gets: ``confirm()`` before committing raises LeaseLost if the lease is no longer its."""

    def __init__(self, lease: ObjectLease | None = None):
        self.lease = lease
        self.lost: LeaseLost | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        if lease is not None:
            self._thread = threading.Thread(target=self._renew_loop, name="tracerl-lease", daemon=True)
            self._thread.start()

    def confirm(self) -> None:
        """Renew now (one conditional PUT): after it returns the lease is ours for another ``ttl_s``."""
        if self.lease is None:
            return
        with self._lock:
            if self.lost is None:
                try:
                    self.lease.renew()
                except LeaseLost as e:
                    self.lost = e
            if self.lost is not None:
                raise self.lost

    def _renew_loop(self) -> None:
        assert self.lease is not None
        while not self._stop.wait(self.lease.ttl_s / 3):
            with self._lock:
                if self.lost is not None:
                    return
                try:
                    self.lease.renew()
                except LeaseLost as e:
                    self.lost = e
                    return
                except Exception:  # a network error: retried at the next tick; confirm() decides
                    continue

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self.lease is not None and self.lost is None:
            with contextlib.suppress(Exception):  # not releasing only makes the next taker wait ttl_s
                self.lease.release()


CONVERTER_LOCK = "transitions/_state"
"""The converter's lock (``hold``'s ``name``): beside the ledger it guards."""
TRAINER_LOCK = "checkpoints/.train"
"""The trainer's lock: beside the round selections it guards."""
JUDGE_LOCK = "judge/_state"
"""The judge's lock (``tracerl judge``): beside its record of failed groups, so two judges never pay for one rollout."""
LOCKS = {"converter": CONVERTER_LOCK, "trainer": TRAINER_LOCK, "judge": JUDGE_LOCK}
"""The store's locks by who takes them, for ``tracerl status``."""


def lease_states(loc: StoreLocation) -> dict[str, dict[str, Any]]:
    """Who holds each of the store's leases on a bucket, and for how long yet (a negative ``expires_in_s``:
    free, or its holder died that long ago); {} for a local store, whose ``flock`` cannot be read without
    taking it (and taking it, even briefly, could make a cron ``train --once`` skip its round)."""
    if loc.is_local:
        return {}
    out = {}
    for who, name in LOCKS.items():
        record, _ = ObjectLease.at(loc, name).read()
        if record is not None:
            out[who] = {"holder": record.get("holder"),
                        "expires_in_s": round(float(record.get("expires_at", 0.0)) - time.time(), 1)}
    return out


@contextlib.contextmanager
def hold(loc: StoreLocation, name: str, ttl_s: float = DEFAULT_TTL_S, wait_s: float | None = None) -> Iterator[Held]:
    """Hold the store's lock ``name`` (e.g. ``transitions/_state``) for the ``with`` block.

    Waits for the current holder (up to ``wait_s``; forever when None; ``wait_s=0`` tries once, as the
    trainer's cron-safe run does). Raises TimeoutError when ``wait_s`` passes first.
    """
    deadline = None if wait_s is None else time.monotonic() + wait_s
    if loc.is_local:
        path = Path(loc.path(f"{name}.lock"))
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a+") as f:
            while True:
                try:
                    fcntl.flock(f, fcntl.LOCK_EX | (0 if deadline is None else fcntl.LOCK_NB))
                    break
                except BlockingIOError:
                    if deadline is not None and time.monotonic() >= deadline:
                        raise TimeoutError(f"{path} is locked by another process; waited {wait_s:g}s") from None
                    time.sleep(0.05)
            try:
                yield Held()
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)
        return
    lease = ObjectLease.at(loc, name, ttl_s)
    while not lease.try_take():
        if deadline is not None and time.monotonic() >= deadline:
            record, _ = lease.read()
            raise TimeoutError(f"{loc.uri}: {name} is held by {(record or {}).get('holder')}; waited {wait_s:g}s")
        time.sleep(min(1.0, ttl_s / 4) * random.uniform(0.5, 1.0))
    held = Held(lease)
    try:
        yield held
    finally:
        held.close()
