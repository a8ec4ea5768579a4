"""Speculative decoding with a draft model (method draft_model), one rank: greedy output equals the same plan's
without speculation and HF transformers token for token, with a draft that is often wrong and one that is the
target itself; the draft's cache holds the accepted tokens' KV after rollbacks; sampling keeps the target's
distribution. Layouts of several ranks: tests/test_speculative_layouts.py."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from tests.oracle import LOGPROB_TOL, hf_greedy, prompt_ids, record_shrinks, write_plan
from tests.test_speculative import LENGTHS, NEW_TOKENS, VerifySpy, chi_square_p_value, greedy, kv_of_positions, run

DRAFT = {"speculative_config.method": "draft_model", "speculative_config.num_speculative_tokens": 3}


def drafted(draft, **settings) -> dict:
    return {**DRAFT, "speculative_config.model": str(draft), **settings}


@pytest.mark.parametrize("arch", ["llama", "deepseek_v2"])
def test_greedy_equals_plain_and_hf(tmp_path, tiny_models, noisy_drafts, monkeypatch, arch):
    """An often-wrong draft (all, some and none of its proposals accepted) and the target as its own draft (every
    proposal accepted): the plain run's and HF's tokens, and counters that add up."""
    target = tiny_models(arch)
    prompts = prompt_ids(len(LENGTHS), LENGTHS, seed=5)
    plain, plain_stats = run(tmp_path, target, {}, prompts, greedy(), "plain.yaml")
    spy = VerifySpy(monkeypatch)
    for name, draft in (("noisy", noisy_drafts(arch)), ("self", target)):
        spy.calls.clear()
        spec, stats = run(tmp_path, target, drafted(draft), prompts, greedy(), f"{name}.yaml")
        for ids, a, b in zip(prompts, plain, spec, strict=True):
            assert b.token_ids == a.token_ids, f"{name}: prompt of {len(ids)} tokens diverged from the plain run"
            tokens, logprobs = hf_greedy(target, ids, NEW_TOKENS)
            assert b.token_ids == tokens
            assert max(abs(lp.logprob - x) for lp, x in zip(b.logprobs, logprobs, strict=True)) < LOGPROB_TOL
        counts = stats["speculative"]
        assert counts["proposed"] == sum(p for p, _ in spy.calls) == sum(o.speculative.proposed for o in spec)
        assert counts["accepted"] == sum(a for _, a in spy.calls) == sum(o.speculative.accepted for o in spec)
        assert counts["verifications"] == len(spy.calls)
        if name == "self":
            assert counts["accepted"] == counts["proposed"] > 0
            assert stats["steps"] < plain_stats["steps"]
        else:
            spy.assert_all_kinds()


def assert_draft_kv(tmp_path, draft, settings, drafter_runner, block_table: list[int], tokens: list[int]) -> None:
    """The drafter's KV of the tokens' positions (through `block_table`) is what the draft model alone computes for
    them."""
    with LLM(write_plan(tmp_path, draft, settings, "draft.yaml")) as alone:
        d = alone.engine.add_request(tokens, greedy(2))
        alone.engine.step()  # the draft's prefill of those tokens
        torch.testing.assert_close(
            kv_of_positions(drafter_runner, block_table, len(tokens)),
            kv_of_positions(alone.engine.runner, d.block_table, len(tokens)),
            rtol=1e-4,
            atol=1e-4,
        )


@pytest.mark.parametrize("arch", ["llama", "deepseek_v2"])
def test_rollback_keeps_both_caches_those_of_the_accepted_tokens(tmp_path, tiny_models, noisy_drafts, arch):
    """After rejections: the block pool (free order, reference counts, block table) is the plain run's at the same
    length, the target's KV of the computed positions is the plain run's, and the draft's KV of the positions it
    holds is what the draft model alone computes for those tokens; after both finish, every block is free again."""
    target, draft = tiny_models(arch), noisy_drafts(arch)
    settings = {"cache.block_size": 4}
    prompt = prompt_ids(1, [22], seed=8)[0]
    params = greedy(48)
    with LLM(write_plan(tmp_path, target, drafted(draft, **settings), "spec.yaml")) as spec:
        # the plain run with the blocks the draft's plan affords (the budget less the draft's KV)
        same_blocks = {**settings, "cache.memory": f"{spec.engine.runner.kv_cache_bytes}B"}
        with LLM(write_plan(tmp_path, target, same_blocks, "plain.yaml")) as plain:
            blocks = spec.engine.blocks
            assert plain.engine.blocks.num_blocks == blocks.num_blocks
            given_back = record_shrinks(blocks)
            s = spec.engine.add_request(prompt, params)
            while s.num_output_tokens < 30:
                spec.engine.step()
            assert s.spec.proposed > s.spec.accepted > 0
            assert any(given_back), "no rejected proposal spilled into a block of its own: the test lost its point"
            p = plain.engine.add_request(prompt, params)
            while len(p) < len(s):
                plain.engine.step()
            assert p.token_ids == s.token_ids
            pb = plain.engine.blocks
            assert (p.num_computed_tokens, p.block_table) == (s.num_computed_tokens, s.block_table)
            assert (list(pb.free), pb.ref_counts, pb.num_free_blocks) == (
                list(blocks.free),
                blocks.ref_counts,
                blocks.num_free_blocks,
            )
            assert blocks.cached == pb.cached
            # verify steps project k + 1 rows where plain decode projects one: other GEMM paths, other summation
            # orders (fp32 KV 1.5e-5 apart on a Zen 4 for MLA; a wrong rollback is O(1) off), as for the draft's KV
            torch.testing.assert_close(
                kv_of_positions(spec.engine.runner, s.block_table, s.num_computed_tokens),
                kv_of_positions(plain.engine.runner, p.block_table, p.num_computed_tokens),
                rtol=1e-4,
                atol=1e-4,
            )
            held, table = min(s.draft_cached, s.num_computed_tokens), list(s.block_table)
            assert held >= s.num_computed_tokens - 1  # the draft lags by at most the last accepted proposal
            while spec.engine.has_unfinished():
                spec.engine.step()
            while plain.engine.has_unfinished():
                plain.engine.step()
            assert p.token_ids == s.token_ids
            assert blocks.num_free_blocks == pb.num_free_blocks == blocks.num_blocks
        assert_draft_kv(tmp_path, draft, settings, spec.engine.drafter.runner, table, s.token_ids[:held])


def test_chunked_prefill_preemption_and_prefix_cache_alongside(tmp_path, tiny_models, noisy_drafts, monkeypatch):
    """A small token budget chunks long prompts while others verify the draft's proposals, a small cache preempts
    (the draft's cache goes with the target's blocks), and a shared prefix is reused: every output is HF's."""
    target, draft = tiny_models("llama"), noisy_drafts("llama")
    shared = prompt_ids(1, [40], seed=2)[0]
    prompts = [*prompt_ids(len(LENGTHS), LENGTHS, seed=1), [*shared, 7, 9], [*shared, 11]]
    # target and draft: 2 layers x 2 x 2 KV heads x 16 dims x 4 B = 512 B/token each: 192 KiB = 48 blocks of 4
    settings = {
        "model.max_model_len": 190,
        "cache.block_size": 4,
        "cache.memory": "192KiB",
        "scheduler.max_num_batched_tokens": 24,
    }
    spy = VerifySpy(monkeypatch)
    with LLM(write_plan(tmp_path, target, drafted(draft, **settings))) as llm:
        assert llm.engine.blocks.num_blocks == 48
        outputs = llm.generate(prompts, greedy())
        assert llm.engine.scheduler.num_preemptions > 0
        assert llm.engine.blocks.prefix_hit_tokens > 0
        assert llm.engine.blocks.num_used_blocks == 0
    spy.assert_all_kinds()
    for ids, out in zip(prompts, outputs, strict=True):
        tokens, logprobs = hf_greedy(target, ids, NEW_TOKENS)
        assert out.token_ids == tokens, f"prompt of {len(ids)} tokens diverged"
        assert max(abs(lp.logprob - x) for lp, x in zip(out.logprobs, logprobs, strict=True)) < LOGPROB_TOL


