"""mkdocs hook: the reference pages generated from the code, and real command output in the guides.

- `on_files` adds the reference pages (`reference/*.md`), built from the plan schema and checks, the typer app,
  the server's FastAPI apps and the environment-variable registry, so they cannot drift from the code. A plan
  field without a description in `engine/plan/schema.py` fails the build.
- `on_page_markdown` replaces each `<!-- dcpctl ARGS -->` line of a page with a text block holding the command
  and its real output, run in-process at build time against a model cache of config.json-only folders of the shipped
  models (what the plan checks read), so that every machine draws the same pictures whether or not it has pulled
  the weights; the output names the cache by its default location (fast commands only: plan validate/show/suggest).
  Append `| exit N` when the command is meant to fail with exit code N, and `| from TEXT` to show the output from the
  first line that contains TEXT.

The repository root goes first on sys.path, so that a worktree's own code is documented, not an installed copy.
"""

from __future__ import annotations

import dataclasses
import inspect
import io
import json
import re
import shlex
import sys
import tokenize
from pathlib import Path
from typing import Any

from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parents[2]
MARKER = re.compile(
    r"^<!-- dcpctl (?P<args>.+?)(?: \| exit (?P<code>\d+))?(?: \| from (?P<start>.+?))? -->$", re.MULTILINE
)
OUTPUT_COLUMNS = 130


def on_config(config: Any) -> Any:
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    return config


def on_files(files: Files, config: Any) -> Files:
    for name, text in reference_pages().items():
        files.append(File.generated(config, f"reference/{name}", content=text))
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Files) -> str:
    return MARKER.sub(lambda m: command_block(m["args"], m["start"], int(m["code"] or 0)), markdown)


def reference_pages() -> dict[str, str]:
    """Every generated page by file name."""
    return {
        "plan.md": plan_reference(),
        "cli.md": cli_reference(),
        "server.md": server_reference(),
        "environment.md": environment_reference(),
    }


# --- real command output ---------------------------------------------------------------------------------------


_STANDIN_CACHE: list[Path] = []


def standin_model_cache() -> Path:
    """A model cache (made once per build) holding each shipped model that has an alias as a config.json-only
    folder, at the place `dcpctl model pull` would put it."""
    import atexit
    import json
    import os
    import shutil
    import tempfile

    from engine.checkpoints.aliases import is_alias, resolve_model_path
    from engine.suggest.models import SHIPPED

    if not _STANDIN_CACHE:
        root = Path(tempfile.mkdtemp(prefix="dcpctl-docs-"))
        atexit.register(shutil.rmtree, root, True)
        cache = root / "models"
        saved = os.environ.get("DCPCTL_CACHE")
        os.environ["DCPCTL_CACHE"] = str(cache)
        try:
            for model in SHIPPED.values():
                if is_alias(model.name):
                    folder = resolve_model_path(model.name)
                    folder.mkdir(parents=True, exist_ok=True)
                    (folder / "config.json").write_text(json.dumps(model.config))
        finally:
            if saved is None:
                os.environ.pop("DCPCTL_CACHE")
            else:
                os.environ["DCPCTL_CACHE"] = saved
        _STANDIN_CACHE.append(cache)
    return _STANDIN_CACHE[0]


def run_dcpctl(args: list[str]) -> tuple[int, str]:
    """`dcpctl ARGS` run in this process (rich output at a fixed width, no colour) against the stand-in model
    cache: exit code and output, the cache named by its default location."""
    import os

    from typer.testing import CliRunner

    from dcpctl.cli import app

    cache = standin_model_cache()
    env = {"COLUMNS": str(OUTPUT_COLUMNS), "NO_COLOR": "1", "TERM": "dumb", "DCPCTL_CACHE": str(cache)}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    cwd = Path.cwd()
    try:
        os.chdir(ROOT)
        result = CliRunner().invoke(app, args)
    finally:
        os.chdir(cwd)
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    return result.exit_code, result.output.replace(str(cache), "~/.cache/dcpctl/models")


