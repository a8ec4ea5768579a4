"""The hand-off inside one process: a prefill engine exports, a decode engine claims and pulls over NIXL (one rank
each, so both fit in one process), and its greedy tokens are HF's."""

from __future__ import annotations

import time

import pytest

from engine.core.sequence import SamplingParams
from engine.core.startup import start_engine
from engine.errors import UserError
from engine.kv_transfer.handles import KVRole, RemotePrefill
from engine.plan.checks import resolve_plan
from tests.oracle import LOGPROB_TOL, hf_greedy, prompt_ids, write_plan

NEW_TOKENS = 12


def run_until_done(engine, seqs):
    while not all(s.is_finished for s in seqs):
        engine.step()


@pytest.fixture
def pair(tmp_path, tiny_models):
    folder = tiny_models("llama")
    prefill_plan = write_plan(tmp_path, folder, {"cache.block_size": 16}, name="prefill.yaml")
    decode_plan = write_plan(tmp_path, folder, {"cache.block_size": 8, "cache.memory": "256KiB"}, name="decode.yaml")
    prefill = start_engine(resolve_plan(prefill_plan), kv_role=KVRole("prefill", lease_s=30))
    decode = start_engine(resolve_plan(decode_plan), kv_role=KVRole("decode", transfer_timeout_s=10))
    yield folder, prefill, decode
    close_engines(prefill, decode)


def close_engines(*engines) -> None:
    """Close in-process engines: their NIXL agents, and the thread that stepped them gets its CPU set back."""
    for engine in engines:
        engine.runner.kv_exporter and engine.runner.kv_exporter.close()
        engine.runner.kv_receiver and engine.runner.kv_receiver.close()
        engine.shutdown()


def hand_off(prefill, decode, ids, params):
    """Prefill with max_tokens 1 and export; then claim on the decode side and queue the remote sequence."""
    seq = prefill.add_request(ids, SamplingParams(max_tokens=1, temperature=0), export=True)
    run_until_done(prefill, [seq])
    manifest = prefill.handoff.exports.claim(seq.transfer_id)
    remote = RemotePrefill(prefill.handoff.info, manifest, time.monotonic(), "in-process")
    return decode.add_request(ids, params, remote=remote), seq.transfer_id


def test_pulled_prompts_continue_exactly_as_hf_and_every_block_comes_back(pair):
    folder, prefill, decode = pair
    lengths = [1, 2, 7, 8, 9, 16, 17, 33, 70]
    prompts = prompt_ids(len(lengths), lengths, seed=3)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, logprobs=1)
    handed = [hand_off(prefill, decode, ids, params) for ids in prompts]
    run_until_done(decode, [s for s, _ in handed])
    for (seq, transfer_id), ids in zip(handed, prompts, strict=True):
        tokens, logprobs = hf_greedy(folder, ids, NEW_TOKENS)
        assert seq.output_token_ids == tokens, f"prompt of {len(ids)} tokens diverged"
        assert max(abs(a.logprob - b) for a, b in zip(seq.logprobs, logprobs, strict=True)) < LOGPROB_TOL
        assert seq.kv_transfer["tokens"] == len(ids) - 1 and seq.kv_transfer["first_decode_s"] >= 0
        assert prefill.handoff.exports.release(transfer_id)
    stats = decode.stats()["kv_transfer"]
    assert stats["pulls"] == len(lengths) and stats["pulls_failed"] == 0
    assert decode.stats()["used_blocks"] == 0
    assert prefill.stats()["used_blocks"] == 0 and prefill.stats()["exports_live"] == 0


def test_a_pull_that_cannot_read_fails_the_request_naming_the_prefill_side(pair):
    _, prefill, decode = pair
    ids = prompt_ids(1, [40], seed=4)[0]
    seq, transfer_id = hand_off(prefill, decode, ids, SamplingParams(max_tokens=4, temperature=0))
    exporter = prefill.runner.kv_exporter
    exporter.close()  # its agent is gone: the decode rank cannot reach it
    run_until_done(decode, [seq])
    assert seq.finish_reason == "error"
    assert seq.error.startswith(
        f"the KV transfer from the prefill instance in-process failed on decode rank 0: "
        f"cannot connect to {exporter.agent.name} (nixlBackendError"
    )
    assert decode.stats()["used_blocks"] == 0 and decode.stats()["kv_transfer"]["pulls_failed"] == 1
    prefill.handoff.exports.release(transfer_id)


def test_exports_expire_and_late_or_forged_claims_say_so(pair):
    _, prefill, _ = pair
    exports = prefill.handoff.exports
    seq = prefill.add_request([5, 6, 7], SamplingParams(max_tokens=1, temperature=0), export=True)
    run_until_done(prefill, [seq])
    assert prefill.stats()["exports_live"] == 1 and prefill.stats()["used_blocks"] == 1
    exports.lease_s = 0.0
    exports.claim(seq.transfer_id)  # renews to now + 0 s
    assert exports.expire() == 1
    assert prefill.stats()["used_blocks"] == 0
    with pytest.raises(Exception, match="was expired") as late:
        exports.claim(seq.transfer_id)
    assert late.value.status == 410
    with pytest.raises(Exception, match="unknown transfer") as forged:
        exports.claim("0" * 32)
    assert forged.value.status == 404


def test_an_instance_without_the_role_refuses_hand_off_requests(pair):
    _, prefill, decode = pair
    with pytest.raises(UserError, match="not a prefill instance"):
        decode.add_request([1, 2], SamplingParams(), export=True)
    with pytest.raises(UserError, match="not a decode instance"):
        prefill.add_request([1, 2], SamplingParams(), remote=object())
