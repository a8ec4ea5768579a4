"""Speculative decoding (ngram): the proposer, the block rollback, the verifier, and one-rank engine runs that must
equal the same plan without speculation and HF transformers token for token. Layouts of several ranks:
tests/test_speculative_layouts.py."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.core import engine as engine_module
from engine.core.block_manager import BlockManager
from engine.core.sampler import _sorted_distribution, verify
from engine.core.sequence import Sequence
from engine.core.speculative import propose_ngram
from tests.oracle import LOGPROB_TOL, hf_greedy, prompt_ids, record_shrinks, write_plan

NGRAM = {
    "speculative_config.method": "ngram",
    "speculative_config.num_speculative_tokens": 4,
    "speculative_config.prompt_lookup_min": 1,
    "speculative_config.prompt_lookup_max": 3,
}
LENGTHS = [1, 6, 10, 17, 30, 50]
NEW_TOKENS = 40


def chi_square_p_value(counts_a: list[int], counts_b: list[int]) -> float:
    """Two-sample chi-square test that two count vectors come from one distribution (categories of fewer than 10
    expected counts pooled into one); the p-value."""
    a, b = torch.tensor(counts_a, dtype=torch.float64), torch.tensor(counts_b, dtype=torch.float64)
    total = a + b
    rare = total < 10
    if rare.any():
        a = torch.cat([a[~rare], a[rare].sum().reshape(1)])
        b = torch.cat([b[~rare], b[rare].sum().reshape(1)])
        total = a + b
    keep = total > 0
    a, b, total = a[keep], b[keep], total[keep]
    na, nb = a.sum(), b.sum()
    expected_a, expected_b = total * na / (na + nb), total * nb / (na + nb)
    statistic = ((a - expected_a) ** 2 / expected_a + (b - expected_b) ** 2 / expected_b).sum()
    dof = len(total) - 1
    if dof == 0:
        return 1.0  # one category: nothing differs
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), statistic / 2))


# ---- the proposer ----


@pytest.mark.parametrize(
    ("tokens", "k", "min_n", "max_n", "proposal"),
    [
        ([1, 2, 3, 4, 2, 3], 4, 2, 3, [4, 2, 3]),  # vLLM's docstring: [4,2,3] has no match, [2,3] does; 3 follow
        ([1, 2, 3, 4, 2, 3], 1, 2, 3, [4]),
        ([5, 1, 2, 9, 1, 2, 7, 1, 2], 2, 1, 2, [9, 1]),  # the earliest of the longest matches
        ([1, 2, 3, 8, 9, 3, 1, 2, 3], 3, 1, 3, [8, 9, 3]),  # [1,2,3] beats the later [3]
        ([7, 7, 7, 7], 3, 1, 3, [7]),  # [7,7,7] at 0 is followed by the last token only
        ([1, 2, 3, 4], 3, 1, 3, []),  # no match
        ([1, 2, 1], 3, 2, 3, []),  # only a 1-gram matches: below prompt_lookup_min
        ([4], 3, 1, 3, []),
        ([1, 2, 1, 2], 0, 1, 3, []),  # no room
    ],
)
def test_ngram_proposals_like_vllm(tokens, k, min_n, max_n, proposal):
    assert propose_ngram(tokens, k, min_n, max_n) == proposal


def test_ngram_matches_brute_force():
    """Against the definition over many random sequences of a small alphabet (many matches of every length)."""
    g = torch.Generator().manual_seed(0)
    for _ in range(500):
        tokens = torch.randint(0, 3, (int(torch.randint(1, 30, (1,), generator=g)),), generator=g).tolist()
        k, min_n, max_n = 3, 1, 4
        expected: list[int] = []
        for n in range(max_n, min_n - 1, -1):
            starts = [i for i in range(len(tokens) - n) if tokens[i : i + n] == tokens[len(tokens) - n :]]
            if n < len(tokens) and starts:
                expected = tokens[starts[0] + n : starts[0] + n + k]
                break
        assert propose_ngram(tokens, k, min_n, max_n) == expected, tokens


# ---- block rollback ----


@pytest.mark.parametrize("prefix_caching", [True, False])
@pytest.mark.parametrize("dcp_size", [1, 2])
def test_shrink_gives_blocks_back_where_grow_took_them(prefix_caching, dcp_size):
    """Growing for proposals and shrinking after rejecting them leaves the pool exactly as before."""
    blocks = BlockManager(num_blocks=16, block_size=4, dcp_size=dcp_size, prefix_caching=prefix_caching)
    span = 4 * dcp_size
    other = Sequence("o", list(range(3 * span)), SamplingParams())
    assert blocks.grow(other, 3 * span)
    blocks.release(other)  # freed blocks: the free list is no longer in id order
    seq = Sequence("s", list(range(span - 1)), SamplingParams())
    assert blocks.grow(seq, span - 1)
    seq.num_computed_tokens = span - 1
    before = (list(blocks.free), list(blocks.ref_counts), list(seq.block_table), blocks.num_free_blocks)
    assert blocks.grow(seq, span - 1 + 2 * span)  # proposals spill over two more virtual blocks
    assert len(seq.block_table) == 3
    blocks.shrink(seq, span - 1)
    assert (list(blocks.free), list(blocks.ref_counts), list(seq.block_table), blocks.num_free_blocks) == before


@pytest.mark.parametrize("dcp_size", [1, 2, 3, 4])
@pytest.mark.parametrize("interleave", [1, 2, 4, 8])
def test_rejected_positions_lie_past_every_ranks_length(dcp_size, interleave):
    """What rollback relies on, over every computed length and proposal count: a verification of [L-1, L+k) writes
    each position's KV on its owner at local index `local_index`; after accepting a of the k proposals, the positions
    kept (< L + a) are exactly those below each rank's new `local_len`, and every rejected one is at or past it, so
    attention (which reads a rank's first local_len slots) never sees it and the next writes overwrite it in order."""
    from engine import dcp

    for length in range(1, 3 * interleave * dcp_size + 2):
        for k in range(1, 6):
            for accepted in range(k + 1):
                kept = length + accepted  # positions with valid KV after the step
                for r in range(dcp_size):
                    new_len = dcp.local_len(kept, r, interleave, dcp_size)
                    for p in range(length - 1, length + k):
                        if dcp.owner(p, interleave, dcp_size) != r:
                            continue
                        index = dcp.local_index(p, interleave, dcp_size)
                        assert (index < new_len) == (p < kept), (length, k, accepted, r, p)


# ---- the verifier ----


def test_greedy_verification_accepts_while_equal():
    logits = torch.full((4, 8), -1.0)
    for row, best in enumerate([5, 6, 1, 3]):
        logits[row, best] = 2.0
    greedy = SamplingParams(temperature=0)
    assert verify(logits, [5, 6, 1], greedy, None) == [5, 6, 1, 3]  # all accepted, then the bonus token
    assert verify(logits, [5, 2, 1], greedy, None) == [5, 6]  # partly accepted: the model's token replaces it
    assert verify(logits, [0, 6, 1], greedy, None) == [5]  # rejected at the first token


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.7, top_k=5),
        SamplingParams(temperature=1.3, top_p=0.8),
    ],
)
def test_rejection_sampling_keeps_the_target_distribution(params):
    """Whatever the proposal, each token the verifier yields is distributed as the sampler's own draw: the first
    token over many seeds (accepted or redrawn) and the second (after an accepted first) match the target."""
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 12, generator=g) * 1.5
    probs, order, _ = _sorted_distribution(logits, [params] * 3)
    target = torch.zeros_like(probs).scatter_(1, order, probs)
    target /= target.sum(dim=-1, keepdim=True)
    proposal = [int(target[0].argsort()[-2]), int(target[1].argmax())]  # a likely but not the likeliest first
    draws = 2000
    first = [0] * 12
    second = [0] * 12
    generator = torch.Generator().manual_seed(2)
    for _ in range(draws):
        tokens = verify(logits, proposal, params, generator)
        first[tokens[0]] += 1
        if tokens[0] == proposal[0] and len(tokens) > 1:
            second[tokens[1]] += 1
    for counts, row in ((first, 0), (second, 1)):
        n = sum(counts)
        expected = (target[row] * n).round().long().tolist()  # a sample the size of `counts` drawn exactly
        assert chi_square_p_value(counts, expected) > 1e-3, (counts, expected)
        assert all(c == 0 for c, p in zip(counts, target[row].tolist(), strict=True) if p == 0)  # top-k/top-p hold


