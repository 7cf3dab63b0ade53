"""Every host says the same words (`runtime/host/protocols.py`): the trio, asyncio and Ray queries and sessions have
the members of `QueryView` and `SessionView`, the blocking ones those of `SyncQueryView` and `SyncSessionView`, each
of the same kind (property, coroutine, plain method) with the same parameters and return type. A member beyond the
protocol is allowed only from the allowlists below, each with why: a word one host adds makes this test fail until
it is either given to every host (and the protocol) or listed here.

`isinstance` with the `runtime_checkable` protocols only checks that the names exist, so the members are compared
with `inspect` too; mypy checks the same conformance statically (`_conform`)."""

from __future__ import annotations

import ast
import asyncio
import inspect
import textwrap
from typing import TYPE_CHECKING, Any

import pytest

import queryloop
from queryloop.aio import AsyncioQuery, AsyncioRuntime, AsyncioSession
from queryloop.runtime.host.blocking import BlockingQuery, BlockingRuntime, BlockingSession
from queryloop.runtime.host.protocols import QueryView, SessionView, SyncQueryView, SyncSessionView
from queryloop.runtime.host.runtime import Runtime
from queryloop.runtime.host.session import QueryHandle, Session
from queryloop.runtime.loop.agents import AgentDefinition
from queryloop.runtime.loop.events import UserMessage
from queryloop.runtime.loop.options import QueryOptions
from queryloop.runtime.providers.scripted import ScriptedModel
from tests.agent_helpers import ByPrompt, agent_call
from tests.helpers import text_reply, tools_reply

if TYPE_CHECKING:
    from queryloop.runtime.ray.query import RemoteQuery, RemoteSession
    from queryloop.runtime.ray.sharded import ShardedRuntime

try:
    from queryloop.runtime.ray.query import RemoteQuery, RemoteSession
    from queryloop.runtime.ray.sharded import ShardedRuntime
except ImportError:  # the `ray` extra is not installed: the other hosts are still compared
    RAY: list[tuple[type, type]] = []
    SHARDED: type[ShardedRuntime] | None = None
else:
    RAY = [(RemoteQuery, QueryView), (RemoteSession, SessionView)]
    SHARDED = ShardedRuntime

QUERY_EXTRAS: dict[type, dict[str, str]] = {
    QueryHandle: {
        "abort_reason": "the reason an abort reached the query with: the trio tests' probe of the loop's rules",
        "event_buffer": "the channel's bound, read by the asyncio pump that forwards the handle",
        "next_batch": "the asyncio pump moves events in batches, one hop each",
        "next_buffered": "the blocking facade serves a channel after its trio run has ended",
    },
    AsyncioQuery: {
        "next_batch": "a consumer that forwards events in batches (one task step each)",
        "on_ready": "a Ray shard forwards events from a callback, without a task per query",
        "take_ready": "what `on_ready`'s listener reads, without waiting",
    },
    BlockingQuery: {},
}
SESSION_EXTRAS: dict[type, dict[str, str]] = {
    Session: {
        "supervisor": "the session's kernel group (`queryloop.lowlevel`): its acks, its actors",
        "options": "the options the session was opened with (a query's overrides start from them, and `set_model`'s)",
        "failure": "the kernel's crash record; every host raises it from the query's stream",
        "abort_nowait": "for code that cannot await (a finalizer, a query's own abort)",
        "live_tasks": "a snapshot of the trio run's work tasks: a probe for tests and benchmarks",
    },
    AsyncioSession: {
        "session": "the trio `Session` underneath, for the trio side",
        "options": "the options as the host gave them (its own async tools, before their stand-ins)",
        "abort_nowait": "`abort` without waiting for the acks, from any task or thread",
        "abort_threadsafe": "`abort` from any thread without the host's loop (a Ray shard's control lane)",
        "live_tasks": "a snapshot of the trio run's work tasks: a probe for tests and benchmarks",
    },
    BlockingSession: {"session": "the trio `Session` underneath, for the trio side"},
}
PARAMETER_EXTRAS: dict[tuple[str, str], dict[str, str]] = {
    ("RemoteSession", "query"): {"events": "what crosses from the shard: every event, all but deltas, or the result"},
}
if RAY:
    QUERY_EXTRAS[RemoteQuery] = {}
    SESSION_EXTRAS[RemoteSession] = {
        "key": "the host's name of the session, its transcript's file name on the shards",
        "shard": "the index of the shard it lives on",
        "spec": "the JSON-able spec its options were built from, on the shard",
        "lost": "why the session is gone with its shard (resume it)",
        "closed": "closed on the driver: no round trip to its shard to ask",
    }

VIEWS: list[tuple[type, type]] = [
    (QueryHandle, QueryView),
    (AsyncioQuery, QueryView),
    (BlockingQuery, SyncQueryView),
    (Session, SessionView),
    (AsyncioSession, SessionView),
    (BlockingSession, SyncSessionView),
    *RAY,
]
ASYNC_DUNDERS = {"__aiter__", "__anext__", "__aenter__", "__aexit__"}
PROTOCOL_DUNDERS = ASYNC_DUNDERS | {"__iter__", "__next__", "__enter__", "__exit__"}


