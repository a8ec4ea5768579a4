"""evals.lm_eval_runner: server checks, parsing real lm-eval output, and real runs against a fake server."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from engine.errors import UserError
from evals.endpoint import check_server, normalize_base_url
from evals.lm_eval_runner import eval_run_from_lm_eval, run_gsm8k
from evals.synthetic import write_synthetic_gsm8k
from evals.tasks import TaskSpec, gsm8k_task
from evals.traces import TOP_LOGPROBS, chat_trace_request, completions_trace_request


class FakeServer:
    """A minimal OpenAI-compatible server: answers questions from a table, records every request."""

    def __init__(self, answers: dict[str, str], *, usage: bool = True, models: bool = True, status: int = 200):
        self.answers, self.usage, self.models, self.status = answers, usage, models, status
        self.requests: list[tuple[str, dict[str, Any]]] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _send(self, code: int, obj: Any) -> None:
                body = json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:
                if self.path == "/v1/models" and outer.models:
                    self._send(200, {"object": "list", "data": [{"id": "tiny", "object": "model"}]})
                elif self.path == "/health":
                    self._send(200, {"status": "ok"})
                else:
                    self._send(404, {"error": "not found"})

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                outer.requests.append((self.path, body))
                if outer.status != 200:
                    return self._send(outer.status, {"error": "engine crashed"})
                if self.path == "/v1/completions":
                    prompts = body["prompt"] if isinstance(body["prompt"], list) else [body["prompt"]]
                    choices = [
                        {"index": i, "text": outer.reply(p), "finish_reason": "stop"} for i, p in enumerate(prompts)
                    ]
                    if body.get("logprobs") and body.get("return_tokens_as_token_ids"):
                        for choice, p in zip(choices, prompts, strict=True):
                            choice["logprobs"] = outer.logprobs(p, choice["text"])
                elif self.path == "/v1/chat/completions":
                    text = outer.reply(body["messages"][-1]["content"])
                    choices = [
                        {
                            "index": 0,
                            "message": {"role": "assistant", "content": text},
                            "finish_reason": "stop",
                        }
                    ]
                else:
                    return self._send(404, {"error": "not found"})
                resp: dict[str, Any] = {"id": "cmpl-1", "object": "text_completion", "choices": choices}
                if outer.usage:
                    resp["usage"] = {
                        "prompt_tokens": 10,
                        "completion_tokens": 7 * len(choices),
                        "total_tokens": 17,
                    }
                self._send(200, resp)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    @staticmethod
    def question(prompt: str) -> str:
        return prompt.split("Question: ")[-1].split("\nAnswer:")[0]

    def reply(self, prompt: str) -> str:
        return self.answers.get(self.question(prompt), " I do not know.")

    @staticmethod
    def token_ids(question: str) -> list[int]:
        """Made-up generated token ids that tell the questions apart."""
        return [len(question), sum(map(ord, question)) % 1000]

    def logprobs(self, prompt: str, text: str) -> dict[str, Any]:
        """A completions logprobs object with token-id names for this prompt's made-up tokens."""
        ids = self.token_ids(self.question(prompt))
        names = [f"token_id:{i}" for i in ids]
        return {
            "tokens": names,
            "token_logprobs": [-0.5, -0.25],
            "top_logprobs": [{names[0]: -0.5, "token_id:1": -0.9}, {names[1]: -0.25}],
            "text_offset": [0, len(text) // 2],
        }

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def fake() -> Iterator[FakeServer]:
    server = FakeServer({})
    yield server
    server.close()


def _closed_port_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


# --- fast -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "url",
    [
        "http://h:8000",
        "http://h:8000/",
        "http://h:8000/v1",
        "http://h:8000/v1/completions",
        "http://h:8000/v1/chat/completions/",
    ],
)
def test_normalize_base_url(url: str) -> None:
    assert normalize_base_url(url) == "http://h:8000"


def test_normalize_base_url_needs_scheme() -> None:
    with pytest.raises(UserError, match="must start with http://"):
        normalize_base_url("localhost:8000")


def test_check_server_lists_models_or_falls_back_to_health(fake: FakeServer) -> None:
    assert check_server(fake.url + "/v1") == ["tiny"]
    fake.models = False
    assert check_server(fake.url) == []


def test_unreachable_server_is_a_user_error(tmp_path: Path) -> None:
    url = _closed_port_url()
    with pytest.raises(UserError, match="cannot reach the server"):
        check_server(url, timeout_s=1.0)
    spec = TaskSpec(name="gsm8k", base="gsm8k", include_path=tmp_path)
    with pytest.raises(UserError, match="cannot reach the server"):
        run_gsm8k(url, "tiny", spec, limit=1)


