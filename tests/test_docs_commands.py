"""Every command the documents quote works from a fresh clone after ``make install``.

The commands are read from the fenced code blocks (bash, sh, shell, console, none) of
``README.md`` and ``docs/**/*.md``, one test per command, named ``file:line``:

* ``streamxm ...`` (also ``.venv/bin/streamxm``, ``python -m streamxm``, ``$ streamxm``): no
  placeholder (``$D``, ``[--flag]``, ``<x>``, ``a|b``, ``...``, ``M``, ``FILE.npz``), the
  project's own argument parser accepts it, and the values it would refuse at start are valid
  (model names, ``--param``, ``--seeds``, a ``--dataset`` that a clone has). Quick ones (any
  ``--help``, ``redis status``/``stop``) are run for real against a temporary data directory;
  the rest (benchmarks, servers) are only parsed.
* ``make TARGET``: the Makefile has that target.
* ``python scripts/X.py ...`` / ``python -c CODE``: the script is in the repository / the code
  compiles, and no placeholder.

The fenced ``python`` blocks compile (doctest blocks example by example) and name nothing they
do not define (ruff's F821). A block whose fence is preceded by ``<!-- runs -->`` is run as a
script (a doctest block as a doctest); ``<!-- runs: api -->`` runs it against a real stack
(embedded Redis, one ``cmos`` worker, the API), with ``http://127.0.0.1:8000`` and
``http://localhost:8000`` in it pointed at that API.

Commands in inline code spans of the prose (``streamxm bench query [--gallery N]``) are
synopses, not pasted: for them only the subcommands and the ``--options`` they name must exist.
"""

from __future__ import annotations

import argparse
import contextlib
import doctest
import importlib.util
import io
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from streamxm.cli import _seeds, build_parser, parse_params

ROOT = Path(__file__).resolve().parent.parent
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("**/*.md"))]

SHELL_LANGUAGES = {"", "bash", "sh", "shell", "console", "shell-session", "zsh"}
PYTHON_LANGUAGES = {"python", "python3", "py", "pycon"}
STREAMXM = {"streamxm", ".venv/bin/streamxm", "./.venv/bin/streamxm"}
PYTHON = {"python", "python3", ".venv/bin/python", "./.venv/bin/python", ".venv/bin/python3"}
WRAPPERS = {"time", "nohup", "exec", "env"}
OPERATORS = {"&&", "||", ";", "|", "&"}

_FENCE = re.compile(r"^(?P<indent>\s*)(?P<fence>`{3,}|~{3,})\s*(?P<info>[^`\s]*)")
_MARKER = re.compile(r"^\s*<!--\s*runs(?:\s*:\s*(?P<kind>[\w-]+))?\s*-->\s*$")
_ASSIGNMENT = re.compile(r"^[A-Za-z_]\w*=")
_PROGRAM_HINT = re.compile(
    r"(?:^|&&|\|\||;|\|)\s*(?:[A-Za-z_]\w*=\S*\s+)*(?:(?:time|nohup|exec|env)\s+)?"
    r"(?:\./)?(?:\.venv/bin/)?(?:streamxm|python3?|make)(?:\s|$)"
)
_REDIRECT = re.compile(r"^\d*(?:>>?|<<?-?|&>)(?:&\d+)?$")
_REDIRECT_ATTACHED = re.compile(r"^\d*(?:>>?|&>|<<-?)\S+$")
_UPPER_PLACEHOLDER = re.compile(r"^[A-Z][A-Z0-9_]*(?:\.[A-Za-z0-9]+)?$")
_ANGLE_PLACEHOLDER = re.compile(r"<[^<>\s]+>")
_MAKE_RULE = re.compile(r"^(?P<targets>[^\s:=#][^:=]*?)\s*::?(?!=)")
_INLINE_CODE = re.compile(r"(?<!`)`(?P<code>[^`]+)`(?!`)")


# --- reading the documents -------------------------------------------------------------------


@dataclass(frozen=True)
class Block:
    """One fenced code block: where its fence opens, its language, its text."""

    path: str
    line: int  # the fence's line; the code's first line is line + 1
    language: str
    code: str
    marker: str | None  # None: no ``<!-- runs -->`` before it; "" plain; else its kind

    @property
    def where(self) -> str:
        return f"{self.path}:{self.line}"


