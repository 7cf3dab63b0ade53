"""examples/sdk_result.py: a host written against the Agent SDK's `ResultMessage` and `SystemMessage` reads
queryloop's `terminal_reason`, `session_id` and `model_usage` as they are, with no mapping code."""

from __future__ import annotations

import re
import subprocess
import sys

import trio

from examples.sdk_result import main, report
from queryloop import ResultMessage
from tests.e2e.test_readme import offline_env
from tests.markdown import REPO

SDK_RESULT_FIELDS = {
    "subtype",
    "duration_ms",
    "duration_api_ms",
    "is_error",
    "num_turns",
    "session_id",
    "stop_reason",
    "total_cost_usd",
    "usage",
    "result",
    "structured_output",
    "model_usage",
    "permission_denials",
    "errors",
    "api_error_status",
    "uuid",
    "terminal_reason",
    "user_message_uuid",
    "user_message_uuids",
}
"""The fields of claude-agent-sdk's `ResultMessage` a host reads (`deferred_tool_use` and `origin` aside: this
runtime has neither deferred tools nor injected turns)."""


def test_the_result_has_every_field_an_sdk_host_reads() -> None:
    assert set(ResultMessage.__dataclass_fields__) >= SDK_RESULT_FIELDS


def test_an_sdk_hosts_report_reads_the_result_terminal_reason_session_and_model_usage() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "examples.sdk_result"],
        cwd=REPO,
        env=offline_env(),
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    lines = done.stdout.splitlines()
    session = re.fullmatch(r"init: session (\S+), model claude-sonnet-5-5, tools \['Agent'\]", lines[0])
    assert session is not None
    assert lines[1] == f"session {session[1]}: completed (is_error=False, api_error_status=None)"
    assert lines[2].startswith("api time ")
    assert lines[3].startswith("  claude-haiku-5-5: 300 in, 8 out, $")  # the subagent's model
    assert lines[4].startswith("  claude-sonnet-5-5: 2500 in, 45 out, $")


def test_the_report_function_is_the_whole_of_the_hosts_code() -> None:
    assert report(object()) == []
    trio.run(main)  # runs in process too