def _is_member(name: str) -> bool:
    return not name.startswith("_") or name in PROTOCOL_DUNDERS


def _instance_attributes(cls: type) -> set[str]:
    """The public attributes each `__init__` in `cls`'s MRO sets on `self` (invisible on the class itself)."""
    found: set[str] = set()
    for klass in cls.__mro__:
        init = vars(klass).get("__init__")
        if init is None or klass is object:
            continue
        tree = ast.parse(textwrap.dedent(inspect.getsource(init)))
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign):
                targets = node.targets
            elif isinstance(node, ast.AnnAssign):
                targets = [node.target]
            else:
                continue
            for target in targets:
                for part in ast.walk(target):
                    if isinstance(part, ast.Attribute) and isinstance(part.value, ast.Name) and part.value.id == "self":
                        found.add(part.attr)
    return {name for name in found if _is_member(name)}


def _kind(value: Any) -> str:
    if isinstance(value, property):
        return "property"
    if isinstance(value, (staticmethod, classmethod)):
        return type(value).__name__
    if inspect.isfunction(value):
        return "coroutine" if inspect.iscoroutinefunction(value) else "method"
    return "attribute"


def _members(cls: type) -> dict[str, str]:
    """Each public member of `cls` (and the protocol dunders it has) → its kind."""
    members = {
        name: _kind(inspect.getattr_static(cls, name))
        for name in dir(cls)
        if _is_member(name) and any(name in vars(klass) for klass in cls.__mro__ if klass is not object)
    }
    for name in _instance_attributes(cls):
        members.setdefault(name, "attribute")
    return members


def _protocol_members(protocol: type) -> dict[str, str]:
    return {name: _kind(value) for name, value in vars(protocol).items() if _is_member(name)}


def _signature(value: Any) -> inspect.Signature:
    if isinstance(value, property):
        assert value.fget is not None
        return inspect.signature(value.fget)
    return inspect.signature(value)


def _ids(views: list[tuple[type, type]]) -> list[str]:
    return [view.__name__ for view, _ in views]


@pytest.mark.parametrize(("view", "protocol"), VIEWS, ids=_ids(VIEWS))
def test_each_view_has_the_protocols_members_of_the_same_kind_and_only_allowlisted_others(
    view: type, protocol: type
) -> None:
    members, expected = _members(view), _protocol_members(protocol)
    assert {name: members.get(name) for name in expected} == expected
    extras = QUERY_EXTRAS[view] if protocol in (QueryView, SyncQueryView) else SESSION_EXTRAS[view]
    assert set(members) - set(expected) == set(extras), (
        "a member beyond the protocol: give it to every host, or allow it"
    )


@pytest.mark.parametrize(("view", "protocol"), VIEWS, ids=_ids(VIEWS))
def test_each_views_members_take_the_protocols_parameters_and_return_its_types(view: type, protocol: type) -> None:
    for name, wanted in vars(protocol).items():
        if not _is_member(name):
            continue
        want, have = _signature(wanted), _signature(inspect.getattr_static(view, name))
        extra = PARAMETER_EXTRAS.get((view.__name__, name), {})
        got = [(p.name, p.kind, p.default) for p in have.parameters.values() if p.name not in extra]
        assert got == [(p.name, p.kind, p.default) for p in want.parameters.values()], f"{view.__name__}.{name}"
        for parameter in extra:
            assert have.parameters[parameter].default is not inspect.Parameter.empty  # an extra is never required
        # The host's own types (its query, `Self`, its iterator) differ by design; every other return type is shared.
        if not any(word in str(want.return_annotation) for word in ("View", "Self", "Iterator")):
            assert have.return_annotation == want.return_annotation, f"{view.__name__}.{name}"


def test_every_allowlisted_member_says_why() -> None:
    reasons = [*QUERY_EXTRAS.values(), *SESSION_EXTRAS.values(), *PARAMETER_EXTRAS.values()]
    assert all(why.strip() for allowed in reasons for why in allowed.values())


def test_the_protocols_are_importable_from_queryloop() -> None:
    exported = (queryloop.QueryView, queryloop.SessionView, queryloop.SyncQueryView, queryloop.SyncSessionView)
    assert exported == (QueryView, SessionView, SyncQueryView, SyncSessionView)


def _conform(
    *,
    trio_query: QueryHandle,
    aio_query: AsyncioQuery,
    ray_query: RemoteQuery,
    blocking_query: BlockingQuery,
    trio_session: Session,
    aio_session: AsyncioSession,
    ray_session: RemoteSession,
    blocking_session: BlockingSession,
) -> tuple[list[QueryView], list[SessionView], SyncQueryView, SyncSessionView]:
    """Never called: mypy checks that each view is its protocol, signatures and types included."""
    queries: list[QueryView] = [trio_query, aio_query, ray_query]
    sessions: list[SessionView] = [trio_session, aio_session, ray_session]
    return queries, sessions, blocking_query, blocking_session