def command_block(args: str, start: str | None = None, expected_code: int = 0) -> str:
    """A text block with `$ dcpctl ARGS` and its output (from the first line containing `start`); the command
    must exit with `expected_code`."""
    code, output = run_dcpctl(shlex.split(args))
    if code != expected_code:
        raise PluginError(f"docs: `dcpctl {args}` exited {code}, not {expected_code}:\n{output}")
    lines = [line.rstrip() for line in output.rstrip().splitlines()]
    if start is not None:
        found = [i for i, line in enumerate(lines) if start in line]
        if not found:
            raise PluginError(f"docs: `dcpctl {args}` printed no line containing {start!r}")
        lines = ["...", *lines[found[0] :]]
    return "```text\n$ dcpctl " + args + "\n" + "\n".join(lines) + "\n```"


# --- plan fields -----------------------------------------------------------------------------------------------


def field_comments(cls: type) -> dict[str, str]:
    """Each field of a schema dataclass with its comment: on the field's line, else the comment lines above it
    (a subclass's fields over its bases')."""
    found: dict[str, str] = {}
    for klass in reversed([k for k in cls.__mro__ if dataclasses.is_dataclass(k)]):
        found.update(_own_field_comments(klass))
    return found


def _own_field_comments(cls: type) -> dict[str, str]:
    source = inspect.getsource(cls)
    comments: dict[int, str] = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.string.lstrip("#").strip()
    lines = source.splitlines()
    names = {f.name for f in dataclasses.fields(cls)}
    found = {}
    for number, line in enumerate(lines, start=1):
        match = re.match(r"\s+(\w+):\s", line)
        if not match or match[1] not in names:
            continue
        if number in comments:
            found[match[1]] = comments[number]
            continue
        above, row = [], number - 1
        while row in comments and lines[row - 1].lstrip().startswith("#"):
            above.insert(0, comments[row])
            row -= 1
        if above:
            found[match[1]] = " ".join(above)
    return found


def _default(f: dataclasses.Field) -> str:
    from omegaconf import MISSING

    if f.default is MISSING:
        return "required"
    if f.default is dataclasses.MISSING:
        return "(section)"
    if f.default is None:
        return "unset"
    if isinstance(f.default, bool):
        return str(f.default).lower()
    return str(f.default) or '""'


def plan_fields() -> list[dict[str, str]]:
    """Every plan field (dotted key) with its default, description, choices and vLLM names, in schema order."""
    from engine.plan import schema
    from engine.plan.field_checks import FIELD_CHOICES

    disagg_choices = {"disagg.connector": schema.CONNECTORS, "disagg.failure_policy": schema.FAILURE_POLICIES}
    aliases: dict[str, list[str]] = {}
    for alias, key in schema.KEY_ALIASES.items():
        aliases.setdefault(key, []).append(alias)
    rows = []

    def walk(cls: type, prefix: str) -> None:
        described = field_comments(cls)
        for f in dataclasses.fields(cls):
            key = prefix + f.name
            if dataclasses.is_dataclass(f.default_factory if f.default_factory is not dataclasses.MISSING else None):
                walk(f.default_factory, key + ".")
                continue
            if f.name not in described:
                raise PluginError(
                    f"docs: plan field {key} has no description: add a comment on its line in engine/plan/schema.py"
                )
            vllm = [f"`{flag}`" for flag in [schema.VLLM_FLAGS.get(key)] if flag]
            vllm += [f"`{alias}`" for alias in aliases.get(key, [])]
            choices = FIELD_CHOICES.get(key) or disagg_choices.get(key)
            rows.append(
                {
                    "key": key,
                    "default": _default(f),
                    "description": described[f.name],
                    "choices": ", ".join(f"`{c}`" for c in choices) if choices else "",
                    "vllm": ", ".join(vllm),
                }
            )

    walk(schema.Plan, "")
    return rows