def test_a_paused_draft_runs_no_forward_and_catches_up_after(tmp_path, tiny_models, noisy_drafts):
    """Two requests above disable_by_batch_size=1: no proposals and no draft forward while both run (the blocks the
    target fills still enter the prefix cache); once the short one finishes, the other's first verification catches
    the draft up on every token it skipped in one forward (its KV then the draft alone's), and both outputs are
    HF's token for token."""
    target, draft = tiny_models("llama"), noisy_drafts("llama")
    settings = {"cache.block_size": 4, "speculative_config.disable_by_batch_size": 1}
    short, long = prompt_ids(2, [10, 17], seed=5)
    with LLM(write_plan(tmp_path, target, drafted(draft, **settings), "spec.yaml")) as llm:
        engine, runner = llm.engine, llm.engine.drafter.runner
        forwards: list[list[int]] = []  # the draft's forwards: each chunk's token count
        execute = runner.execute
        runner.execute = lambda step: forwards.append([len(c.token_ids) for c in step.chunks]) or execute(step)
        a, b = engine.add_request(short, greedy(8)), engine.add_request(long, greedy(40))
        while not a.is_finished:
            engine.step()
        assert forwards == [] and a.spec.proposed == b.spec.proposed == 0
        assert len(engine.blocks.cached) >= len(long) // 4
        skipped = len(b)
        while b.spec.verifications < 3:
            engine.step()
        assert forwards[0] == [skipped], "the first verification did not catch the draft up from the start"
        held, table = min(b.draft_cached, b.num_computed_tokens), list(b.block_table)
        while engine.has_unfinished():
            engine.step()
        assert b.spec.proposed > 0
        for ids, seq in ((short, a), (long, b)):
            assert seq.output_token_ids == hf_greedy(target, ids, seq.params.max_tokens)[0]
        assert_draft_kv(tmp_path, draft, settings, runner, table, b.token_ids[:held])