def test_chi_square_detects_a_different_distribution():
    """The statistic used above can fail: a proposal accepted with probability 1 is caught."""
    counts = [900, 100, 0, 0]
    assert chi_square_p_value(counts, [500, 300, 150, 50]) < 1e-6


# ---- one-rank engine runs ----


class VerifySpy:
    """Records (proposed, accepted) of every verification the engine runs (the real verifier does the work)."""

    def __init__(self, monkeypatch):
        self.calls: list[tuple[int, int]] = []
        self.yielded: list[tuple[str, int, list[int]]] = []  # request id, output tokens before, tokens yielded
        real_verify, real_step = engine_module.verify, engine_module.LLMEngine._verify
        current: list = []

        def verify_spy(logits, draft, params, generator, draft_probs=None):
            tokens = real_verify(logits, draft, params, generator, draft_probs)
            self.calls.append((len(draft), len(tokens) - 1))
            seq = current[-1]
            self.yielded.append((seq.request_id, seq.num_output_tokens, tokens))
            return tokens

        def step_spy(engine, seq, chunk, logits):
            current.append(seq)
            return real_step(engine, seq, chunk, logits)

        monkeypatch.setattr(engine_module, "verify", verify_spy)
        monkeypatch.setattr(engine_module.LLMEngine, "_verify", step_spy)

    def assert_all_kinds(self) -> None:
        """Proposals were accepted whole, accepted in part, and rejected at the first token."""
        assert any(a == p for p, a in self.calls), self.calls
        assert any(0 < a < p for p, a in self.calls), self.calls
        assert any(a == 0 for _, a in self.calls), self.calls


