"""Load a YAML plan: `base:` inheritance, KEY=VALUE overrides, and schema checks with locations.

Every schema problem of a plan is collected (unknown keys with a suggestion, wrong types,
missing required fields), each naming the file and line it came from.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from engine.plan.schema import KEY_ALIASES, Plan

COMMAND_LINE = "command line"
MAX_PLAN_BYTES = 1 << 20  # a plan is a few hundred bytes of YAML; this bounds what a wrong path makes us read
MAX_PLAN_FIELDS = 10_000  # bounds YAML anchors that expand into an exponential number of fields


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


PREFILL_PREFIX = "prefill."  # a P/D plan's overrides of its prefill plan: prefill.KEY=VALUE


@dataclass
class LoadedPlan:
    """A plan that passed the schema, with where each field was set."""

    plan: Plan
    source: Path
    files: list[Path] = field(default_factory=list)  # the plan and its bases, child first
    origins: dict[str, tuple[str, int | None]] = field(default_factory=dict)  # field -> (file, line)
    prefill_overrides: list[str] = field(default_factory=list)  # P/D: KEY=VALUE for the prefill plan

    def where(self, key: str) -> tuple[str, int | None]:
        """(file, line) that set `key`, or the plan file when it kept its default."""
        return self.origins.get(key, (str(self.source), None))


class DuplicateKeyError(ValueError):
    """A key given twice in one YAML mapping (YAML would silently keep the last value)."""

    def __init__(self, key: str, first: int, again: int):
        super().__init__(f"key {key!r} appears twice (lines {first} and {again}); keep one of them")
        self.line = again


def _key_lines(node: yaml.Node, prefix: str = "", seen: set[int] | None = None) -> dict[str, int]:
    """Dotted key -> line; a mapping reached again through an alias is walked once. DuplicateKeyError for a key
    given twice in one mapping."""
    seen = set() if seen is None else seen
    lines: dict[str, int] = {}
    if isinstance(node, yaml.MappingNode) and id(node) not in seen:
        seen.add(id(node))
        here: dict[str, int] = {}
        for key_node, value_node in node.value:
            key = f"{prefix}{key_node.value}"
            line = key_node.start_mark.line + 1
            if key in here and key_node.value != "<<":
                raise DuplicateKeyError(key, here[key], line)
            here[key] = lines[key] = line
            lines.update(_key_lines(value_node, key + ".", seen))
    return lines


def _flatten(data: dict[str, Any], prefix: str = "", budget: list[int] | None = None) -> dict[str, Any]:
    """Dotted keys of nested mappings; raises ValueError past MAX_PLAN_FIELDS fields."""
    budget = [MAX_PLAN_FIELDS] if budget is None else budget
    flat: dict[str, Any] = {}
    for key, value in data.items():
        budget[0] -= 1
        if budget[0] < 0:
            raise ValueError(f"the plan has more than {MAX_PLAN_FIELDS} fields (YAML anchors expanding?)")
        dotted = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            flat.update(_flatten(value, dotted + ".", budget))
        else:
            flat[dotted] = value
    return flat


def _problem(path: Path, message: str, line: int | None = None) -> PlanLoadError:
    return PlanLoadError(str(path), [PlanProblem("", message, str(path), line)])


def _read_text(path: Path) -> str:
    try:
        with path.open("rb") as f:
            raw = f.read(MAX_PLAN_BYTES + 1)
    except FileNotFoundError:
        hint = ""
        section, dot, _ = path.name.partition(".")
        if dot and section in {f.name for f in fields(Plan)} and path.suffix not in (".yaml", ".yml"):
            hint = f"; it looks like an override missing '=': write {path.name}=VALUE"
        raise _problem(path, f"plan file {path} does not exist{hint}") from None
    except OSError as exc:
        raise _problem(path, f"cannot read {path}: {exc.strerror}") from None
    if len(raw) > MAX_PLAN_BYTES:
        raise _problem(path, f"plan file {path} is larger than {MAX_PLAN_BYTES} bytes; a plan is a short YAML file")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        raise _problem(
            path, f"plan file {path} is not UTF-8 text (byte {raw[exc.start]:#04x}); a plan is a YAML file", line
        ) from None


def _read_yaml(path: Path) -> tuple[dict[str, Any], dict[str, int]]:
    """The plan file's fields as dotted keys, and the line of each key."""
    text = _read_text(path)
    try:
        data = yaml.safe_load(text)
        node = yaml.compose(text)
    except yaml.MarkedYAMLError as exc:
        line = exc.problem_mark.line + 1 if exc.problem_mark else None
        raise _problem(path, f"invalid YAML: {exc.problem}", line) from None
    except yaml.YAMLError as exc:  # e.g. a control character the reader refuses
        raise _problem(path, f"invalid YAML: {str(exc).splitlines()[0]}") from None
    except RecursionError:
        raise _problem(path, "invalid YAML: nested too deeply; a plan is a mapping of sections") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise _problem(path, "a plan must be a YAML mapping of sections", 1)
    try:
        flat = _flatten(data)
        lines = _key_lines(node) if node is not None else {}
    except DuplicateKeyError as exc:
        raise _problem(path, str(exc), exc.line) from None
    except ValueError as exc:
        raise _problem(path, str(exc)) from None
    return flat, lines


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
    try:
        found = base_path.is_file()
    except (OSError, ValueError):  # a name too long, a NUL byte
        found = False
    if not found:
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
        try:
            flat[key.strip()] = yaml.safe_load(value) if value else ""
        except yaml.YAMLError as exc:
            problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
            raise PlanLoadError(
                COMMAND_LINE,
                [PlanProblem(key, f"override {item!r}: the value is not valid YAML ({problem})", COMMAND_LINE)],
            ) from None
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
    """Load a plan file with its bases and overrides; PlanLoadError lists every schema problem.

    Overrides `prefill.KEY=VALUE` are kept for a P/D plan's prefill plan (`LoadedPlan.prefill_overrides`).
    """
    source = Path(path)
    overrides = list(overrides or [])
    prefill_overrides = [o[len(PREFILL_PREFIX) :] for o in overrides if o.startswith(PREFILL_PREFIX)]
    overrides = [o for o in overrides if not o.startswith(PREFILL_PREFIX)]
    layers = _collect_files(source)
    flat: dict[str, Any] = {}
    origins: dict[str, tuple[str, int | None]] = {}
    for file, data, lines in layers:
        for key, value in data.items():
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
    files = [f for f, _, _ in reversed(layers)]
    return LoadedPlan(plan, source.resolve(), files, origins, prefill_overrides)


def plan_to_dict(plan: Plan) -> dict[str, Any]:
    """The plan as plain data (for JSON output and for shipping to the ranks)."""
    return OmegaConf.to_container(OmegaConf.structured(plan), resolve=True)


def plan_from_dict(data: dict[str, Any]) -> Plan:
    """Inverse of `plan_to_dict`."""
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(Plan), data))