def test_wrong_model_name_and_bad_args_are_user_errors(fake: FakeServer, tmp_path: Path) -> None:
    spec = TaskSpec(name="gsm8k", base="gsm8k", include_path=tmp_path)
    with pytest.raises(UserError, match="model 'llama' is not served"):
        run_gsm8k(fake.url, "llama", spec, limit=1)
    with pytest.raises(UserError, match="either a limit or a list of doc ids"):
        run_gsm8k(fake.url, "tiny", spec, limit=1, doc_ids=[0])
    assert fake.requests == []


def test_unknown_task_is_a_user_error(fake: FakeServer, tmp_path: Path) -> None:
    spec = TaskSpec(name="gsm8k_nope", base="gsm8k", include_path=tmp_path)
    with pytest.raises(UserError, match="finds no task 'gsm8k_nope'"):
        run_gsm8k(fake.url, "tiny", spec, limit=1)


# simple_evaluate(...) output for 2 docs x 2 filters against FakeServer, trimmed to the fields we read
# (captured with lm-eval 0.4.13; metric values are np.float64 there, which are floats).
CAPTURED = {
    "results": {
        "gsm8k_synthetic": {
            "name": "gsm8k_synthetic",
            "alias": "gsm8k_synthetic",
            "sample_len": 2,
            "exact_match,strict-match": 0.5,
            "exact_match_stderr,strict-match": 0.5,
            "exact_match,flexible-extract": 1.0,
            "exact_match_stderr,flexible-extract": 0.0,
        }
    },
    "versions": {"gsm8k_synthetic": 3.0},
    "n-shot": {"gsm8k_synthetic": 1},
    "samples": {"gsm8k_synthetic": []},
}
_DOCS = [
    (
        "Chen fills 12 boxes with 2 shells each. How many shells are in the boxes?",
        "There are 12 * 2 = <<12*2=24>>24 shells in the boxes.\n#### 24",
        " So it is 24.\n#### 24",
        {"strict-match": ("24", 1.0), "flexible-extract": ("24", 1.0)},
    ),
    (
        "Ivo has 25 marbles. Ivo gets 39 more marbles. How many marbles does Ivo have now?",
        "Ivo has 25 + 39 = <<25+39=64>>64 marbles now.\n#### 64",
        " The answer is 64.",
        {"strict-match": ("[invalid]", 0.0), "flexible-extract": ("64.", 1.0)},
    ),
]
for _filt in ("strict-match", "flexible-extract"):  # lm-eval logs one sample per (filter, doc)
    for _doc_id, (_q, _a, _resp, _by_filter) in enumerate(_DOCS):
        CAPTURED["samples"]["gsm8k_synthetic"].append(
            {
                "doc_id": _doc_id,
                "doc": {"question": _q, "answer": _a},
                "target": _a,
                "resps": [[_resp]],
                "filtered_resps": [_by_filter[_filt][0]],
                "filter": _filt,
                "metrics": ["exact_match"],
                "exact_match": _by_filter[_filt][1],
                "prompt_hash": f"hash{_doc_id}",
            }
        )


def test_parse_captured_lm_eval_output() -> None:
    run = eval_run_from_lm_eval(CAPTURED, "gsm8k_synthetic", label="tp1", wall_s=2.0, generated_tokens=10)
    assert run.version == "3.0" and run.n_shot == 1 and run.task == "gsm8k_synthetic"
    assert run.filters == ["strict-match", "flexible-extract"]
    assert run.metrics["strict-match"].value == 0.5 and run.metrics["strict-match"].stderr == 0.5
    assert run.metrics["flexible-extract"].value == 1.0
    assert [s.doc_id for s in run.samples] == [0, 1]
    s1 = run.samples[1]
    assert s1.generated == " The answer is 64." and s1.gold == "64"
    assert s1.extracted == {"strict-match": "[invalid]", "flexible-extract": "64."}
    assert s1.correct == {"strict-match": False, "flexible-extract": True}
    assert run.tokens_per_s == 5.0


def test_parse_na_stderr_and_missing_task() -> None:
    out = json.loads(json.dumps(CAPTURED))
    out["results"]["gsm8k_synthetic"]["exact_match_stderr,strict-match"] = "N/A"
    assert eval_run_from_lm_eval(out, "gsm8k_synthetic", label="x").metrics["strict-match"].stderr is None
    with pytest.raises(ValueError, match="no results for task 'gsm8k'"):
        eval_run_from_lm_eval(out, "gsm8k", label="x")


