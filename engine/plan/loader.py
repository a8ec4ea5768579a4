"""Load a YAML plan: `base:` inheritance, KEY=VALUE overrides, and schema checks with locations.

Every schema problem of a plan is collected (unknown keys with a suggestion, wrong types,
missing required fields), each naming the file and line it came from.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from engine.plan.schema import KEY_ALIASES, Plan

COMMAND_LINE = "command line"


@dataclass(frozen=True)
class PlanProblem:
    """One thing wrong with a plan: where it is, which field, and what to do."""

    field: str
    message: str
    file: str = ""
    line: int | None = None

    def location(self) -> str:
        if not self.file:
            return ""
        return f"{self.file}:{self.line}" if self.line else self.file

    def __str__(self) -> str:
        where = self.location()
        return f"{where}: {self.message}" if where else self.message


class PlanLoadError(Exception):
    """The plan could not be loaded into the schema; `problems` lists every reason."""

    def __init__(self, source: str, problems: list[PlanProblem]):
        self.source = source
        self.problems = problems
        super().__init__("; ".join(str(p) for p in problems))


@dataclass
class LoadedPlan:
    """A plan that passed the schema, with where each field was set."""

    plan: Plan
    source: Path
    files: list[Path] = field(default_factory=list)  # the plan and its bases, child first
    origins: dict[str, tuple[str, int | None]] = field(default_factory=dict)  # field -> (file, line)

    def where(self, key: str) -> tuple[str, int | None]:
        """(file, line) that set `key`, or the plan file when it kept its default."""
        return self.origins.get(key, (str(self.source), None))


def _key_lines(node: yaml.Node, prefix: str = "") -> dict[str, int]:
    lines: dict[str, int] = {}
    if isinstance(node, yaml.MappingNode):
        for key_node, value_node in node.value:
            key = f"{prefix}{key_node.value}"
            lines[key] = key_node.start_mark.line + 1
            lines.update(_key_lines(value_node, key + "."))
    return lines


def _flatten(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in data.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            flat.update(_flatten(value, dotted + "."))
        else:
            flat[dotted] = value
    return flat


def _read_yaml(path: Path) -> tuple[dict[str, Any], dict[str, int]]:
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise PlanLoadError(str(path), [PlanProblem("", f"plan file {path} does not exist", str(path))]) from None
    except OSError as exc:
        raise PlanLoadError(str(path), [PlanProblem("", f"cannot read {path}: {exc.strerror}", str(path))]) from None
    try:
        data = yaml.safe_load(text)
        node = yaml.compose(text)
    except yaml.MarkedYAMLError as exc:
        line = exc.problem_mark.line + 1 if exc.problem_mark else None
        raise PlanLoadError(str(path), [PlanProblem("", f"invalid YAML: {exc.problem}", str(path), line)]) from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise PlanLoadError(str(path), [PlanProblem("", "a plan must be a YAML mapping of sections", str(path), 1)])
    return data, _key_lines(node) if node is not None else {}


def _collect_files(path: Path, seen: tuple[Path, ...] = ()) -> list[tuple[Path, dict[str, Any], dict[str, int]]]:
    """The plan and its `base:` chain, base first."""
    path = path.resolve()
    if path in seen:
        chain = " -> ".join(str(p) for p in (*seen, path))
        raise PlanLoadError(str(path), [PlanProblem("base", f"`base:` inheritance loops: {chain}", str(path))])
    data, lines = _read_yaml(path)
    base = data.get("base")
    if base is None:
        return [(path, data, lines)]
    if not isinstance(base, str):
        raise PlanLoadError(
            str(path), [PlanProblem("base", "base must be a path to another plan file", str(path), lines.get("base"))]
        )
    base_path = (path.parent / base).expanduser()
    if not base_path.is_file():
        raise PlanLoadError(
            str(path),
            [
                PlanProblem(
                    "base",
                    f"base plan {base} not found (looked for {base_path}); paths are relative to the plan file",
                    str(path),
                    lines.get("base"),
                )
            ],
        )
    return [*_collect_files(base_path, (*seen, path)), (path, data, lines)]


def _parse_overrides(overrides: list[str]) -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise PlanLoadError(
                COMMAND_LINE,
                [PlanProblem("", f"override {item!r} is not KEY=VALUE (e.g. parallel.interleave=16)", COMMAND_LINE)],
            )
        flat[key.strip()] = yaml.safe_load(value) if value else ""
    return flat


def _unknown_key(cfg: Any, key: str) -> str | None:
    """'unknown key ...' with a suggestion when `key` is not in the schema, else None."""
    node, known = cfg, []
    parts = key.split(".")
    for depth, part in enumerate(parts):
        # list(keys) on purpose: `part in node` is False for a MISSING field such as model.path
        choices = [str(k) for k in node.keys()] if OmegaConf.is_dict(node) else []  # noqa: SIM118
        if part not in choices:
            prefix = ".".join(known)
            close = difflib.get_close_matches(part, choices, n=1, cutoff=0.6)
            if close:
                hint = f" (did you mean '{prefix + '.' if prefix else ''}{close[0]}'?)"
            else:
                hint = f"; known keys{' in ' + prefix if prefix else ''}: {', '.join(choices)}" if choices else ""
            return f"unknown key '{key}'{hint}" if depth or choices else f"unknown key '{key}'"
        known.append(part)
        if depth < len(parts) - 1:
            node = node[part]
    return None


def _assign(cfg: Any, key: str, value: Any, file: str, line: int | None) -> PlanProblem | None:
    unknown = _unknown_key(cfg, key)
    if unknown:
        return PlanProblem(key, unknown, file, line)
    if OmegaConf.is_dict(OmegaConf.select(cfg, key)) and not isinstance(value, dict):
        return PlanProblem(key, f"{key} must be a mapping of fields, not {value!r}", file, line)
    try:
        OmegaConf.update(cfg, key, value, merge=True, force_add=False)
    except OmegaConfBaseException as exc:
        return PlanProblem(key, f"{key}: {str(exc).splitlines()[0]}", file, line)
    return None


def load_plan(path: str | Path, overrides: list[str] | None = None) -> LoadedPlan:
    """Load a plan file with its bases and overrides; PlanLoadError lists every schema problem."""
    source = Path(path)
    layers = _collect_files(source)
    flat: dict[str, Any] = {}
    origins: dict[str, tuple[str, int | None]] = {}
    for file, data, lines in layers:
        for key, value in _flatten(data).items():
            if key == "base":
                continue
            key = KEY_ALIASES.get(key, key)
            flat[key] = value
            origins[key] = (str(file), lines.get(key))
    for key, value in _parse_overrides(overrides or []).items():
        key = KEY_ALIASES.get(key, key)
        flat[key] = value
        origins[key] = (COMMAND_LINE, None)

    cfg = OmegaConf.structured(Plan)
    problems = [p for key, value in flat.items() if (p := _assign(cfg, key, value, *origins[key]))]
    if OmegaConf.is_missing(cfg.model, "path"):
        problems.append(
            PlanProblem(
                "model.path",
                "model.path is required: an HF checkpoint folder or a known alias such as smollm2-135m-instruct",
                str(source.resolve()),
            )
        )
    if problems:
        raise PlanLoadError(str(source), problems)
    plan: Plan = OmegaConf.to_object(cfg)
    if not plan.name:
        plan.name = source.stem
    return LoadedPlan(plan=plan, source=source.resolve(), files=[f for f, _, _ in reversed(layers)], origins=origins)


def plan_to_dict(plan: Plan) -> dict[str, Any]:
    """The plan as plain data (for JSON output and for shipping to the ranks)."""
    return OmegaConf.to_container(OmegaConf.structured(plan), resolve=True)


def plan_from_dict(data: dict[str, Any]) -> Plan:
    """Inverse of `plan_to_dict`."""
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(Plan), data))
