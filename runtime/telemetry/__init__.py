"""OpenTelemetry for queryloop: the spans and metrics of queries, model calls, tool calls and hook runs, named
after the OpenTelemetry GenAI semantic conventions (docs/telemetry.md lists them all). It owns the decision whether
telemetry is on, the tracer and instruments while it is, and the parent each query's spans hang from; the actors
call it at their instrumentation points, and nothing else in queryloop imports `opentelemetry`.

On or off. `opentelemetry-api` is optional (`queryloop[otel]`) and looked for only when a query is submitted.
Telemetry is on when a provider is configured (an SDK's, set with `trace.set_tracer_provider` or
`metrics.set_meter_provider`), or injected with `use(...)` (tests do); without the API, or with its own default
(proxy or no-op) providers, it is off. It is decided once per query, when the host submits it (`query_submitted`,
from `Session.query`), and kept in `active`: None while off, and every instrumentation point is that one check.

Parents. The current context lives in contextvars, and the actors' tasks run in their session's context, not in
the task of the host that submits a query: the host's context (or `TRACEPARENT`'s) is captured where the query is
submitted, keyed by its `QueryControl`. The query's `invoke_agent` span (`query_span_start`) is its child, and the
query's `chat`, `execute_tool` and hook spans are the query span's (the captured parent's until it starts). A
subagent's query hangs from the Agent tool call's span (`subagent_submitted`, called inside that call).
A host whose caller runs elsewhere carries the caller's context to where it submits (`propagation`: the
asyncio host's trio side, a Ray shard).
"""

from __future__ import annotations

import importlib.util
import time
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

if TYPE_CHECKING:
    from collections.abc import AsyncGenerator, Awaitable

    from opentelemetry.context import Context
    from opentelemetry.metrics import MeterProvider
    from opentelemetry.trace import Span, TracerProvider

    from queryloop.runtime.loop.model import ModelRequest
    from queryloop.runtime.loop.stream import SeenResponse


from queryloop.runtime.telemetry.propagation import attached as attached
from queryloop.runtime.telemetry.propagation import from_environment, to_carrier
from queryloop.runtime.telemetry.propagation import submitted_under as submitted_under

T = TypeVar("T")


class QueryAbortFlag(Protocol):
    """What telemetry reads of a query's control (`QueryControl`): the key of its query, and its abort reason."""

    @property
    def abort_reason(self) -> str | None: ...


class Named(Protocol):
    """A tool, as telemetry reads it."""

    @property
    def name(self) -> str: ...


INSTRUMENTATION_NAME = "queryloop"
PROVIDER_NAME = "anthropic"
DEFAULT_AGENT_NAME = "queryloop"
"""`gen_ai.agent.name` of a session's own queries (a subagent's is its type)."""

# The bucket boundaries the conventions give `gen_ai.client.token.usage` and `gen_ai.client.operation.duration`.
TOKEN_BUCKETS = [4**n for n in range(14)]
DURATION_BUCKETS = [0.01 * 2**n for n in range(14)]

ABORTED = frozenset({"aborted_streaming", "aborted_tools"})
"""The terminal reasons of an aborted query (`queryloop.query.aborts` counts them by abort reason)."""
SUCCEEDED = frozenset({"completed"})
"""The terminal reasons that are no error (every other one sets the query span's status to ERROR)."""

_NO_SPAN: AbstractContextManager[None] = nullcontext()

active: Telemetry | None = None
"""The tracer and instruments while telemetry is on; None while it is off (`refresh` decides)."""

_explicit: tuple[TracerProvider | None, MeterProvider | None] | None = None
"""Providers injected by `use`; None: the API's global ones."""
_api_state = 0  # 0: `opentelemetry` not looked for yet; 1: installed; -1: not installed

_parents: dict[QueryAbortFlag, Context | None] = {}
"""Each submitted query's parent context (the host's, or `TRACEPARENT`'s), by its control, until its span starts."""
_queries: dict[QueryAbortFlag, Context] = {}
"""Each running query's context (its `invoke_agent` span current), by its control, until its span ends."""


