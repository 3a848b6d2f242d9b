"""Error messages, checked on the code itself: the layers below the commands spell no command-line flag (they name
a setting through llmc_cli.naming.arg, so a Python caller reads its own argument), and no message raised or
`fail`ed carries more than MAX_FIXED characters of fixed text (what is wrong and what to do, short)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "llmc_cli"
DOMAIN = ("training", "formats", "parallel", "tokenizing", "models", "data", "inference", "evals", "bench")
MAX_FIXED = 150
FLAG = re.compile(r"(?<![\w\-.])(--[a-z][a-z0-9-]+|-[bt](?= |$|/))")  # `--out`, `-t 64`; not `a-b` or `x--y`
COMMAND = re.compile(r"`(llmc|pip) [^`]*`")  # a whole command to run (`llmc train --procs N`) is advice to anyone


def _flags(text: str) -> list[str]:
    return FLAG.findall(COMMAND.sub("", text))


def _files(tops) -> list[Path]:
    return [p for top in tops for p in sorted((PKG / top).rglob("*.py"))]


def _message(node: ast.AST) -> ast.AST | None:
    """The message of `raise E(msg, ...)` or `fail(msg, ...)`: its first argument."""
    call = node.exc if isinstance(node, ast.Raise) else node
    if isinstance(call, ast.Call) and call.args:
        return call.args[0]
    return None


def _fixed(node: ast.AST) -> int:
    """Characters of constant text in a message: its literals, f-strings' literal parts, either side of a
    conditional (the longer), joined by +."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return len(node.value)
    if isinstance(node, ast.JoinedStr):
        return sum(_fixed(v) for v in node.values)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return _fixed(node.left) + _fixed(node.right)
    if isinstance(node, ast.IfExp):
        return max(_fixed(node.body), _fixed(node.orelse))
    return 0


def _messages(paths):
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            is_fail = (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "fail")
            if (isinstance(node, ast.Raise) or is_fail) and (msg := _message(node)) is not None:
                yield f"{path.relative_to(PKG.parent)}:{node.lineno}", msg


def test_the_domain_layers_spell_no_flag():
    spelled = [f"{where}: {found}" for where, msg in _messages(_files(DOMAIN))
               if (found := [f for s in ast.walk(msg) if isinstance(s, ast.Constant) and isinstance(s.value, str)
                             for f in _flags(s.value)])]
    assert not spelled, "name a setting with llmc_cli.naming.arg, not its flag:\n" + "\n".join(spelled)


def test_no_message_carries_more_than_its_share_of_fixed_text():
    long = [f"{where}: {n}" for where, msg in _messages(sorted(PKG.rglob("*.py"))) if (n := _fixed(msg)) > MAX_FIXED]
    assert not long, f"messages over {MAX_FIXED} characters of fixed text:\n" + "\n".join(long)


def test_the_measures_see_what_they_look_for():
    (_, msg), = _messages_of('raise E(f"--out {x}: " + y + ("abc" if c else "b"))')
    assert _fixed(msg) == len("--out : abc")
    assert _flags("-t 64, --n-embd, -b/--batch-size, a-b, x--y, `llmc train --procs N`") == [
        "-t", "--n-embd", "-b", "--batch-size"]


def _messages_of(src: str):
    return [("<src>", _message(n)) for n in ast.walk(ast.parse(src)) if isinstance(n, ast.Raise)]
