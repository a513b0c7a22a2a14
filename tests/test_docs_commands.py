"""Every shell command README.md and docs/*.md print is run as printed or checked by the parser
of the program it names, so a renamed flag or run-config key breaks the suite, not a user.

Which text is a command: in README.md and docs/*.md, fenced blocks tagged bash, sh or shell
hold commands on every non-empty line; in blocks tagged console, and in untagged blocks, the
lines starting with "$ " do (the prompt is dropped, other lines are output or layout). A line
ending in a backslash continues on the next. `# ...` comments are dropped; leading `VAR=value`
assignments, `nice -n N` and a `.venv/bin/` before the program are not part of the command.
Blocks tagged text hold usage synopses: their `--flags` must exist in the named command's
parser. Other tags (python, toml) are not shell. In the prose, an inline code span is a
command too when it starts with a program this test checks (python, fedfields, flwr, make,
pip, ray, flower-superlink, flower-supernode, tensorboard), carries a flag (`--name`, `-e`) or a
`VAR=value`, and has no synopsis mark (`[`, `|`, `<`, `>`, `...`, an upper-case placeholder
such as N or DIR); a bare name like `make demo` in a sentence is not.

What each command gets: the few in `RUN_AS_PRINTED` run, as printed, in a scratch folder
holding links to the checkout's data/ and .venv/; every other command's form (its program and
subcommand) must be in `CHECKED_ONLY`, with the reason it does not run here, or in
`EXTERNAL`; a command of any other form fails this test, so new documentation gets covered.
A checked command is parsed by its program's own parser: the argparse parser that
`python -m simulations.launch|deploy|sweep|bench.X` and `fedfields ...` build in main() (a
sweep's flags after `--` by the launcher's), Flower's
click commands for `flwr`, Flower's argparse parsers for flower-superlink and
flower-supernode, Ray's click command for `ray start`, TensorBoard's argparse parser (its
plugins' flags included) for `tensorboard`; every `--flag` must be one of the
parser's own option strings, spelled out (argparse would accept `--user` for `--users`). A
`--run-config` (and make's RUN_CONFIG) is validated by `FederatedConfig.from_run_config` over
pyproject's declared config, as the launchers do (a sweep's: each setting of its `--grid`
with its `--run-config`, by the sweep's own `plan_sweep`; benchmarks merge theirs into their own
settings: there each key must exist and have its key's type); a `--node-config` may hold only
the keys a SuperNode's ClientApp reads; `export`ed Flower variables must equal the launcher's.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import optparse
import os
import re
import shlex
import subprocess
import sys
import tomllib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click
import pytest
import typer
from flwr.common.config import parse_config_args

from fedfields.cli import build_parser
from fedfields.config.schema import section_of_keys
from simulations import APP_DIR
from simulations.deploy import node_config_text
from simulations.launch import federation_config
from simulations.planner import ENVIRONMENT, job_config
from simulations.sweep import plan_sweep

DOCS = [APP_DIR / "README.md", *sorted((APP_DIR / "docs").rglob("*.md"))]
SHELL_TAGS = ("bash", "sh", "shell")
PROMPT_TAGS = ("console", "")
PLACEHOLDER_VALUE = "1"  # `flwr ls --run-id <id>`: the reader's run id, a number
FENCE = re.compile(r"^([ \t]*)```([\w-]*)[^\n]*\n(.*?)^\1```", re.S | re.M)

DEPLOY = "python -m simulations.deploy --users 4"  # README.md's deployment, as printed
RUN_AS_PRINTED = {
    ".venv/bin/fedfields data objects --count 1 --views 80 --resolution 25 "
    "--out runs/objects_split_bench": "renders one 25x25 object: a few seconds",
}
CHECKED_ONLY = {
    "python -m simulations.launch": "a federated run through Ray: minutes",
    "python -m simulations.deploy": "a real deployment: minutes (tests/test_deployment.py runs "
    "it through this command line with tiny settings)",
    "python -m simulations.sweep": "launcher runs, minutes each (tests/test_sweep.py runs a tiny "
    "sweep through this command line)",
    "python -m simulations.bench": "benchmarks: minutes to hours each",
    "python -m simulations.reproduce": "a paper table over seeds: an hour at cpu scale "
    "(tests/test_reproduce.py runs it through main() at its toy scale)",
    "fedfields train": "trains a field for minutes",
    "fedfields eval": "needs the checkpoint that `fedfields train` writes",
    "fedfields audit": "needs finished runs",
    "fedfields data crowd": "a 16-user crowd takes tens of seconds",
    "fedfields data objects": "tens of objects take minutes",
    "fedfields sdar-digits": "trains a split CNN and its attack for minutes",
    "flwr run": "a whole federated run",
    "flwr ls": "needs a SuperLink and a run id",
    "flower-superlink": "a server that runs until stopped",
    "flower-supernode": "a node that runs until stopped, dialling a real server",
    "make demo": "a federated run: 6-16 minutes",
    "make test": "the whole suite, this test included",
    "make install": "creates .venv and installs packages",
    "ray start": "starts a Ray cluster that outlives the command",
    "pip install": "installs packages",
    "pip download": "fetches wheels from PyPI",
    "export": "changes the shell's environment only",
    "tensorboard": "a web server that runs until stopped",
}
EXTERNAL = {
    "apt": "Debian's package manager: needs root and the network",
    "apt-get": "Debian's package manager: needs root and the network",
}


@dataclass(frozen=True)
class DocCommand:
    """One documented shell command: where it is and its text (continuations joined)."""

    doc: str
    line: int
    text: str

    def __str__(self) -> str:
        return f"{self.doc}:{self.line}: {self.text}"


def fenced_commands(markdown: str, doc: str) -> list[DocCommand]:
    """The shell commands of `markdown`'s fenced blocks, by the module docstring's rule."""
    found = []
    for block in FENCE.finditer(markdown):
        tag, body = block[2], block[3]
        if tag not in SHELL_TAGS + PROMPT_TAGS:
            continue
        first_line = markdown.count("\n", 0, block.start(3)) + 1
        pending, start = "", 0
        for offset, raw in enumerate(body.splitlines()):
            line = raw.strip()
            if not pending:
                start = first_line + offset
                if tag in PROMPT_TAGS:
                    if not line.startswith("$ "):
                        continue
                    line = line[2:]
            if line.endswith("\\"):
                pending += line[:-1] + " "
                continue
            text = re.sub(r"\s+", " ", pending + line).strip()
            pending = ""
            if text and not text.startswith("#"):
                found.append(DocCommand(doc, start, text))
    return found


INLINE_PROGRAMS = (
    "python", "fedfields", "flwr", "make", "pip", "ray", "flower-superlink", "flower-supernode",
    "tensorboard",
)  # fmt: skip
SYNOPSIS_MARK = re.compile(r"[\[|<>]|\.\.\.|(?<![\w'\"=/.-])[A-Z][A-Z_]*(?![\w'\"=])")
INLINE_FLAG = re.compile(r"\s(?:--[a-z]|-e\b)|\s[A-Z_]+=")


def inline_commands(markdown: str, doc: str) -> list[DocCommand]:
    """The commands among `markdown`'s inline code spans, by the module docstring's rule."""
    prose = FENCE.sub(lambda block: "\n" * block[0].count("\n"), markdown)
    found = []
    for span in re.finditer(r"(?<!`)`([^`\n]+(?:\n[^`\n]+)?)`(?!`)", prose):
        text = re.sub(r"\s+", " ", span[1]).strip()
        if SYNOPSIS_MARK.search(text) or not INLINE_FLAG.search(text):
            continue
        if argv_of(text)[:1] and argv_of(text)[0] in INLINE_PROGRAMS:
            found.append(DocCommand(doc, prose.count("\n", 0, span.start()) + 1, text))
    return found


def synopses(markdown: str, doc: str) -> list[DocCommand]:
    """The usage lines of `text` blocks (continuations joined) that start with `fedfields`."""
    found = []
    for block in FENCE.finditer(markdown):
        if block[2] != "text":
            continue
        first_line = markdown.count("\n", 0, block.start(3)) + 1
        joined = re.sub(r"\\\n\s*", " ", block[3])
        for offset, line in enumerate(joined.splitlines()):
            if line.startswith("fedfields "):
                found.append(DocCommand(doc, first_line + offset, line.strip()))
    return found


def all_commands() -> list[DocCommand]:
    """The fenced and inline commands of every document."""
    found = []
    for path in DOCS:
        text, name = path.read_text(), str(path.relative_to(APP_DIR))
        found += fenced_commands(text, name) + inline_commands(text, name)
    return found


def argv_of(text: str) -> list[str]:
    """The command's words without leading assignments, `nice -n N` and `.venv/bin/`; a word
    that is all placeholder (`<id>`) becomes `PLACEHOLDER_VALUE`."""
    words = shlex.split(text, comments=True)
    while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):
        words = words[1:]
    if words[:1] == ["nice"]:
        words = words[3:] if words[1:2] == ["-n"] else words[1:]
    words = [PLACEHOLDER_VALUE if re.fullmatch(r"<[^<>]+>", word) else word for word in words]
    if words:
        words[0] = words[0].removeprefix(".venv/bin/")
        if words[0] == "python3":
            words[0] = "python"
    return words


def form_of(argv: list[str]) -> str:
    """The command's form: the longest key of CHECKED_ONLY or EXTERNAL its words start with
    (a benchmark module by its package); '' when none."""
    joined = " ".join(argv)
    forms = [*CHECKED_ONLY, *EXTERNAL]
    matching = [form for form in forms if joined == form or joined.startswith(form + " ")]
    if argv[:3] and argv[:2] == ["python", "-m"] and argv[2].startswith("simulations.bench."):
        matching.append("python -m simulations.bench")
    return max(matching, key=len, default="")


class Parsed(Exception):
    """Raised by the patched `parse_args` once the program's own parser accepted the words."""

    def __init__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace) -> None:
        super().__init__("parsed")
        self.parser, self.namespace = parser, namespace


