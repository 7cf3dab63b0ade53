"""Tools: functions with a pydantic input model, a concurrency flag, progress and a timeout.

    @tool(concurrency_safe=True, description="Read a file")
    async def read(args: ReadArgs, ctx: ToolContext) -> str:
        await ctx.progress("opening")
        return await trio.Path(args.path).read_text()

    @tool(description="Count the lines of a file")
    def count(args: ReadArgs, ctx: ToolContext) -> str:  # a plain def: runs in a worker thread
        ctx.progress_from_thread("counting")
        return str(len(Path(args.path).read_text().splitlines()))

A tool is an `async def`, awaited on the runtime's trio thread, or a plain `def`,
run in a worker thread (`trio.to_thread.run_sync`) so that blocking code never
stalls the runtime. Which one is decided once, when the `Tool` is made
(`inspect.iscoroutinefunction`, or its `__call__`'s for a callable object), never
per call; anything else (not callable, a generator function) is a `TypeError`
then. A plain function that returns an awaitable is not supported: it would run in a
thread and its awaitable would be an error result.

A sync tool's thread cannot be stopped: an abort, a timeout or a discarded response
answers the tool at once (`abandon_on_cancel=True`) and abandons the thread, which
runs on until the function returns; its late result (or exception) is discarded and
its progress dropped. Until then it holds one of trio's worker-thread slots
(`trio.to_thread.current_default_thread_limiter()`, 40 by default), so a sync tool
that may block for long should bound its own waits, or poll
`trio.from_thread.check_cancelled()`, which raises `trio.Cancelled` in an abandoned thread.

A tool returns a string or a list of content blocks. An exception (or
`ToolError`) becomes an error result wrapped in `<tool_use_error>`; so do an
unknown tool, input that fails validation, a denied permission, a timeout, and
an output of another type or one that is not JSON-serializable (a list is made
plain JSON as pydantic's JSON mode makes it: datetimes become ISO strings).
The loop goes on in every case.

A tool's definition is checked when it is made (`Tool(...)` or `@tool`), never when first called: its
name must be one the Messages API takes (`TOOL_NAME`), its function must take `(args, ctx)`
positionally, and a `timeout_s` must be above zero; each is a `TypeError` or `ValueError` naming the tool.

`runs_on` says which event loop an `async def` tool is written for: `"trio"` (awaited on the
runtime's trio thread), `"asyncio"` (run as a task of the host's asyncio loop, under
`queryloop.aio.AsyncioRuntime` only), or None (the default): on trio under `Runtime`, on the
host's asyncio loop under `AsyncioRuntime`.
"""

from __future__ import annotations

import functools
import inspect
import json
import re
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Literal, cast, overload

import trio
from loguru import logger
from pydantic import BaseModel, ConfigDict
from pydantic_core import PydanticSerializationError, to_jsonable_python

from queryloop.runtime.errors import QueryloopError

if TYPE_CHECKING:
    from queryloop.runtime.loop.events import AssistantMessage, Block

ToolOutput = str | list[dict[str, Any]]

TOOL_NAME = re.compile(r"[a-zA-Z0-9_-]{1,128}")
"""A client tool's name as the Messages API takes it, whole (`fullmatch`): `^[a-zA-Z0-9_-]{1,128}$`.

The API's own refusal of a bad name says so (`tools.N.custom.name: String should match pattern
'^[a-zA-Z0-9_-]{1,128}$'`, a 400); older documentation said {1,64}. A name outside it fails every
request that carries the tool (a 400 for the whole query), so it is refused when the tool is made instead."""

AsyncToolFunction = Callable[[Any, "ToolContext"], Awaitable[ToolOutput]]
SyncToolFunction = Callable[[Any, "ToolContext"], ToolOutput]
ToolFunction = AsyncToolFunction | SyncToolFunction
"""`async def fn(args, ctx)` (awaited on the trio thread) or `def fn(args, ctx)` (run in a worker thread)."""


class ToolError(QueryloopError):
    """Raise from a tool to report a failure to the model as an error result."""


