"""The gateway's weight-version reads around a call (serving/gateway/versions.py), as plain logic.

Against real vLLM (a reload during streamed calls) in test_vllm.py; here the rules and the sharing.
"""

from __future__ import annotations

import asyncio
import time

from serving.gateway.versions import VersionLabel, Watch, label


def test_equal_reads_are_the_exact_version_and_unequal_ones_ambiguous_never_a_guess():
    assert label("3", "3") == VersionLabel("3")
    assert label("3", "4") == VersionLabel(None, ("3", "4")) and label("3", "4").ambiguous
    assert label(None, None) == VersionLabel()  # an upstream that reports no version: nothing to say
    assert label("3", None) == VersionLabel(None, ("3",))  # the second read failed: not exact


class Upstream:
    """A scripted ``(paused, version)`` source that counts its reads, each taking ``rtt_s``."""

    def __init__(self, answers: list[tuple[bool, str]], rtt_s: float = 0.01):
        self.answers, self.rtt_s, self.reads = answers, rtt_s, 0

    async def read(self) -> tuple[bool, str]:
        self.reads += 1
        await asyncio.sleep(self.rtt_s)
        return self.answers[min(self.reads, len(self.answers)) - 1]


def test_calls_ending_together_share_reads_and_each_read_starts_after_its_call_ended():
    reads = 0

    async def read() -> tuple[bool, str]:  # the "version" is when this read started
        nonlocal reads
        reads += 1
        started = time.monotonic()
        await asyncio.sleep(0.01)
        return False, repr(started)

    async def main() -> list[bool]:
        watch = Watch(read)

        async def one() -> bool:
            ended = time.monotonic()
            return float((await watch.after()).version) >= ended

        return await asyncio.gather(*(one() for _ in range(200)))

    assert all(asyncio.run(main())) and reads == 1, reads


def test_a_call_is_held_while_the_upstream_is_paused_and_sent_with_the_version_read_after_it():
    async def main() -> tuple[str | None, int]:
        # the read that sees the pause end may have read the version just before the new tag
        up = Upstream([(True, "1")] * 3 + [(False, "1"), (False, "2")])
        watch = Watch(up.read, poll_s=0.001)
        obs = await watch.before(time.monotonic() + 10)
        return obs.version, up.reads

    assert asyncio.run(main()) == ("2", 5)


def test_a_pause_longer_than_the_deadline_sends_the_call_anyway():
    async def main() -> bool:
        watch = Watch(Upstream([(True, "1")]).read, poll_s=0.001)
        return (await watch.before(time.monotonic() + 0.05)).paused

    assert asyncio.run(main())


def test_a_fresh_observation_is_reused_before_sending_without_a_read():
    async def main() -> int:
        up = Upstream([(False, "1")])
        watch = Watch(up.read, max_age_s=10)
        await watch.after()
        for _ in range(50):
            await watch.before(time.monotonic() + 1)
        return up.reads

    assert asyncio.run(main()) == 1


def test_while_calls_are_sent_the_observation_is_renewed_off_their_path_and_not_when_idle():
    """One stream at a time: each call found the last read aging out (or still on its way) and waited a
    round trip before it went. Renewed while calls are sent, the next one goes at once; idle, nothing reads."""

    async def main() -> tuple[float, int, int, int]:
        up = Upstream([(False, "1")], rtt_s=0.05)
        watch = Watch(up.read, max_age_s=0.1, active_s=0.3)
        await watch.before(time.monotonic() + 1)  # the first call waits for the first read
        await asyncio.sleep(0.25)  # longer than max_age_s: without renewal the next call would wait 50 ms
        renewed = up.reads  # before the next call asks
        t = time.monotonic()
        obs = await watch.before(time.monotonic() + 1)
        waited = time.monotonic() - t
        assert time.monotonic() - obs.at <= watch.max_age_s
        await asyncio.sleep(0.6)  # past active_s with no call: renewal stops
        idle_from = up.reads
        await asyncio.sleep(0.3)
        return waited, renewed, idle_from, up.reads

    waited, renewed, idle_from, end = asyncio.run(main())
    assert waited < 0.025, f"the call waited {waited * 1e3:.1f} ms for a read"
    assert renewed >= 2, renewed  # read again in the background while calls were being sent
    assert end == idle_from, "no reads once no call was sent for active_s"