def test_sampled_tokens_are_distributed_as_without_speculation(tmp_path, tiny_models, noisy_drafts, monkeypatch):
    """Temperature sampling: proposals drawn from the draft's distribution and verified against it (rejection
    sampling with q = the draft's probabilities): the tokens at each of the first output positions over many seeded
    requests are distributed as the plain sampler's (two-sample chi-square)."""
    target, draft = tiny_models("llama"), noisy_drafts("llama")
    prompt = prompt_ids(1, [12], seed=4)[0]
    count, length = 300, 5
    params = [
        SamplingParams(max_tokens=length, temperature=1.0, top_k=20, seed=seed, ignore_eos=True)
        for seed in range(count)
    ]
    settings = {"scheduler.max_num_seqs": count}
    plain, _ = run(tmp_path, target, settings, [prompt] * count, params, "plain.yaml")
    spy = VerifySpy(monkeypatch)
    spec, stats = run(tmp_path, target, drafted(draft, **settings), [prompt] * count, params, "spec.yaml")
    assert 0 < stats["speculative"]["acceptance_rate"] < 1
    assert any(a == 0 for _, a in spy.calls) and any(a > 0 for _, a in spy.calls)
    vocab = 512
    for position in range(length):
        a, b = [0] * vocab, [0] * vocab
        for out in plain:
            a[out.token_ids[position]] += 1
        for out in spec:
            b[out.token_ids[position]] += 1
        assert chi_square_p_value(a, b) > 1e-3, f"output position {position}"


@pytest.fixture
def one_thread():
    """Thousands of tiny draws: torch's second thread only adds synchronisation (10x slower on a busy machine)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.8, top_k=6)])
def test_verify_against_the_drafts_distribution(params, one_thread):
    """Proposals drawn from a draft distribution q and verified against it: the first token is distributed as the
    target's p, and a proposal is accepted with probability sum_x min(p(x), q(x)) (with q taken for a point mass it
    would be sum_x p(x) q(x): the check fails if `verify` ignores q)."""
    from engine.core.sampler import distribution, verify

    g = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 10, generator=g) * 1.5
    p, _ = distribution(logits, [params] * 2)
    q = torch.softmax(logits[:1] + torch.randn(1, 10, generator=g), dim=-1)  # a draft close to the target
    draws, first, accepted = 3000, [0] * 10, 0
    generator = torch.Generator().manual_seed(4)
    for _ in range(draws):
        x = int(torch.multinomial(q[0], 1, generator=generator)[0])
        tokens = verify(logits, [x], params, generator, q)
        first[tokens[0]] += 1
        accepted += len(tokens) == 2
    expected = (p[0] * draws).round().long().tolist()
    assert chi_square_p_value(first, expected) > 1e-3, (first, expected)
    rate, overlap, point_mass = accepted / draws, float(torch.minimum(p[0], q[0]).sum()), float((p[0] * q[0]).sum())
    bound = 4 * (overlap * (1 - overlap) / draws) ** 0.5  # four standard deviations
    assert abs(rate - overlap) < bound and abs(point_mass - overlap) > 2 * bound, (rate, overlap, point_mass)