class ToolContext:
    """What a running tool may use: its id and a progress channel to the consumer.

    An async tool awaits `progress`. A sync tool runs in a worker thread, where nothing can be
    awaited: it calls `progress_from_thread` instead, which has the trio thread send the event
    and blocks until it is sent (the same backpressure as `progress`); the async `progress`
    is not for it (called there, it only makes a coroutine that never runs). Once the runtime
    has stopped waiting for the tool (`abandon`: an abort, its timeout, a discarded response),
    `progress_from_thread` returns at once and emits nothing, so an abandoned thread never
    reaches the consumer and never blocks on it.
    """

    __slots__ = ("_abandoned", "_report", "_sending", "_token", "tool_use_id")

    def __init__(self, tool_use_id: str, report: Callable[[str, Any], Awaitable[None]]) -> None:
        self.tool_use_id = tool_use_id
        self._report = report
        self._abandoned = False
        self._sending: set[trio.CancelScope] | None = None
        """The sends `progress_from_thread` has in flight on the trio thread (`abandon` cancels them)."""
        try:  # made on the trio thread by the executor: any thread the tool starts can reach it too
            self._token: trio.lowlevel.TrioToken | None = trio.lowlevel.current_trio_token()
        except RuntimeError:
            self._token = None

    async def progress(self, data: Any) -> None:
        """Emit a `progress` event for this tool now (an async tool; a sync one: `progress_from_thread`)."""
        await self._report(self.tool_use_id, data)

    def progress_from_thread(self, data: Any) -> None:
        """Emit a `progress` event from a worker thread (a sync tool's, or one the tool started).

        Blocks the calling thread until the event is sent (the consumer may be slow); returns at
        once, emitting nothing, once the tool has been abandoned or the runtime has closed.
        Called on the trio thread itself it raises `RuntimeError` (it would deadlock).
        """
        if self._abandoned:  # a hint only: the trio thread checks again, where it is set
            return
        try:
            trio.from_thread.run(self._send_unless_abandoned, data, trio_token=self._token)
        except (trio.RunFinishedError, trio.Cancelled):  # the runtime has closed meanwhile
            return

    def abandon(self) -> None:
        """The runtime no longer waits for this tool: its progress is dropped from now on (trio thread only)."""
        self._abandoned = True
        for scope in self._sending or ():
            scope.cancel()

    async def _send_unless_abandoned(self, data: Any) -> None:
        if self._abandoned:
            return
        sending = self._sending
        if sending is None:
            sending = self._sending = set()
        with trio.CancelScope() as scope:
            sending.add(scope)
            try:
                await self._report(self.tool_use_id, data)
            finally:
                sending.discard(scope)


