"""What nn.Module's call machinery costs a decode step: the model forward of one step, streamlined or not.

    GOMP_CPU_AFFINITY="0 1" .venv/bin/python benchmarks/module_call_overhead.py PLAN [KEY=VALUE ...] [--batch 16]
        [--prompt-len 128] [--calls 50] [--rounds 5]

Runs the plan on one rank (tp 1, dcp 1), generates a few tokens for `--batch` seeded prompts, keeps the inputs of
its first decode step, then times the model forward of that step in place (`--calls` forwards a round, the KV
write landing on the same slots each time) in two forms, alternating round by round: as the engine runs it
(`streamline_modules`: calling a module runs its forward directly) and with every module back on its own class, so
each call goes through nn.Module.__call__. Prints ms per forward, the best round of each form, and the difference;
the two forms compute the same bits (checked). A deep model with tiny layers (`dcpctl model tiny ... --num-layers
30 --hidden-size 64`) shows the per-step cost alone; a real model shows its share of a step.
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("plan")
    parser.add_argument("overrides", nargs="*", help="KEY=VALUE plan overrides")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--calls", type=int, default=50, help="forwards per timed round")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds of each form, alternating")
    args = parser.parse_args()
    print(json.dumps(measure(args)))


def measure(args: argparse.Namespace) -> dict[str, float | int | str]:
    """Best ms per forward of one decode step's model forward, streamlined and through nn.Module.__call__."""
    from engine.attention.backend import step_metadata
    from engine.core.sequence import SamplingParams
    from engine.llm import LLM
    from engine.runtime.model_runner import ModelRunner

    captured: dict = {}
    execute = ModelRunner.execute

    def capture(self, step):
        if "metadata" not in captured and step.chunks and not step.num_prefills:
            captured["runner"] = self
            captured["ids"], captured["positions"], captured["metadata"] = self.prepare_inputs(step)
        return execute(self, step)

    ModelRunner.execute = capture
    llm = LLM(args.plan, [*args.overrides, "parallel.tp=1", "parallel.dcp=1"])
    try:
        g = torch.Generator().manual_seed(0)
        vocab = llm.engine.runner.vocab_size
        prompts = [torch.randint(10, vocab - 1, (args.prompt_len,), generator=g).tolist() for _ in range(args.batch)]
        llm.generate(prompts, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
        model = captured["runner"].model
        streamlined = {module: type(module) for module in model.modules()}
        plain = {module: cls.__mro__[1] for module, cls in streamlined.items()}  # the class before streamlining

        def use(classes: dict) -> None:
            for module, cls in classes.items():
                module.__class__ = cls

        def forward() -> torch.Tensor:
            return model(captured["ids"], captured["positions"])

        best = {"streamlined": float("inf"), "nn.Module calls": float("inf")}
        with torch.inference_mode(), step_metadata(captured["metadata"]):
            outputs = {}
            for form, classes in (("streamlined", streamlined), ("nn.Module calls", plain)):
                use(classes)
                outputs[form] = forward()
            if not torch.equal(*outputs.values()):
                raise SystemExit("the two forms computed different hidden states")
            for round_ in range(args.rounds + 1):  # round 0 warms both forms up
                for form, classes in (("streamlined", streamlined), ("nn.Module calls", plain)):
                    use(classes)
                    start = time.perf_counter()
                    for _ in range(args.calls):
                        forward()
                    if round_:
                        best[form] = min(best[form], (time.perf_counter() - start) / args.calls)
            use(streamlined)
    finally:
        ModelRunner.execute = execute
        llm.close()
    ms = {form: round(1e3 * seconds, 3) for form, seconds in best.items()}
    return {
        "plan": args.plan,
        "overrides": " ".join(args.overrides),
        "batch": args.batch,
        "modules": len(streamlined),
        **{f"{form} ms": value for form, value in ms.items()},
        "saved ms": round(ms["nn.Module calls"] - ms["streamlined"], 3),
    }


if __name__ == "__main__":
    main()
