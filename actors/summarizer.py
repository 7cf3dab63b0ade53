"""ToolUseSummarizer: Claude Code's tool-use summary, a short line for each tool batch, made while the
next model call runs (the model it asks is an option, `small_model`).

The QueryLoop asks for it at `next_turn` and awaits the answer at the top of
the next iteration, as Claude Code's query loop does, so a summary that takes as long as the main call
adds no wall time. The summary is work of this actor: an abort cancels it. Any
failure costs the summary (the answer is None), never the loop. The QueryLoop spawns it
with the first summary it asks for.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from queryloop.actors.budget_guard import RecordUsage
from queryloop.runtime.kernel.actor import TrioActor
from queryloop.runtime.kernel.messages import Message, record
from queryloop.runtime.loop.events import Block
from queryloop.runtime.loop.model import DEFAULT_STREAM_IDLE_TIMEOUT_S, ModelProvider, ModelRequest
from queryloop.runtime.loop.stream import complete_text

if TYPE_CHECKING:
    from pykka import ActorRef

    from queryloop.actors.budget_guard import BudgetGuard

SUMMARY_PROMPT = (
    "Summarize in one short line (under 12 words, no period) what these tool calls did, for a collapsed "
    "view in a user interface."
)
RESULT_PREVIEW_CHARS = 300


@record
class Summarize(Message):
    model: str
    tool_uses: list[Block]
    results: list[Block]
    stream_idle_timeout_s: float | None = DEFAULT_STREAM_IDLE_TIMEOUT_S
    """The query's stream watchdog, which bounds the summary's stream as it does the loop's own."""


class ToolUseSummarizer(TrioActor):
    actor_name = "ToolUseSummarizer"

    def __init__(self, provider: ModelProvider, *, budget_guard: ActorRef[BudgetGuard] | None = None) -> None:
        super().__init__()
        self.provider = provider
        self.budget_guard = budget_guard

    def on_receive(self, message: Any) -> Any:
        if isinstance(message, Summarize):
            return self._summarize(message)
        return super().on_receive(message)

    async def _summarize(self, message: Summarize) -> str | None:
        calls = [
            {
                "tool": use.get("name"),
                "input": use.get("input"),
                "result": str(result.get("content", ""))[:RESULT_PREVIEW_CHARS],
            }
            for use, result in zip(message.tool_uses, message.results, strict=False)
        ]
        request = ModelRequest(
            model=message.model,
            system=[{"type": "text", "text": SUMMARY_PROMPT}],
            messages=[{"role": "user", "content": [{"type": "text", "text": json.dumps(calls)}]}],
            max_tokens=64,
            purpose="summary",
            stream_idle_timeout_s=message.stream_idle_timeout_s,
        )
        try:
            summary, usage = await complete_text(self.provider, request)
        except Exception as error:  # noqa: BLE001 - the summary is optional; its failure costs only itself
            self.log.warning("tool-use summary failed: {!r}", error)
            return None
        if self.budget_guard is not None:
            self.budget_guard.tell(RecordUsage(model=message.model, usage=usage, query_usage=False))
        return summary or None
