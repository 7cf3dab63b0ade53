"""How Claude Code reads a hook's matcher, and how the permission decisions of several hooks combine."""

from __future__ import annotations

import itertools

import pytest

from queryloop.runtime.loop.hook_matching import matcher_matches, strongest_decision


@pytest.mark.parametrize("matcher", [None, "", "*"])
def test_an_absent_empty_or_star_matcher_matches_every_tool(matcher: str | None) -> None:
    assert all(matcher_matches(matcher, name) for name in ("Bash", "mcp__memory__store", "x"))


def test_a_name_of_letters_digits_and_underscores_is_an_exact_match() -> None:
    assert matcher_matches("Bash", "Bash")
    assert not matcher_matches("Bash", "BashOutput")  # exact, not a prefix
    assert not matcher_matches("bash", "Bash")  # case-sensitive


def test_a_pipe_list_matches_each_name_exactly() -> None:
    assert matcher_matches("Write|Edit", "Edit") and matcher_matches("Write|Edit", "Write")
    assert not matcher_matches("Write|Edit", "NotebookEdit")


def test_a_comma_list_with_spaces_matches_each_name_exactly() -> None:
    assert matcher_matches("Write, Edit", "Edit") and matcher_matches("Write,Edit", "Write")
    assert matcher_matches("Write | Edit", "Edit")
    assert not matcher_matches("Write, Edit", "NotebookEdit")


def test_a_name_with_hyphens_is_exact_not_a_regular_expression() -> None:
    assert matcher_matches("mcp__my-server__search", "mcp__my-server__search")
    assert not matcher_matches("mcp__my-server__search", "mcp__my-server__search_all")
    assert not matcher_matches("my-server", "mcp__my-server__search")  # exact: not searched in the name


def test_an_mcp_server_prefix_alone_matches_no_tool_of_that_server() -> None:
    assert not matcher_matches("mcp__memory", "mcp__memory__store")
    assert matcher_matches("mcp__memory__.*", "mcp__memory__store")
    assert not matcher_matches("mcp__memory__.*", "mcp__files__read")


def test_any_other_character_makes_an_unanchored_regular_expression() -> None:
    assert matcher_matches("^Notebook", "NotebookEdit") and not matcher_matches("^Notebook", "EditNotebook")
    assert matcher_matches("Edit$", "NotebookEdit")
    assert matcher_matches("ote", "NotebookEdit") is False  # letters only: exact, not searched
    assert matcher_matches(".ote", "NotebookEdit")  # a regular expression is searched, as RegExp.test does


def test_an_invalid_expression_matches_nothing_and_raises_nothing() -> None:
    assert not matcher_matches("(unclosed", "(unclosed")
    assert not matcher_matches("[", "Bash")


@pytest.mark.parametrize(
    ("decisions", "expected"),
    [
        ([], None),
        ([None, None], None),
        (["allow"], "allow"),
        (["allow", "ask"], "ask"),
        (["ask", "defer", "allow"], "defer"),
        (["allow", "deny", "defer", "ask"], "deny"),
        (["maybe", "allow"], "allow"),  # an unknown value decides nothing
    ],
)
def test_deny_beats_defer_beats_ask_beats_allow(decisions: list[str | None], expected: str | None) -> None:
    assert strongest_decision(decisions) == expected


def test_the_strongest_decision_does_not_depend_on_the_order_hooks_finished() -> None:
    four = ["allow", "ask", "defer", "deny"]
    for n in range(1, 5):
        for chosen in itertools.combinations(four, n):
            results = {strongest_decision(order) for order in itertools.permutations(chosen)}
            assert results == {max(chosen, key=four.index)}