def plan_reference() -> str:
    rows = plan_fields()
    out = [
        "# Plan fields",
        "",
        "Generated from `engine/plan/schema.py` (fields, defaults, descriptions, vLLM names) and "
        "`engine/plan/field_checks.py` (choices) when the docs are built. How plans are written and combined: "
        "[Plans](../guides/plans.md). `dcpctl plan validate` checks every rule below and names the field, "
        "the rule and a fix.",
        "",
    ]
    section = None
    for row in rows:
        head = row["key"].split(".")[0] if "." in row["key"] else "plan"
        if head != section:
            section = head
            title = "top level" if head == "plan" else f"`{head}`"
            out += ["", f"## {title}", "", "| field | default | what and rule | vLLM |", "|---|---|---|---|"]
        text = row["description"].replace("|", "\\|").rstrip(".") + "."
        if row["choices"]:
            text += f" Choices: {row['choices']}."
        out.append(f"| `{row['key']}` | `{row['default']}` | {text} | {row['vllm']} |")
    return "\n".join(out) + "\n"


# --- the command line ------------------------------------------------------------------------------------------


def _commands(command: Any, path: list[str]) -> list[tuple[list[str], Any]]:
    subs = getattr(command, "commands", None)
    if not subs:
        return [(path, command)]
    found = [(path, command)]
    for name in sorted(subs):
        found += _commands(subs[name], [*path, name])
    return found


def _type_name(param: Any) -> str:
    descriptor = getattr(param, "type_descriptor", None)
    annotation = getattr(descriptor, "annotation", None)
    if annotation is None:
        return ""
    name = getattr(annotation, "__name__", None) or str(annotation)
    return name.replace("typing.", "").replace("pathlib.", "")


def _option_default(param: Any) -> str:
    if getattr(param, "required", False):
        return "required"
    default = param.default
    if default is None or default == () or (getattr(param, "is_flag", False) and default is False):
        return ""
    if isinstance(default, list | tuple):
        return ", ".join(map(str, default))
    return str(default)


def cli_reference() -> str:
    import typer.main

    from dcpctl.cli import app

    root = typer.main.get_command(app)
    out = [
        "# Command line",
        "",
        "Generated from the typer app (`dcpctl/cli.py`) when the docs are built: every command and option "
        "with its default. `dcpctl COMMAND --help` prints the same.",
        "",
    ]
    for path, command in _commands(root, ["dcpctl"]):
        if getattr(command, "commands", None):
            if len(path) > 1:
                out += [f"`{' '.join(path)} ...`: {(command.help or '').strip()}", ""]
            continue
        usage = [" ".join(path)]
        for param in command.params:
            if type(param).__name__.endswith("Argument"):
                usage.append(param.name.upper() + ("..." if param.nargs == -1 else ""))
        out += [f"## `{' '.join(path)}`", "", f"`{' '.join(usage)} [OPTIONS]`", "", (command.help or "").strip(), ""]
        rows = []
        for param in command.params:
            if getattr(param, "hidden", False):
                continue
            is_argument = type(param).__name__.endswith("Argument")
            names = param.name.upper() if is_argument else " / ".join([*param.opts, *param.secondary_opts])
            help_text = (getattr(param, "help", None) or "").replace("|", "\\|").replace("\n", " ")
            rows.append(f"| `{names}` | {_type_name(param)} | {_option_default(param)} | {help_text} |")
        if rows:
            out += ["| argument / option | type | default | what |", "|---|---|---|---|", *rows, ""]
    return "\n".join(out) + "\n"


# --- the server ------------------------------------------------------------------------------------------------


def _schema_type(spec: dict, schemas: dict) -> str:
    if "$ref" in spec:
        return spec["$ref"].rsplit("/", 1)[-1]
    if "anyOf" in spec:
        return " or ".join(_schema_type(s, schemas) for s in spec["anyOf"] if s.get("type") != "null")
    if spec.get("type") == "array":
        return f"list of {_schema_type(spec.get('items', {}), schemas)}"
    return spec.get("type", "any")


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else str(value)


