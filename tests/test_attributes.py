"""The gateway -> converter contract (schemas/attributes.py): what the gateway writes, the converter reads.

The round trip goes through real parts: the gateway's ``span_attributes`` on a real OTel SDK span, the
SDK's OTLP encoder, the collector's OTLP -> Arrow rows, the converter's rows -> ``Span`` and its token
reader. A name changed on one side only fails here.
"""

from __future__ import annotations

import pytest
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from collector_exporter.otlp_arrow import trace_request_to_table
from schemas import attributes as attr
from serving.gateway.record import CallRecord, ChoiceRecord, span_attributes
from serving.protocol import latest_version_name
from span_to_transition.columnar import spans_from_table
from span_to_transition.tokens import is_gateway, tokens_from


@pytest.mark.parametrize(("base", "k"), [("policy", 0), ("policy", 12), ("team@prod", 3)])
def test_version_name_and_parse_are_inverse(base: str, k: int) -> None:
    name = attr.version_name(base, k)
    assert attr.parse_policy_version(name) == k
    assert attr.base_name(name) == base


@pytest.mark.parametrize("model", ["policy", "gpt-4o", "policy@", "policy@v3", "", None])
def test_a_name_without_at_k_has_no_version(model: str | None) -> None:
    assert attr.parse_policy_version(model) is None
    if model:
        assert attr.base_name(model) == model


def test_a_negative_version_is_refused() -> None:
    with pytest.raises(ValueError, match=">= 0"):
        attr.version_name("policy", -1)


def test_the_gateway_routes_to_the_newest_name_the_rule_writes() -> None:
    served = [attr.version_name("policy", k) for k in (1, 10, 2)] + [attr.version_name("other", 99)]
    assert latest_version_name("policy", served) == "policy@10"


def _through_the_collector(attrs: dict) -> list:
    mem = InMemorySpanExporter()
    tp = TracerProvider()
    tp.add_span_processor(SimpleSpanProcessor(mem))
    with tp.get_tracer("gateway").start_as_current_span("call") as span:
        span.set_attributes(attrs)
    table = trace_request_to_table(encode_spans(mem.get_finished_spans()), received_at_ns=1)
    return spans_from_table(table, all_attributes=True)


def test_what_the_gateway_writes_the_converter_reads() -> None:
    rec = CallRecord(
        operation="chat",
        request_model="policy",
        response_model=attr.version_name("policy", 4),
        prompt_token_ids=[5, 6, 7],
        choices=[
            ChoiceRecord(index=0, token_ids=[8, 9], logprobs=[-0.5, -0.25]),
            ChoiceRecord(index=1, token_ids=[10], logprobs=[-1.0]),
        ],
    )
    (span,) = _through_the_collector(span_attributes(rec, "http://upstream"))
    assert is_gateway(span)
    problems: list[str] = []
    tokens = tokens_from(span, "gateway", problems)
    assert problems == []
    assert tokens is not None
    assert (tokens.prompt_token_ids, tokens.response_token_ids) == ([5, 6, 7], [8, 9])
    assert tokens.response_logprobs == [-0.5, -0.25]
    assert tokens.policy_version == 4
    assert span.attributes[attr.choice_prefix(1) + "response_token_ids"] == "[10]"
    assert span.attributes[attr.UPSTREAM] == "http://upstream"
