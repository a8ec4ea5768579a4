"""The `--hf` reference: HF transformers `generate`, in-process, on the same model folder and the same prompts.

Sequential batches of `batch_size` (= --concurrency) prompts, left-padded, greedy, exactly `output_len` new
tokens (`min_new_tokens = max_new_tokens`, so EOS never ends a row early). Each batch starts when the previous
one has finished: a request's "send time" is the start of its batch, and every row of a batch sees the same
token arrival times (HF emits one token per row per step), recorded by a stopping criterion that is called
after each generated token.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from evals.bench.client import RequestRecord, RunResult


def _stamp_criterion(stamps: list[float], clock: Callable[[], float]) -> Any:
    import torch
    from transformers import StoppingCriteria

    class _Stamp(StoppingCriteria):
        """Never stops generation; records when each new token was appended."""

        def __call__(self, input_ids: torch.LongTensor, scores: Any, **kwargs: Any) -> torch.BoolTensor:
            stamps.append(clock())
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    return _Stamp()


def _left_pad(prompts: list[list[int]], pad_id: int, device: str) -> tuple[Any, Any]:
    import torch

    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, p in enumerate(prompts):
        ids[row, width - len(p) :] = torch.tensor(p, dtype=torch.long)
        mask[row, width - len(p) :] = 1
    return ids.to(device), mask.to(device)


def load_hf_model(model_path: str | Path, dtype: str, device: str) -> Any:
    """The checkpoint through transformers (the test oracle's loader), in eval mode on `device`."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=getattr(torch, dtype), local_files_only=True)
    return model.to(device).eval()


def run_hf(
    model: Any,
    prompts: list[list[int]],
    output_len: int,
    *,
    batch_size: int,
    warmup: list[list[int]] | None = None,
    on_done: Callable[[RequestRecord], None] | None = None,
) -> RunResult:
    """Generate for every prompt in sequential left-padded batches; timestamps as the HTTP client records them."""
    import torch

    device = str(next(model.parameters()).device)
    cfg = model.generation_config
    pad_id = cfg.pad_token_id if cfg.pad_token_id is not None else model.config.pad_token_id
    if pad_id is None:
        eos = cfg.eos_token_id
        pad_id = (eos[0] if isinstance(eos, list) else eos) if eos is not None else 0
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    kwargs: dict[str, Any] = {"do_sample": False, "pad_token_id": pad_id}
    with torch.inference_mode():
        if warmup:
            ids, mask = _left_pad(warmup[:batch_size], pad_id, device)
            n = min(4, output_len)
            model.generate(input_ids=ids, attention_mask=mask, min_new_tokens=n, max_new_tokens=n, **kwargs)
        records = [RequestRecord(index=i, prompt_len=len(p)) for i, p in enumerate(prompts)]
        start = time.perf_counter()

        def clock() -> float:
            return time.perf_counter() - start

        def synced_clock() -> float:
            sync()  # on CUDA the token exists once its kernels have run, not when they were queued
            return clock()

        for lo in range(0, len(prompts), batch_size):
            batch = records[lo : lo + batch_size]
            ids, mask = _left_pad(prompts[lo : lo + batch_size], pad_id, device)
            stamps: list[float] = []
            sent = clock()
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                min_new_tokens=output_len,
                max_new_tokens=output_len,
                stopping_criteria=[_stamp_criterion(stamps, synced_clock)],
                **kwargs,
            )
            sync()
            done = clock()
            for rec in batch:
                rec.send_time = sent
                rec.token_times = list(stamps)
                rec.first_token_time = stamps[0] if stamps else None
                rec.end_time = done
                rec.output_tokens = int(out.shape[1] - ids.shape[1])
                if on_done is not None:
                    on_done(rec)
        return RunResult(records=records, duration_s=clock())
