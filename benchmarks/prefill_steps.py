"""Where a prefill-heavy batch's time goes, step by step: each step's chunks and its wall time, offline.

    GOMP_CPU_AFFINITY="0 1" .venv/bin/python benchmarks/prefill_steps.py PLAN [KEY=VALUE ...] [--prompts 8]
        [--prompt-len 1024] [--max-tokens 16] [--rounds 3]

Runs the plan on one rank (tp 1, dcp 1) in this process and generates `--max-tokens` forced tokens for `--prompts`
seeded random prompts of `--prompt-len` tokens, `--rounds` times (new prompts each round, after a short warm-up).
Prints each round's wall time, and for the last round one line per step: its wall time (the model runner's
`execute`: the forward, the LM head and the logits' transfer), its prefill chunks as `new tokens+cached context`
and its count of decoding sequences. A chunk with context is a prompt the scheduler split over steps
(`scheduler.max_num_batched_tokens`); comparing steps with and without one shows what chunking costs.
"""

from __future__ import annotations

import argparse
import random
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("plan")
    parser.add_argument("overrides", nargs="*", help="KEY=VALUE plan overrides")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    from engine.core.sequence import SamplingParams
    from engine.llm import LLM

    rng = random.Random(0)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)

    with LLM(args.plan, args.overrides) as llm:
        vocab = min(len(llm.tokenizer), 30000)

        def prompts(count: int, length: int) -> list[list[int]]:
            return [[rng.randrange(vocab) for _ in range(length)] for _ in range(count)]

        runner = llm.engine.runner
        execute, steps = runner.execute, []

        def timed_execute(step):
            start = time.perf_counter()
            result = execute(step)
            steps.append((time.perf_counter() - start, step))
            return result

        runner.execute = timed_execute
        llm.generate(prompts(2, 64), params)
        for r in range(args.rounds):
            steps.clear()
            start = time.perf_counter()
            llm.generate(prompts(args.prompts, args.prompt_len), params)
            print(f"round {r}: {time.perf_counter() - start:.3f} s, {len(steps)} steps")
        for seconds, step in steps:
            chunks = [f"{len(c.token_ids)}+{c.start}" for c in step.chunks if len(c.token_ids) > 1]
            decodes = sum(len(c.token_ids) == 1 for c in step.chunks)
            print(f"  {seconds * 1e3:8.1f} ms  prefill [{' '.join(chunks)}]  decodes {decodes}")


if __name__ == "__main__":
    main()
