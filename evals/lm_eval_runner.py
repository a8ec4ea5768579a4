"""Run lm-eval gsm8k against an OpenAI-compatible server and turn its output into an EvalRun.

lm-eval is imported lazily: importing it costs ~2 s, which commands that don't evaluate shouldn't pay.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import time
from collections.abc import Callable
from contextvars import ContextVar
from pathlib import Path
from typing import Any

from engine.errors import UserError
from engine.io_utils import atomic_write_text
from evals.endpoint import check_server, normalize_base_url
from evals.results import EvalRun, Metric, SampleResult
from evals.tasks import TaskSpec
from evals.traces import (
    TokenTrace,
    chat_trace_request,
    completions_trace_request,
    trace_from_chat,
    trace_from_completion,
)

__all__ = ["EvalRun", "eval_run_from_lm_eval", "run_gsm8k"]


AnswerProgress = Callable[[int, int, int], None]
"""Called after each answer: (questions answered, questions asked, generated tokens so far)."""

_PROMPTS: ContextVar[list[Any] | None] = ContextVar("dcpctl_eval_prompts", default=None)


def _prompt_key(prompt: Any) -> str:
    return str(getattr(prompt, "prompt", prompt))  # chat prompts are lm-eval JsonChatStr


class _Recorder:
    """What the responses carry beyond the text lm-eval keeps: usage (lm-eval discards it), each question's token
    trace (evals.traces), and progress."""

    def __init__(self, chat: bool, on_answer: AnswerProgress | None) -> None:
        self.chat = chat
        self.on_answer = on_answer
        self.completion_tokens = 0
        self.prompt_tokens = 0
        self.responses = 0
        self.missing = 0
        self.generate_s = 0.0
        self.asked = 0
        self.answered = 0
        self._docs: dict[str, list[int]] = {}  # prompt -> doc ids (a repeated question has one prompt)
        self.traces: dict[int, TokenTrace] = {}  # doc id -> trace

    @property
    def request_fields(self) -> dict[str, Any]:
        return chat_trace_request() if self.chat else completions_trace_request()

    def expect(self, requests: list[Any]) -> None:
        """lm-eval's generate_until requests (Instances): which prompt is which doc."""
        for req in requests:
            self._docs.setdefault(_prompt_key(req.args[0]), []).append(req.doc_id)
        self.asked += len(requests)
        self._report()

    def add(self, outputs: Any, prompts: list[Any] | None) -> None:
        """One response (or a list of them) for `prompts`, in choice-index order."""
        for out in outputs if isinstance(outputs, list) else [outputs]:
            self.responses += 1
            usage = out.get("usage") if isinstance(out, dict) else None
            if not isinstance(usage, dict) or not isinstance(usage.get("completion_tokens"), int):
                self.missing += 1
            else:
                self.completion_tokens += usage["completion_tokens"]
                if isinstance(usage.get("prompt_tokens"), int):
                    self.prompt_tokens += usage["prompt_tokens"]
            choices = out.get("choices", []) if isinstance(out, dict) else []
            for choice in choices:
                self.answered += 1
                index = choice.get("index", 0)
                if not prompts or not 0 <= index < len(prompts):
                    continue
                try:
                    trace = trace_from_chat(choice) if self.chat else trace_from_completion(choice)
                except (TypeError, ValueError, AttributeError):  # a server's odd logprobs must not fail the eval
                    trace = None
                for doc_id in self._docs.get(_prompt_key(prompts[index]), []) if trace else []:
                    self.traces[doc_id] = trace
        self._report()

    def _report(self) -> None:
        if self.on_answer is not None:
            self.on_answer(self.answered, self.asked, self.completion_tokens)

    @property
    def generated_tokens(self) -> int | None:
        return self.completion_tokens if self.responses and not self.missing else None