@dataclass(frozen=True)
class Command:
    """One command line as a document quotes it (continuations joined, chains split)."""

    path: str
    line: int
    text: str
    program: str  # "streamxm", "make" or "python"
    argv: tuple[str, ...] = ()  # the arguments after the program
    env: tuple[tuple[str, str], ...] = ()  # VAR=value assignments before the program
    error: str | None = None  # the line could not be read as a shell command
    index: int = 0  # its place among the commands of the same line
    stdin: str | None = None  # the body of a here-document (``python - <<'PY'``)

    @property
    def where(self) -> str:
        return f"{self.path}:{self.line}" + (f"#{self.index + 1}" if self.index else "")


@dataclass(frozen=True)
class Span:
    """A command in an inline code span of the prose (a synopsis, not pasted)."""

    path: str
    line: int
    text: str
    words: tuple[str, ...] = field(default=())

    @property
    def where(self) -> str:
        return f"{self.path}:{self.line}"


def _relative(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def blocks(path: Path) -> Iterator[Block]:
    """The fenced blocks of one Markdown file."""
    lines = path.read_text(encoding="utf-8").splitlines()
    i = 0
    while i < len(lines):
        opening = _FENCE.match(lines[i])
        if opening is None:
            i += 1
            continue
        fence, indent = opening["fence"], len(opening["indent"])
        start, body = i, []
        i += 1
        while i < len(lines):
            closing = _FENCE.match(lines[i])
            if (
                closing is not None
                and closing["fence"][0] == fence[0]
                and len(closing["fence"]) >= len(fence)
                and not closing["info"]
            ):
                break
            text = lines[i]
            body.append(text[indent:] if not text[:indent].strip() else text.lstrip())
            i += 1
        i += 1  # past the closing fence
        before = next((lines[j] for j in range(start - 1, -1, -1) if lines[j].strip()), "")
        marked = _MARKER.match(before)
        yield Block(
            _relative(path),
            start + 1,
            opening["info"].lower(),
            "\n".join(body),
            None if marked is None else (marked["kind"] or ""),
        )


def _logical_lines(block: Block) -> Iterator[tuple[int, str, str | None]]:
    """(line number, text, here-document): continuations joined, console output left out."""
    console = block.language in {"console", "shell-session"}
    lines = block.code.split("\n")
    i = 0
    while i < len(lines):
        number, text = block.line + 1 + i, lines[i].strip()
        i += 1
        prompted = text.startswith("$ ")
        if prompted:
            text = text[2:].strip()
        elif console:
            continue  # output of the command above
        while text.endswith("\\") and i < len(lines):
            text = text[:-1].rstrip() + " " + lines[i].strip()
            i += 1
        if not text or text.startswith("#"):
            continue
        if _PROGRAM_HINT.search(text) is None:
            continue  # output, a diagram, or a command this test does not check
        tokens: list[str] = []
        while True:  # a quoted argument over several lines (python -c "...")
            try:
                tokens = shlex.split(text, comments=True)
                break
            except ValueError:
                if i >= len(lines):
                    break
                text += "\n" + lines[i]
                i += 1
        here = None
        heredoc = next((k for k, t in enumerate(tokens) if t.startswith("<<")), None)
        if heredoc is not None:  # python - <<'PY' ... PY: the body is the command's stdin
            word = tokens[heredoc][2:].lstrip("-") or "".join(tokens[heredoc + 1 : heredoc + 2])
            body = []
            while i < len(lines) and lines[i].strip() != word:
                body.append(lines[i])
                i += 1
            i += 1  # past the closing word
            here = "\n".join(body)
        yield number, text, here


def _split_chain(tokens: list[str]) -> list[list[str]]:
    """``a && b | c &`` -> ``[[a], [b], [c]]``, redirections dropped."""
    segments: list[list[str]] = [[]]
    skip_next = False
    for token in tokens:
        if skip_next:
            skip_next = False
            continue
        if token in OPERATORS:
            segments.append([])
            continue
        if _REDIRECT.match(token):
            skip_next = "&" not in token[1:]  # ``2>&1`` has no target word after it
            continue
        if _REDIRECT_ATTACHED.match(token):
            continue
        if token.endswith((";", "&")) and token not in OPERATORS and len(token) > 1:
            segments[-1].append(token[:-1])
            segments.append([])
            continue
        segments[-1].append(token)
    return [s for s in segments if s]


def _command(
    path: str, line: int, text: str, words: list[str], index: int, stdin: str | None
) -> Command | None:
    env: list[tuple[str, str]] = []
    while words and _ASSIGNMENT.match(words[0]):
        key, _, value = words.pop(0).partition("=")
        env.append((key, value))
    while words and words[0] in WRAPPERS:
        words.pop(0)
    if not words:
        return None
    first, rest = words[0], tuple(words[1:])
    if first in STREAMXM:
        return Command(path, line, text, "streamxm", rest, tuple(env), index=index, stdin=stdin)
    if first in PYTHON and rest[:2] == ("-m", "streamxm"):
        return Command(path, line, text, "streamxm", rest[2:], tuple(env), index=index, stdin=stdin)
    if first in PYTHON:
        return Command(path, line, text, "python", rest, tuple(env), index=index, stdin=stdin)
    if first == "make":
        return Command(path, line, text, "make", rest, tuple(env), index=index, stdin=stdin)
    return None


def commands(block: Block) -> Iterator[Command]:
    """The ``streamxm``, ``make`` and ``python`` commands of one shell block."""
    for number, text, stdin in _logical_lines(block):
        try:
            tokens = shlex.split(text, comments=True)
        except ValueError as exc:
            yield Command(block.path, number, text, "streamxm", error=f"not a shell line: {exc}")
            continue
        index = 0
        for segment in _split_chain(tokens):
            found = _command(block.path, number, text, segment, index, stdin)
            if found is not None:
                yield found
                index += 1


def inline_spans(path: Path) -> Iterator[Span]:
    """Inline code spans of the prose (outside fences) that quote a command."""
    in_fence: str | None = None
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        fence = _FENCE.match(line)
        if fence is not None:
            if in_fence is None:
                in_fence = fence["fence"][0]
            elif fence["fence"][0] == in_fence and not fence["info"]:
                in_fence = None
            continue
        if in_fence is not None:
            continue
        for match in _INLINE_CODE.finditer(line):
            text = match["code"].replace("\\|", "|").strip()
            words = text.split()
            if len(words) >= 2 and (words[0] in STREAMXM or words[0] == "make"):
                yield Span(_relative(path), number, text, tuple(words))


ALL_BLOCKS = [b for doc in DOCUMENTS if doc.is_file() for b in blocks(doc)]
SHELL_BLOCKS = [b for b in ALL_BLOCKS if b.language in SHELL_LANGUAGES]
PYTHON_BLOCKS = [b for b in ALL_BLOCKS if b.language in PYTHON_LANGUAGES]
COMMANDS = [c for b in SHELL_BLOCKS for c in commands(b)]
SPANS = [s for doc in DOCUMENTS if doc.is_file() for s in inline_spans(doc)]


def _params_of(items: list[Any]) -> list[Any]:
    return [pytest.param(item, id=item.where) for item in items]


# --- checking a streamxm command -------------------------------------------------------------


def placeholders(argv: tuple[str, ...]) -> list[str]:
    """What in ``argv`` a user would have to replace before the command runs."""
    found = []
    for token in argv:
        value = token.partition("=")[2] if "=" in token else token
        if "$" in token:
            found.append(f"{token!r} is a shell variable")
        elif token.startswith("[") or token.endswith("]"):
            found.append(f"{token!r} is an optional part in brackets")
        elif _ANGLE_PLACEHOLDER.search(token):
            found.append(f"{token!r} is a <placeholder>")
        elif "|" in token:
            found.append(f"{token!r} lists alternatives")
        elif "..." in token or token == "\u2026":
            found.append(f"{token!r} is an ellipsis")
        elif _UPPER_PLACEHOLDER.match(value):
            found.append(f"{token!r} is a placeholder")
    return found


def parse(argv: tuple[str, ...]) -> tuple[argparse.Namespace | None, str]:
    """The project's parser on ``argv``, not run: the namespace, or None and what it said."""
    err, out = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
            return build_parser().parse_args(list(argv)), ""
    except SystemExit as exc:
        if exc.code == 0:  # --help
            return argparse.Namespace(help=True), ""
        return None, (err.getvalue().strip().splitlines() or [f"exit {exc.code}"])[-1]


def check_model(name: str) -> None:
    """A model name a command accepts: a registered model, or an ensemble of them."""
    from streamxm.models import split_name
    from streamxm.models.ensemble import is_ensemble, parse_ensemble

    if is_ensemble(name):
        parse_ensemble(name)
    else:
        split_name(name)


def check_dataset(value: str) -> None:
    """``wiki`` (bundled), or a file inside the repository: a fresh clone has nothing else."""
    from streamxm.tools.datasets import BUNDLED

    if value in BUNDLED:
        return
    path = (ROOT / value).resolve()
    if not path.is_relative_to(ROOT):
        raise ValueError(
            f"--dataset {value}: outside the repository, not in a fresh clone "
            f"(--dataset {', '.join(BUNDLED)} is bundled)"
        )
    if not path.is_file():
        raise ValueError(f"--dataset {value}: no such file in the repository")


def _comma(text: str, kind: type[int] | type[float], what: str) -> None:
    try:
        [kind(x) for x in text.split(",")]
    except ValueError:
        raise ValueError(f"{what} {text!r}: comma-separated numbers expected") from None


def check_values(ns: argparse.Namespace) -> list[str]:
    """Values the parser lets through but the command refuses as it starts."""
    from streamxm.models import check_params

    problems: list[str] = []

    def attempt(label: str, check: Callable[..., object], *args: Any) -> None:
        try:
            check(*args)
        except (ValueError, SystemExit) as exc:
            said = str(exc)
            problems.append(said if said.startswith(label) else f"{label}: {said}")

    values = vars(ns)
    model = values.get("model")
    for name in model if isinstance(model, list) else [model] if model else []:
        attempt("--model", check_model, name)
    if isinstance(values.get("models"), str):
        for name in (m.strip() for m in values["models"].split(",")):
            attempt("--models", check_model, name)
    if values.get("dataset"):
        attempt("--dataset", check_dataset, values["dataset"])
    if isinstance(values.get("seeds"), str):
        attempt("--seeds", _seeds, values["seeds"])
    for option, kind in (("ranks", int), ("sizes", float), ("dims", int)):
        if isinstance(values.get(option), str):
            attempt(f"--{option}", _comma, values[option], kind, f"--{option}")
    if values.get("param"):
        try:
            params = parse_params(values["param"])
        except SystemExit as exc:
            problems.append(f"--param: {exc}")
        else:
            if isinstance(model, str) and not problems:
                from streamxm.models.ensemble import is_ensemble

                if not is_ensemble(model):
                    attempt("--param", check_params, model, params)
    url = values.get("url")
    if isinstance(url, str) and not url.startswith(("http://", "https://")):
        problems.append(f"--url {url!r}: not an http(s) URL")
    return problems


def is_quick(argv: tuple[str, ...]) -> bool:
    """Runs in a second or two with no server: help, and the embedded Redis's status/stop."""
    if "-h" in argv or "--help" in argv:
        return True
    words = [a for a in argv if not a.startswith("-")]
    return words[:1] == ["redis"] and words[1:2] in (["status"], ["stop"])


STREAMXM_COMMANDS = [c for c in COMMANDS if c.program == "streamxm"]
QUICK_COMMANDS = [
    c
    for c in STREAMXM_COMMANDS
    if c.error is None and not placeholders(c.argv) and is_quick(c.argv)
]
MAKE_COMMANDS = [c for c in COMMANDS if c.program == "make"]
PYTHON_COMMANDS = [c for c in COMMANDS if c.program == "python"]


def _say(command: Command, problems: list[str]) -> str:
    return f"{command.where}: `{command.text}`:\n  " + "\n  ".join(problems)


def test_the_documents_quote_commands() -> None:
    """The extraction finds something: a README without a command block fails here."""
    assert any(c.path == "README.md" for c in COMMANDS), "README.md quotes no command"


@pytest.mark.parametrize("command", _params_of(STREAMXM_COMMANDS))
def test_streamxm_command_parses(command: Command) -> None:
    assert command.error is None, _say(command, [command.error or ""])
    problems = placeholders(command.argv)
    if not problems:
        ns, said = parse(command.argv)
        problems = (
            [f"streamxm {' '.join(command.argv)}: {said}"] if ns is None else (check_values(ns))
        )
    assert not problems, _say(command, problems)


def _streamxm_executable() -> list[str]:
    """The console script ``make install`` puts beside this interpreter, else ``-m``."""
    script = Path(sys.executable).with_name("streamxm")
    return [str(script)] if script.is_file() else [sys.executable, "-m", "streamxm"]


def _clean_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("STREAMXM_")}
    env.update(STREAMXM_DATA_DIR=str(tmp_path / "data"), STREAMXM_THREADS="1")
    env.update(extra)
    return env