class Tool(BaseModel):
    """A tool the model may call: `call` is an `async def` or a plain `def` (see the module docstring).

    Its input is described by `input_model` (a pydantic model: its JSON schema is what the model sees,
    and the input is validated into it) or by `input_schema` (a JSON schema, sent as is: the input
    reaches `call` as the raw dict, unvalidated here; an MCP tool's server validates it), or neither
    (any object, passed as a dict).
    """

    model_config = ConfigDict(frozen=True, extra="forbid", arbitrary_types_allowed=True)

    name: str
    call: ToolFunction
    description: str = ""
    input_model: type[BaseModel] | None = None
    input_schema: dict[str, Any] | None = None
    concurrency_safe: bool = False
    timeout_s: float | None = None
    runs_on: Literal["trio", "asyncio"] | None = None
    """The event loop an async tool is written for (see the module docstring); None: the host's."""
    backfill_observable_input: Callable[[dict[str, Any]], None] | None = None
    """Adds derived fields to a copy of a call's input, for observers (Claude Code's
    `backfillObservableInput`): the consumer's `AssistantMessage` and the transcript show the copy when
    it gained fields (not when it only changed some), a PostToolUse hook always gets it. The conversation
    sent to the API keeps the input as the model wrote it, byte for byte (its prompt cache)."""

    def model_post_init(self, context: Any, /) -> None:
        # Every way a tool is made passes here (`@tool`, `Tool(...)`, MCP's and the runtime's own), so a
        # definition the API or the executor would refuse later is refused now, naming the tool.
        check_tool_name(self.name)
        if self.input_model is not None and self.input_schema is not None:
            msg = f"tool {self.name!r}: give input_model or input_schema, not both"
            raise ValueError(msg)
        _check_timeout(self.timeout_s, self.name)
        # Both made now, once (a tool is frozen): a call that is neither sync nor async is refused here,
        # and a JSON schema, ~300 µs to generate, is not made again for every query.
        _ = self.runs_in_thread, self._api_schema
        _check_shape(self.call, self.name)  # a callable, as `runs_in_thread` made sure

    # Cached in the instance's __dict__, read as plain attributes: a pydantic private attribute is read
    # through `BaseModel.__getattr__`, ten times slower, and `run` reads this on every call.
    @functools.cached_property
    def runs_in_thread(self) -> bool:
        """A plain `def`: `run` calls it in a worker thread (decided when the tool was made)."""
        return _runs_in_thread(self.call, self.name)

    @functools.cached_property
    def _api_schema(self) -> dict[str, Any]:
        if self.input_schema is not None:
            schema = self.input_schema
        elif self.input_model is not None:
            schema = self.input_model.model_json_schema()
        else:
            schema = {"type": "object", "properties": {}}
        return {"name": self.name, "description": self.description, "input_schema": schema}

    async def run(self, args: Any, context: ToolContext) -> ToolOutput:
        """Call the tool with parsed `args`, on the trio thread or (a sync tool) in a worker thread.

        A cancellation (abort, timeout) answers at once either way: a sync tool's thread is then
        abandoned, its late result discarded, and `context.abandon()` drops its further progress.
        """
        if not self.runs_in_thread:  # an async def, as checked when the tool was made
            if self.runs_on == "asyncio":
                msg = f"tool {self.name!r} runs on asyncio: it needs a queryloop.aio.AsyncioRuntime"
                raise ToolError(msg)
            call_async: AsyncToolFunction = self.call  # type: ignore[assignment]  # not cast(): no call per tool call
            return await call_async(args, context)
        call = cast("SyncToolFunction", self.call)
        try:
            return await trio.to_thread.run_sync(
                call, args, context, abandon_on_cancel=True, thread_name=f"tool {self.name} {context.tool_use_id}"
            )
        finally:
            context.abandon()  # returned, raised or abandoned: nothing of it may reach the consumer now

    def api_schema(self) -> dict[str, Any]:
        """The definition sent to the Messages API (made when the tool was; shared: do not change it)."""
        return self._api_schema

    def observable_input(self, raw: dict[str, Any]) -> dict[str, Any] | None:
        """`raw` backfilled for observers (`backfill_observable_input`), as a copy; None if the tool has no
        backfill or it raised (logged: an observer's view is not worth a failed call)."""
        backfill = self.backfill_observable_input
        if backfill is None:
            return None
        observed = dict(raw)
        try:
            backfill(observed)
        except Exception:  # noqa: BLE001 - the host's function; the call goes on with its input as sent
            logger.opt(exception=True).warning("tool {}: backfill_observable_input raised", self.name)
            return None
        return observed

    def observed_message(self, message: AssistantMessage, block: Block) -> AssistantMessage:
        """What observers see of `message`, a call of this tool (its `block`): a copy whose input the backfill
        extended, if it added fields; else `message` itself (a backfill that only changes fields is not shown)."""
        raw = block.get("input")
        if not isinstance(raw, dict):
            return message
        observed = self.observable_input(raw)
        if observed is None or all(key in raw for key in observed):
            return message
        return message.model_copy(update={"content": [{**block, "input": observed}]})

    def parse_input(self, raw: dict[str, Any]) -> Any:
        """Validate the model's input; raises pydantic's `ValidationError` naming the field."""
        return self.input_model.model_validate(raw) if self.input_model else raw


@overload
def tool(fn: ToolFunction, /) -> Tool: ...