def greedy(n=NEW_TOKENS, **kw):
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, logprobs=1, **kw)


def run(tmp_path, folder, settings, prompts, params, name):
    with LLM(write_plan(tmp_path, folder, settings, name)) as llm:
        outputs = llm.generate(prompts, params)
        stats = llm.engine.stats()
        assert llm.engine.blocks.num_used_blocks == 0
    return outputs, stats


@pytest.mark.parametrize("arch", ["llama", "deepseek_v2"])
def test_greedy_equals_plain_and_hf(tmp_path, echo_models, monkeypatch, arch):
    folder = echo_models(arch)
    prompts = prompt_ids(len(LENGTHS), LENGTHS, seed=5)
    plain, plain_stats = run(tmp_path, folder, {}, prompts, greedy(), "plain.yaml")
    spy = VerifySpy(monkeypatch)
    spec, stats = run(tmp_path, folder, NGRAM, prompts, greedy(), "spec.yaml")
    spy.assert_all_kinds()
    for ids, a, b in zip(prompts, plain, spec, strict=True):
        assert b.token_ids == a.token_ids, f"prompt of {len(ids)} tokens diverged from the plain run"
        tokens, logprobs = hf_greedy(folder, ids, NEW_TOKENS)
        assert b.token_ids == tokens
        ours = [lp.logprob for lp in b.logprobs]
        assert max(abs(x - y) for x, y in zip(ours, logprobs, strict=True)) < LOGPROB_TOL
    counts = stats["speculative"]
    assert counts["proposed"] == sum(p for p, _ in spy.calls) > counts["accepted"] == sum(a for _, a in spy.calls) > 0
    assert counts["proposed"] == sum(o.speculative.proposed for o in spec)
    assert "speculative" not in plain_stats and all(o.speculative is None for o in plain)
    assert stats["steps"] < plain_stats["steps"]  # several tokens per verification