def use(tracer_provider: TracerProvider | None = None, meter_provider: MeterProvider | None = None) -> None:
    """Use these providers instead of the API's global ones (either may be None: that signal is off); with no
    argument, go back to the global ones. Takes effect at the next query submitted (or `refresh()`).

    For a host that keeps its providers to itself, and for tests: the API's global providers can be set only once
    per process."""
    global _explicit  # noqa: PLW0603 - the process's choice of providers
    _explicit = None if tracer_provider is None and meter_provider is None else (tracer_provider, meter_provider)
    refresh()


def _api_installed() -> bool:
    global _api_state  # noqa: PLW0603 - looked for once
    if _api_state == 0:
        try:
            _api_state = 1 if importlib.util.find_spec("opentelemetry.trace") is not None else -1
        except ImportError:  # no `opentelemetry` package at all
            _api_state = -1
    return _api_state > 0


def _is_default(provider: object) -> bool:
    """The API's own provider (its proxy or its no-op one): no SDK configured for that signal."""
    return type(provider).__module__.startswith(("opentelemetry.trace", "opentelemetry.metrics"))


def refresh() -> Telemetry | None:
    """Decide whether telemetry is on, from the providers now configured; sets and returns `active`."""
    global active  # noqa: PLW0603 - a module attribute: the one check of every instrumentation point
    explicit = _explicit
    if explicit is not None:
        tracer_provider, meter_provider = explicit
    else:
        if not _api_installed():
            active = None
            return None
        from opentelemetry import metrics, trace

        tracer_provider, meter_provider = trace.get_tracer_provider(), metrics.get_meter_provider()
        if _is_default(tracer_provider) and _is_default(meter_provider):
            active = None
            return None
    current = active
    if (
        current is None
        or current.tracer_provider is not tracer_provider
        or current.meter_provider is not meter_provider
    ):
        _api_installed()
        current = active = Telemetry(tracer_provider, meter_provider)
    return current


def query_submitted(control: QueryAbortFlag) -> None:
    """The host submits a query (`Session.query`, in the host's task): decide whether telemetry is on for it and,
    if so, keep the host's current context (or `TRACEPARENT`'s) as the parent of its spans."""
    telemetry = refresh()
    if telemetry is not None:
        telemetry.bind_parent(control)


def caller_context() -> Context | None:
    """The current context, for a host that submits its caller's query elsewhere (`propagation`); None while
    telemetry is off (then nothing is carried)."""
    if active is None:
        return None
    from opentelemetry import context

    return context.get_current()


def caller_carrier() -> dict[str, str] | None:
    """`caller_context` as a W3C carrier, for a query submitted in another process; None while telemetry is off
    or no span is current."""
    return None if active is None else to_carrier()


def subagent_submitted(control: QueryAbortFlag) -> None:
    """A subagent's query is sent, from inside the Agent tool call that runs it: the child's query span will be
    that call's `execute_tool` span's child (the span current where this is called)."""
    telemetry = active
    if telemetry is not None:
        telemetry.bind_parent(control)


@dataclass(slots=True)
class QuerySpan:
    """A query's `invoke_agent` span and what its end needs."""

    telemetry: Telemetry
    span: Span
    context: Context
    control: QueryAbortFlag
    attributes: dict[str, Any]
    agent_id: str | None
    started: float = field(default_factory=time.monotonic)


def query_span_start(
    control: QueryAbortFlag,
    *,
    session_id: str,
    model: str,
    agent_name: str | None = None,
    agent_id: str | None = None,
) -> QuerySpan | None:
    """The query's `invoke_agent` span, started (None while telemetry is off). Call it at the start of the query's
    own task: its context becomes that task's current one, so what the task runs (hooks) nests under it.
    `agent_name`/`agent_id`: a subagent's type and id (None: the session's own query)."""
    telemetry = active
    if telemetry is None:
        return None
    return telemetry.query_start(control, session_id, model, agent_name or DEFAULT_AGENT_NAME, agent_id)