@overload
def tool(
    *,
    name: str | None = None,
    description: str | None = None,
    input_model: type[BaseModel] | None = None,
    concurrency_safe: bool = False,
    timeout_s: float | None = None,
    runs_on: Literal["trio", "asyncio"] | None = None,
    backfill_observable_input: Callable[[dict[str, Any]], None] | None = None,
) -> Callable[[ToolFunction], Tool]: ...


def tool(
    fn: ToolFunction | None = None,
    /,
    *,
    name: str | None = None,
    description: str | None = None,
    input_model: type[BaseModel] | None = None,
    concurrency_safe: bool = False,
    timeout_s: float | None = None,
    runs_on: Literal["trio", "asyncio"] | None = None,
    backfill_observable_input: Callable[[dict[str, Any]], None] | None = None,
) -> Tool | Callable[[ToolFunction], Tool]:
    """Make a `Tool` of an `async def fn(args: SomeModel, ctx: ToolContext)`, or of a plain `def`
    of the same shape (run in a worker thread: see the module docstring).

    Used bare (`@tool`) it makes the tool with every default; with arguments (`@tool(...)`) it returns
    the decorator. The input model is `input_model`, or else read from the first parameter's hint.
    Refused here, naming the tool: anything but a sync or async function (or callable object), one
    that cannot be called as `fn(args, ctx)` (`TypeError`), a name the Messages API would refuse and
    a `timeout_s` not above zero (`ValueError`). `runs_on` names the event loop an async tool is
    written for (None: the host's); `backfill_observable_input` is `Tool`'s.
    """

    def wrap(fn: ToolFunction) -> Tool:
        tool_name = name if name is not None else _name_of(fn)
        _runs_in_thread(fn, tool_name)  # refuses what is neither, before anything else reads it
        model = input_model if input_model is not None else _hinted_model(fn)
        return Tool(
            name=tool_name,
            call=fn,
            description=description if description is not None else inspect.getdoc(fn) or "",
            input_model=model,
            concurrency_safe=concurrency_safe,
            timeout_s=timeout_s,
            runs_on=runs_on,
            backfill_observable_input=backfill_observable_input,
        )

    return wrap if fn is None else wrap(fn)


def check_tool_name(name: str) -> None:
    """`ValueError` unless `name` is one the Messages API takes for a client tool (`TOOL_NAME`)."""
    if TOOL_NAME.fullmatch(name) is None:
        shown = f"{name!r}" if len(name) <= 64 else f"{name[:64]!r}... ({len(name)} characters)"
        msg = (
            f"tool {shown}: a tool's name must be 1 to 128 ASCII letters, digits, '_' or '-' "
            "(the Messages API's rule); give it another (name=...)"
        )
        raise ValueError(msg)


def _check_timeout(timeout_s: float | None, name: str) -> None:
    if timeout_s is not None and not timeout_s > 0:  # NaN is not above 0 either
        msg = f"tool {name!r}: timeout_s must be above 0 seconds (None: no timeout), not {timeout_s!r}"
        raise ValueError(msg)


