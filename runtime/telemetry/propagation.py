"""A query's parent trace context carried to where the query is submitted, as W3C trace context.

The telemetry package captures a query's parent where the host submits it (`query_submitted`). Two hosts submit
away from their caller's context: the asyncio host submits on its trio side, where the asyncio task's context
is not current, and a Ray driver's query is submitted on a shard, in another process. They carry the caller's
context over: the asyncio host as the context itself (`attached` around the submission), a Ray driver as a
`traceparent` / `tracestate` carrier (`to_carrier`, `from_carrier`), which pickles. `TRACEPARENT` in the
environment (`from_environment`) is the parent of a query submitted with no span current.

Imports `opentelemetry` only: the package calls these once it has found the API installed.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from opentelemetry.context import Context


def from_environment() -> Context | None:
    """The parent `TRACEPARENT` (and `TRACESTATE`) name, W3C trace context; None without a valid one."""
    traceparent = os.environ.get("TRACEPARENT")
    if not traceparent:
        return None
    carrier = {"traceparent": traceparent}
    tracestate = os.environ.get("TRACESTATE")
    if tracestate:
        carrier["tracestate"] = tracestate
    return from_carrier(carrier)


def to_carrier() -> dict[str, str] | None:
    """The current context as a W3C trace context carrier (`traceparent`, `tracestate`); None with no span current."""
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    carrier: dict[str, str] = {}
    TraceContextTextMapPropagator().inject(carrier)
    return carrier or None


def from_carrier(carrier: Mapping[str, str]) -> Context | None:
    """The context a carrier names; None if it names no valid span (a malformed `traceparent` is no parent)."""
    from opentelemetry import trace
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    extracted = TraceContextTextMapPropagator().extract(dict(carrier))
    return extracted if trace.get_current_span(extracted).get_span_context().is_valid else None


@contextmanager
def attached(parent: Context) -> Iterator[None]:
    """`parent` current in this task for the block (a submission made there takes it as its parent)."""
    from opentelemetry import context

    token = context.attach(parent)
    try:
        yield
    finally:
        context.detach(token)


def submitted_under(carrier: Mapping[str, str] | None) -> AbstractContextManager[None]:
    """The context a carrier names, current for a submission (a Ray shard's); nothing without a carrier, a valid
    one, or the API (a driver's trace context reaches a shard that has no telemetry: it is dropped)."""
    if carrier is None:
        return nullcontext()
    try:
        parent = from_carrier(carrier)
    except ImportError:
        return nullcontext()
    return nullcontext() if parent is None else attached(parent)
