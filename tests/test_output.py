"""Remote output: node prefixes and the output-control decorators."""

from __future__ import annotations

import sys

import pytest

import flotilla as sky


@sky.function
def chatter(tag: str) -> int:
    node = sky.instance_info().node
    print(f"{tag} out {node}")
    print(f"{tag} err {node}", file=sys.stderr)
    return node


@sky.function
@sky.stdout(only="head")
def below(tag: str) -> None:
    print(f"{tag} {sky.instance_info().node}")


@sky.stdout(only="head")
@sky.function
def above(tag: str) -> None:
    print(f"{tag} {sky.instance_info().node}")


@sky.function
@sky.stdout(only=lambda info: info.node < 2)
def first_two(tag: str) -> None:
    print(f"{tag} {sky.instance_info().node}")


@sky.function
@sky.silent
def quiet(tag: str) -> int:
    print(f"{tag} out")
    print(f"{tag} err", file=sys.stderr)
    return 1


@sky.function(timeout=30)
@sky.stderr(only="head")
def err_head(tag: str) -> None:
    print(f"{tag} {sky.instance_info().node}", file=sys.stderr)


def lines(text: str, tag: str) -> list[str]:
    return sorted(line for line in text.splitlines() if tag in line)


def test_lines_carry_their_node(pool4: sky.Compute, capsys: pytest.CaptureFixture[str]) -> None:
    chatter("p1") @ pool4
    out, err = capsys.readouterr()
    assert lines(out, "p1") == [f"(node-{k}, rank={k}) p1 out {k}" for k in range(4)]
    assert lines(err, "p1") == [f"(node-{k}, rank={k}) p1 err {k}" for k in range(4)]


@pytest.mark.parametrize("fn", [below, above], ids=["below", "above"])
def test_stdout_only_head(
    fn: sky.Function[[str], None], pool4: sky.Compute, capsys: pytest.CaptureFixture[str]
) -> None:
    fn("h1") @ pool4
    assert lines(capsys.readouterr().out, "h1") == ["(node-0, rank=0) h1 0"]


def test_stdout_predicate(pool4: sky.Compute, capsys: pytest.CaptureFixture[str]) -> None:
    first_two("pr") @ pool4
    assert lines(capsys.readouterr().out, "pr") == [
        "(node-0, rank=0) pr 0",
        "(node-1, rank=1) pr 1",
    ]


def test_silent_and_stderr(pool4: sky.Compute, capsys: pytest.CaptureFixture[str]) -> None:
    assert quiet("sl") @ pool4 == [1, 1, 1, 1]
    err_head("eh") @ pool4
    out, err = capsys.readouterr()
    assert lines(out + err, "sl") == []
    assert lines(err, "eh") == ["(node-0, rank=0) eh 0"]


def test_decorated_options_survive_output_decorators() -> None:
    assert isinstance(above, sky.Function)
    assert err_head.timeout == 30


def test_only_must_be_head_or_a_predicate() -> None:
    with pytest.raises(ValueError, match="only="):
        sky.stdout(only="tail")  # type: ignore[arg-type]


def test_stdout_only_head_in_standalone_mode_keeps_node_0(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with sky.Compute(nodes=2, options=sky.Options(cluster=False)) as pool:
        below("sa") @ pool
    got = lines(capsys.readouterr().out, "sa")
    assert len(got) == 1 and got[0].endswith("sa 0")