def _check_shape(fn: Callable[..., Any], name: str) -> None:
    """`TypeError` unless `fn` can be called as `fn(args, ctx)`: found when the tool is made, not at its first call."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin with no signature to read: its call will tell
        return
    try:
        signature.bind(None, None)
    except TypeError as error:
        msg = (
            f"tool {name!r}: its function is called as fn(args, ctx), two positional arguments, "
            f"but its signature {signature} cannot take them ({error})"
        )
        raise TypeError(msg) from None


def _name_of(fn: object) -> str:
    found = getattr(fn, "__name__", None)
    if isinstance(found, str):
        return found
    if callable(fn):
        return type(fn).__name__
    msg = f"@tool makes a tool of a function (def or async def), not of {type(fn).__name__} {fn!r}"
    raise TypeError(msg)


def _runs_in_thread(fn: object, name: str) -> bool:
    """False for an async function (or callable object), True for a sync one; `TypeError` for anything else."""
    if not callable(fn):
        msg = f"tool {name!r}: call must be a function (def or async def), not {type(fn).__name__} {fn!r}"
        raise TypeError(msg)
    if inspect.isgeneratorfunction(fn) or inspect.isasyncgenfunction(fn):
        msg = f"tool {name!r}: a generator function cannot be a tool; return its output (use ctx for progress)"
        raise TypeError(msg)
    if inspect.iscoroutinefunction(fn):
        return False
    if not (inspect.isfunction(fn) or inspect.ismethod(fn) or inspect.isclass(fn)):
        kind: Any = type(fn)
        dunder = kind.__call__  # a callable object: its __call__ says
        if inspect.iscoroutinefunction(dunder):
            return False
        if inspect.isasyncgenfunction(dunder) or inspect.isgeneratorfunction(dunder):
            msg = f"tool {name!r}: a generator cannot be a tool; return its output"
            raise TypeError(msg)
    return True


def _hinted_model(fn: Callable[..., Any]) -> type[BaseModel] | None:
    first = next(iter(inspect.signature(fn).parameters), None)
    if first is None:
        return None
    hint = inspect.signature(fn).parameters[first].annotation
    try:
        if isinstance(hint, str):  # postponed annotations: resolve this one hint as typing would
            hint = eval(hint, _globals_of(fn))
    except NameError as error:
        msg = (
            f"tool {_name_of(fn)!r}: cannot resolve the type of {first!r} ({error}); "
            "define the model at module level or pass input_model="
        )
        raise TypeError(msg) from error
    return hint if isinstance(hint, type) and issubclass(hint, BaseModel) else None


def _globals_of(fn: object) -> dict[str, Any]:
    """The module globals `fn`'s annotations were written in (through partials, of a callable object's class)."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    if not (inspect.isfunction(fn) or inspect.ismethod(fn)):
        kind: Any = type(fn)
        fn = kind.__call__
    found: dict[str, Any] = getattr(fn, "__globals__", {})
    return found


class Allow(BaseModel):
    """`can_use_tool`'s answer letting the tool run (the SDK's `PermissionResultAllow`), with `updated_input` in
    place of the model's if given, and `updated_permissions` (SDK `PermissionUpdate`s) applied to the session's
    rules and mode from this call on."""

    model_config = ConfigDict(frozen=True, arbitrary_types_allowed=True)
    behavior: Literal["allow"] = "allow"
    updated_input: dict[str, Any] | None = None
    updated_permissions: list[Any] | None = None


class Deny(BaseModel):
    """`can_use_tool`'s answer refusing the tool (the SDK's `PermissionResultDeny`): the model gets `message` as
    the tool's error result; `interrupt` also ends the query, as a user's interrupt does (`aborted_tools`)."""

    model_config = ConfigDict(frozen=True)
    behavior: Literal["deny"] = "deny"
    message: str = ""
    interrupt: bool = False


PermissionResult = Allow | Deny
CanUseTool = (
    Callable[[str, dict[str, Any], Any], Awaitable[PermissionResult]]
    | Callable[[str, dict[str, Any]], Awaitable[PermissionResult]]
)
"""`await can_use_tool(tool_name, input, context)` (the Agent SDK's form, `context` a `ToolPermissionContext`) or
`await can_use_tool(tool_name, input)` for each call the permission rules leave undecided."""


def plain_output(output: object) -> tuple[list[dict[str, Any]] | None, str]:
    """A tool's non-string output as plain JSON content blocks, or None and what is wrong with it. Values
    pydantic's JSON mode knows (datetimes, sets, models…) are converted, as the SDK and the transcript would
    convert them; NaN and infinities are not JSON (the SDK refuses them)."""
    if not isinstance(output, list):
        return None, f"a {type(output).__name__}, not a string or a list of content blocks"
    try:
        plain: list[dict[str, Any]] = to_jsonable_python(output)
        json.dumps(plain, allow_nan=False)
    except (PydanticSerializationError, TypeError, ValueError) as error:
        return None, f"a result that is not JSON-serializable ({error})"
    return plain, ""
