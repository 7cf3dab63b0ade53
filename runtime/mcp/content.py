"""MCP results as tool_result content, and MCP tool names as the model sees them.

Text is a text block, an image (or an embedded image resource) an image block; an embedded text
resource is a text block that names its URI; what the Messages API cannot carry (audio, other binary
resources) is a text block that says what was left out; a resource link is a text block with its
URI. A result with no content but structured content is that JSON as text (as an MCP client that
does not read `structuredContent` would show it, the SDK's servers put the same in a text block).
"""

from __future__ import annotations

import json
import re
from typing import Any

from mcp_types import (
    AudioContent,
    BlobResourceContents,
    CallToolResult,
    ContentBlock,
    EmbeddedResource,
    ImageContent,
    PromptMessage,
    ResourceLink,
    TextContent,
    TextResourceContents,
)

from queryloop.runtime.loop.tools import ToolOutput

IMAGE_TYPES = frozenset({"image/jpeg", "image/png", "image/gif", "image/webp"})
"""The image media types the Messages API takes in an image block."""

_UNSAFE = re.compile(r"[^a-zA-Z0-9_-]")


def tool_name(server: str, tool: str) -> str:
    """`mcp__<server>__<tool>`, each part with what a tool name cannot hold replaced by `_` (as Claude Code)."""
    return f"mcp__{_UNSAFE.sub('_', server)}__{_UNSAFE.sub('_', tool)}"


def result_output(result: CallToolResult) -> ToolOutput:
    """A successful result's content: one text block alone as a string, anything else as blocks."""
    blocks = [block for item in result.content for block in _blocks(item)]
    if not blocks and result.structured_content is not None:
        return json.dumps(result.structured_content)
    if all(block["type"] == "text" for block in blocks):
        return "\n".join(block["text"] for block in blocks)
    return blocks


def error_text(result: CallToolResult) -> str:
    """An `isError` result's text, for the error tool_result (its other blocks are named, not kept)."""
    texts = [block["text"] for item in result.content for block in _blocks(item) if block["type"] == "text"]
    return "\n".join(texts) or "the tool reported an error without a message"


def _blocks(item: ContentBlock) -> list[dict[str, Any]]:
    if isinstance(item, TextContent):
        return [{"type": "text", "text": item.text}]
    if isinstance(item, ImageContent):
        return [_image(item.mime_type, item.data)]
    if isinstance(item, EmbeddedResource):
        resource = item.resource
        if isinstance(resource, TextResourceContents):
            return [{"type": "text", "text": f"[resource {resource.uri}]\n{resource.text}"}]
        if isinstance(resource, BlobResourceContents):
            mime = resource.mime_type or "application/octet-stream"
            if mime in IMAGE_TYPES:
                return [_image(mime, resource.blob)]
            return [{"type": "text", "text": f"[resource {resource.uri}: {mime} content, not shown]"}]
    if isinstance(item, AudioContent):
        return [_left_out(f"{item.mime_type} audio")]
    if isinstance(item, ResourceLink):
        about = f": {item.description}" if item.description else ""
        return [{"type": "text", "text": f"[resource link {item.name} {item.uri}{about}]"}]
    return [_left_out(f"{getattr(item, 'type', type(item).__name__)} content")]


def prompt_blocks(messages: list[PromptMessage]) -> list[dict[str, Any]]:
    """A filled-in prompt's messages as the content blocks of one user message, in order (an assistant
    message's too: Claude Code sends an MCP prompt as the user's turn)."""
    return [block for message in messages for block in _blocks(message.content)]


def resource_output(uri: str, contents: list[TextResourceContents | BlobResourceContents]) -> ToolOutput:
    """A read resource's contents: texts as one string, an image as an image block, other binaries named."""
    blocks = [block for item in contents for block in _blocks(EmbeddedResource(resource=item))]
    if not blocks:
        return f"[resource {uri}: empty]"
    if all(block["type"] == "text" for block in blocks):
        return "\n".join(block["text"] for block in blocks)
    return blocks


def _image(mime: str, data: str) -> dict[str, Any]:
    if mime not in IMAGE_TYPES:
        return _left_out(f"{mime} image")
    return {"type": "image", "source": {"type": "base64", "media_type": mime, "data": data}}


def _left_out(what: str) -> dict[str, Any]:
    return {"type": "text", "text": f"[{what}, not shown: the model cannot read it]"}
