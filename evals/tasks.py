"""lm-eval task specs for gsm8k: lm-eval's own (hub data) or a local YAML over a data directory, and where the
data comes from (--data-dir, $DCPCTL_GSM8K_DIR, the hub).

lm-eval is not imported here (it costs ~2 s); the installed task YAMLs are located on disk instead.
"""

from __future__ import annotations

import importlib.util
import json
import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from engine.errors import UserError
from engine.io_utils import atomic_write_text

# Our task name -> the installed lm-eval YAML it includes.
_BASE_YAMLS = {"gsm8k": "gsm8k.yaml", "gsm8k_cot": "gsm8k-cot.yaml"}
SUPPORTED_TASKS: tuple[str, ...] = tuple(_BASE_YAMLS)
SPLIT_FILES = ("test.jsonl", "train.jsonl")
# Written by evals.synthetic next to its jsonl files; its presence marks the data as not GSM8K.
SYNTHETIC_MARKER = "dataset_info.json"
DATA_DIR_ENV = "DCPCTL_GSM8K_DIR"
_OFFLINE_VARS = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")


@dataclass(frozen=True)
class TaskSpec:
    """What lm-eval needs to find one task offline, plus how to label it in reports."""

    name: str  # the lm-eval task name to pass to simple_evaluate
    base: str  # gsm8k | gsm8k_cot
    include_path: Path  # folder for TaskManager(include_path=..., include_defaults=False)
    data_dir: Path | None = None  # None: lm-eval's own task, data from the HF hub
    yaml_path: Path | None = None
    synthetic: bool = False
    fixed_fewshot: bool = False  # every question gets the same few-shot examples (the first of the train split)

    @property
    def display_name(self) -> str:
        """The dataset name shown in tables: says where the data came from (and when the shots are fixed)."""
        shots = ", fixed shots" if self.fixed_fewshot else ""
        if self.synthetic:
            return f"{self.base} format, SYNTHETIC data (not GSM8K){shots}"
        if self.data_dir is not None:
            return f"{self.base} (local data{shots})"
        return f"{self.base} (fixed shots)" if self.fixed_fewshot else self.base

    def task_manager(self):
        """A TaskManager that indexes only our folder (indexing all of lm-eval's tasks takes ~12 s)."""
        from lm_eval.tasks import TaskManager

        return TaskManager(include_path=str(self.include_path), include_defaults=False)


def lm_eval_tasks_dir() -> Path:
    """Folder of the installed lm-eval gsm8k task YAMLs."""
    spec = importlib.util.find_spec("lm_eval")
    if spec is None or not spec.submodule_search_locations:
        raise UserError("lm-eval is not installed; install it with `pip install lm-eval==0.4.13`")
    return Path(next(iter(spec.submodule_search_locations))) / "tasks" / "gsm8k"


def validate_data_dir(data_dir: Path) -> None:
    """Check that `data_dir` holds GSM8K-format test.jsonl and train.jsonl; raise UserError if not."""
    if data_dir.is_file():
        raise UserError(
            f"--data-dir {data_dir} is a file; pass the folder holding test.jsonl and train.jsonl ({data_dir.parent})"
        )
    if not data_dir.is_dir():
        raise UserError(f"GSM8K data dir {data_dir} does not exist; pass a folder with test.jsonl and train.jsonl")
    for fname in SPLIT_FILES:
        path = data_dir / fname
        if not path.is_file():
            raise UserError(
                f"{path} is missing; a GSM8K data dir needs both {' and '.join(SPLIT_FILES)} "
                "(openai/grade-school-math format)"
            )
        first = _first_line(path)
        if first is None:
            raise UserError(f"{path} is empty; it needs one JSON object per line with question and answer")
        try:
            row = json.loads(first)
        except json.JSONDecodeError as exc:
            raise UserError(f"{path} line 1 is not JSON ({exc.msg}); expected one JSON object per line") from None
        if (
            not isinstance(row, dict)
            or not isinstance(row.get("question"), str)
            or not isinstance(row.get("answer"), str)
        ):
            raise UserError(
                f"{path} line 1 lacks string fields 'question' and 'answer'; "
                'each line must look like {"question": ..., "answer": "... #### 42"}'
            )
        if "####" not in row["answer"]:
            raise UserError(f"{path} line 1: the answer has no final '#### N'; GSM8K answers end with '#### <number>'")


def is_synthetic(data_dir: Path) -> bool:
    """True if `data_dir` was written by evals.synthetic (so results must not be called GSM8K)."""
    marker = data_dir / SYNTHETIC_MARKER
    if not marker.is_file():
        return False
    try:
        return bool(json.loads(marker.read_text()).get("synthetic", False))
    except (json.JSONDecodeError, AttributeError, OSError):
        return False