# --- slow: real lm-eval runs ------------------------------------------------------------------------------


def _synthetic(tmp_path: Path, n_test: int = 6) -> tuple[TaskSpec, list[dict]]:
    d = write_synthetic_gsm8k(tmp_path / "data", n_test=n_test, n_train=3, seed=5)
    rows = [json.loads(line) for line in (d / "test.jsonl").read_text().splitlines()]
    return gsm8k_task(d, tmp_path / "work"), rows


def _answer(row: dict) -> str:
    return " " + row["answer"]  # the reference solution, so strict-match is right


@pytest.mark.slow
def test_run_gsm8k_completions_against_fake_server(tmp_path: Path) -> None:
    spec, rows = _synthetic(tmp_path)
    server = FakeServer({rows[0]["question"]: _answer(rows[0]), rows[1]["question"]: " The answer is 0."})
    try:
        run = run_gsm8k(
            server.url,
            None,
            spec,
            label="tp1",
            limit=4,
            num_fewshot=2,
            num_concurrent=2,
            max_gen_toks=40,
            output_dir=tmp_path / "raw",
        )
    finally:
        server.close()
    assert run.label == "tp1" and run.model == "tiny" and run.mode == "completions" and run.n_shot == 2
    assert run.metrics["strict-match"].value == pytest.approx(0.25)
    assert [s.doc_id for s in run.samples] == [0, 1, 2, 3]
    assert run.samples[0].correct["strict-match"] and not run.samples[1].correct["flexible-extract"]
    assert run.samples[1].generated == " The answer is 0."
    assert run.generated_tokens == 4 * 7 and run.prompt_tokens == 40
    assert run.generate_s and run.wall_s and run.wall_s >= run.generate_s and run.tokens_per_s
    assert "SYNTHETIC" in run.dataset

    # The request contract our server must meet.
    assert len(server.requests) == 4
    path, body = server.requests[0]
    assert path == "/v1/completions"
    assert isinstance(body["prompt"], str) and body["prompt"].endswith("\nAnswer:")
    assert body["prompt"].count("Question: ") == 3  # 2 few-shot + the question
    assert set(body) == {"prompt", "model", "max_tokens", "temperature", "stop", "seed", *completions_trace_request()}
    assert body["model"] == "tiny" and body["max_tokens"] == 40
    assert body["temperature"] == 0.0 and body["seed"] == 1234
    assert body["stop"] == ["Question:", "</s>", "<|im_end|>"]
    assert body["logprobs"] == TOP_LOGPROBS and body["return_tokens_as_token_ids"] is True and "echo" not in body
    assert (tmp_path / "raw" / "lm_eval_results.json").is_file()
    assert len((tmp_path / "raw" / "lm_eval_samples.jsonl").read_text().splitlines()) == 8