def kv_of_positions(runner, block_table: list[int], num_positions: int) -> torch.Tensor:
    """The cached K (and V) of a sequence's first positions in a one-rank runner's cache, every layer (slot = block *
    B + offset)."""
    from engine import dcp
    from engine.layers.attention import PagedAttention

    c = runner.cache_layout
    slots = [dcp.slot(p, 0, block_table, c.block_size, c.interleave, 1) for p in range(num_positions)]
    blocks, offsets = torch.tensor(slots) // c.block_size, torch.tensor(slots) % c.block_size
    parts = []
    for layer in runner.model.modules():
        if isinstance(layer, PagedAttention):
            for cache in (layer.key_cache, layer.value_cache):
                if cache is not None:
                    parts.append(cache[blocks, offsets].flatten(1))
    return torch.cat(parts, dim=1)


def _pool(blocks: BlockManager) -> tuple:
    return (list(blocks.free), list(blocks.ref_counts), list(blocks.block_hash), dict(blocks.cached))


@pytest.mark.parametrize("arch", ["llama", "deepseek_v2"])
def test_rollback_leaves_the_state_of_the_plain_run(tmp_path, echo_models, arch):
    """After rejections, a speculating sequence's computed length, block table, the block pool (free order, counts,
    prefix-cache hashes) and the KV of its computed positions are those of the plain run at the same length; after
    both finish, the pools (what later requests reuse) are equal."""
    folder = echo_models(arch)
    settings = {"cache.block_size": 4}
    prompt = prompt_ids(1, [22], seed=8)[0]
    params = greedy(48)
    with (
        LLM(write_plan(tmp_path, folder, settings, "plain.yaml")) as plain,
        LLM(write_plan(tmp_path, folder, {**settings, **NGRAM}, "spec.yaml")) as spec,
    ):
        blocks = spec.engine.blocks
        given_back = record_shrinks(blocks)
        s = spec.engine.add_request(prompt, params)
        while s.num_output_tokens < 30:
            spec.engine.step()
        assert not s.is_finished and s.spec.proposed > s.spec.accepted > 0
        assert any(given_back), "no rejected proposal spilled into a block of its own: the test lost its point"
        p = plain.engine.add_request(prompt, params)
        while len(p) < len(s):
            plain.engine.step()
        assert p.token_ids == s.token_ids
        assert (p.num_computed_tokens, p.block_table) == (s.num_computed_tokens, s.block_table)
        assert _pool(p_blocks := plain.engine.blocks) == _pool(spec.engine.blocks)
        assert p_blocks.num_free_blocks == spec.engine.blocks.num_free_blocks
        torch.testing.assert_close(
            kv_of_positions(spec.engine.runner, s.block_table, s.num_computed_tokens),
            kv_of_positions(plain.engine.runner, p.block_table, p.num_computed_tokens),
            rtol=1e-5,
            atol=1e-5,
        )
        while spec.engine.has_unfinished():
            spec.engine.step()
        while plain.engine.has_unfinished():
            plain.engine.step()
        assert p.token_ids == s.token_ids
        assert _pool(plain.engine.blocks) == _pool(spec.engine.blocks)


def test_chunked_prefill_preemption_and_prefix_cache_alongside(tmp_path, echo_models, monkeypatch):
    """A small token budget chunks long prompts while others verify proposals, a small cache preempts, and a shared
    prefix is reused: every output is HF's."""
    folder = echo_models("llama")
    shared = prompt_ids(1, [40], seed=2)[0]
    prompts = [*prompt_ids(len(LENGTHS), LENGTHS, seed=1), [*shared, 7, 9], [*shared, 11]]
    # 2 layers x 2 x 2 KV heads x 16 dims x 4 B = 512 B/token: 96 KiB = 48 blocks of 4 = 192 tokens
    settings = {
        "model.max_model_len": 190,
        "cache.block_size": 4,
        "cache.memory": "96KiB",
        "scheduler.max_num_batched_tokens": 24,
        **NGRAM,
    }
    spy = VerifySpy(monkeypatch)
    with LLM(write_plan(tmp_path, folder, settings)) as llm:
        outputs = llm.generate(prompts, greedy())
        assert llm.engine.scheduler.num_preemptions > 0
        assert llm.engine.blocks.prefix_hit_tokens > 0
        assert llm.engine.blocks.num_used_blocks == 0
    spy.assert_all_kinds()
    for ids, out in zip(prompts, outputs, strict=True):
        tokens, logprobs = hf_greedy(folder, ids, NEW_TOKENS)
        assert out.token_ids == tokens, f"prompt of {len(ids)} tokens diverged"
        assert max(abs(lp.logprob - x) for lp, x in zip(out.logprobs, logprobs, strict=True)) < LOGPROB_TOL


