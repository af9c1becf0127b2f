"""What a store holds, for ``tracerl doctor``: read-only queries whose results ``doctor.diagnose`` judges.

Spans are grouped by instrumentation scope and attribute-key shape (indexes collapsed), with one
sample span (and its ``gen_ai.*`` log records) per group; reward channels are counted with a sample
each; gateway spans, the token sources of the transitions and the rollouts still pending (by the
pass's own completion rules) complete the picture. Nothing is written: DuckDB views with external
access off, Arrow reads, and the converter's ledger read as it is.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import duckdb
import pyarrow as pa

from schemas.attributes import CONTENT_RECORDED, GATEWAY_FLAG, REWARD
from schemas.tables import SPANS_SCHEMA
from span_to_transition.columnar import SPAN_COLUMNS, logs_from_table, spans_from_table
from span_to_transition.content_join import REQUEST_MESSAGES, WINDOW_SLACK_NS, ContentJoin
from span_to_transition.convert import ConvertConfig
from span_to_transition.dialects.registry import VALUE_KEYS, classify, parse_call
from span_to_transition.doctor_chat import Untrainable
from span_to_transition.identity import assign_rollouts
from span_to_transition.ledger import Ledger
from span_to_transition.records import LogEvent, Span, as_bool
from span_to_transition.rewards import AUTO, UNNAMED
from span_to_transition.store_read import read_files, relative, rollout_statuses, table_files
from span_to_transition.survey_training import TrainingFacts, gather_training
from span_to_transition.tokens import is_gateway
from span_to_transition.tree import decide_completion
from store.location import StoreLocation
from store.views import connect_readonly

REWARD_SPELLINGS: dict[str, str] = {
    REWARD: f"a span attribute {REWARD}",
    "agentlightning.reward": "Agent Lightning reward spans (agentlightning.reward, agentlightning.reward.*)",
    "agentops.task.output": "AgentOps reward payloads (agentops.task.output / agentops.entity.output "
    '{"type": "reward", ...})',
    "gen_ai.evaluation.result": "gen_ai.evaluation.result events (span events or log records)",
    "rewards table": "rows in rewards/ (POST /v1/rewards on the collector, or an offline rewards file)",
}
"""Every reward channel the survey counts (DESIGN.md "Rewards", plus Agent Lightning's and AgentOps')."""

# ---------------------------------------------------------------------------------------------
# Facts (query results)


@dataclass
class SpanGroup:
    """Spans sharing an instrumentation scope and an attribute-key shape (indexes collapsed), with one sample."""

    scope: str | None
    count: int
    sample: Span
    sample_logs: list[LogEvent] = field(default_factory=list)  # gen_ai.* log records joined to the sample
    wraps_call: bool = False  # the sample is a content-free record over a call span that has the messages


@dataclass(frozen=True)
class Pending:
    rollout_id: str
    wait: str  # waiting_quiet | waiting_root (tree.decide_completion)
    seconds_left: float


@dataclass
class StoreFacts:
    """Everything ``diagnose`` needs, read from one store."""

    spans: int = 0
    wal_backlog_bytes: int = 0
    scopes: dict[str, int] = field(default_factory=dict)  # instrumentation scope -> spans
    groups: list[SpanGroup] = field(default_factory=list)
    rewards: dict[str, int] = field(default_factory=dict)  # REWARD_SPELLINGS key -> count
    reward_samples: dict[str, Span] = field(default_factory=dict)  # spelling -> one span carrying it
    gateway_spans: int = 0
    gateway_roots: int = 0  # gateway spans with no parent: the agent did not propagate traceparent
    # gateway spans that record no request/response (gateway --no-record-content)
    gateway_content_off: int = 0
    transitions: int = 0
    token_sources: dict[str, int] = field(default_factory=dict)
    untrainable: list[Untrainable] = field(default_factory=list)  # malformed chat, by reason
    # converted calls no agent span, resource attribute or chain span named
    transitions_without_agent: int = 0
    agents_setting: str | None = None  # the --agents the rows were converted with
    # root gateway spans joined by content, and the ties / near-misses
    content_join: ContentJoin | None = None
    pending: list[Pending] = field(default_factory=list)
    excluded: list[str] = field(default_factory=list)  # rollouts the ledger holds as excluded (no reward)
    quiet_s: float = ConvertConfig.quiet_s  # the completion settings pending rollouts are judged by
    max_wait_s: float = ConvertConfig.max_wait_s
    missing_reward: str = "exclude"
    reward_from: str = "auto"  # the --reward-from the rows were converted with
    reward_names: dict[str, int] = field(default_factory=dict)  # rewards table: name -> rows
    training: TrainingFacts | None = None  # the next round (None: no spans to speak of)


# ---------------------------------------------------------------------------------------------
# Reading the store (read-only)


_REWARD_WHERE = {
    REWARD: f"map_contains(attributes, '{REWARD}')",
    "agentlightning.reward": "starts_with(name, 'agentlightning.reward') OR len(list_filter(map_keys(attributes), "
    "lambda k: starts_with(k, 'agentlightning.reward'))) > 0",
    "agentops.task.output": "coalesce(coalesce(attributes['agentops.task.output'], "
    "attributes['agentops.entity.output']) LIKE '%reward%', false)",
    "gen_ai.evaluation.result": "len(list_filter(events, lambda e: e.name = 'gen_ai.evaluation.result')) > 0",
}
"""How each in-span reward channel of ``REWARD_SPELLINGS`` is spotted (the others are counted in logs/rewards)."""

_DECIDING = ", ".join(f"attributes['{key}']" for key in VALUE_KEYS)
"""The values that decide whether a span is a call, as each dialect declares them (``registry.VALUE_KEYS``)."""
_SHAPE = rf"""scope_name,
    list_sort(list_distinct(list_transform(map_keys(attributes),
                                           lambda k: regexp_replace(k, '\.[0-9]+(\.|$)', '.N\1', 'g')))),
    {_DECIDING}, attributes['{GATEWAY_FLAG}'],
    span_id IN (SELECT span_id FROM logs WHERE event_name LIKE 'gen_ai.%'),
    len(list_filter(events, lambda e: starts_with(e.name, 'gen_ai.'))) > 0"""
_GROUPS_SQL = (
    "SELECT scope_name, count(*) AS n, count(*) FILTER (WHERE parent_span_id IS NULL) AS roots, "
    + ", ".join(f'count(*) FILTER (WHERE {w}) AS "{k}"' for k, w in _REWARD_WHERE.items())
    + ", arg_min({"
    + ", ".join(f"'{c}': {c}" for c in SPAN_COLUMNS)
    + "}, span_id) AS sample "
    + f"FROM spans GROUP BY {_SHAPE}, "
    + ", ".join(f"({w})" for w in _REWARD_WHERE.values())
    + " ORDER BY n DESC"
)
"""One scan: spans grouped by scope, attribute-key shape (indexes collapsed), the values that decide
a call's dialect, the gateway flag, whether gen_ai.* log records or span events (Strands) carry its
content, and each reward
channel, with a count and the first span of each
group as its sample (a group's spans look alike to every rule the doctor applies)."""


def _groups(con: duckdb.DuckDBPyConnection, f: StoreFacts) -> None:
    table = con.sql(_GROUPS_SQL).to_arrow_table()
    samples = spans_from_table(
        pa.Table.from_struct_array(table.column("sample").combine_chunks()), all_attributes=True
    )
    ids = pa.array([s.span_id for s in samples], pa.string())
    logs: dict[str | None, list[LogEvent]] = {}
    for e in logs_from_table(
        con.sql(
            "SELECT * FROM logs WHERE span_id IN (SELECT unnest(?)) AND event_name LIKE 'gen_ai.%'",
            params=[ids.to_pylist()],
        ).to_arrow_table()
    ):
        logs.setdefault(e.span_id, []).append(e)
    for row, sample in zip(table.drop_columns(["sample"]).to_pylist(), samples):
        scope, n = row["scope_name"], row["n"]
        f.groups.append(SpanGroup(scope, n, sample, logs.get(sample.span_id, [])))
        f.scopes[scope or ""] = f.scopes.get(scope or "", 0) + n
        for k in _REWARD_WHERE:
            if row[k]:
                f.rewards[k] = f.rewards.get(k, 0) + row[k]
                f.reward_samples.setdefault(k, sample)
        if is_gateway(sample):
            f.gateway_spans += n
            f.gateway_roots += row["roots"]
            recorded = sample.attributes.get(CONTENT_RECORDED)
            if recorded is not None and not as_bool(recorded):
                f.gateway_content_off += n
    for g in f.groups:
        call = parse_call(g.sample, g.sample_logs) if classify(g.sample.attributes) else None
        if call is not None and not call.messages:
            g.wraps_call = _wraps_call(con, g.sample)


def _wraps_call(con: duckdb.DuckDBPyConnection, sample: Span) -> bool:
    """Whether a call span without messages has, somewhere below it, a call span with them: the same request
    recorded twice (LlamaIndex's outer ``achat`` keeps the response, the inner one the messages); the converter
    keeps the inner record, so the outer one is no content problem."""
    spans = spans_from_table(
        con.sql(
            f"SELECT {', '.join(SPAN_COLUMNS)} FROM spans WHERE trace_id = ?", params=[sample.trace_id]
        ).to_arrow_table(),
        all_attributes=True,
    )
    children: dict[str | None, list[Span]] = {}
    for s in spans:
        children.setdefault(s.parent_span_id, []).append(s)
    todo, seen = list(children.get(sample.span_id, [])), set()
    while todo:
        s = todo.pop()
        if s.span_id in seen:
            continue
        seen.add(s.span_id)
        call = parse_call(s) if classify(s.attributes) else None
        if call is not None and call.messages:
            return True
        todo.extend(children.get(s.span_id, []))
    return False


def gather(
    layout: StoreLocation,
    quiet_s: float = ConvertConfig.quiet_s,
    max_wait_s: float = ConvertConfig.max_wait_s,
    now_ns: int | None = None,
    wal_backlog_bytes: int = 0,
    *,
    estimator: str = "auto",
    feedback_window_s: float = 0.0,
) -> StoreFacts:
    """The facts ``diagnose`` reads, from the store at ``layout`` (never written to); ``quiet_s`` / ``max_wait_s``:
    the completion settings to judge pending rollouts by (default: convert's); ``estimator`` and
    ``feedback_window_s``: the trainer's, to judge the next round by (``tracerl doctor`` passes the
    trainer's default estimator; ``auto`` is DESIGN.md's)."""
    ledger = Ledger.load(layout)
    settings = ledger.settings
    f = StoreFacts(
        wal_backlog_bytes=wal_backlog_bytes,
        quiet_s=quiet_s,
        max_wait_s=max_wait_s,
        missing_reward=str(settings.get("missing_reward", "exclude")),
        reward_from=str(settings.get("reward_from", AUTO)),
        agents_setting=settings.get("agents"),  # type: ignore[arg-type]
    )
    con = connect_readonly(layout)
    try:
        f.spans = con.execute("SELECT count(*) FROM spans").fetchall()[0][0]
        if f.spans == 0:
            return f
        _counts(con, f)
        f.training = gather_training(
            con,
            layout,
            ledger,
            estimator=estimator,
            feedback_window_s=feedback_window_s,
            now_ns=time.time_ns() if now_ns is None else now_ns,
        )
    finally:
        con.close()
    f.excluded = sorted(ledger.excluded)
    f.pending = _pending(
        layout,
        ledger,
        f.quiet_s,
        f.max_wait_s,
        time.time_ns() if now_ns is None else now_ns,
        bool(settings.get("follow_links", True)),
    )
    return f


def _counts(con: duckdb.DuckDBPyConnection, f: StoreFacts) -> None:
    """What the store holds, counted into ``f``: rewards by spelling and by name, span groups, transitions by
    token source, the untrainable and agentless ones, and how the content join went."""
    f.rewards = dict.fromkeys(REWARD_SPELLINGS, 0)
    _groups(con, f)
    f.rewards["gen_ai.evaluation.result"] += con.execute(
        "SELECT count(*) FROM logs WHERE event_name = 'gen_ai.evaluation.result'"
    ).fetchall()[0][0]
    f.reward_names = dict(
        con.execute(
            "SELECT coalesce(name, ?), count(*) FROM rewards GROUP BY 1 ORDER BY 1", [UNNAMED]
        ).fetchall()
    )
    f.rewards["rewards table"] = sum(f.reward_names.values())
    f.token_sources = dict(
        con.execute("SELECT token_source, count(*) FROM transitions GROUP BY 1").fetchall()
    )
    f.transitions = sum(f.token_sources.values())
    f.untrainable = _untrainable(con)
    f.transitions_without_agent = con.execute(
        "SELECT count(*) FROM transitions WHERE agent_name IS NULL"
    ).fetchall()[0][0]
    f.content_join = _content_join(con)


_UNTRAINABLE_SQL = """
SELECT t.reason, t.n, t.span_id, any_value(s.scope_name) AS scope
FROM (SELECT untrainable_reason AS reason, count(*) AS n, min(span_id) AS span_id
      FROM transitions WHERE untrainable_reason IS NOT NULL GROUP BY 1) t
LEFT JOIN spans s ON s.span_id = t.span_id
GROUP BY ALL ORDER BY t.n DESC, t.reason
"""


def _untrainable(con: duckdb.DuckDBPyConnection) -> list[Untrainable]:
    """Transitions the converter marked untrainable (malformed chat), by reason, with a sample span and its scope."""
    return [Untrainable(*row) for row in con.execute(_UNTRAINABLE_SQL).fetchall()]


def _content_join(con: duckdb.DuckDBPyConnection) -> ContentJoin | None:
    """The rollout assignment's joins of root gateway spans that record their content, rerun over the spans in
    their time range: which joined by content, which tied or nearly matched (None: no such gateway span)."""
    cols = ", ".join(SPAN_COLUMNS)
    bounds = con.execute(
        "SELECT min(start_time_ns), max(end_time_ns) FROM spans WHERE parent_span_id IS NULL "
        f"AND attributes['tracerl.gateway'] = 'true' AND map_contains(attributes, '{REQUEST_MESSAGES}')"
    ).fetchall()[0]
    if bounds[0] is None:
        return None
    near = con.sql(
        f"SELECT {cols}, links FROM spans WHERE start_time_ns <= ? AND end_time_ns >= ?",
        params=[bounds[1] + WINDOW_SLACK_NS, bounds[0] - WINDOW_SLACK_NS],
    ).to_arrow_table()
    joins = ContentJoin()
    assign_rollouts(near.cast(pa.schema([SPANS_SCHEMA.field(n) for n in near.schema.names])), {}, joins=joins)
    return joins


def _pending(
    layout: StoreLocation, ledger: Ledger, quiet_s: float, max_wait_s: float, now_ns: int, follow_links: bool
) -> list[Pending]:
    """Rollouts the next convert pass would leave pending, with the wait each is on (the pass's own rules)."""
    files = [f for f in table_files(layout, "spans") if relative(layout, "spans", f) not in ledger.files_done]
    if not files:
        return []
    # (all a content join of gateway traces reads)
    spans = read_files(layout, files, SPANS_SCHEMA, columns=[*SPAN_COLUMNS, "links"])
    statuses = rollout_statuses(assign_rollouts(spans, dict(ledger.traces), follow_links)[0])
    quiet_ns, wait_ns = int(quiet_s * 1e9), int(max_wait_s * 1e9)
    out = []
    for r, st in sorted(statuses.items()):
        if r in ledger.converted or r in ledger.excluded:
            continue
        done = decide_completion(st, now_ns, quiet_ns, wait_ns)
        if not done.complete:
            idle = now_ns - st.last_received_ns
            left = (quiet_ns if done.reason == "waiting_quiet" else wait_ns) - idle
            out.append(Pending(r, done.reason, max(left, 0) / 1e9))
    return out