def _options() -> QueryOptions:
    return QueryOptions(provider=ScriptedModel([text_reply("first"), text_reply("second")]))


async def test_a_trio_query_and_session_mean_by_each_word_what_the_protocol_says() -> None:
    async with Runtime.open() as runtime:
        session = await runtime.open_session(_options())
        query = session.query("one")
        assert isinstance(session, SessionView) and isinstance(query, QueryView)
        assert (query.result, query.terminal, query.done) == (None, None, False)  # None until the end
        result = await query.wait()
        assert query.result is result and query.done and query.terminal is not None
        query.abort()  # over: a no-op
        assert (await session.query("two").wait()).result == "second"
        assert await session.abort() >= 3  # the QueryLoop, the ModelCaller, the StreamingToolExecutor
        assert await session.sidechains() == {}
        await session.close()


def test_an_asyncio_query_and_session_mean_by_each_word_what_the_protocol_says() -> None:
    async def main() -> None:
        async with AsyncioRuntime.open() as runtime:
            session = await runtime.open_session(_options())
            query = session.query("one")
            assert isinstance(session, SessionView) and isinstance(query, QueryView)
            assert (query.result, query.terminal, query.done) == (None, None, False)  # a property, not a coroutine
            result = await query.wait()
            assert query.result is result and query.done and query.terminal is not None
            query.abort()  # over: a no-op
            assert (await session.query("two").wait()).result == "second"
            assert await session.abort() >= 3
            assert await session.sidechains() == {}
            await session.close()

    asyncio.run(main())


def test_a_blocking_query_and_session_mean_by_each_word_what_the_protocol_says() -> None:
    with BlockingRuntime() as runtime:
        session = runtime.open_session(_options())
        with session.query("one") as query:
            assert isinstance(session, SyncSessionView) and isinstance(query, SyncQueryView)
            assert (query.result, query.terminal, query.done) == (None, None, False)
            result = query.wait()
            assert query.result is result and query.done and query.terminal is not None
            query.abort()  # over: a no-op
        assert session.query("two").wait().result == "second"
        assert session.abort() >= 3
        assert session.sidechains() == {}
        session.close()


RUNTIME_OPTIONS = ("max_concurrent_model_calls", "max_live_agents", "tune_gc")
"""The options every in-process host passes to the `Runtime.open` it runs, with `Runtime.open`'s defaults."""


def _keywords(fn: Any) -> dict[str, tuple[inspect._ParameterKind, Any, Any]]:
    return {
        p.name: (p.kind, p.default, p.annotation)
        for p in inspect.signature(fn).parameters.values()  # follows `__wrapped__` past `asynccontextmanager`
        if p.name != "self"
    }


def test_every_in_process_host_takes_runtime_opens_options_with_its_defaults() -> None:
    want = _keywords(Runtime.open)
    shared = {name: want[name] for name in RUNTIME_OPTIONS}
    assert all(kind is inspect.Parameter.KEYWORD_ONLY for kind, _, _ in shared.values())
    for host in (AsyncioRuntime.open, AsyncioRuntime.start, BlockingRuntime.__init__):
        have = _keywords(host)
        assert {name: have.get(name) for name in RUNTIME_OPTIONS} == shared, host.__qualname__


def test_sharded_open_takes_exactly_starts_typed_parameters() -> None:
    if SHARDED is None:
        pytest.skip("the `ray` extra is not installed")
    open_parameters = _keywords(SHARDED.open)
    assert open_parameters == _keywords(SHARDED.start)
    assert all(kind is not inspect.Parameter.VAR_KEYWORD for kind, _, _ in open_parameters.values())


def test_a_blocking_runtimes_max_live_agents_refuses_an_agent_call_past_it_with_an_error_result() -> None:
    reviewer = AgentDefinition(description="Reviews one file", prompt="You review code.")
    provider = ByPrompt(
        {"Review": [tools_reply(agent_call("call_a", "reviewer", "file a")), text_reply("Done.")], "file a": []}
    )
    options = QueryOptions(provider=provider, agents={"reviewer": reviewer})
    with BlockingRuntime(max_live_agents=0) as runtime:
        session = runtime.open_session(options)
        with session.query("Review") as query:
            events = list(query)
        results = [
            block
            for event in events
            if isinstance(event, UserMessage) and event.parent_tool_use_id is None and isinstance(event.content, list)
            for block in event.content
            if block.get("type") == "tool_result"
        ]
        assert query.result is not None and query.result.result == "Done."
        assert len(results) == 1 and results[0]["is_error"]
        assert "max_live_agents=0" in results[0]["content"]
        assert provider.requests_of("file a") == []  # the subagent never ran
        session.close()
