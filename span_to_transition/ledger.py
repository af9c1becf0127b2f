"""The converter's state, kept next to the table it describes: ``transitions/_state.json``.

Not a Parquet file, so table globs never read it. It records which rollouts are converted (with
the received-at watermark of their last span) or excluded, the span files that are fully
converted, late spans, the trace -> rollout pairs learnt so far, the rewards files already
applied, the settings the converted rows were made with, the rollout each feedback row keyed only
by a response id joined, and the feedback rows that match no rollout (counted for doctor and status). Written by the store's atomic writer
(store/atomic.py), so a crash leaves the old state or the new one; on local disk or in a bucket alike.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import pyarrow.fs as pafs

from span_to_transition.convert import ConvertConfig
from store.atomic import write_atomic
from store.location import StoreLocation


@dataclass
class Ledger:
    """What earlier passes did, so a pass converts each complete rollout once (see the module docstring)."""

    converted: dict[str, int] = field(default_factory=dict)  # rollout -> received-at watermark (ns)
    excluded: dict[str, list[str]] = field(default_factory=dict)  # rollout -> span files holding it
    files_done: set[str] = field(default_factory=set)  # span files (relative) fully converted
    late: dict[str, list[str]] = field(default_factory=dict)  # rollout -> late span ids
    traces: dict[str, str] = field(default_factory=dict)  # trace -> explicit rollout id (tracerl.rollout_id)
    reward_files: set[str] = field(default_factory=set)  # rewards files (relative) already applied
    settings: dict[str, object] = field(default_factory=dict)  # the row settings of the converted rows
    responses: dict[str, str] = field(default_factory=dict)  # response id of a feedback row -> its rollout
    unjoined: dict[str, object] = field(
        default_factory=dict
    )  # {count, samples}: feedback matching no rollout

    @staticmethod
    def path(store: StoreLocation) -> str:
        return store.path("transitions", "_state.json")

    @classmethod
    def load(cls, loc: StoreLocation) -> Ledger:
        if loc.fs.get_file_info(p := cls.path(loc)).type == pafs.FileType.NotFound:
            return cls()
        d = json.loads(loc.read_bytes(p))
        return cls(
            d["converted"],
            d["excluded"],
            set(d["files_done"]),
            d["late"],
            d.get("traces", {}),
            set(d.get("reward_files", [])),
            d.get("settings", {}),
            d.get("responses", {}),
            d.get("unjoined", {}),
        )

    def save(self, loc: StoreLocation) -> None:
        data = {
            "converted": self.converted,
            "excluded": self.excluded,
            "files_done": sorted(self.files_done),
            "late": self.late,
            "traces": self.traces,
            "reward_files": sorted(self.reward_files),
            "settings": self.settings,
            "responses": self.responses,
            "unjoined": self.unjoined,
        }
        write_atomic(self.path(loc), json.dumps(data, separators=(",", ":")).encode(), loc.fs)


def row_settings(config: ConvertConfig) -> dict[str, object]:
    """The settings a converted row depends on (not completion timing or worker count)."""
    return {
        "agents": config.agents,
        "credit": config.credit,
        "gamma": config.gamma,
        "missing_reward": config.missing_reward,
        "fill_reward": config.fill_reward,
        "reward_from": config.reward_from,
        "follow_links": config.follow_links,
        "task_key": config.task_key,
        "rollout_key": config.rollout_key,
        "agent_from": config.agent_from,
    }


def settings_note(old: dict[str, object], new: dict[str, object]) -> str | None:
    """A note for the summary when the rows already converted were made with other settings."""
    changed = [k for k in new if k in old and old[k] != new[k]]
    if not changed:
        return None
    what = ", ".join(f"--{k.replace('_', '-')} {old[k]!r} -> {new[k]!r}" for k in changed)
    return (
        f"rows already converted used other settings ({what}); they are kept as they are and only newly "
        "complete rollouts use the new ones; run 'tracerl convert --rebuild' with the new settings to rewrite all"
    )