def _stop_string_inside_a_run(tokenizer, out, yielded) -> tuple[int, str] | None:
    """(i, s): output token i is yielded by a verification before its last token, and s is a printable stop string
    whose first occurrence in the output text ends inside token i's text."""
    tokens, text = out.token_ids, out.text
    for rid, before, run_tokens in yielded:
        for i in range(before, before + len(run_tokens) - 1) if rid == out.request_id else ():
            lo, hi = len(tokenizer.decode(tokens[:i])), len(tokenizer.decode(tokens[: i + 1]))
            for length in range(1, 9):
                stop = text[max(0, hi - length) : hi]
                if stop.isprintable() and lo < text.find(stop) + len(stop) <= hi:
                    return i, stop
    return None


def test_stops_and_max_tokens_inside_an_accepted_run(tmp_path, echo_models, monkeypatch):
    """A stop string that completes inside a run of accepted proposals ends the request there, exactly as without
    speculation (the tokens after it are dropped); stop tokens and max_tokens end it as without speculation too."""
    from transformers import AutoTokenizer

    folder = echo_models("deepseek_v2")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    prompts = prompt_ids(len(LENGTHS), LENGTHS, seed=5)
    spy = VerifySpy(monkeypatch)
    full, _ = run(tmp_path, folder, NGRAM, prompts, greedy(), "full.yaml")
    params, inside = [], 0
    for i, out in enumerate(full):
        found = _stop_string_inside_a_run(tokenizer, out, spy.yielded)
        if found is not None and i % 2 == 0:
            params.append(greedy(stop=[found[1]]))
            inside += 1
        else:
            params.append(greedy(stop_token_ids=[out.token_ids[9]]) if i % 4 == 1 else greedy(n=7 + 2 * i))
    assert inside >= 2
    plain, _ = run(tmp_path, folder, {}, prompts, params, "plain.yaml")
    spec, _ = run(tmp_path, folder, NGRAM, prompts, params, "spec.yaml")
    for a, b in zip(plain, spec, strict=True):
        assert (b.token_ids, b.text, b.finish_reason, b.stop_reason) == (
            a.token_ids,
            a.text,
            a.finish_reason,
            a.stop_reason,
        )
        assert [lp.token_id for lp in b.logprobs] == b.token_ids
    assert [o.finish_reason for o in spec].count("stop") >= inside + 1
    assert "length" in {o.finish_reason for o in spec}


def test_sampled_tokens_are_distributed_as_without_speculation(tmp_path, echo_models, monkeypatch):
    """Temperature sampling: over many seeded requests of one prompt, the tokens at each of the first output
    positions (the first from the prompt's step, the next ones from verifications) are distributed as the plain
    sampler's (two-sample chi-square), while proposals were both accepted and rejected."""
    folder = echo_models("llama")
    prompt = prompt_ids(1, [12], seed=4)[0]
    count, length = 300, 6
    params = [
        SamplingParams(max_tokens=length, temperature=1.5, top_p=0.95, seed=seed, ignore_eos=True)
        for seed in range(count)
    ]
    settings = {"scheduler.max_num_seqs": count}
    plain, _ = run(tmp_path, folder, settings, [prompt] * count, params, "plain.yaml")
    spy = VerifySpy(monkeypatch)
    spec, stats = run(tmp_path, folder, {**settings, **NGRAM}, [prompt] * count, params, "spec.yaml")
    assert 0 < stats["speculative"]["acceptance_rate"] < 1
    assert any(a == 0 for _, a in spy.calls)
    vocab = 512
    for position in range(length):
        a, b = [0] * vocab, [0] * vocab
        for out in plain:
            a[out.token_ids[position]] += 1
        for out in spec:
            b[out.token_ids[position]] += 1
        assert chi_square_p_value(a, b) > 1e-3, f"output position {position}"


