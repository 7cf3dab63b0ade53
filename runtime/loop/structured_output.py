"""Structured output: a query's final answer as data of a pydantic model (`QueryOptions.output_type`).

As Claude Code does it (`--json-schema`, the Agent SDK's `output_format`): the model is given one more
tool, `StructuredOutput`, whose input schema is the model's JSON schema, and answers by calling it. The
tool's input is validated as any tool's is: an invalid answer is an error result, and the model tries
again. Where Claude Code is loose, this runtime is strict (docs/design.md, "Structured output"):

* The query ends with the batch whose `StructuredOutput` call was valid (no further model call):
  `completed`, the answer in `ResultMessage.structured_output` (its JSON form). Claude Code sends the
  tool's result back and lets the model go on, which its users report as a bug (claude-code #17125).
* A response that would end the query without a valid answer is sent back with `ENFORCEMENT_TEXT`
  (Claude Code's built-in stop hook); every such response and every invalid call is a failed
  attempt, counted per query (claude-code #40022: a count kept across resumed queries).
* After `QueryOptions.max_structured_output_retries` failed attempts the query ends
  `max_structured_output_retries` (`error_max_structured_output_retries`, an error): a `success` of a
  query with an `output_type` that is not `is_error` (a surfaced API error) always carries its answer
  (claude-agent-sdk-typescript #277).

The pure parts live here; the QueryLoop keeps one `StructuredAnswer` per query and applies them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel

from queryloop.runtime.loop.tools import Tool, ToolContext

STRUCTURED_OUTPUT_TOOL = "StructuredOutput"

STRUCTURED_OUTPUT_ACCEPTED = "Structured output provided successfully"
"""The tool's result for a valid answer (Claude Code's text)."""

ENFORCEMENT_TEXT = (
    f"You must call the {STRUCTURED_OUTPUT_TOOL} tool to give your final answer: this request is complete "
    f"only once {STRUCTURED_OUTPUT_TOOL} has been called with input that matches its schema. Call it now."
)
"""Sent back, as a meta user message, with a response that would end the query without an answer."""

DEFAULT_MAX_RETRIES = 5
"""Failed attempts allowed per query (Claude Code's limit)."""


def exhausted_text(attempts: int) -> str:
    """The `result.errors` entry of a query that ran out of attempts (Claude Code's text)."""
    return f"Failed to provide valid structured output after {attempts} attempts"


@dataclass(slots=True)
class StructuredAnswer:
    """One query's answer so far: the valid answers by call id, and the failed attempts."""

    output_type: type[BaseModel]
    answers: dict[str, BaseModel] = field(default_factory=dict)
    failures: int = 0

    def tool(self) -> Tool:
        """The query's `StructuredOutput` tool: validated input is kept, by call, as an answer."""

        async def call(args: BaseModel, context: ToolContext) -> str:
            self.answers[context.tool_use_id] = args
            return STRUCTURED_OUTPUT_ACCEPTED

        # A copy of the type's one tool, with this query's call: its JSON schema (~200 µs) is made once.
        return _template(self.output_type).model_copy(update={"call": call})

    def settle_batch(self, tool_uses: list[dict[str, Any]]) -> BaseModel | None:
        """After a tool batch: the last valid answer among its `StructuredOutput` calls (in block order),
        else None, each of its calls that gave none counted as a failed attempt."""
        answer: BaseModel | None = None
        for block in tool_uses:
            if block.get("name") != STRUCTURED_OUTPUT_TOOL:
                continue
            given = self.answers.get(block.get("id", ""))
            if given is None:
                self.failures += 1
            else:
                answer = given
        return answer


_TEMPLATES: dict[type[BaseModel], Tool] = {}


def _template(output_type: type[BaseModel]) -> Tool:
    template = _TEMPLATES.get(output_type)
    if template is None:
        template = _TEMPLATES[output_type] = Tool(
            name=STRUCTURED_OUTPUT_TOOL,
            call=_unbound,
            description=(
                "Give your final answer as structured data. Call this tool once, when the task is done, with "
                "input matching its schema; the request ends when the input is valid. An invalid input is "
                "returned as an error: correct it and call again."
            ),
            input_model=output_type,
            concurrency_safe=True,
        )
    return template


async def _unbound(args: BaseModel, context: ToolContext) -> str:
    msg = "the StructuredOutput template is copied with a query's call, never called itself"
    raise RuntimeError(msg)


def answer_json(answer: BaseModel) -> dict[str, Any]:
    """The answer as `ResultMessage.structured_output` carries it (JSON-safe, as a transcript keeps it)."""
    return answer.model_dump(mode="json")


def attempts_exhausted(failures: int, max_retries: int) -> bool:
    """Whether a query with `failures` failed attempts ends without an answer."""
    return failures >= max_retries
