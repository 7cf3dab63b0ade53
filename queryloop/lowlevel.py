"""queryloop.lowlevel: the kernel, for hosts that write actors of their own (as `trio.lowlevel` is trio's).

A session's six actors are built on it; most hosts never touch it. A host that runs actors of its own
beside them subclasses `TrioActor` (handlers on the trio thread that return at once, `async` methods run
as abortable work), starts a group with `Runtime.start_group()` (a `Supervisor`: `spawn`, `abort`,
`close`), declares its messages as `@record` subclasses of `Message` (`CarrierMessage` for one that carries
runtime objects: refs, channels, callables), and reads the supervision protocol's `Abort` (overtakes
queued mail) and `AbortAck` (what `Supervisor.abort` returns). `TrioFuture` is what an ask returns,
awaitable on trio.

The kernel's errors (`ActorCrashed`, `BlockingCallOnTrioThread`, `NotInSession`, `WorkCancelled`) and
`AbortReason` are importable from `queryloop`, as every error is. How the kernel works: docs/design.md,
"The kernel in one page"; its code: `queryloop.runtime.kernel`.
"""

from queryloop import _publish
from queryloop.runtime._records import record
from queryloop.runtime.kernel._future import TrioFuture
from queryloop.runtime.kernel.actor import TrioActor
from queryloop.runtime.kernel.messages import Abort, AbortAck, CarrierMessage, Message, SupervisorMessage
from queryloop.runtime.kernel.supervisor import Supervisor

__all__ = [
    "Abort",
    "AbortAck",
    "CarrierMessage",
    "Message",
    "Supervisor",
    "SupervisorMessage",
    "TrioActor",
    "TrioFuture",
    "record",
]

_publish(globals())