def _finishing_counters(events: list) -> dict[int, dict]:
    """Choice index -> the `speculative` entry of a stream's chunks; asserts each is on its choice's finishing chunk
    (and only there), for that choice alone."""
    found = {}
    for event in events:
        if event == "[DONE]" or not event["choices"]:
            continue
        (choice,) = event["choices"]
        if choice["finish_reason"] is None:
            assert "speculative" not in event, event
            continue
        (entry,) = event["speculative"]
        assert entry["index"] == choice["index"] not in found
        found[choice["index"]] = entry
    return found


def test_server_reports_speculation_per_request_and_in_stats(tmp_path, echo_models):
    """Over HTTP: n > 1 and streaming speculate like offline generation; each choice's counters are in the response,
    streamed or not (a stream's on each choice's finishing chunk), for completions and chat, and the engine's in
    /v1/engine/stats."""
    from tests.test_server import serve, sse_events

    folder = echo_models("llama")
    prompt = prompt_ids(1, [10], seed=5)[0]
    plan = write_plan(tmp_path, folder, NGRAM)
    with LLM(plan) as llm:
        (offline,) = llm.generate([prompt], greedy(24))
    request = {"model": "tiny-llama", "prompt": prompt, "max_tokens": 24, "temperature": 0}
    chat = {
        "model": "tiny-llama",
        "messages": [{"role": "user", "content": "one two one two one two"}],
        "max_tokens": 24,
        "temperature": 0,
        "ignore_eos": True,
    }
    served = serve(plan)
    try:
        with served.http() as http:
            body = http.post("/v1/completions", json={**request, "n": 2, "return_token_ids": True}).json()
            with http.stream("POST", "/v1/completions", json={**request, "n": 2, "stream": True}) as response:
                streamed = sse_events(response.iter_lines())
            chat_body = http.post("/v1/chat/completions", json=chat).json()
            with http.stream("POST", "/v1/chat/completions", json={**chat, "stream": True}) as response:
                chat_streamed = sse_events(response.iter_lines())
            stats = served.wait_idle()
    finally:
        served.handle.stop()
    assert [c["token_ids"] for c in body["choices"]] == [offline.token_ids] * 2
    assert [s["index"] for s in body["speculative"]] == [0, 1]
    assert body["speculative"][0] == {"index": 0, **offline.speculative.as_dict()}
    assert "".join(c["text"] for c in body["choices"][:1]) == offline.text
    texts = ["".join(e["choices"][0]["text"] for e in streamed[:-1] if e["choices"][0]["index"] == i) for i in (0, 1)]
    assert texts == [offline.text] * 2
    assert _finishing_counters(streamed) == {i: {"index": i, **offline.speculative.as_dict()} for i in (0, 1)}
    (chat_counters,) = chat_body["speculative"]
    assert chat_counters["accepted"] > 0
    assert _finishing_counters(chat_streamed) == {0: chat_counters}
    chat_text = "".join(e["choices"][0]["delta"].get("content", "") for e in chat_streamed[:-1])
    assert chat_text == chat_body["choices"][0]["message"]["content"]
    assert stats["speculative"]["proposed"] == 4 * offline.speculative.proposed + 2 * chat_counters["proposed"]
    assert stats["speculative"]["accepted"] == 4 * offline.speculative.accepted + 2 * chat_counters["accepted"]


