"""queryloop for asyncio programs: `AsyncioRuntime` runs the trio runtime as a guest of the running
asyncio loop (or, `mode="thread"`, on a thread of its own) and offers the same sessions, options,
tools, events and results, awaited from asyncio.

    from queryloop.aio import AsyncioRuntime

    async with AsyncioRuntime.open() as rt:
        session = await rt.open_session(QueryOptions(provider=model, tools=[...]))
        async with session.query("Fix the bug") as query:
            async for event in query:
                ...
        print(query.terminal.reason)

See `queryloop.runtime.host.aio` for how events, aborts and asyncio tools cross between the loops.
"""

from queryloop import _publish
from queryloop.runtime.errors import RuntimeClosed
from queryloop.runtime.host.aio import AsyncioQuery, AsyncioRuntime, AsyncioSession
from queryloop.runtime.host.aio_bridge import AsyncioToolContext

__all__ = ["AsyncioQuery", "AsyncioRuntime", "AsyncioSession", "AsyncioToolContext", "RuntimeClosed"]

_publish(globals())
