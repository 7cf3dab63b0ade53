"""The actor kernel: pykka actors whose handlers run on the trio thread and whose work runs as trio
tasks under cancel scopes the actor owns, supervisors that abort and close a group of them, and the
event channels that carry a query's events.

Owns: `TrioActor` (`actor`), its priority inbox and dispatcher (`_inbox`), `TrioFuture` (`_future`),
`Supervisor` (`supervisor`), the kernel's messages (`messages`) and `EventChannel` (`flow`).
Imports only `queryloop.runtime.errors`, `queryloop.runtime._records` and `queryloop.runtime._frozen`: the
kernel knows nothing of agent loops.
"""