def test_bench_rows_count_only_the_measured_run():
    """`dcpctl bench` shows the acceptance of the measured requests: the counters after the run less those before
    (the warm-up's), and its rows only when a target speculates."""
    from engine.core.speculative import SpecCounters
    from evals.bench.report import NONE, BenchReport, TargetBench, bench_grid

    before = SpecCounters(proposed=10, accepted=4, verifications=5).as_dict()
    after = SpecCounters(proposed=50, accepted=34, verifications=25).as_dict()
    measured = SpecCounters.since(before, after)
    assert measured.as_dict() == {
        "proposed": 40,
        "accepted": 30,
        "verifications": 20,
        "acceptance_rate": 0.75,
        "mean_accepted_length": 2.5,
    }
    # targets without metrics (as if they failed): only the speculation rows have values
    plain = TargetBench("plain", "plan", "a.yaml", error="-")
    spec = TargetBench("spec", "plan", "b.yaml", error="-", speculation=measured)
    _, rows = bench_grid(BenchReport({}, {}, [plain, spec]))
    assert ["speculation: proposals accepted", NONE, "75%"] in rows
    assert ["speculation: tokens per verification", NONE, "2.50"] in rows
    _, rows = bench_grid(BenchReport({}, {}, [plain]))
    assert not any(r[0].startswith("speculation") for r in rows)


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_decode_side_of_a_hand_off_speculates_after_the_pull(tmp_path, echo_models, method):
    """P/D: the decode instance pulls the prompt's KV (NIXL, in one process) and then speculates on it: HF's tokens,
    proposals accepted, every block back. A draft model (here the target itself) has no KV of a pulled prompt: its
    first pass prefills it."""
    from engine.core.startup import start_engine
    from engine.kv_transfer.handles import KVRole
    from engine.plan.checks import resolve_plan
    from tests.test_handoff_engine import close_engines, hand_off, run_until_done

    folder = echo_models("llama")
    speculation = NGRAM
    if method == "draft_model":  # the budget also holds the draft's cache
        speculation = {"speculative_config.model": str(folder), "speculative_config.num_speculative_tokens": 3}
        speculation["cache.memory"] = "512KiB"
    prefill_plan = write_plan(tmp_path, folder, {"cache.block_size": 16}, name="prefill.yaml")
    decode_plan = write_plan(
        tmp_path, folder, {"cache.block_size": 8, "cache.memory": "256KiB", **speculation}, "d.yaml"
    )
    prefill = start_engine(resolve_plan(prefill_plan), kv_role=KVRole("prefill", lease_s=30))
    decode = start_engine(resolve_plan(decode_plan), kv_role=KVRole("decode", transfer_timeout_s=10))
    try:
        prompts = prompt_ids(len(LENGTHS), LENGTHS, seed=5)
        handed = [hand_off(prefill, decode, ids, greedy(24)) for ids in prompts]
        run_until_done(decode, [s for s, _ in handed])
        for (seq, transfer_id), ids in zip(handed, prompts, strict=True):
            tokens, logprobs = hf_greedy(folder, ids, 24)
            assert seq.output_token_ids == tokens, f"prompt of {len(ids)} tokens diverged"
            assert max(abs(a.logprob - b) for a, b in zip(seq.logprobs, logprobs, strict=True)) < LOGPROB_TOL
            assert prefill.handoff.exports.release(transfer_id)
        stats = decode.stats()
        assert stats["kv_transfer"]["pulls"] == len(LENGTHS) and stats["kv_transfer"]["pulls_failed"] == 0
        proposed, accepted = stats["speculative"]["proposed"], stats["speculative"]["accepted"]
        assert proposed > accepted > 0 if method == "ngram" else proposed == accepted > 0
        assert stats["used_blocks"] == 0
    finally:
        close_engines(prefill, decode)


def test_disable_by_batch_size_pauses_proposals_in_large_batches(tmp_path, echo_models):
    """No proposals while more sequences than disable_by_batch_size run; they resume once the batch shrinks."""
    folder = echo_models("llama")
    prompts = prompt_ids(3, [6, 10, 17], seed=5)
    params = [greedy(8), greedy(8), greedy(40)]  # two finish early: the third then runs alone
    settings = {**NGRAM, "speculative_config.disable_by_batch_size": 1}
    with LLM(write_plan(tmp_path, folder, settings)) as llm:
        outputs = llm.generate(prompts, params)
    assert [o.speculative.proposed for o in outputs[:2]] == [0, 0]
    assert outputs[2].speculative.accepted > 0
    for ids, out, p in zip(prompts, outputs, params, strict=True):
        assert out.token_ids == hf_greedy(folder, ids, p.max_tokens)[0]