@pytest.mark.parametrize("command", _params_of(QUICK_COMMANDS))
def test_quick_streamxm_command_runs(command: Command, tmp_path: Path) -> None:
    """Run for real (in a temporary directory, a temporary STREAMXM_DATA_DIR)."""
    done = subprocess.run(
        [*_streamxm_executable(), *command.argv],
        cwd=tmp_path,
        env=_clean_env(tmp_path, **dict(command.env)),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, _say(
        command, [f"exit {done.returncode}", *done.stderr.strip().splitlines()[-5:]]
    )


def make_targets() -> set[str]:
    targets: set[str] = set()
    for line in (ROOT / "Makefile").read_text(encoding="utf-8").splitlines():
        rule = _MAKE_RULE.match(line)
        if rule is not None and not line.startswith((".", "\t")):
            targets.update(rule["targets"].split())
    return targets


@pytest.mark.parametrize("command", _params_of(MAKE_COMMANDS))
def test_make_command_names_a_target(command: Command) -> None:
    wanted = [a for a in command.argv if not a.startswith("-") and "=" not in a]
    problems = placeholders(command.argv)
    missing = sorted(set(wanted) - make_targets())
    if missing:
        problems.append(
            f"no Makefile target {', '.join(missing)} "
            f"(targets: {', '.join(sorted(make_targets()))})"
        )
    assert not problems, _say(command, problems)


@pytest.mark.parametrize("command", _params_of(PYTHON_COMMANDS))
def test_python_command(command: Command) -> None:
    """``python -c CODE`` and ``python - <<EOF`` compile; ``python FILE`` is in the repository."""
    argv, problems = list(command.argv), []
    while argv and argv[0].startswith("-") and argv[0] != "-c":
        argv.pop(0)  # -u, -O, ...
    if argv[:1] == ["-c"]:
        code = argv[1] if len(argv) > 1 else ""
        try:
            compile(code, command.where, "exec")
        except SyntaxError as exc:
            problems.append(f"the code does not compile: {exc}")
        problems += placeholders(tuple(argv[2:]))
    elif argv[:1] == ["-"]:
        try:
            compile(command.stdin or "", command.where, "exec")
        except SyntaxError as exc:
            problems.append(f"the here-document does not compile: {exc}")
        problems += placeholders(tuple(argv[1:]))
    elif argv:
        script = (ROOT / argv[0]).resolve()
        if not (script.is_relative_to(ROOT) and script.is_file()):
            problems.append(f"{argv[0]}: no such file in the repository")
        problems += placeholders(tuple(argv[1:]))
    assert not problems, _say(command, problems)


# --- python blocks ---------------------------------------------------------------------------


def is_doctest(block: Block) -> bool:
    return any(line.lstrip().startswith(">>>") for line in block.code.splitlines())


def as_script(block: Block) -> str:
    """The block as Python with its line numbers kept (a doctest's prompts and output blank)."""
    if not is_doctest(block):
        return block.code
    out = []
    for line in block.code.splitlines():
        stripped = line.lstrip()
        prompted = stripped.startswith((">>> ", "... ")) or stripped in (">>>", "...")
        out.append(stripped[4:] if prompted else "")  # output lines: blank
    return "\n".join(out)


@pytest.mark.parametrize("block", _params_of(PYTHON_BLOCKS))
def test_python_block_compiles(block: Block) -> None:
    if is_doctest(block):
        parser = doctest.DocTestParser()
        for example in parser.get_examples(block.code):
            where = f"{block.path}:{block.line + 1 + example.lineno}"
            try:
                compile(example.source, where, "single")
            except SyntaxError as exc:
                pytest.fail(f"{where}: {exc}")
    else:
        try:
            compile(block.code, block.where, "exec")
        except SyntaxError as exc:
            line = block.line + (exc.lineno or 0)
            pytest.fail(f"{block.path}:{line}: {exc.msg}: {(exc.text or '').strip()}")


@pytest.mark.skipif(importlib.util.find_spec("ruff") is None, reason="ruff not installed")
@pytest.mark.parametrize("block", _params_of(PYTHON_BLOCKS))
def test_python_block_defines_what_it_uses(block: Block) -> None:
    """Pasted as written, the block names nothing undefined (ruff's F821)."""
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "ruff",
            "check",
            "--isolated",
            "--no-cache",
            "--select",
            "F821",
            "--output-format",
            "concise",
            "--stdin-filename",
            "block.py",
            "-",
        ],
        input=as_script(block),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    found = [
        f"{block.path}:{block.line + int(m[1])}: {m[2]}"
        for m in re.finditer(r"^block\.py:(\d+):\d+: (.*)$", done.stdout, re.M)
    ]
    assert done.returncode in (0, 1), done.stderr
    assert not found, f"{block.where}:\n  " + "\n  ".join(found)