def _make_lm(chat: bool, on_answer: AnswerProgress | None, **model_args: Any):
    """An instance of lm-eval's local-(chat-)completions model that asks for token traces and records them, usage
    and request time (a _Recorder in its `record`)."""
    missing = [pkg for pkg in ("aiohttp", "requests", "tenacity", "tqdm") if importlib.util.find_spec(pkg) is None]
    if missing:
        raise UserError(
            f"lm-eval's API models need {', '.join(missing)}; install them with `pip install 'lm-eval[api]==0.4.13'`"
        )
    from lm_eval.models.openai_completions import LocalChatCompletion, LocalCompletionsAPI

    base = LocalChatCompletion if chat else LocalCompletionsAPI

    class _RecordingLM(base):  # type: ignore[misc, valid-type]
        def __init__(self, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self.record = _Recorder(chat, on_answer)

        def _create_payload(self, messages: Any, generate: bool = False, **kwargs: Any) -> dict:
            payload = super()._create_payload(messages, generate=generate, **kwargs)
            if generate:
                payload.update(self.record.request_fields)
            return payload

        async def amodel_call(self, session: Any, sem: Any, messages: Any, **kwargs: Any) -> Any:
            # parse_generations sees only the response here: the prompts travel alongside in a context variable.
            token = _PROMPTS.set(list(messages))
            try:
                return await super().amodel_call(session, sem, messages, **kwargs)
            finally:
                _PROMPTS.reset(token)

        def parse_generations(self, outputs: Any, **kwargs: Any) -> list[str]:
            self.record.add(outputs, kwargs.get("contexts") or _PROMPTS.get())
            return super().parse_generations(outputs=outputs, **kwargs)

        def generate_until(self, requests: Any, disable_tqdm: bool = False) -> list[str]:
            self.record.expect(requests)
            t0 = time.perf_counter()
            try:
                return super().generate_until(requests, disable_tqdm=disable_tqdm)
            finally:
                self.record.generate_s += time.perf_counter() - t0

    _RecordingLM.__name__ = f"Recording{base.__name__}"
    return _RecordingLM(**model_args)


def run_gsm8k(
    base_url: str,
    model_name: str | None,
    task: TaskSpec,
    *,
    label: str | None = None,
    limit: int | float | None = None,
    doc_ids: list[int] | None = None,
    num_fewshot: int | None = 5,
    apply_chat_template: bool = False,
    fewshot_as_multiturn: bool = True,
    system_instruction: str | None = None,
    num_concurrent: int = 1,
    batch_size: int = 1,
    max_gen_toks: int = 256,
    max_retries: int = 3,
    timeout_s: int = 600,
    seed: int = 1234,
    output_dir: Path | None = None,
    on_answer: AnswerProgress | None = None,
) -> EvalRun:
    """Run lm-eval `task` on the server at `base_url` via local-completions (chat: local-chat-completions).

    `model_name` None takes the first id from GET /v1/models. `limit` takes the first N test docs; `doc_ids`
    picks docs instead. With `output_dir`, lm-eval's raw results and samples are written there too.
    """
    if limit is not None and doc_ids is not None:
        raise UserError("pass either a limit or a list of doc ids, not both")
    root = normalize_base_url(base_url)
    served = check_server(root)
    if model_name is None:
        if not served:
            raise UserError(f"server at {root} lists no models at /v1/models; pass the model name explicitly")
        model_name = served[0]
    elif served and model_name not in served:
        raise UserError(f"model {model_name!r} is not served at {root} (it serves {', '.join(served)}); fix the name")

    mode = "chat" if apply_chat_template else "completions"
    endpoint = f"{root}/v1/chat/completions" if apply_chat_template else f"{root}/v1/completions"
    lm = _make_lm(
        apply_chat_template,
        on_answer,
        base_url=endpoint,
        model=model_name,
        # No client-side tokenizer: 'auto' would probe /tokenizer_info then fetch model_name from the hub.
        tokenizer_backend=None,
        tokenized_requests=False,
        num_concurrent=num_concurrent,
        batch_size=batch_size,
        max_gen_toks=max_gen_toks,
        max_retries=max_retries,
        timeout=timeout_s,
        seed=seed,
    )

    refusals = ServerRefusals()
    api_log = logging.getLogger("lm_eval.models.api_models")
    api_log.addHandler(refusals)
    try:
        output, wall_s = evaluate_lm(
            lm,
            task,
            limit=limit,
            doc_ids=doc_ids,
            num_fewshot=num_fewshot,
            apply_chat_template=apply_chat_template,
            fewshot_as_multiturn=fewshot_as_multiturn,
            system_instruction=system_instruction,
        )
    except Exception as exc:
        if _is_request_error(exc):
            _quiet_abandoned_requests()
            why = f"the server answered: {refusals.reason}" if refusals.reason else f"{type(exc).__name__}: {exc}"
            raise UserError(f"lm-eval's requests to {endpoint} failed ({why}); check the server log") from exc
        raise
    finally:
        api_log.removeHandler(refusals)
    if output_dir is not None:
        write_lm_eval_output(output, Path(output_dir))
    return eval_run_from_lm_eval(
        output,
        task.name,
        label=label or model_name,
        dataset=task.display_name,
        mode=mode,
        wall_s=wall_s,
        generate_s=lm.record.generate_s or None,
        generated_tokens=lm.record.generated_tokens,
        prompt_tokens=lm.record.prompt_tokens if lm.record.generated_tokens is not None else None,
        base_url=root,
        model=model_name,
        traces=lm.record.traces,
    )


def evaluate_lm(
    lm: Any,
    task: TaskSpec,
    *,
    limit: int | float | None = None,
    doc_ids: list[int] | None = None,
    num_fewshot: int | None = 5,
    apply_chat_template: bool = False,
    fewshot_as_multiturn: bool = True,
    system_instruction: str | None = None,
) -> tuple[dict[str, Any], float]:
    """lm-eval's simple_evaluate of `task` on any lm-eval model, with per-sample logs; returns (output, wall s)."""
    from lm_eval import simple_evaluate

    try:
        task_manager = task.task_manager()
    except Exception as exc:  # lm-eval raises plain exceptions for a bad YAML
        raise UserError(f"lm-eval could not index task folder {task.include_path}: {exc}") from None
    if task.name not in task_manager.all_tasks:
        raise UserError(
            f"lm-eval finds no task {task.name!r} under {task.include_path}; build the spec with evals.tasks.gsm8k_task"
        )
    t0 = time.perf_counter()
    output = simple_evaluate(
        model=lm,
        tasks=[task.name],
        task_manager=task_manager,
        num_fewshot=num_fewshot,
        limit=limit,
        samples={task.name: list(doc_ids)} if doc_ids is not None else None,
        log_samples=True,
        apply_chat_template=apply_chat_template,
        fewshot_as_multiturn=fewshot_as_multiturn if apply_chat_template else False,
        system_instruction=system_instruction,
    )
    wall_s = time.perf_counter() - t0
    if output is None:
        raise RuntimeError("lm-eval returned no results (not rank 0?)")
    return output, wall_s


class ServerRefusals(logging.Handler):
    """The server's own reason for the last request lm-eval's API client logged as failed (its JSON error message,
    e.g. a prompt longer than max_model_len), which lm-eval's exception leaves out."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.reason: str | None = None

    def emit(self, record: logging.LogRecord) -> None:
        _, found, body = record.getMessage().partition("Response text: ")
        if not found:
            return
        try:  # lm-eval appends ". Retrying..." to the body
            self.reason = str(json.JSONDecoder().raw_decode(body.strip())[0]["error"]["message"])
        except (ValueError, KeyError, TypeError):
            self.reason = body.strip()[:300] or None


class _AbandonedRequests(logging.Filter):
    """Drops asyncio's "Task exception was never retrieved" for lm-eval's request tasks left behind by a failure
    that is already reported (with the server's reason), which would otherwise print a traceback at exit."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not (
            record.getMessage().startswith("Task exception was never retrieved") and exc and _is_request_error(exc)
        )


def _quiet_abandoned_requests() -> None:
    asyncio_log = logging.getLogger("asyncio")
    if not any(isinstance(f, _AbandonedRequests) for f in asyncio_log.filters):
        asyncio_log.addFilter(_AbandonedRequests())


def _is_request_error(exc: BaseException) -> bool:
    import asyncio

    import requests

    try:
        import aiohttp

        aio: tuple[type[BaseException], ...] = (aiohttp.ClientError,)
    except ImportError:
        aio = ()
    return isinstance(exc, (requests.RequestException, asyncio.TimeoutError, TimeoutError, *aio))


def _stderr(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) else None  # lm-eval writes "N/A" for n = 1


def eval_run_from_lm_eval(
    output: dict[str, Any],
    task_name: str,
    *,
    label: str,
    dataset: str | None = None,
    mode: str = "completions",
    wall_s: float | None = None,
    generate_s: float | None = None,
    generated_tokens: int | None = None,
    prompt_tokens: int | None = None,
    base_url: str | None = None,
    model: str | None = None,
    traces: dict[int, TokenTrace] | None = None,
) -> EvalRun:
    """Turn simple_evaluate's result dict (run with log_samples=True) into an EvalRun for `task_name`; `traces`
    (doc id -> TokenTrace) go to their samples."""
    results = output.get("results", {})
    if task_name not in results:
        raise ValueError(f"lm-eval output has no results for task {task_name!r} (has {sorted(results)})")
    metrics: dict[str, Metric] = {}
    stderrs: dict[str, Any] = {}
    # Keys look like "exact_match,strict-match" and "exact_match_stderr,strict-match".
    for key, value in results[task_name].items():
        if "," not in key:
            continue
        metric, filt = key.split(",", 1)
        if metric.endswith("_stderr"):
            stderrs[f"{metric[: -len('_stderr')]},{filt}"] = value
        elif isinstance(value, (int, float)):
            metrics[filt] = Metric(name=metric, value=float(value), stderr=None)
    for filt, m in metrics.items():
        m.stderr = _stderr(stderrs.get(f"{m.name},{filt}"))

    by_doc: dict[int, SampleResult] = {}
    for s in output.get("samples", {}).get(task_name, []):
        doc_id = int(s["doc_id"])
        sample = by_doc.get(doc_id)
        if sample is None:
            resps = s.get("resps") or [[""]]
            doc = s.get("doc", {})
            sample = SampleResult(
                doc_id=doc_id,
                question=str(doc.get("question", "")),
                target=str(s.get("target", "")),
                generated=str(resps[0][0]) if resps and resps[0] else "",
                prompt_hash=s.get("prompt_hash"),
                trace=(traces or {}).get(doc_id),
            )
            by_doc[doc_id] = sample
        filt = s.get("filter", "none")
        filtered = s.get("filtered_resps") or [""]
        sample.extracted[filt] = str(filtered[0])
        metric_name = metrics[filt].name if filt in metrics else "exact_match"
        sample.correct[filt] = float(s.get(metric_name, 0.0)) == 1.0

    version = output.get("versions", {}).get(task_name)
    n_shot = output.get("n-shot", {}).get(task_name)
    return EvalRun(
        label=label,
        task=task_name,
        dataset=dataset or task_name,
        version=None if version is None else str(version),
        n_shot=None if n_shot is None else int(n_shot),
        mode=mode,
        metrics=metrics,
        samples=[by_doc[k] for k in sorted(by_doc)],
        wall_s=wall_s,
        generate_s=generate_s,
        generated_tokens=generated_tokens,
        prompt_tokens=prompt_tokens,
        base_url=base_url,
        model=model,
    )


def write_lm_eval_output(output: dict[str, Any], out_dir: Path) -> None:
    """Write lm-eval's raw result dict (lm_eval_results.json) and samples (lm_eval_samples.jsonl)."""
    rest = {k: v for k, v in output.items() if k != "samples"}
    atomic_write_text(out_dir / "lm_eval_results.json", json.dumps(rest, indent=2, default=str) + "\n")
    lines = [
        json.dumps(s, default=str, ensure_ascii=False)
        for samples in output.get("samples", {}).values()
        for s in samples
    ]
    atomic_write_text(out_dir / "lm_eval_samples.jsonl", "".join(line + "\n" for line in lines))
