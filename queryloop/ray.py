"""queryloop beyond one process: sessions sharded over Ray actors (`pip install 'queryloop[ray]'`).

    from queryloop.ray import ShardedRuntime, ShardLost

    async with ShardedRuntime.open(shards=4, factory="myapp.agents:options", transcript_dir="/shared/t") as rt:
        session = await rt.open_session({"task": "fix-1234"})
        async with session.query("Fix the bug", events="result") as query:
            result = await query.wait()

See `queryloop.runtime.ray` and docs/ray.md.
"""

try:
    import ray as _ray  # noqa: F401  (only to say what is missing, before the modules that need it)
except ImportError as _missing:
    _msg = "queryloop.ray needs Ray, the `ray` extra: pip install 'queryloop[ray]'"
    raise ImportError(_msg, name="ray") from _missing

from queryloop import _publish
from queryloop.runtime.errors import FactoryError, RemoteError, RuntimeClosed, ShardLost
from queryloop.runtime.ray.query import RemoteQuery, RemoteSession
from queryloop.runtime.ray.sharded import ShardedRuntime
from queryloop.runtime.ray.wire import EventsMode

__all__ = [
    "EventsMode",
    "FactoryError",
    "RemoteError",
    "RemoteQuery",
    "RemoteSession",
    "RuntimeClosed",
    "ShardLost",
    "ShardedRuntime",
]

_publish(globals())