def gsm8k_task(data_dir: Path | None, work_dir: Path, name: str = "gsm8k", *, fixed_fewshot: bool = False) -> TaskSpec:
    """Task spec for gsm8k (or gsm8k_cot); with `data_dir` or `fixed_fewshot`, a local YAML written into `work_dir`.

    `fixed_fewshot` gives every gsm8k question the first train examples as its shots (lm-eval's first_n sampler)
    instead of a random draw per question: the prompts then share one long prefix, which a server's prefix cache
    computes once. gsm8k_cot's exemplars are fixed already.
    """
    if name not in _BASE_YAMLS:
        raise UserError(f"unknown eval task {name!r}; supported tasks: {', '.join(SUPPORTED_TASKS)}")
    tasks_dir = lm_eval_tasks_dir()
    base_yaml = tasks_dir / _BASE_YAMLS[name]
    if not base_yaml.is_file():
        raise UserError(f"lm-eval's {base_yaml} is missing; reinstall lm-eval==0.4.13")
    fixed_fewshot = fixed_fewshot and name == "gsm8k"
    if data_dir is None and not fixed_fewshot:
        return TaskSpec(name=name, base=name, include_path=tasks_dir)

    # include: merges the base YAML shallowly and our keys win, so dataset_kwargs is given whole.
    cfg: dict[str, Any] = {
        "include": str(base_yaml),
        "tag": [],  # don't register under the base task's tags (math_word_problems, chain_of_thought)
    }
    synthetic = False
    task_name = name
    if data_dir is not None:
        data_dir = Path(data_dir).expanduser().resolve()
        validate_data_dir(data_dir)
        synthetic = is_synthetic(data_dir)
        task_name = f"{name}_synthetic" if synthetic else f"{name}_local"
        cfg |= {
            "dataset_path": "json",
            "dataset_name": None,
            "dataset_kwargs": {
                "data_files": {split: str(data_dir / f"{split}.jsonl") for split in ("test", "train")},
                # Keep the datasets arrow cache with the run rather than in ~/.cache.
                "cache_dir": str(Path(work_dir).resolve() / "hf_datasets"),
            },
            "test_split": "test",
        }
        if name == "gsm8k":
            cfg["training_split"] = "train"
            cfg["fewshot_split"] = "train"
    if fixed_fewshot:
        task_name = f"{task_name}_fixedshot"
        cfg["fewshot_config"] = {"sampler": "first_n"}
    cfg = {"include": cfg.pop("include"), "task": task_name, **cfg}
    # A folder of its own: TaskManager indexes every YAML under include_path.
    task_dir = Path(work_dir) / "lm_eval_tasks"
    yaml_path = task_dir / f"{task_name}.yaml"
    atomic_write_text(yaml_path, yaml.safe_dump(cfg, sort_keys=False))
    return TaskSpec(
        name=task_name,
        base=name,
        include_path=task_dir.resolve(),
        data_dir=data_dir,
        yaml_path=yaml_path.resolve(),
        synthetic=synthetic,
        fixed_fewshot=fixed_fewshot,
    )


def resolve_data_dir(option: Path | None) -> Path | None:
    """--data-dir, else $DCPCTL_GSM8K_DIR, else None (lm-eval's hub task)."""
    if option is not None:
        return option
    env = os.environ.get(DATA_DIR_ENV, "").strip()
    return Path(env) if env else None


def hub_reachable(timeout_s: float = 3.0) -> bool:
    """False when HF offline mode is set or huggingface.co:443 does not accept a connection within timeout_s."""
    for var in _OFFLINE_VARS:
        if os.environ.get(var, "").strip().lower() in ("1", "true", "yes", "on"):
            return False
    try:
        with socket.create_connection(("huggingface.co", 443), timeout=timeout_s):
            return True
    except OSError:
        return False


def prepare_task(
    name: str, data_dir: Path | None, work_dir: Path, *, fixed_fewshot: bool = False, num_fewshot: int = 0
) -> TaskSpec:
    """The task spec, with its dataset loaded once so that data problems (and more shots than a local data dir's
    training examples) surface before any launch."""
    spec = gsm8k_task(data_dir, work_dir, name=name, fixed_fewshot=fixed_fewshot)
    train = train_examples(spec.data_dir) if spec.data_dir is not None else None
    if train is not None and num_fewshot > train:
        raise UserError(
            f"--num-fewshot {num_fewshot} is more than the {train} examples in {spec.data_dir / 'train.jsonl'}; "
            "lower it or add training examples"
        )
    if spec.data_dir is None and not hub_reachable():
        offline = any(os.environ.get(v) for v in _OFFLINE_VARS)
        if not offline:
            raise UserError(
                f"no --data-dir (or ${DATA_DIR_ENV}) and huggingface.co is unreachable, so lm-eval's {name} "
                "data can't be fetched; pass --data-dir DIR with GSM8K test.jsonl/train.jsonl "
                "(or set HF_DATASETS_OFFLINE=1 to use a cached copy)"
            )
    try:
        spec.task_manager().load([spec.name])
    except Exception as exc:  # datasets / lm-eval raise many kinds; the message is what matters
        where = spec.data_dir or "the Hugging Face hub"
        raise UserError(
            f"lm-eval could not load task {spec.name} from {where} ({type(exc).__name__}: {str(exc)[:300]}); "
            "check --data-dir"
        ) from None
    return spec


def _first_line(path: Path) -> str | None:
    try:
        with path.open("r", encoding="utf-8") as fh:
            for line in fh:
                if line.strip():
                    return line
    except UnicodeDecodeError:
        raise UserError(f"{path} is not UTF-8 text; it needs one JSON object per line (GSM8K format)") from None
    return None


def train_examples(data_dir: Path) -> int | None:
    """The examples (non-blank lines) of a data dir's train.jsonl, which the few-shot examples are drawn from; None
    when it cannot be read (validate_data_dir says why)."""
    try:
        with (data_dir / "train.jsonl").open("rb") as fh:
            return sum(1 for line in fh if line.strip())
    except OSError:
        return None