@contextlib.contextmanager
def stop_after_parsing() -> Iterator[None]:
    """Make `ArgumentParser.parse_args` raise `Parsed` after parsing: main() stops there."""
    original = argparse.ArgumentParser.parse_args

    def parse_then_stop(self: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> Any:
        raise Parsed(self, original(self, *args, **kwargs))

    argparse.ArgumentParser.parse_args = parse_then_stop  # type: ignore[method-assign]
    try:
        yield
    finally:
        argparse.ArgumentParser.parse_args = original  # type: ignore[method-assign]


def parse_with_main(module_name: str, args: list[str]) -> Parsed:
    """`module_name`'s main() parsing `args` with its own parser, stopped right after."""
    module = importlib.import_module(module_name)
    stderr = io.StringIO()
    saved = sys.argv
    sys.argv = [module_name, *args]
    try:
        with stop_after_parsing(), contextlib.redirect_stderr(stderr):
            module.main()
    except Parsed as parsed:
        return parsed
    except SystemExit:
        raise AssertionError(f"{module_name} refuses {args}: {stderr.getvalue().strip()}") from None
    finally:
        sys.argv = saved
    raise AssertionError(f"{module_name}.main() never parsed its arguments")


def option_strings(parser: argparse.ArgumentParser) -> set[str]:
    """Every option string of `parser` and of its subcommands' parsers."""
    options = set()
    for action in parser._actions:
        options.update(action.option_strings)
        if isinstance(action, argparse._SubParsersAction):
            for subparser in action.choices.values():
                options |= option_strings(subparser)
    return options


def assert_spelled_out(args: list[str], options: set[str], program: str) -> None:
    """Every `--flag` word in `args` is exactly one of `options` (no abbreviations)."""
    for word in args:
        flag = word.split("=", 1)[0]
        if re.fullmatch(r"--[A-Za-z][\w-]*", flag):
            assert flag in options, f"{program}: no option {flag!r} (known: {sorted(options)})"


def declared_keys_and_types(run_config: str) -> None:
    """Each key of `run_config` exists and its value has the key's type (benchmarks)."""
    owners = section_of_keys()
    for key, value in parse_config_args([run_config]).items():
        assert key in owners, f"unknown run-config key {key!r}"
        expected = type(owners[key][1].default)
        number = expected is float and isinstance(value, int) and not isinstance(value, bool)
        assert isinstance(value, expected) or number, f"run-config {key!r}: {value!r}"


def expand(word: str) -> str:
    """`word` with $PWD (the checkout, where the docs' commands start) and $PATH expanded."""
    return word.replace("$PWD", str(APP_DIR)).replace("$PATH", os.environ.get("PATH", ""))


def check_python_module(argv: list[str]) -> None:
    """`python -m MODULE ...` and `fedfields ...`: the module's own parser, its run-config; a
    sweep's grid and run-config as the sweep checks them, its flags after `--` as the
    launcher's."""
    module, args = ("fedfields.cli", argv[1:]) if argv[0] == "fedfields" else (argv[2], argv[3:])
    args = [expand(word) for word in args]
    launcher_args: list[str] = []
    if module == "simulations.sweep" and "--" in args:
        args, launcher_args = args[: args.index("--")], args[args.index("--") + 1 :]
    parsed = parse_with_main(module, args)
    assert_spelled_out(args, option_strings(parsed.parser), module)
    run_config = getattr(parsed.namespace, "run_config", "")
    if module == "simulations.sweep":
        plan_sweep(parsed.namespace)  # every setting through the launcher's job_config
        check_python_module(["python", "-m", "simulations.launch", *launcher_args])
    elif run_config and module in ("simulations.launch", "simulations.deploy"):
        job_config(run_config)
    elif run_config:
        declared_keys_and_types(run_config)


def click_context(command: click.Command, name: str, args: list[str]) -> click.Context:
    """`command` parsing `args` (nothing runs); AssertionError naming a refused word."""
    try:
        return command.make_context(name, list(args), resilient_parsing=False)
    except click.UsageError as error:
        raise AssertionError(f"{name} refuses {args}: {error}") from None


def click_options(command: click.Command) -> set[str]:
    return {opt for param in command.params for opt in (*param.opts, *param.secondary_opts)}


def check_flwr(argv: list[str]) -> None:
    """`flwr run|ls ...` by Flower's own click commands; run-config and federation-config."""
    from flwr.cli.app import app

    command = typer.main.get_command(app).commands[argv[1]]  # type: ignore[attr-defined]
    args = [expand(word) for word in argv[2:]]
    context = click_context(command, f"flwr {argv[1]}", args)
    assert_spelled_out(args, click_options(command), f"flwr {argv[1]}")
    if argv[1] != "run":
        return
    assert context.params["app"] == ".", "the docs run this app: `flwr run .`"
    for run_config in context.params["run_config_overrides"] or []:
        job_config(run_config)
    launcher_keys = set(parse_config_args([federation_config(1, 1, 0.0, ray_cpus=1)]))
    for federation in context.params["federation_config_overrides"] or []:
        unknown = set(parse_config_args([federation])) - launcher_keys
        assert not unknown, f"--federation-config keys the launcher never sets: {unknown}"


def check_flower_server(argv: list[str]) -> None:
    """flower-superlink / flower-supernode by Flower's argparse parsers; node-config keys."""
    if argv[0] == "flower-superlink":
        from flwr.superlink.cli.flower_superlink import _parse_args_run_superlink as parser_of
    else:
        from flwr.supernode.cli.flower_supernode import _parse_args_run_supernode as parser_of
    parser = parser_of()
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            namespace = parser.parse_args(argv[1:])
    except SystemExit:
        raise AssertionError(f"{argv[0]} refuses: {stderr.getvalue().strip()}") from None
    assert_spelled_out(argv[1:], option_strings(parser), argv[0])
    node_config = getattr(namespace, "node_config", None)
    if node_config:
        readable = set(parse_config_args([node_config_text(0, 1, Path("/d"), Path("/s"))]))
        unknown = set(parse_config_args([node_config])) - readable
        assert not unknown, f"--node-config keys no ClientApp reads: {unknown}"


def check_make(argv: list[str]) -> None:
    """`make TARGET [VAR=value]`: the Makefile's targets and variables; RUN_CONFIG validated."""
    makefile = (APP_DIR / "Makefile").read_text()
    for word in argv[1:]:
        if "=" in word:
            name, value = word.split("=", 1)
            assert re.search(rf"^{name}\s*[?:]?=", makefile, re.M), f"Makefile has no {name}"
            if name == "RUN_CONFIG":
                job_config(value)
        else:
            assert re.search(rf"^{re.escape(word)}:", makefile, re.M), f"no make target {word}"


def check_export(argv: list[str]) -> None:
    """`export ...`: the Flower variables the launcher sets, with its values; the venv on PATH."""
    for word in argv[1:]:
        name, value = word.split("=", 1)
        if name == "PATH":
            assert expand(value).startswith(f"{APP_DIR}/.venv/bin:"), word
        else:
            assert ENVIRONMENT.get(name) == expand(value), f"the launcher sets {name} otherwise"


def check_ray(argv: list[str]) -> None:
    """`ray start ...` by Ray's click command."""
    from ray.scripts.scripts import cli

    command = cli.commands[argv[1]]  # type: ignore[attr-defined]
    click_context(command, f"ray {argv[1]}", argv[2:])
    assert_spelled_out(argv[2:], click_options(command), f"ray {argv[1]}")


def check_tensorboard(argv: list[str]) -> None:
    """`tensorboard ...` by TensorBoard's own parser (its plugins' flags included)."""
    from tensorboard import program

    stderr = io.StringIO()
    try:
        with stop_after_parsing(), contextlib.redirect_stderr(stderr):
            program.TensorBoard().configure(argv)
    except Parsed as parsed:
        assert_spelled_out(argv[1:], option_strings(parsed.parser), "tensorboard")
        return
    except SystemExit:
        raise AssertionError(
            f"tensorboard refuses {argv[1:]}: {stderr.getvalue().strip()}"
        ) from None
    raise AssertionError("tensorboard never parsed its arguments")


def check_pip(argv: list[str]) -> None:
    """`pip install [-e] .[extras]` or this distribution by name: the extras pyproject declares;
    `pip download`: `check_pip_download`."""
    if argv[1] == "download":
        check_pip_download(argv)
        return
    project = tomllib.loads((APP_DIR / "pyproject.toml").read_text())["project"]
    targets = [word for word in argv[2:] if word != "-e"]
    assert argv[1] == "install" and targets, "pip install TARGET"
    for target in targets:
        match = re.fullmatch(r"\.(?:\[([\w,-]+)\])?", target)
        if match is None:
            assert target == project["name"], f"pip install {target}: not this project"
            continue
        extras = set((match[1] or "").split(",")) - {""}
        unknown = extras - set(project.get("optional-dependencies", {}))
        assert not unknown, f"pyproject declares no extra {unknown}"


def check_pip_download(argv: list[str]) -> None:
    """`pip download ...`: pip's own parser, every `--flag` spelled out, and each `-r` file in
    the checkout pinning one `name==version` a line (comments aside)."""
    from pip._internal.commands import create_command

    command = create_command("download")
    known = {
        name
        for option in command.parser._get_all_options()
        for name in option._long_opts + option._short_opts
    }
    assert_spelled_out(argv[2:], known, "pip download")
    try:
        options, _ = command.parse_args(argv[2:])
    except (optparse.OptParseError, SystemExit) as error:
        raise AssertionError(f"pip download refuses {argv[2:]}: {error}") from None
    assert options.requirements, "pip download: name the wheels with -r FILE"
    for requirements in options.requirements:
        lines = (APP_DIR / requirements).read_text().splitlines()
        pins = [line for line in lines if line.strip() and not line.startswith("#")]
        assert pins and all(re.fullmatch(r"[\w.-]+==[\w.]+", pin) for pin in pins), requirements


CHECKERS: dict[str, Callable[[list[str]], None]] = {
    "python": check_python_module,
    "fedfields": check_python_module,
    "flwr": check_flwr,
    "flower-superlink": check_flower_server,
    "flower-supernode": check_flower_server,
    "make": check_make,
    "export": check_export,
    "ray": check_ray,
    "pip": check_pip,
    "tensorboard": check_tensorboard,
}


def check_command(text: str) -> None:
    """AssertionError (or ValueError from run-config) unless `text`'s form is known and its
    program's parser accepts every word of it."""
    argv = argv_of(text)
    form = form_of(argv)
    assert form, f"unknown command form {argv[:3]}: add it to CHECKED_ONLY or EXTERNAL"
    if form in EXTERNAL:
        return
    CHECKERS[argv[0]](argv)


COMMANDS = all_commands()


def test_the_docs_hold_the_commands_this_test_knows() -> None:
    documented = {tuple(argv_of(command.text)) for command in COMMANDS}
    assert tuple(argv_of(DEPLOY)) in documented  # the README's deployment
    to_run = {tuple(argv_of(text)) for text in RUN_AS_PRINTED}
    assert to_run <= documented, "a command to run is no longer in the docs"
    assert len(COMMANDS) >= 40


@pytest.mark.parametrize("command", COMMANDS, ids=str)
def test_documented_command_is_accepted_by_its_parser(command: DocCommand) -> None:
    check_command(command.text)


@pytest.mark.parametrize(
    "command",
    [synopsis for path in DOCS for synopsis in synopses(path.read_text(), path.name)],
    ids=str,
)
def test_usage_synopsis_names_only_real_options(command: DocCommand) -> None:
    parser, names = build_parser(), []
    for word in command.text.split()[1:]:
        subcommands = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not subcommands or word not in subcommands[0].choices:
            break
        parser = subcommands[0].choices[word]
        names.append(word)
    flags = re.findall(r"--[a-z][\w-]*", command.text)
    assert names and flags, command
    assert_spelled_out(flags, option_strings(parser), f"fedfields {' '.join(names)}")


@pytest.mark.parametrize("text", RUN_AS_PRINTED)
def test_cheap_documented_command_runs_as_printed(text: str, tmp_path: Path) -> None:
    """In a scratch folder holding links to data/ and .venv/ (the command's relative paths)."""
    for name in ("data", ".venv"):
        (tmp_path / name).symlink_to(APP_DIR / name)
    result = subprocess.run(
        ["bash", "-c", text], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-2000:]
    out = argv_of(text)[argv_of(text).index("--out") + 1]
    assert any((tmp_path / out).iterdir()), f"{text} wrote nothing to {out}"


# The checker itself: a documented command with one word changed must be refused.


@pytest.mark.parametrize(
    ("broken", "reason"),
    [
        ("python -m simulations.deploy --user 4", "no option '--user'"),
        (
            DEPLOY + ' --run-config "num-server-rounds=2 local-step=8"',
            "unknown run-config key 'local-step'",
        ),
        ("make demo RUN_CONFIG=\"task='faces' meta-lerner='fedmenf'\"", "meta-lerner"),
        ("flwr ls --run-idd 3 --format json", "--run-idd"),
        ("flower-supernode --superlink a:9092 --root-certificate ca.crt", "--root-certificate"),
        ("flower-supernode --superlink a:9092 --node-config \"data-directory='/d'\"", "data-dir"),
        (".venv/bin/fedfields data crowd --scene data/lego --down-scale 2 --out x", "down-scale"),
        ("python -m simulations.bench.faults --round 6", "no option '--round'"),
        ("make deploy", "unknown command form"),
        ('make demo RUN_CONFI="local-steps=2"', "Makefile has no RUN_CONFI"),
        ("export FLWR_HOME=$HOME/.flwr", "FLWR_HOME"),
        ("frobnicate --fast", "unknown command form"),
        ("python -m simulations.nowhere --x", "unknown command form"),
        ("python -m simulations.sweep --grid \"strategy=['fedavgg']\"", "'fedavgg' is unknown"),
        ('python -m simulations.sweep --grid "local-step=[1]"', "did you mean 'local-steps'"),
        ("python -m simulations.sweep --seeds 0 -- --user 4", "no option '--user'"),
    ],
)
def test_the_checker_refuses_a_renamed_flag_key_or_program(broken: str, reason: str) -> None:
    with pytest.raises((AssertionError, ValueError), match=re.escape(reason)):
        check_command(broken)


FLAGGED = [
    command
    for command in COMMANDS
    if re.search(r"\s--[a-z]", command.text) and form_of(argv_of(command.text)) not in EXTERNAL
]


@pytest.mark.parametrize("command", FLAGGED, ids=str)
def test_every_documented_command_with_a_flag_misspelt_is_refused(command: DocCommand) -> None:
    """Its first `--flag` loses its last letter (an abbreviation argparse alone would take)."""
    flag = re.search(r"(?<=\s)--[a-z][\w-]*", command.text)
    assert flag is not None
    broken = command.text[: flag.end() - 1] + command.text[flag.end() :]
    with pytest.raises(AssertionError, match=re.escape(flag[0][:-1])):
        check_command(broken)


def test_renaming_a_documented_flag_in_the_code_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    """The deploy parser with --users renamed (as a code change would) refuses the README."""
    check_command(DEPLOY)
    original = argparse.ArgumentParser.add_argument

    def renamed(self: argparse.ArgumentParser, *names: Any, **kwargs: Any) -> Any:
        return original(self, *("--num-users" if n == "--users" else n for n in names), **kwargs)

    monkeypatch.setattr(argparse.ArgumentParser, "add_argument", renamed)
    with pytest.raises(AssertionError, match="--users"):
        check_command(DEPLOY)


def test_collection_joins_continued_lines_and_reads_prompts_only_in_console_blocks() -> None:
    markdown = (
        '```bash\nmake demo \\\n    RUN_CONFIG="local-steps=2"   # comment\n# only a comment\n```\n'
        "```console\n$ make test\noutput line\n```\n"
        "```\nlayout/   not a command\n```\n"
        "```python\nimport os\n```\n"
    )
    found = fenced_commands(markdown, "doc.md")
    assert [(c.line, c.text) for c in found] == [
        (2, 'make demo RUN_CONFIG="local-steps=2" # comment'),
        (7, "make test"),
    ]
    assert argv_of(found[0].text) == ["make", "demo", "RUN_CONFIG=local-steps=2"]
    prose = (
        'Try `make demo RUN_CONFIG="seed=1"`, not `make demo` alone,\n'
        "`python -m simulations.launch --clients N` (a synopsis) or `fedfields eval\n"
        "--checkpoint c.pt --scene s` (one span over two lines).\n"
    )
    assert [(c.line, c.text) for c in inline_commands(prose, "doc.md")] == [
        (1, 'make demo RUN_CONFIG="seed=1"'),
        (2, "fedfields eval --checkpoint c.pt --scene s"),
    ]
    assert argv_of("OMP_NUM_THREADS=1 nice -n 5 .venv/bin/python -m x --y") == [
        "python", "-m", "x", "--y",
    ]  # fmt: skip


def repository_texts() -> Iterator[Path]:
    """The checkout's sources and documents (no hidden folder, no runs/)."""
    for path in sorted(APP_DIR.rglob("*")):
        parts = path.relative_to(APP_DIR).parts
        if path.suffix in (".py", ".md", ".toml") and not any(
            part.startswith(".") or part == "runs" for part in parts
        ):
            yield path


def test_sources_and_docs_cite_only_documents_in_the_repository() -> None:
    """A citation of notes outside the checkout (the shared folder beside it, a notes file, a
    markdown file the repository lacks) leaves the reader with nothing to open."""
    documents = {path.name for path in repository_texts() if path.suffix == ".md"}
    outside = re.compile("|".join([r"\.\./" + "shared", r"\b\w*_" + "NOTES\\b"]))
    for path in repository_texts():
        text = path.read_text(errors="replace")
        where = path.relative_to(APP_DIR)
        assert not outside.search(text), f"{where} cites notes outside the repository"
        for cited in re.findall(r"\b[A-Z][A-Z0-9_]+\.md\b", text):
            assert cited in documents, f"{where} cites {cited}, which the repository lacks"
