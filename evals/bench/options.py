"""What a bench run is, decided before anything launches: the options, the checks that the targets can run the
workload (one model, prompts that fit), the workload itself and the notes the report carries."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.errors import UserError
from evals.bench.workload import Workload, build_workload, load_tokenizer
from evals.launch import DEFAULT_HEALTH_TIMEOUT_S, check_health_timeout
from evals.targets import Target

DEFAULT_INPUT_LEN = 512
DEFAULT_CONCURRENCY = 8
HF_LABEL = "hf-transformers"


@dataclass
class BenchOptions:
    """The workload and how it is sent; the same for every target."""

    input_len: int | None = None
    output_len: int = 128
    num_prompts: int = 32
    concurrency: int | None = DEFAULT_CONCURRENCY
    request_rate: float | None = None
    seed: int = 0
    prompts_file: Path | None = None
    warmup: int = 2
    hf: bool = False
    tokenizer: Path | None = None
    health_timeout_s: float = DEFAULT_HEALTH_TIMEOUT_S

    def check(self) -> None:
        """UserError for a value the workload cannot use."""
        for name in ("output_len", "num_prompts"):
            if getattr(self, name) < 1:
                raise UserError(f"--{name.replace('_', '-')} must be at least 1 (got {getattr(self, name)})")
        if self.input_len is not None and self.input_len < 1:
            raise UserError(f"--input-len must be at least 1 (got {self.input_len})")
        if self.concurrency is not None and self.concurrency < 1:
            raise UserError(f"--concurrency must be at least 1 (got {self.concurrency})")
        if self.request_rate is not None and not self.request_rate > 0:
            raise UserError(f"--request-rate must be positive requests/s (got {self.request_rate})")
        if self.seed < 0:
            raise UserError(f"--seed must be 0 or more (got {self.seed})")
        if self.tokenizer is not None and not self.tokenizer.is_dir():
            raise UserError(f"--tokenizer {self.tokenizer} is not a model folder; give the folder with tokenizer.json")
        check_health_timeout(self.health_timeout_s)
        if self.warmup < 0:
            raise UserError(f"--warmup must be 0 or more requests (got {self.warmup})")

    @property
    def max_batch(self) -> int:
        """Requests in flight at most (HF generate's batch): --concurrency, else (a request rate alone) every
        prompt at once."""
        return min(self.concurrency or self.num_prompts, self.num_prompts)

    def settings(self) -> dict[str, Any]:
        return {
            "input_len": self.input_len,
            "output_len": self.output_len,
            "num_prompts": self.num_prompts,
            "concurrency": self.concurrency,
            "request_rate": self.request_rate,
            "seed": self.seed,
            "prompts_file": str(self.prompts_file) if self.prompts_file else None,
            "warmup": self.warmup,
            "hf": self.hf,
            "hf_batch": self.max_batch if self.hf else None,
            "ignore_eos": True,
        }


@dataclass
class BenchContext:
    """What the targets share: the workload, the model folder (plans, --hf), measured bandwidth per device."""

    opts: BenchOptions
    overrides: list[str]
    workload: Workload
    model_path: Path | None
    bandwidth: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


def check_plans(targets: list[Target], opts: BenchOptions) -> Path | None:
    """The plans' shared model folder (None without plans); UserError if they differ or --hf has no model."""
    folders = {t.resolved.model_path.resolve() for t in targets if t.resolved is not None and t.resolved.model_path}
    if len(folders) > 1:
        raise UserError(
            f"the plans use different models ({', '.join(sorted(map(str, folders)))}); bench compares layouts of "
            "one model, so give plans with the same model.path (or override it: model.path=...)"
        )
    folder = next(iter(folders), None)
    if folder is None and opts.tokenizer is None:
        raise UserError("with only URL targets, pass --tokenizer MODEL_FOLDER (the served model's tokenizer)")
    if opts.hf and folder is None and not (opts.tokenizer and (opts.tokenizer / "config.json").is_file()):
        raise UserError("--hf needs a model folder: give a plan, or --tokenizer with a full checkpoint folder")
    return folder or opts.tokenizer


def check_lengths(targets: list[Target], workload: Workload) -> None:
    """UserError if a prompt plus its output cannot fit a plan's max_model_len."""
    for t in targets:
        if t.resolved is None or t.resolved.max_model_len is None:
            continue
        if workload.max_total_len > t.resolved.max_model_len:
            raise UserError(
                f"plan {t.label}: prompts of up to {max(workload.input_lens)} tokens + {workload.output_len} output "
                f"tokens exceed model.max_model_len={t.resolved.max_model_len}; lower --input-len/--output-len or "
                f"raise model.max_model_len (nothing was launched)"
            )


def capacity_notes(targets: list[Target], workload: Workload, opts: BenchOptions) -> list[str]:
    """A note for each plan whose KV cache cannot hold the whole batch at once (preemptions are expected)."""
    batch = opts.max_batch
    need = batch * workload.max_total_len
    notes = []
    for t in targets:
        kv = t.resolved.kv if t.resolved is not None else None
        if kv is not None and kv.token_capacity < need:
            notes.append(
                f"{t.label}: its KV cache holds {kv.token_capacity} tokens, less than {batch} requests × "
                f"{workload.max_total_len} tokens = {need}; expect preemptions"
            )
    return notes


def prepare_bench(targets: list[Target], overrides: list[str], opts: BenchOptions) -> BenchContext:
    """Check the targets against the options, build the workload and the report's notes (nothing launches)."""
    model_path = check_plans(targets, opts)
    workload = build_workload(
        load_tokenizer(model_path),
        num_prompts=opts.num_prompts,
        input_len=opts.input_len,
        output_len=opts.output_len,
        seed=opts.seed,
        num_warmup=opts.warmup,
        prompts_file=opts.prompts_file,
        default_input_len=DEFAULT_INPUT_LEN,
    )
    check_lengths(targets, workload)
    ctx = BenchContext(opts=opts, overrides=overrides, workload=workload, model_path=model_path)
    ctx.notes += capacity_notes(targets, workload, opts)
    if any(t.is_url for t in targets):
        ctx.notes.append(
            "URL targets were sent ignore_eos=true (a vLLM extension); a server without it may stop at EOS, "
            "which shows as fewer output tokens"
        )
    if opts.hf:
        ctx.notes.append(
            f"{HF_LABEL}: transformers generate in-process, sequential left-padded batches of {opts.max_batch}; "
            "a request's TTFT counts from the start of its batch"
        )
    return ctx
