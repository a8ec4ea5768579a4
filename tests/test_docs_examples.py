"""The commands the README's tour and the guides' first examples show are run as written, on a tiny checkpoint
where the real model would be slow (`model.path=TINY`, smaller workloads), and the output README shows is real.

Each command is read from the page itself, so an example edited there is the one tested; a command this file does
not know how to run fails the test rather than going untested.
"""

from __future__ import annotations

import glob
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from engine.runtime.launcher import free_port
from tests.test_eval_cmd import write_gsm8k

ROOT = Path(__file__).resolve().parents[1]
# The first ```bash block of each guide whose example runs on one machine without a GPU (multi-node and GPUs don't).
GUIDES = (
    "running.md",
    "evaluating.md",
    "benchmarking.md",
    "choosing-a-layout.md",
    "pd.md",
    "speculative.md",
    "models.md",
    "other-engines.md",
)
TINY_OVERRIDES = ["cache.memory=64MiB"]  # the shipped CPU plans' 1 GiB per rank is for SmolLM2's long contexts


def bash_blocks(text: str) -> list[list[str]]:
    """The command lines of each ```bash block (continuations joined, comments dropped)."""
    blocks = []
    for body in re.findall(r"```bash\n(.*?)```", text, re.DOTALL):
        joined = body.replace("\\\n", " ")
        lines = [line.split("  #")[0].strip() for line in joined.splitlines()]
        blocks.append([line for line in lines if line and not line.startswith("#")])
    return blocks


def readme_tour() -> list[str]:
    text = (ROOT / "README.md").read_text()
    tour = text[text.index("## A five-minute tour") : text.index("## Headline results")]
    return [line for block in bash_blocks(tour) for line in block]


def guide_examples() -> list[str]:
    return [line for name in GUIDES for line in bash_blocks((ROOT / "docs" / "guides" / name).read_text())[0]]


def test_readme_shows_real_plan_show_output():
    from typer.testing import CliRunner

    from dcpctl.cli import app

    text = (ROOT / "README.md").read_text()
    shown = re.search(r"```text\n\$ dcpctl (.+?)\n\.\.\.\n(.*?)```", text, re.DOTALL)
    result = CliRunner().invoke(app, shlex.split(shown[1]), env={"COLUMNS": "110", "NO_COLOR": "1"})
    assert result.exit_code == 0, result.output
    assert shown[2] in result.output


def test_every_example_is_one_this_file_runs():
    for line in readme_tour() + guide_examples():
        words = shlex.split(line)
        assert words[0] in ("dcpctl", "curl"), line
        if words[0] == "dcpctl":
            assert words[1] in ("plan", "run", "eval", "bench", "model"), line


class Examples:
    """Runs example command lines in a scratch folder holding a copy of plans/ (a `--write` or `--output` lands
    there, never in the repository), the commands rewritten for a tiny checkpoint."""

    def __init__(self, tmp: Path, tiny: Path):
        self.tmp = tmp
        self.tiny = tiny
        shutil.copytree(ROOT / "plans", tmp / "plans")
        (tmp / "prompts.txt").write_text("The capital of France is\nOne, two, three,\n")
        self.data = write_gsm8k(tmp / "gsm8k")
        self.env = dict(os.environ, PYTHONPATH=str(ROOT), COLUMNS="120", NO_COLOR="1")
        self.port = None
        self.server = None

    def rewrite(self, words: list[str]) -> list[str]:
        """The command for the tiny checkpoint: its model, small workloads, local data, a free port."""
        words = [match for word in words for match in (sorted(glob.glob(word, root_dir=self.tmp)) or [word])]
        command = words[1]
        if command == "model":
            return words
        if command in ("run", "eval", "bench"):
            words += [f"model.path={self.tiny}", *TINY_OVERRIDES]
            if any("_pd_" in word for word in words):
                words += [f"prefill.model.path={self.tiny}", *(f"prefill.{o}" for o in TINY_OVERRIDES)]
        smaller = {"--limit": "2", "--data-dir": str(self.data), "--num-prompts": "2", "--max-tokens": "8"}
        added = {}  # options the tiny run needs, given unless the example sets them
        if command == "eval":
            added = {"--num-fewshot": "1", "--max-gen-toks": "8"}
        if command == "bench":
            added = {"--input-len": "16", "--output-len": "4", "--warmup": "0"}
        for i, word in enumerate(words[:-1]):
            if word in smaller or word in added:
                words[i + 1] = smaller.get(word) or added.pop(word)
        return words + [word for option, value in added.items() for word in (option, value)]

    def run(self, line: str) -> None:
        words = shlex.split(line)
        if words[0] == "curl":
            assert self.server is not None, f"{line}: no server started before it"
            words = [w.replace("127.0.0.1:8000", f"127.0.0.1:{self.port}") for w in words]
            out = subprocess.run(words, capture_output=True, text=True, timeout=120, check=True).stdout
            assert '"text"' in out, out
            self.stop_server()
            return
        self.stop_server()
        words = self.rewrite(words)
        serving = words[1] == "run" and not {"--prompt", "--prompts-file"} & set(words)
        argv = [sys.executable, "-m", "dcpctl.cli", *words[1:]]
        if serving:
            # A free port can be taken by another worker's process before the server binds it: then a new one.
            for attempt in range(3):
                self.port = free_port()
                self.server = subprocess.Popen(  # SIGINT as in a terminal, even when this run inherited it ignored
                    [*argv, f"serve.port={self.port}"],
                    cwd=self.tmp,
                    env=self.env,
                    stderr=subprocess.PIPE,
                    text=True,
                    preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
                )
                if self.wait_healthy(port_race_ok=attempt < 2):
                    return
        done = subprocess.run(argv, cwd=self.tmp, env=self.env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, f"{line}\n-> {shlex.join(words)}\n{done.stdout}\n{done.stderr}"

    def wait_healthy(self, port_race_ok: bool) -> bool:
        """True once the server answers /health; False if it exited because its port was taken meanwhile (when
        `port_race_ok`)."""
        deadline = time.monotonic() + 300
        url = f"http://127.0.0.1:{self.port}/health"
        while time.monotonic() < deadline:
            if self.server.poll() is not None:
                error = self.server.stderr.read()
                self.server = None
                assert port_race_ok and f"port={self.port} on 127.0.0.1 is already in use" in error, error
                return False
            try:
                if httpx.get(url, timeout=2, trust_env=False).status_code == 200:
                    return True
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise AssertionError("the served example never became healthy")

    def stop_server(self) -> None:
        if self.server is None:
            return
        self.server.send_signal(signal.SIGINT)
        code = self.server.wait(timeout=120)
        self.server = None
        assert code == 0, f"the served example exited {code} on SIGINT"


@pytest.fixture
def examples(tmp_path, tiny_models):
    runner = Examples(tmp_path, tiny_models("llama", num_layers=1))
    yield runner
    if runner.server is not None:
        runner.server.kill()
        runner.server.wait()


@pytest.mark.slow
@pytest.mark.multiproc
def test_readme_tour_runs(examples):
    for line in readme_tour():
        examples.run(line)
    examples.stop_server()


@pytest.mark.slow
@pytest.mark.multiproc
def test_guides_first_examples_run(examples):
    for line in guide_examples():
        examples.run(line)
    examples.stop_server()