RUNNABLE_BLOCKS = [b for b in PYTHON_BLOCKS if b.marker is not None]
_DOCTEST_DRIVER = """
import doctest, sys
test = doctest.DocTestParser().get_doctest(sys.stdin.read(), {}, sys.argv[1], sys.argv[1], 0)
runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
runner.run(test)
sys.exit(1 if runner.failures else 0)
"""


def run_block(block: Block, code: str, cwd: Path, env: dict[str, str]) -> None:
    argv = (
        [sys.executable, "-c", _DOCTEST_DRIVER, block.where]
        if is_doctest(block)
        else [sys.executable, "-"]
    )
    done = subprocess.run(
        argv, input=code, cwd=cwd, env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, (
        f"{block.where}: exit {done.returncode}\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}"
    )


@pytest.mark.slow
@pytest.mark.parametrize("block", _params_of(RUNNABLE_BLOCKS))
def test_runnable_python_block(
    block: Block, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """``<!-- runs -->``: as written; ``<!-- runs: api -->``: against Redis, a worker, the API
    (the block's STREAMXM_REDIS_URL and STREAMXM_NAMESPACE are theirs, for ``get_settings()``)."""
    if block.marker == "":
        run_block(block, block.code, tmp_path, _clean_env(tmp_path))
        return
    assert block.marker == "api", f"{block.where}: unknown marker runs: {block.marker}"
    from tests.conftest import ApiServer, WorkerProcess, worker_env

    settings = request.getfixturevalue("settings")
    with WorkerProcess(worker_env(settings), "cmos"), ApiServer(settings) as api:
        code = block.code
        for address in ("http://127.0.0.1:8000", "http://localhost:8000"):
            code = code.replace(address, api.url)
        run_block(
            block,
            code,
            tmp_path,
            _clean_env(
                tmp_path,
                STREAMXM_API_URL=api.url,
                STREAMXM_REDIS_URL=str(settings.redis_url),
                STREAMXM_NAMESPACE=settings.namespace,
            ),
        )


# --- inline synopses -------------------------------------------------------------------------


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def synopsis_problems(words: tuple[str, ...]) -> list[str]:
    """Subcommands and ``--options`` a synopsis names that the parser does not have."""
    parser, path, problems = build_parser(), ["streamxm"], []
    for raw in words[1:]:
        word = raw.strip("[]()").rstrip(",")
        if word.startswith("-"):
            option = word.split("=")[0]
            if (
                re.fullmatch(r"--?[A-Za-z][\w-]*", option)
                and option not in parser._option_string_actions
            ):
                problems.append(f"{' '.join(path)} has no option {option}")
            continue
        choices = _subparsers(parser)
        if not choices or not re.fullmatch(r"[a-z][a-z-]*", word):
            continue  # a value, a positional, a placeholder: a synopsis may name those
        if word not in choices:
            problems.append(
                f"{' '.join(path)} has no subcommand {word!r} (it has: {', '.join(choices)})"
            )
            break
        parser = choices[word]
        path.append(word)
    return problems


@pytest.mark.parametrize("span", _params_of(SPANS))
def test_inline_command_names_exist(span: Span) -> None:
    if span.words[0] == "make":
        wanted = [w for w in span.words[1:] if not w.startswith("-") and "=" not in w]
        missing = sorted(set(wanted) - make_targets())
        assert not missing, f"{span.where}: `{span.text}`: no Makefile target {missing}"
        return
    problems = synopsis_problems(span.words)
    assert not problems, f"{span.where}: `{span.text}`:\n  " + "\n  ".join(problems)