def query_span_end(
    query: QuerySpan | None,
    terminal_reason: str,
    *,
    cost_usd: float = 0.0,
    is_error: bool | None = None,
    error: str | None = None,
) -> None:
    """End the query's span with its terminal reason (`queryloop.terminal_reason`; error status for an error result:
    `is_error`, else any reason but `completed`), and record its duration, its cost and, for an abort, the abort
    reason. May be called from any task."""
    if query is not None:
        failed = terminal_reason not in SUCCEEDED if is_error is None else is_error
        query.telemetry.query_end(query, terminal_reason, cost_usd, failed, error)


class Telemetry:
    """The tracer and instruments of one pair of providers (`refresh` makes one per change of providers)."""

    def __init__(self, tracer_provider: TracerProvider | None, meter_provider: MeterProvider | None) -> None:
        from opentelemetry import metrics, trace

        self.tracer_provider = tracer_provider
        self.meter_provider = meter_provider
        self.tracer = trace.get_tracer(
            INSTRUMENTATION_NAME, tracer_provider=tracer_provider or trace.NoOpTracerProvider()
        )
        meter = (meter_provider or metrics.NoOpMeterProvider()).get_meter(INSTRUMENTATION_NAME)
        self.token_usage = meter.create_histogram(
            "gen_ai.client.token.usage",
            unit="{token}",
            description="Tokens used by each model call, by gen_ai.token.type",
            explicit_bucket_boundaries_advisory=TOKEN_BUCKETS,
        )
        self.operation_duration = meter.create_histogram(
            "gen_ai.client.operation.duration",
            unit="s",
            description="Duration of each model call",
            explicit_bucket_boundaries_advisory=DURATION_BUCKETS,
        )
        self.query_duration = meter.create_histogram("gen_ai.invoke_agent.duration", unit="s")
        self.tool_duration = meter.create_histogram("gen_ai.execute_tool.duration", unit="s")
        self.cost = meter.create_counter("queryloop.cost.usd", unit="{USD}", description="Queries' cost in US dollars")
        self.aborts = meter.create_counter("queryloop.query.aborts", unit="{query}")

    # -- parents

    def bind_parent(self, control: QueryAbortFlag) -> None:
        """Keep the current context (or `TRACEPARENT`'s when it has no span) as the parent of `control`'s query."""
        from opentelemetry import context, trace

        current: Context | None = context.get_current()
        if not trace.get_current_span(current).get_span_context().is_valid:
            current = from_environment()
        if _parents:
            for gone in [c for c in _parents if getattr(c, "finished", False)]:
                del _parents[gone]  # a query that never started its span (it ended waiting its turn)
        _parents[control] = current

    def parent_of(self, control: QueryAbortFlag | None) -> Context | None:
        """The context a query's calls hang from: its span's, else the parent captured when it was submitted."""
        if control is None:
            return None
        found = _queries.get(control)
        return found if found is not None else _parents.get(control)

    async def in_query(self, control: QueryAbortFlag | None, work: Awaitable[T]) -> T:
        """`work`, awaited with the query's context current in this task (the spans of what it runs nest there)."""
        from opentelemetry import context

        parent = self.parent_of(control)
        if parent is None:
            return await work
        token = context.attach(parent)
        try:
            return await work
        finally:
            context.detach(token)

    # -- queries

    def query_start(
        self, control: QueryAbortFlag, session_id: str, model: str, agent_name: str, agent_id: str | None
    ) -> QuerySpan:
        from opentelemetry import context, trace

        parent = _parents.pop(control, None)
        attributes: dict[str, Any] = {
            "gen_ai.operation.name": "invoke_agent",
            "gen_ai.provider.name": PROVIDER_NAME,
            "gen_ai.agent.name": agent_name,
            "gen_ai.conversation.id": session_id,
            "gen_ai.request.model": model,
        }
        if agent_id is not None:
            attributes["gen_ai.agent.id"] = agent_id
        span = self.tracer.start_span(
            f"invoke_agent {agent_name}", context=parent, kind=trace.SpanKind.INTERNAL, attributes=attributes
        )
        query_context = trace.set_span_in_context(span, parent)
        _queries[control] = query_context
        context.attach(query_context)  # the query's task: its context dies with it (no detach needed)
        return QuerySpan(self, span, query_context, control, attributes, agent_id)

    def query_end(
        self, query: QuerySpan, terminal_reason: str, cost_usd: float, is_error: bool, error: str | None
    ) -> None:
        from opentelemetry.trace import Status, StatusCode

        _queries.pop(query.control, None)
        span = query.span
        span.set_attribute("queryloop.terminal_reason", terminal_reason)
        attributes = {
            "gen_ai.operation.name": "invoke_agent",
            "gen_ai.agent.name": query.attributes["gen_ai.agent.name"],
            "gen_ai.request.model": query.attributes["gen_ai.request.model"],
            "queryloop.terminal_reason": terminal_reason,
        }
        if is_error:
            span.set_attribute("error.type", terminal_reason)
            span.set_status(Status(StatusCode.ERROR, error or terminal_reason))
            attributes["error.type"] = terminal_reason
        span.end()
        self.query_duration.record(time.monotonic() - query.started, attributes)
        if cost_usd and query.agent_id is None:  # a subagent's cost is in its parent query's already
            self.cost.add(cost_usd, {"gen_ai.request.model": attributes["gen_ai.request.model"]})
        if terminal_reason in ABORTED:
            reason = query.control.abort_reason or "user"
            self.aborts.add(1, {"queryloop.abort.reason": reason, "queryloop.terminal_reason": terminal_reason})

    # -- model calls

    def chat_start(self, request: ModelRequest, control: QueryAbortFlag | None) -> ChatSpan:
        from opentelemetry import trace

        model = request.model
        span = self.tracer.start_span(
            f"chat {model}",
            context=self.parent_of(control),
            kind=trace.SpanKind.CLIENT,
            attributes={
                "gen_ai.operation.name": "chat",
                "gen_ai.provider.name": PROVIDER_NAME,
                "gen_ai.request.model": model,
                "gen_ai.request.max_tokens": request.max_tokens,
            },
        )
        return ChatSpan(span, model)

    async def chat_stream(
        self, stream: AsyncGenerator[Any, None], request: ModelRequest, control: QueryAbortFlag | None
    ) -> AsyncGenerator[Any, None]:
        """The provider's `stream`, passed through as it is, in the request's `chat` span: the span ends with the
        response's model, finish reason and usage, or with the failure (`error.type`: a `ModelError`'s kind, or
        `connection` for a stream that ended before `message_stop`, `_OTHER` for one closed before it)."""
        chat = self.chat_start(request, control)
        from queryloop.runtime.loop.stream import SeenResponse

        seen = SeenResponse()
        try:
            async for raw in stream:
                seen.see(raw)
                yield raw
        except BaseException as error:
            self.chat_failed(chat, None if isinstance(error, GeneratorExit) and not seen.stopped else error)
            raise
        finally:
            await stream.aclose()
        if not seen.stopped:
            self.chat_failed(chat, None, "connection")
            return
        self.chat_done(chat, seen)

    def chat_done(self, chat: ChatSpan, seen: SeenResponse) -> None:
        """End a call's span with what its response said (model, id, finish reason, usage) and record its metrics."""
        span, response, usage = chat.span, seen.response, seen.usage
        model = response.get("model") or None
        if model:
            span.set_attribute("gen_ai.response.model", model)
        if response.get("id"):
            span.set_attribute("gen_ai.response.id", response["id"])
        if seen.stop_reason is not None:
            span.set_attribute("gen_ai.response.finish_reasons", [seen.stop_reason])
        counts = (
            ("input", "gen_ai.usage.input_tokens", usage.input_tokens),
            ("output", "gen_ai.usage.output_tokens", usage.output_tokens),
            ("cache_read", "gen_ai.usage.cache_read.input_tokens", usage.cache_read_input_tokens),
            ("cache_creation", "gen_ai.usage.cache_creation.input_tokens", usage.cache_creation_input_tokens),
        )
        attributes = chat.metric_attributes(model)
        for token_type, name, count in counts:
            span.set_attribute(name, count)
            if count or token_type in ("input", "output"):
                self.token_usage.record(count, {**attributes, "gen_ai.token.type": token_type})
        span.end()
        self.operation_duration.record(time.monotonic() - chat.started, attributes)

    def chat_failed(self, chat: ChatSpan, error: BaseException | None, kind: str | None = None) -> None:
        from opentelemetry.trace import Status, StatusCode

        kind = kind or _error_type(error)
        span = chat.span
        span.set_attribute("error.type", kind)
        span.set_status(Status(StatusCode.ERROR, str(error or "") or kind))
        span.end()
        self.operation_duration.record(
            time.monotonic() - chat.started, {**chat.metric_attributes(None), "error.type": kind}
        )

    # -- tool calls

    def tool_span(self, name: str, call_id: str) -> Span:
        """A tool call's `execute_tool` span, started under the current context (the query's: `in_query`)."""
        from opentelemetry import trace

        attributes = {"gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": name, "gen_ai.tool.call.id": call_id}
        return self.tracer.start_span(f"execute_tool {name}", kind=trace.SpanKind.INTERNAL, attributes=attributes)

    async def tool(self, tool: Named, call_id: str, call: Awaitable[tuple[Any, bool]]) -> tuple[Any, bool]:
        """A tool call (`StreamingToolExecutor._call`: its output and whether it is an error), awaited in its
        `execute_tool` span, current while the tool runs (a subagent's query nests in it)."""
        from opentelemetry import trace

        name = tool.name
        span, started, error_type = self.tool_span(name, call_id), time.monotonic(), None
        try:
            with trace.use_span(span, record_exception=False, set_status_on_exception=False):
                output, is_error = await call
            error_type = "tool_error" if is_error else None
        except BaseException:
            error_type = "cancelled"  # `_call` answers every failure of the tool itself: this is its cancellation
            raise
        finally:
            self.tool_done(span, name, started, error_type)
        return output, is_error

    def tool_done(self, span: Span, name: str, started: float, error_type: str | None) -> None:
        """End a tool call's span (`error.type` and status ERROR for a failed call), and record its duration."""
        from opentelemetry.trace import Status, StatusCode

        attributes = {"gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": name}
        if error_type is not None:
            span.set_attribute("error.type", error_type)
            span.set_status(Status(StatusCode.ERROR, error_type))
            attributes["error.type"] = error_type
        span.end()
        self.tool_duration.record(time.monotonic() - started, attributes)

    # -- hooks

    def hook_span(self, event: str, callbacks: int) -> AbstractContextManager[Any]:
        """A hook run's span (`hook {event}`), current while its callbacks run (they inherit it)."""
        from opentelemetry import trace

        span = self.tracer.start_span(
            f"hook {event}",
            kind=trace.SpanKind.INTERNAL,
            attributes={"queryloop.hook.event": event, "queryloop.hook.callbacks": callbacks},
        )
        return trace.use_span(span, end_on_exit=True)


def hook_span(event: str, callbacks: int) -> AbstractContextManager[Any]:
    """`Telemetry.hook_span` while telemetry is on; a shared do-nothing context manager while it is off."""
    telemetry = active
    return _NO_SPAN if telemetry is None else telemetry.hook_span(event, callbacks)


@dataclass(slots=True)
class ChatSpan:
    """One model request's `chat` span."""

    span: Span
    model: str
    started: float = field(default_factory=time.monotonic)

    def metric_attributes(self, response_model: str | None) -> dict[str, Any]:
        attributes = {"gen_ai.operation.name": "chat", "gen_ai.provider.name": PROVIDER_NAME}
        attributes["gen_ai.request.model"] = self.model
        if response_model:
            attributes["gen_ai.response.model"] = response_model
        return attributes


def _error_type(error: BaseException | None) -> str:
    """`error.type` for a failed model request: a `ModelError`'s kind, else the exception's class name."""
    kind = getattr(error, "kind", None)
    if isinstance(kind, str):
        return kind
    return "_OTHER" if error is None else type(error).__qualname__