@pytest.mark.slow
@pytest.mark.parametrize("num_concurrent", [1, 3])  # lm-eval's sync path, and its async one
def test_traces_and_progress_follow_each_question(tmp_path: Path, num_concurrent: int) -> None:
    spec, rows = _synthetic(tmp_path)
    server = FakeServer({})
    answers: list[tuple[int, int, int]] = []
    try:
        run = run_gsm8k(
            server.url,
            None,
            spec,
            limit=4,
            num_fewshot=1,
            num_concurrent=num_concurrent,
            on_answer=lambda *a: answers.append(a),
        )
    finally:
        server.close()
    for s in run.samples:
        assert s.trace is not None and s.trace.ids == FakeServer.token_ids(rows[s.doc_id]["question"])
        assert s.trace.rivals[0] == [(1, -0.9)] and s.trace.pieces[0] == s.generated[: len(s.generated) // 2]
    assert answers[0] == (0, 4, 0) and answers[-1] == (4, 4, 4 * 7)  # asked, then one per answer
    assert [done for done, _, _ in answers] == [0, 1, 2, 3, 4]


@pytest.mark.slow
def test_run_gsm8k_chat_and_missing_usage(tmp_path: Path) -> None:
    spec, rows = _synthetic(tmp_path)
    server = FakeServer({rows[2]["question"]: _answer(rows[2])}, usage=False)
    try:
        run = run_gsm8k(server.url, "tiny", spec, doc_ids=[2, 3], num_fewshot=2, apply_chat_template=True)
    finally:
        server.close()
    assert run.mode == "chat" and [s.doc_id for s in run.samples] == [2, 3]
    assert run.metrics["strict-match"].value == pytest.approx(0.5)
    assert run.generated_tokens is None and run.tokens_per_s is None
    path, body = server.requests[0]
    assert path == "/v1/chat/completions"
    assert [m["role"] for m in body["messages"]] == ["user", "assistant", "user", "assistant", "user"]
    assert body["messages"][-1]["content"].startswith("Question: ")
    assert set(body) == {"messages", "model", "max_tokens", "temperature", "stop", "seed", *chat_trace_request()}
    assert body["stop"] == ["Question:", "</s>", "<|im_end|>"] and body["max_tokens"] == 256
    assert body["logprobs"] is True and body["top_logprobs"] == TOP_LOGPROBS


@pytest.mark.slow
def test_server_errors_during_the_run_are_user_errors(tmp_path: Path) -> None:
    spec, _ = _synthetic(tmp_path, n_test=2)
    server = FakeServer({}, status=500)
    try:
        with pytest.raises(UserError, match=r"requests to .*/v1/completions failed"):
            run_gsm8k(server.url, "tiny", spec, limit=1, num_fewshot=0, max_retries=1)
    finally:
        server.close()


def _tiny_llama(folder: Path) -> Path:
    try:
        from engine.checkpoints.tiny import make_tiny_checkpoint
    except ImportError:  # the project's builder is optional here; a local one does the same job
        pass
    else:
        return make_tiny_checkpoint(folder, "llama", num_layers=1)
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(["Question: How many? Answer: 3 + 4 = 7\n#### 7"] * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(folder)
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=len(fast),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=1024,
        bos_token_id=0,
        eos_token_id=1,
    )
    LlamaForCausalLM(cfg).save_pretrained(folder)
    return folder


@pytest.mark.slow
def test_parse_real_hf_lm_eval_output(tmp_path: Path) -> None:
    from lm_eval import simple_evaluate

    spec, rows = _synthetic(tmp_path, n_test=3)
    ckpt = _tiny_llama(tmp_path / "tiny")
    out = simple_evaluate(
        model="hf",
        model_args=f"pretrained={ckpt},device=cpu,dtype=float32",
        tasks=[spec.name],
        task_manager=spec.task_manager(),
        limit=2,
        num_fewshot=1,
        gen_kwargs={"max_gen_toks": 8},
        log_samples=True,
    )
    run = eval_run_from_lm_eval(out, spec.name, label="hf")
    assert run.n_shot == 1 and run.version == "3.0"
    assert set(run.metrics) == {"strict-match", "flexible-extract"}
    assert all(0.0 <= m.value <= 1.0 and m.name == "exact_match" for m in run.metrics.values())
    assert [s.doc_id for s in run.samples] == [0, 1]
    raw = {(s["doc_id"], s["filter"]): s for s in out["samples"][spec.name]}
    for s in run.samples:
        assert s.question == rows[s.doc_id]["question"]
        assert s.gold == rows[s.doc_id]["answer"].split("#### ")[1]
        assert s.generated == raw[(s.doc_id, "strict-match")]["resps"][0][0]
        for f in ("strict-match", "flexible-extract"):
            assert s.extracted[f] == raw[(s.doc_id, f)]["filtered_resps"][0]
            assert s.correct[f] == (raw[(s.doc_id, f)]["exact_match"] == 1.0)
    for f, m in run.metrics.items():
        assert m.value == pytest.approx(sum(s.correct[f] for s in run.samples) / 2)


def test_the_servers_reason_for_a_refused_request_is_kept():
    import logging

    from evals.lm_eval_runner import ServerRefusals, _AbandonedRequests

    refusals = ServerRefusals()
    log = logging.getLogger("lm_eval.models.api_models.test")
    log.addHandler(refusals)
    try:
        body = {"error": {"message": "the prompt has 1947 tokens but the plan's max_model_len is 256"}}
        log.warning("API request failed! Status code: 400, Response text: %s. Retrying...", json.dumps(body))
    finally:
        log.removeHandler(refusals)
    assert refusals.reason == "the prompt has 1947 tokens but the plan's max_model_len is 256"
    import aiohttp

    exc = aiohttp.ClientError("400")
    record = logging.LogRecord("asyncio", logging.ERROR, "", 0, "Task exception was never retrieved", (), None)
    record.exc_info = (type(exc), exc, None)
    assert not _AbandonedRequests().filter(record)
    record.exc_info = (ValueError, ValueError("mine"), None)
    assert _AbandonedRequests().filter(record)
