"""Claude Code's settings files, read as Claude Code reads them: sources and their precedence, hooks merged
across them, permission rules added up; and the working folder's files read as the hostile input they are."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from queryloop.runtime.loop.command_hooks import KILL_GRACE_S
from queryloop.runtime.loop.settings import (
    MAX_SETTINGS_BYTES,
    PermissionSettings,
    RuleText,
    Settings,
    SettingsError,
    load_settings,
)
from tests.helpers import log_records


@pytest.fixture
def folders(tmp_path: Path) -> tuple[Path, Path]:
    """A working folder and a home folder, each with its `.claude`."""
    cwd, home = tmp_path / "project", tmp_path / "home"
    (cwd / ".claude").mkdir(parents=True)
    (home / ".claude").mkdir(parents=True)
    return cwd, home


@pytest.fixture
def logged() -> Iterator[list[dict[str, Any]]]:
    with log_records() as records:
        yield records


def warnings(records: list[dict[str, Any]]) -> list[str]:
    return [record["message"] for record in records if record["level"] == "WARNING"]


def write(path: Path, value: Any) -> Path:
    path.write_text(value if isinstance(value, str) else json.dumps(value))
    return path


def hook(command: str, matcher: str | None = "Bash", timeout: float | None = None) -> dict[str, Any]:
    handler: dict[str, Any] = {"type": "command", "command": command}
    if timeout is not None:
        handler["timeout"] = timeout
    group: dict[str, Any] = {"hooks": [handler]}
    if matcher is not None:
        group["matcher"] = matcher
    return {"hooks": {"PreToolUse": [group]}}


def load(folders: tuple[Path, Path], sources: Any = ("user", "project", "local"), settings: Any = None) -> Settings:
    cwd, home = folders
    return load_settings(settings=settings, setting_sources=sources, cwd=cwd, home=home)


def commands(settings: Settings, event: str = "PreToolUse") -> list[str]:
    return [matcher.hooks[0].__name__ for matcher in settings.hooks.get(event, [])]


def all_three(folders: tuple[Path, Path], user: Any, project: Any, local: Any) -> None:
    cwd, home = folders
    write(home / ".claude" / "settings.json", user)
    write(cwd / ".claude" / "settings.json", project)
    write(cwd / ".claude" / "settings.local.json", local)


# Sources and precedence


@pytest.mark.parametrize("sources", [None, []])
def test_no_setting_sources_reads_no_file_of_the_working_folder_or_home(
    folders: tuple[Path, Path], sources: Any
) -> None:
    all_three(folders, hook("echo user"), hook("echo project"), hook("echo local"))
    assert load(folders, sources) == Settings()


def test_each_named_source_is_read_from_its_own_file(folders: tuple[Path, Path]) -> None:
    cwd, home = folders
    all_three(folders, hook("echo user"), hook("echo project"), hook("echo local"))
    assert load(folders, ["project"]).sources == (cwd / ".claude" / "settings.json",)
    assert load(folders, ["local", "user"]).sources == (
        home / ".claude" / "settings.json",
        cwd / ".claude" / "settings.local.json",
    )


def test_default_mode_comes_from_the_highest_source_flag_local_project_user(folders: tuple[Path, Path]) -> None:
    def mode(name: str) -> dict[str, Any]:
        return {"permissions": {"defaultMode": name}}

    all_three(folders, mode("plan"), mode("acceptEdits"), mode("dontAsk"))
    assert load(folders).permissions.default_mode == "dontAsk"
    assert load(folders, ["user", "project"]).permissions.default_mode == "acceptEdits"
    assert load(folders, settings='{"permissions": {"defaultMode": "default"}}').permissions.default_mode == "default"
    write(folders[0] / ".claude" / "settings.local.json", {"permissions": {"allow": ["Read"]}})
    assert load(folders).permissions.default_mode == "acceptEdits"  # a source that does not set it decides nothing


def test_inline_json_is_the_flag_source_with_no_settings_directory(folders: tuple[Path, Path]) -> None:
    settings = load(folders, None, settings='  {"permissions": {"deny": ["Bash(curl *)"]}}')
    assert settings.sources == ("inline",)
    assert settings.permissions.deny == (RuleText("Bash(curl *)", None),)


def test_a_settings_path_is_read_relative_to_the_working_folder(folders: tuple[Path, Path]) -> None:
    cwd, _ = folders
    write(cwd / "ci-settings.json", {"permissions": {"allow": ["Read"]}})
    settings = load(folders, None, settings="ci-settings.json")
    assert settings.sources == (cwd / "ci-settings.json",)
    assert settings.permissions.allow == (RuleText("Read", cwd),)
    assert load(folders, None, settings=cwd / "ci-settings.json").permissions == settings.permissions


def test_a_settings_path_that_does_not_exist_is_an_error(folders: tuple[Path, Path]) -> None:
    with pytest.raises(SettingsError, match=r"missing\.json: does not exist"):
        load(folders, None, settings="missing.json")


def test_an_unknown_setting_source_is_refused(folders: tuple[Path, Path]) -> None:
    with pytest.raises(SettingsError, match="'managed' is not one of user, project, local"):
        load(folders, ["managed"])


# Permissions


def test_permission_rules_add_up_across_sources_each_with_its_settings_directory(folders: tuple[Path, Path]) -> None:
    cwd, home = folders
    all_three(
        folders,
        {"permissions": {"allow": ["Read"], "deny": ["Bash(rm *)"]}},
        {"permissions": {"allow": ["Edit(/src/**)", "Read"], "ask": ["Bash(git push *)"]}},
        {"permissions": {"deny": ["Read(./.env)"]}},
    )
    permissions = load(folders).permissions
    assert permissions.allow == (
        RuleText("Read", home / ".claude"),
        RuleText("Edit(/src/**)", cwd / ".claude"),
        RuleText("Read", cwd / ".claude"),  # the same text from another file: its `/p` paths mean another thing
    )
    assert permissions.deny == (RuleText("Bash(rm *)", home / ".claude"), RuleText("Read(./.env)", cwd / ".claude"))
    assert permissions.ask == (RuleText("Bash(git push *)", cwd / ".claude"),)


def test_additional_directories_are_absolute_home_and_working_folder_relative(folders: tuple[Path, Path]) -> None:
    cwd, home = folders
    dirs = ["/srv/data", "~/notes", "vendor/shared", "/srv/data"]
    write(cwd / ".claude" / "settings.json", {"permissions": {"additionalDirectories": dirs}})
    assert load(folders, ["project"]).permissions.additional_directories == (
        Path("/srv/data"),
        home / "notes",
        cwd / "vendor" / "shared",
    )


def test_settings_without_permissions_have_empty_ones(folders: tuple[Path, Path]) -> None:
    write(folders[0] / ".claude" / "settings.json", {"model": "opus", "env": {"A": "1"}, "statusLine": {}})
    assert load(folders).permissions == PermissionSettings()


# Hooks


def test_every_source_s_hooks_run_lowest_source_first(folders: tuple[Path, Path]) -> None:
    all_three(folders, hook("echo user"), hook("echo project"), hook("echo local", matcher="Write"))
    settings = load(folders, settings=json.dumps(hook("echo flag", matcher=None)))
    assert commands(settings) == [f"command_hook('echo {name}')" for name in ("user", "project", "local", "flag")]
    assert [matcher.matcher for matcher in settings.hooks["PreToolUse"]] == ["Bash", "Bash", "Write", None]


def test_an_identical_command_in_several_files_runs_once_with_the_highest_source_s_timeout(
    folders: tuple[Path, Path],
) -> None:
    all_three(folders, hook("./check.sh", timeout=5), hook("./check.sh", timeout=7), hook("./other.sh"))
    settings = load(folders)
    assert commands(settings) == ["command_hook('./check.sh')", "command_hook('./other.sh')"]
    assert settings.hooks["PreToolUse"][0].timeout_s == 7 + KILL_GRACE_S + 1.0
    write(folders[0] / ".claude" / "settings.local.json", hook("./check.sh", matcher="Write"))
    assert len(load(folders).hooks["PreToolUse"]) == 2  # another matcher: another hook


def test_a_command_hook_without_a_timeout_gets_claude_code_s_600_seconds(folders: tuple[Path, Path]) -> None:
    write(folders[0] / ".claude" / "settings.json", hook("true"))
    assert load(folders).hooks["PreToolUse"][0].timeout_s > 600


async def test_a_loaded_command_hook_runs_in_the_working_folder(folders: tuple[Path, Path]) -> None:
    cwd, _ = folders
    write(cwd / ".claude" / "settings.json", hook('cat >/dev/null; echo "$(pwd)" >&2; exit 2'))
    callback = load(folders).hooks["PreToolUse"][0].hooks[0]
    output = await callback({"hook_event_name": "PreToolUse"}, "t1", {"signal": None})  # type: ignore[arg-type]
    assert output["hookSpecificOutput"].get("permissionDecisionReason") == str(cwd)


def test_hooks_of_other_types_are_skipped_with_a_warning(
    folders: tuple[Path, Path], logged: list[dict[str, Any]]
) -> None:
    handlers = [
        {"type": "http", "url": "https://example.com/hook"},
        {"type": "prompt", "prompt": "Is this safe?"},
        {"type": "agent", "prompt": "Check it"},
        {"type": "mcp_tool", "server": "s", "tool": "t"},
        {"type": "command", "command": "echo kept"},
        {"type": "http", "url": "https://example.com/hook"},  # the same url again: run once
    ]
    write(folders[0] / ".claude" / "settings.json", {"hooks": {"Stop": [{"hooks": handlers}]}})
    kept = ["http_hook('https://example.com/hook')", "command_hook('echo kept')"]
    assert commands(load(folders), "Stop") == kept
    said = warnings(logged)
    assert len(said) == 3 and all("only 'command' and 'http'" in warning for warning in said)


def test_async_hooks_are_skipped_with_a_warning(folders: tuple[Path, Path], logged: list[dict[str, Any]]) -> None:
    handlers = [{"type": "command", "command": "echo later", "async": True}]
    write(folders[0] / ".claude" / "settings.json", {"hooks": {"PreToolUse": [{"matcher": "Bash", "hooks": handlers}]}})
    assert load(folders).hooks == {}
    said = warnings(logged)
    assert len(said) == 1 and "'async'" in said[0]


async def test_an_if_condition_runs_the_hook_only_for_the_calls_its_rule_matches(
    folders: tuple[Path, Path], tmp_path: Path
) -> None:
    ran = tmp_path / "ran.txt"
    handler = {"type": "command", "command": f"cat >> {ran}; echo >> {ran}", "if": "Bash(git *)"}
    groups = [{"matcher": "Bash", "hooks": [handler]}]
    write(folders[0] / ".claude" / "settings.json", {"hooks": {"PreToolUse": groups}})
    (matcher,) = load(folders).hooks["PreToolUse"]
    for command in ("npm test", "git push", "make && git commit"):
        data = {"hook_event_name": "PreToolUse", "tool_name": "Bash", "tool_input": {"command": command}}
        await matcher.hooks[0](data, "t1", {"signal": None})  # type: ignore[arg-type]
    seen = [json.loads(line)["tool_input"]["command"] for line in ran.read_text().split("\n") if line.strip()]
    assert seen == ["git push", "make && git commit"]  # a piece of a chained command counts


def test_an_if_condition_that_is_not_a_permission_rule_is_refused(folders: tuple[Path, Path]) -> None:
    handler = {"type": "command", "command": "true", "if": "Bash(git"}
    write(folders[0] / ".claude" / "settings.json", {"hooks": {"PreToolUse": [{"hooks": [handler]}]}})
    with pytest.raises(SettingsError, match="'if'"):
        load(folders)


def test_hooks_of_events_outside_the_agent_loop_are_skipped_with_a_warning(
    folders: tuple[Path, Path], logged: list[dict[str, Any]]
) -> None:
    group = [{"hooks": [{"type": "command", "command": "true"}]}]
    write(folders[0] / ".claude" / "settings.json", {"hooks": {"WorktreeCreate": group, "SessionStart": group}})
    assert set(load(folders).hooks) == {"SessionStart"}
    assert len(warnings(logged)) == 1 and "'WorktreeCreate'" in warnings(logged)[0]


# Hostile files


def test_a_missing_file_or_folder_is_skipped(tmp_path: Path) -> None:
    settings = load_settings(settings=None, setting_sources=["user", "project", "local"], cwd=tmp_path, home=tmp_path)
    assert settings == Settings()
    (tmp_path / ".claude").write_text("a file where the folder would be")
    assert load_settings(settings=None, setting_sources=["project"], cwd=tmp_path, home=tmp_path) == Settings()


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ('{"hooks": ', "is not valid JSON: Expecting value (line 1, column 11)"),
        ("[1, 2]", "must be a JSON object, not list"),
        (b"\xff\xfe{}", "is not UTF-8 text"),
        ("[" * 100_000 + "]" * 100_000, "is not valid JSON"),
        ('{"hooks": []}', "hooks must be a valid dictionary"),
        ('{"permissions": {"allow": "Bash"}}', "permissions.allow must be a valid list"),
        ('{"permissions": {"deny": [""]}}', "permissions.deny[0] must not be empty"),
        ('{"permissions": {"defaultMode": "yolo"}}', "permissions.defaultMode must be 'default', 'acceptEdits'"),
        ('{"permissions": {"additionalDirectories": [3]}}', "permissions.additionalDirectories[0] must be a valid"),
        ('{"hooks": {"Stop": [{"matcher": 1, "hooks": []}]}}', "hooks.Stop[0].matcher must be a valid string"),
        ('{"hooks": {"Stop": [{"matcher": "x"}]}}', "hooks.Stop[0].hooks is required"),
        (
            '{"hooks": {"Stop": [{"hooks": [{"type": "shell", "command": "x"}]}]}}',
            "hooks.Stop[0].hooks[0].type must be",
        ),
        ('{"hooks": {"Stop": [{"hooks": [{"type": "command"}]}]}}', "hooks.Stop[0].hooks[0] a command hook needs"),
        ('{"hooks": {"Stop": [{"hooks": [{"type": "command", "command": " "}]}]}}', "a command hook needs a non-empty"),
    ],
)
def test_a_malformed_file_is_refused_naming_the_file_and_the_key(
    folders: tuple[Path, Path], content: str | bytes, message: str
) -> None:
    path = folders[0] / ".claude" / "settings.json"
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)
    with pytest.raises(SettingsError) as raised:
        load(folders)
    assert str(raised.value).startswith(f"{path}: ")
    assert message in str(raised.value)


@pytest.mark.parametrize("timeout", [-1, 0, "10", True, None])
def test_a_hook_timeout_that_is_not_a_positive_number_is_refused(folders: tuple[Path, Path], timeout: Any) -> None:
    handler: dict[str, Any] = {"type": "command", "command": "true", "timeout": timeout}
    second = {"hooks": {"PreToolUse": [{"matcher": "Bash", "hooks": [{"type": "command", "command": "x"}, handler]}]}}
    path = write(folders[0] / ".claude" / "settings.json", second)
    if timeout is None:
        assert len(load(folders).hooks["PreToolUse"]) == 2  # null: the default
        return
    with pytest.raises(SettingsError) as raised:
        load(folders)
    expected = "must be a positive number" if timeout in (-1, 0) else "must be a valid number"
    assert str(raised.value) == f"{path}: hooks.PreToolUse[0].hooks[1].timeout {expected}"


def test_a_non_finite_timeout_is_refused(folders: tuple[Path, Path]) -> None:
    write(folders[0] / ".claude" / "settings.json", '{"hooks": {"Stop": [{"hooks": [{"type": "command", '
          '"command": "x", "timeout": NaN}]}]}}')  # fmt: skip
    with pytest.raises(SettingsError, match=r"hooks.Stop\[0\].hooks\[0\].timeout must be a positive number"):
        load(folders)


def test_several_mistakes_name_the_first_and_count_the_rest(folders: tuple[Path, Path]) -> None:
    write(folders[0] / ".claude" / "settings.json", {"permissions": {"allow": [1, 2, 3]}})
    with pytest.raises(SettingsError, match=r"permissions.allow\[0\] must be a valid string \(and 2 more\)"):
        load(folders)


def test_a_file_over_one_mebibyte_is_refused(folders: tuple[Path, Path]) -> None:
    padding = " " * MAX_SETTINGS_BYTES
    write(folders[0] / ".claude" / "settings.json", "{}" + padding)
    with pytest.raises(SettingsError, match=f"is larger than {MAX_SETTINGS_BYTES} bytes"):
        load(folders)


def test_a_fifo_or_a_folder_in_place_of_the_file_is_refused_without_blocking(folders: tuple[Path, Path]) -> None:
    cwd, _ = folders
    os.mkfifo(cwd / ".claude" / "settings.json")
    with pytest.raises(SettingsError, match="is not a regular file"):
        load(folders, ["project"])
    (cwd / ".claude" / "settings.local.json").mkdir()
    with pytest.raises(SettingsError, match=r"settings\.local\.json: is not a regular file"):
        load(folders, ["local"])


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads a file whatever its mode")
def test_an_unreadable_file_is_refused(folders: tuple[Path, Path]) -> None:
    path = write(folders[0] / ".claude" / "settings.json", {})
    path.chmod(0)
    with pytest.raises(SettingsError, match="cannot be read"):
        load(folders)


def test_an_empty_file_and_unknown_keys_say_nothing(folders: tuple[Path, Path]) -> None:
    cwd, _ = folders
    write(cwd / ".claude" / "settings.json", "")
    write(cwd / ".claude" / "settings.local.json", {"apiKeyHelper": "x", "permissions": {"disableBypass": 1}})
    settings = load(folders)
    assert settings.hooks == {} and settings.permissions == PermissionSettings()
    assert len(settings.sources) == 2


def test_a_file_whose_reading_fails_is_refused(folders: tuple[Path, Path]) -> None:
    with pytest.raises(SettingsError, match=r"/proc/self/mem: cannot be read \("):
        load(folders, None, settings="/proc/self/mem")  # a regular file whose first page cannot be read