def _constraints(spec: dict) -> str:
    words = {"minimum": ">=", "exclusiveMinimum": ">", "maximum": "<=", "exclusiveMaximum": "<"}
    found = [f"{sign} {_number(spec[key])}" for key, sign in words.items() if key in spec]
    for inner in spec.get("anyOf", []):
        found += [f"{sign} {_number(inner[key])}" for key, sign in words.items() if key in inner]
    if "enum" in spec:
        found.append("one of " + ", ".join(f"`{v}`" for v in spec["enum"] if v is not None))
    return ", ".join(found)


def _endpoints(document: dict) -> list[str]:
    schemas = document.get("components", {}).get("schemas", {})
    out = []
    for path, operations in document["paths"].items():
        for method, op in operations.items():
            summary = (op.get("description") or "").strip().split("\n")[0]
            if not summary:
                raise PluginError(f"docs: {method.upper()} {path} has no docstring: add one to its handler")
            out += [f"### `{method.upper()} {path}`", "", summary, ""]
            body = op.get("requestBody", {}).get("content", {}).get("application/json", {}).get("schema")
            if body and "$ref" in body:
                model = schemas[body["$ref"].rsplit("/", 1)[-1]]
                required = set(model.get("required", []))
                out += ["| field | type | default | rule | what |", "|---|---|---|---|---|"]
                for name, spec in model.get("properties", {}).items():
                    default = f"`{json.dumps(spec['default'])}`" if "default" in spec else ""
                    default = "required" if name in required else default
                    what = (spec.get("description") or "").replace("|", "\\|")
                    out.append(
                        f"| `{name}` | {_schema_type(spec, schemas)} | {default} | {_constraints(spec)} | {what} |"
                    )
                out.append("")
            statuses = [f"{code}: {r.get('description', '')}" for code, r in op.get("responses", {}).items()]
            out += ["Responses: " + "; ".join(statuses) + ".", ""]
    return out


def server_reference() -> str:
    from engine.serving.openai_app import OpenAIServer
    from engine.serving.router import Router

    # The apps' routes and schemas only: an OpenAIServer without an engine (its handlers are never called here).
    server = OpenAIServer.__new__(OpenAIServer)
    server.model = server.engine_loop = None
    engine_doc = server._build_app().openapi()
    router_doc = Router("http://prefill.invalid", "http://decode.invalid").app.openapi()
    out = [
        "# Server endpoints",
        "",
        "Generated from the server's FastAPI apps (`engine/serving/openai_app.py`, `engine/serving/router.py`) "
        "and their request models (`engine/serving/protocol.py`) when the docs are built. Every error is "
        'OpenAI\'s shape, `{"error": {"message", "type", "param", "code"}}`, naming the field; '
        "[Running and serving](../guides/running.md#errors) says which request gets which status.",
        "",
        "## The engine's server (`dcpctl run PLAN`)",
        "",
        *_endpoints(engine_doc),
        "## The P/D router (`dcpctl run PD_PLAN`, `--role router`)",
        "",
        "The router forwards each request to the prefill, then the decode instance "
        "([P/D guide](../guides/pd.md)); its request bodies are the engine server's.",
        "",
        *_endpoints(router_doc),
    ]
    return "\n".join(out) + "\n"


# --- environment variables -------------------------------------------------------------------------------------


def environment_reference() -> str:
    from engine.env_vars import ENV_VARS

    out = [
        "# Environment variables",
        "",
        "Generated from the registry `engine/env_vars.py` when the docs are built (a test checks that every "
        "`DCPCTL_*` variable the code reads is registered there). A bad value is a one-line error naming the "
        "variable, never ignored.",
        "",
        "| variable | default | what | read by |",
        "|---|---|---|---|",
    ]
    for var in ENV_VARS:
        out.append(f"| `{var.name}` | {var.default} | {var.meaning} | `{var.read_by}` |")
    return "\n".join(out) + "\n"
