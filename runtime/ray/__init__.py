"""Sessions sharded over Ray actors (public as `queryloop.ray`): `shard` is the Ray actor hosting one
`AsyncioRuntime` (trio as a guest of the actor's asyncio loop), `sharded` the driver's
`ShardedRuntime` (placement, the per-shard event streams, failure), `query` the driver's
`RemoteSession` and `RemoteQuery`, `wire` what crosses between them. Imports `queryloop.runtime.host`
(and what it may import) and `ray`; nothing in the package imports this subpackage but `queryloop.ray`.
"""
