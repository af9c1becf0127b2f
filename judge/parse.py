"""The judge's answer -> every trajectory's score, or a failure with its reason. Never a made-up score.

Accepted shapes (a JSON object, alone, in a code fence, or with prose around it):

- ``{"scores": {"1": {"explanation": "...", "score": 0.7}, ...}}`` (what the prompt and schema ask for);
- ``{"scores": [{"trajectory_id": "1", "explanation": "...", "score": 0.7}, ...]}`` (RULER's shape);
- ``{"explanation": "...", "score": 0.7}`` when a single trajectory was judged.

A score must be a JSON number (not a string, not a boolean) within [0, 1]; it is never clipped, since a
judge answering on a 0-10 scale has misread the task and a clipped 7 -> 1 would be invented.

A partial answer fails the whole group: scores are relative to the group the judge saw, and when it
skips or invents ids it has most likely lost track of which trajectory is which, so the scores it did
give cannot be trusted to belong to the ids they name. The group gets no reward (GRPO then has no
advantage to take from it) rather than a possibly shuffled one.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any

MAX_EXPLANATION = 160
"""Characters of explanation the schema admits; the answer budget (JudgeSettings.max_tokens) covers it even at a
token per character, so guided decoding can always close the JSON."""
_FENCE = re.compile(r"```(?:json)?\s*(.*?)```", re.S | re.I)


@dataclass(frozen=True)
class Score:
    score: float
    explanation: str


@dataclass(frozen=True)
class Parsed:
    """Either ``scores`` for every id, or ``error`` (``kind``: a short label to count failures by)."""

    scores: dict[str, Score] | None = None
    error: str | None = None
    kind: str | None = None

    @property
    def ok(self) -> bool:
        return self.scores is not None


def _fail(kind: str, error: str) -> Parsed:
    return Parsed(None, error, kind)


def response_format(ids: list[str]) -> dict[str, Any]:
    """``response_format`` for an OpenAI-compatible endpoint: exactly these ids, each an explanation and a
    score in [0, 1]. vLLM enforces it by guided decoding, so even a small judge answers parseable JSON."""
    entry = {
        "type": "object",
        "properties": {
            "explanation": {"type": "string", "maxLength": MAX_EXPLANATION},
            "score": {"type": "number", "minimum": 0, "maximum": 1},
        },
        "required": ["explanation", "score"],
        "additionalProperties": False,
    }
    scores = {
        "type": "object",
        "properties": {i: entry for i in ids},
        "required": list(ids),
        "additionalProperties": False,
    }
    schema = {
        "type": "object",
        "properties": {"scores": scores},
        "required": ["scores"],
        "additionalProperties": False,
    }
    return {"type": "json_schema", "json_schema": {"name": "judge_scores", "strict": True, "schema": schema}}


def find_json(text: str) -> Any:
    """The JSON object of the answer: the whole text, a fenced block, or the first object in prose that
    has ``scores`` (or ``score``). Raises ValueError when there is none, or when the answer is one JSON
    object that does not parse (cut off by the token limit, say): a fragment inside it is no answer."""
    stripped = text.strip()
    for c in [stripped, *(m.group(1).strip() for m in _FENCE.finditer(text))]:
        try:
            value = json.loads(c)
        except ValueError:
            continue
        if isinstance(value, dict):
            return value
    if stripped.startswith("{"):
        try:
            json.loads(stripped)
        except ValueError as e:
            raise ValueError(
                f"the JSON answer is malformed or cut off ({e.msg} at character {e.pos})"
            ) from None
    decoder = json.JSONDecoder()
    for m in re.finditer(r"\{", text):
        try:
            value, _ = decoder.raw_decode(text, m.start())
        except ValueError:
            continue
        if isinstance(value, dict) and ("scores" in value or "score" in value):
            return value
    raise ValueError("no JSON object with scores in the answer")


def _entries(data: dict[str, Any], ids: list[str]) -> list[tuple[str, Any]] | Parsed:
    """(id, entry) pairs in the answer's order, or a failure for a shape that names no ids."""
    scores = data.get("scores")
    if scores is None and len(ids) == 1 and "score" in data:
        return [(ids[0], data)]
    if isinstance(scores, dict):
        return [(str(k), v) for k, v in scores.items()]
    if isinstance(scores, list):
        out = []
        for e in scores:
            if not isinstance(e, dict) or e.get("trajectory_id") is None:
                return _fail("bad_shape", "an entry of the 'scores' list has no trajectory_id")
            out.append((str(e["trajectory_id"]), e))
        return out
    return _fail("bad_shape", "the JSON object has no 'scores' object")


def _score(tid: str, entry: Any) -> Score | Parsed:
    value = entry.get("score") if isinstance(entry, dict) else entry
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return _fail(
            "not_numeric", f"the score of trajectory {tid} is {json.dumps(value)[:40]}, not a number"
        )
    if not math.isfinite(value) or not 0.0 <= value <= 1.0:
        return _fail("out_of_range", f"the score of trajectory {tid} is {value}, outside [0, 1]")
    explanation = entry.get("explanation") if isinstance(entry, dict) else None
    return Score(float(value), str(explanation or "")[:MAX_EXPLANATION])


def parse_answer(text: str | None, ids: list[str]) -> Parsed:
    """Every id's score from the judge's answer, or the first reason it cannot be used (module docstring)."""
    if not text or not text.strip():
        return _fail("empty", "the answer is empty")
    try:
        data = find_json(text)
    except ValueError as e:
        return _fail("no_json", str(e))
    entries = _entries(data, ids)
    if isinstance(entries, Parsed):
        return entries
    wanted = set(ids)
    unknown = sorted({tid for tid, _ in entries} - wanted)
    if unknown:
        return _fail("unknown_ids", f"scores for unknown trajectory ids {unknown}; the ids are {ids}")
    seen: dict[str, Score] = {}
    for tid, entry in entries:
        if tid in seen:
            return _fail("duplicate_ids", f"trajectory {tid} is scored twice")
        got = _score(tid, entry)
        if isinstance(got, Parsed):
            return got
        seen[tid] = got
    missing = [i for i in ids if i not in seen]
    if missing:
        return _fail("missing_ids", f"no score for trajectories {missing} ({len(seen)} of {len(ids)} scored)")
    return Parsed({i: seen[i] for i in ids})
