"""Claude Code's permission rules: how their text is read and what each form matches (pure functions)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from queryloop.runtime.loop.permissions import (
    PermissionRule,
    check_mode,
    parse_rule,
    permission_rules,
    rule_matches,
)
from queryloop.runtime.loop.shell_commands import command_matches, subcommands


def matches(text: str, tool: str, tool_input: dict[str, Any], cwd: Path, settings_dir: Path | None = None) -> bool:
    return rule_matches(parse_rule(text, cwd=cwd, settings_dir=settings_dir), tool, tool_input, cwd=cwd)


def bash(text: str, command: str, cwd: Path) -> bool:
    return matches(text, "Bash", {"command": command}, cwd)


# --- reading rule text ---------------------------------------------------------------------------------


@pytest.mark.parametrize("text", ["Bash", "Bash()", "Bash(*)", "  Bash  "])
def test_a_tool_name_alone_or_with_an_empty_or_star_specifier_covers_the_whole_tool(text: str, tmp_path: Path) -> None:
    assert parse_rule(text, cwd=tmp_path) == PermissionRule("Bash")


def test_a_rule_prints_as_it_is_written(tmp_path: Path) -> None:
    assert str(parse_rule("Bash(git diff:*)", cwd=tmp_path)) == "Bash(git diff:*)"
    assert str(parse_rule("mcp__memory", cwd=tmp_path)) == "mcp__memory"


@pytest.mark.parametrize(
    "text",
    ["", "   ", "(git diff)", "Bash(git diff", "Bash)", "Bash(a))", "Bash(a(b)", "Ba sh", "Bash(x)y", "((((",
     "*", "Read([z-a])", "mcp__s__*(x)", "Bash\n(x)"],
)  # fmt: skip
def test_malformed_rule_text_is_refused_with_a_clear_error(text: str, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"permission rule|path pattern"):
        parse_rule(text, cwd=tmp_path)


def test_a_rule_that_is_not_a_string_is_refused(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="string"):
        parse_rule(["Bash"], cwd=tmp_path)  # type: ignore[arg-type]


def test_balanced_and_escaped_parentheses_inside_a_specifier_are_kept(tmp_path: Path) -> None:
    assert parse_rule("Bash(echo (hi))", cwd=tmp_path).specifier == "echo (hi)"
    assert parse_rule(r"Bash(echo \))", cwd=tmp_path).specifier == r"echo \)"


def test_an_absurdly_long_rule_is_read_without_trouble(tmp_path: Path) -> None:
    rule = parse_rule("Bash(" + "a*" * 5000 + ")", cwd=tmp_path)
    assert not rule_matches(rule, "Bash", {"command": "b" * 10000})


def test_allowed_and_disallowed_tools_are_allow_and_deny_rules(tmp_path: Path) -> None:
    rules = permission_rules(allow=["Read", "Bash(npm test)"], deny=["WebFetch"], cwd=tmp_path)
    assert [str(rule) for rule in rules.allow] == ["Read", "Bash(npm test)"]
    assert [str(rule) for rule in rules.deny] == ["WebFetch"]
    assert rules.ask == ()


def test_the_auto_mode_is_refused_with_why(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="classifier"):
        check_mode("auto")
    with pytest.raises(ValueError, match="unknown permission mode"):
        check_mode("yolo")


# --- Bash -----------------------------------------------------------------------------------------------


def test_a_trailing_colon_star_is_a_prefix_match(tmp_path: Path) -> None:
    assert bash("Bash(git diff:*)", "git diff HEAD~1", tmp_path)
    assert bash("Bash(git diff:*)", "git diff", tmp_path)
    assert not bash("Bash(git diff:*)", "git status", tmp_path)


def test_a_trailing_colon_star_equals_a_trailing_space_star(tmp_path: Path) -> None:
    for command in ("git diff", "git diff --stat", "git diffx", "git dif"):
        assert bash("Bash(git diff:*)", command, tmp_path) == bash("Bash(git diff *)", command, tmp_path)


def test_a_space_before_the_star_is_a_word_boundary(tmp_path: Path) -> None:
    assert bash("Bash(ls *)", "ls -la", tmp_path)
    assert not bash("Bash(ls *)", "lsof", tmp_path)
    assert bash("Bash(ls*)", "lsof", tmp_path)


def test_a_star_anywhere_matches_any_run_of_characters(tmp_path: Path) -> None:
    assert bash("Bash(git * main)", "git push origin main", tmp_path)
    assert bash("Bash(* --version)", "python --version", tmp_path)
    assert not bash("Bash(* --version)", "python --help", tmp_path)


def test_a_specifier_without_a_wildcard_is_an_exact_match(tmp_path: Path) -> None:
    assert bash("Bash(npm test)", "npm test", tmp_path)
    assert not bash("Bash(npm test)", "npm test --watch", tmp_path)
    assert not bash("Bash(npm test)", "npm tes", tmp_path)


def test_an_escaped_star_is_a_literal_star(tmp_path: Path) -> None:
    assert command_matches(r"echo \*", "echo *")
    assert not command_matches(r"echo \*", "echo hi")


def test_a_command_that_is_not_a_string_matches_no_specific_bash_rule(tmp_path: Path) -> None:
    for command in (None, 42, ["git", "diff"], {"x": 1}):
        assert not matches("Bash(git diff *)", "Bash", {"command": command}, tmp_path)
    assert not matches("Bash(git diff *)", "Bash", {}, tmp_path)
    assert matches("Bash", "Bash", {"command": 42}, tmp_path)


def test_commands_are_cut_at_every_shell_operator() -> None:
    command = "a && b || c; d | e |& f & g\nh $(i) `j` <(k) (l) { m; }"
    assert subcommands(command) == list("abcdefghijklm")
    assert subcommands("cmd 2>&1 >&2 &>log") == ["cmd 2>&1 >&2 &>log"]
    assert subcommands('rm -rf "${DIR}"/*') == ['rm -rf "${DIR}"/*']


# --- file paths -------------------------------------------------------------------------------------------


def test_a_dot_slash_pattern_covers_everything_under_that_folder_of_the_working_directory(tmp_path: Path) -> None:
    assert matches("Read(./src/**)", "Read", {"file_path": str(tmp_path / "src/a/b.py")}, tmp_path)
    assert matches("Read(./src/**)", "Read", {"file_path": "src/a.py"}, tmp_path)
    assert not matches("Read(./src/**)", "Read", {"file_path": str(tmp_path / "lib/a.py")}, tmp_path)


def test_a_dot_dot_in_the_input_cannot_escape_a_pattern(tmp_path: Path) -> None:
    assert not matches("Read(./src/**)", "Read", {"file_path": "src/../secrets"}, tmp_path)
    assert not matches("Read(./src/**)", "Read", {"file_path": str(tmp_path / "src/../../x/src/a")}, tmp_path)


def test_read_rules_use_gitignore_paths_relative_to_the_settings_file(tmp_path: Path) -> None:
    settings_dir = tmp_path / "project"
    cwd = settings_dir / "sub"
    rule = "Read(/docs/**)"
    assert matches(rule, "Read", {"file_path": str(settings_dir / "docs/x.md")}, cwd, settings_dir)
    assert not matches(rule, "Read", {"file_path": str(cwd / "docs/x.md")}, cwd, settings_dir)
    assert matches(rule, "Read", {"file_path": str(cwd / "docs/x.md")}, cwd)  # no settings file: from cwd


def test_a_double_slash_pattern_is_absolute(tmp_path: Path) -> None:
    assert matches(f"Read(/{tmp_path}/etc/**)", "Read", {"file_path": str(tmp_path / "etc/passwd")}, tmp_path / "w")


def test_a_tilde_pattern_is_under_the_home_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    rule = "Read(~/.ssh/**)"
    assert matches(rule, "Read", {"file_path": str(tmp_path / "home/.ssh/id_rsa")}, tmp_path / "w")
    assert matches(rule, "Read", {"file_path": "~/.ssh/id_rsa"}, tmp_path / "w")
    assert not matches(rule, "Read", {"file_path": str(tmp_path / "w/.ssh/id_rsa")}, tmp_path / "w")


def test_a_pattern_without_a_slash_matches_at_any_depth(tmp_path: Path) -> None:
    assert matches("Read(.env)", "Read", {"file_path": str(tmp_path / "a/b/.env")}, tmp_path)
    assert matches("Read(*.pem)", "Read", {"file_path": str(tmp_path / "keys/x.pem")}, tmp_path)
    assert not matches("Read(.env)", "Read", {"file_path": str(tmp_path / "a/.envrc")}, tmp_path)


def test_a_single_star_stays_within_one_folder_and_a_double_star_spans_many(tmp_path: Path) -> None:
    assert matches("Edit(src/*.py)", "Edit", {"file_path": str(tmp_path / "src/a.py")}, tmp_path)
    assert not matches("Edit(src/*.py)", "Edit", {"file_path": str(tmp_path / "src/pkg/a.py")}, tmp_path)
    assert matches("Edit(src/**/*.py)", "Edit", {"file_path": str(tmp_path / "src/pkg/deep/a.py")}, tmp_path)
    assert matches("Edit(src/**/*.py)", "Edit", {"file_path": str(tmp_path / "src/a.py")}, tmp_path)


def test_a_pattern_naming_a_folder_covers_what_is_inside_it(tmp_path: Path) -> None:
    assert matches("Read(./secrets)", "Read", {"file_path": str(tmp_path / "secrets/key")}, tmp_path)
    assert matches("Read(secrets/)", "Read", {"file_path": str(tmp_path / "secrets/key")}, tmp_path)


def test_edit_rules_apply_to_every_edit_tool(tmp_path: Path) -> None:
    target = str(tmp_path / "src/a.py")
    for tool, key in (("Edit", "file_path"), ("Write", "file_path"), ("MultiEdit", "file_path")):
        assert matches("Edit(./src/**)", tool, {key: target}, tmp_path)
    assert matches("Edit(./src/**)", "NotebookEdit", {"notebook_path": target}, tmp_path)
    assert not matches("Edit(./src/**)", "Read", {"file_path": target}, tmp_path)
    assert matches("Edit", "Write", {"file_path": target}, tmp_path)


def test_read_rules_apply_to_read_glob_and_grep(tmp_path: Path) -> None:
    folder = str(tmp_path / "src")
    assert matches("Read(./src/**)", "Read", {"file_path": folder + "/a.py"}, tmp_path)
    assert matches("Read(./src)", "Glob", {"path": folder, "pattern": "*.py"}, tmp_path)
    assert matches("Read(./src)", "Grep", {"path": folder, "pattern": "x"}, tmp_path)
    assert not matches("Read(./src/**)", "Edit", {"file_path": folder + "/a.py"}, tmp_path)


def test_a_write_rule_applies_to_write_alone(tmp_path: Path) -> None:
    target = str(tmp_path / "gen/a.py")
    assert matches("Write(./gen/**)", "Write", {"file_path": target}, tmp_path)
    assert not matches("Write(./gen/**)", "Edit", {"file_path": target}, tmp_path)


@pytest.mark.parametrize(
    "tool_input", [{}, {"file_path": None}, {"file_path": 7}, {"file_path": ""}, {"file_path": "a\0b"}]
)
def test_a_missing_or_malformed_path_matches_no_path_rule(tool_input: dict[str, Any], tmp_path: Path) -> None:
    assert not matches("Read(**)", "Read", tool_input, tmp_path)
    assert matches("Read", "Read", tool_input, tmp_path)


def test_a_relative_input_path_without_a_working_directory_matches_no_path_rule(tmp_path: Path) -> None:
    rule = parse_rule("Read(./src/**)", cwd=tmp_path)
    assert not rule_matches(rule, "Read", {"file_path": "src/a.py"})
    assert rule_matches(rule, "Read", {"file_path": str(tmp_path / "src/a.py")})


# --- web, MCP and other tools -------------------------------------------------------------------------------


def test_a_webfetch_domain_rule_matches_the_urls_host(tmp_path: Path) -> None:
    rule = "WebFetch(domain:example.com)"
    assert matches(rule, "WebFetch", {"url": "https://example.com/a?b"}, tmp_path)
    assert matches(rule, "WebFetch", {"url": "https://EXAMPLE.com:8443/"}, tmp_path)
    assert not matches(rule, "WebFetch", {"url": "https://example.com.evil.net/"}, tmp_path)
    assert not matches(rule, "WebFetch", {"url": "https://evil.net/?example.com"}, tmp_path)
    assert not matches(rule, "WebFetch", {"url": "https://sub.example.com/"}, tmp_path)
    assert matches("WebFetch(domain:*.example.com)", "WebFetch", {"url": "https://sub.example.com/"}, tmp_path)


@pytest.mark.parametrize("url", [None, 3, "", "not a url", "http://[::1", "https://user@/x"])
def test_a_missing_or_malformed_url_matches_no_domain_rule(url: object, tmp_path: Path) -> None:
    assert not matches("WebFetch(domain:example.com)", "WebFetch", {"url": url}, tmp_path)


def test_mcp_rules_match_a_tool_or_every_tool_of_a_server(tmp_path: Path) -> None:
    assert matches("mcp__memory__store", "mcp__memory__store", {}, tmp_path)
    assert not matches("mcp__memory__store", "mcp__memory__load", {}, tmp_path)
    assert matches("mcp__memory", "mcp__memory__load", {}, tmp_path)
    assert matches("mcp__memory__*", "mcp__memory__load", {}, tmp_path)
    assert not matches("mcp__memory", "mcp__memoryx__load", {}, tmp_path)
    assert not matches("mcp__memory__*", "mcp__other__load", {}, tmp_path)


def test_a_specifier_on_a_tool_without_known_syntax_matches_nothing(tmp_path: Path) -> None:
    assert not matches("Agent(Explore)", "Agent", {"subagent_type": "Explore"}, tmp_path)
    assert not matches("WebFetch(example.com)", "WebFetch", {"url": "https://example.com"}, tmp_path)
    assert matches("Agent(*)", "Agent", {"subagent_type": "Explore"}, tmp_path)


def test_rule_names_are_case_sensitive_and_exact(tmp_path: Path) -> None:
    assert not matches("bash", "Bash", {"command": "ls"}, tmp_path)
    assert not matches("Bash", "BashOutput", {}, tmp_path)
