"""P/D plans (a decode plan whose `disagg` section names its prefill plan): the pair's checks, each problem with its
fix and all reported at once; the transport missing makes only P/D plans invalid; `plan show` draws the hand-off
with the descriptor counts the layouts imply."""

from __future__ import annotations

import pytest
import yaml
from typer.testing import CliRunner

from dcpctl.cli import app
from engine.errors import UserError
from engine.kv_transfer import transport
from engine.plan.checks import validate_plan_file
from engine.plan.disagg import handoff_summary
from tests.conftest import mla_fields, write_config

runner = CliRunner()


def _merged(base: str, extra: str) -> str:
    """`base` YAML with the sections of `extra` merged over it field by field (a plan may not repeat a key)."""
    data = yaml.safe_load(base)
    for section, fields in (yaml.safe_load(extra) or {}).items():
        data[section] = {**data.get(section, {}), **fields} if isinstance(fields, dict) else fields
    return yaml.safe_dump(data)


def pd_pair(make_plan, prefill_model, decode_model, prefill: str = "", decode: str = "", disagg: str = ""):
    """prefill.yaml and pd.yaml (naming it) in one folder; extra YAML lines per file."""
    make_plan(
        _merged(f"model: {{path: {prefill_model}}}\nlaunch: {{device: cpu}}\ncache: {{memory: 1MiB}}\n", prefill),
        "prefill.yaml",
    )
    return make_plan(
        _merged(
            _merged(f"model: {{path: {decode_model}}}\nlaunch: {{device: cpu}}\ncache: {{memory: 1MiB}}\n", decode),
            f"disagg:\n  prefill: prefill.yaml\n{disagg}",
        ),
        "pd.yaml",
    )


def messages(check) -> list[str]:
    return [f"{e.field}: {e.message}" for e in check.problems.errors]


def test_valid_pair_resolves_both_sides(make_plan, llama_folder):
    path = pd_pair(make_plan, llama_folder, llama_folder, decode="parallel: {dcp: 2, interleave: 16}\n")
    check = validate_plan_file(path)
    assert check.valid, messages(check)
    pd = check.resolved.disagg
    assert pd.prefill_name == "prefill" and pd.prefill.world_size == 1 and check.resolved.world_size == 2
    assert (pd.section.lease_s, pd.section.transfer_timeout_s, pd.section.failure_policy) == (300, 30, "fail")


def test_every_pair_problem_reported_at_once(make_plan, llama_folder, tmp_path):
    mla = write_config(tmp_path / "mla", **mla_fields())
    path = pd_pair(
        make_plan,
        mla,
        llama_folder,
        decode="serve: {port: 8123}\n",
        disagg=(
            "  prefill_port: 8123\n  lease_s: 5\n  transfer_timeout_s: 10\n  failure_policy: retry\n"
            "  prefill_url: localhost:9000\n  max_pulls_per_step: 0\n  max_restarts: -1\n"
        ),
    )
    got = messages(validate_plan_file(path))
    expected = [
        "disagg.prefill_port: disagg.prefill_port=8123 is also serve.port; the router and both instances need their "
        "own ports",
        "disagg.transfer_timeout_s: disagg.transfer_timeout_s=10 must be more than 1 s below disagg.lease_s=5",
        "disagg.failure_policy: disagg.failure_policy='retry' is not one of fail, recompute",
        "disagg.max_restarts: disagg.max_restarts=-1 must be >= 0 (0: a dead instance ends the run)",
        "disagg.max_pulls_per_step: disagg.max_pulls_per_step=0 must be >= 1",
        "disagg.prefill_url: disagg.prefill_url='localhost:9000' must be an http:// or https:// URL",
        "disagg.prefill: the prefill plan runs another model (architecture DeepseekV2ForCausalLM there, "
        "LlamaForCausalLM here;",
    ]
    for want in expected:
        assert any(m.startswith(want) for m in got), (want, got)
    assert len(got) == len(expected), got


def test_same_model_other_cache_and_shorter_context(make_plan, llama_folder):
    path = pd_pair(
        make_plan,
        llama_folder,
        llama_folder,
        prefill="cache: {memory: 1MiB, dtype: bfloat16}\nmodel: {path: "
        + str(llama_folder)
        + ", max_model_len: 256}\n",
        decode="model: {path: " + str(llama_folder) + ", max_model_len: 512}\n",
    )
    got = messages(validate_plan_file(path))
    assert any("the KV cache dtype differs: bfloat16 on the prefill side, float32 here" in m for m in got), got
    assert any("max_model_len 256 is below this plan's 512" in m for m in got), got


def test_prefill_plan_problems_listed_under_its_name(make_plan, llama_folder, tmp_path):
    path = pd_pair(make_plan, llama_folder, llama_folder, prefill="parallel: {interleave: 3}\n")
    got = messages(validate_plan_file(path))
    assert got == [
        "disagg.prefill: prefill plan prefill: parallel.interleave: parallel.interleave=3 does not divide "
        "cache.block_size=16; use one of 1, 2, 4, 8, 16"
    ] or any("prefill plan prefill:" in m and "interleave=3" in m for m in got), got
    missing = make_plan(f"model: {{path: {llama_folder}}}\ndisagg: {{prefill: nowhere.yaml}}\n", "lost.yaml")
    got = messages(validate_plan_file(missing))
    assert any("nowhere.yaml" in m for m in got), got


def test_kv_role_alias_must_be_the_consumer(make_plan, llama_folder):
    path = pd_pair(make_plan, llama_folder, llama_folder, decode="kv_transfer_config: {kv_role: kv_producer}\n")
    got = messages(validate_plan_file(path))
    assert any(m.startswith("disagg.kv_role: kv_transfer_config.kv_role='kv_producer'") for m in got), got


def test_without_nixl_only_pd_plans_fail(make_plan, llama_folder, monkeypatch):
    def missing():
        raise ImportError("No module named 'nixl_cu12'")

    monkeypatch.setattr(transport, "_nixl", missing)
    plain = make_plan(f"model: {{path: {llama_folder}}}\nparallel: {{dcp: 2}}\n", "plain.yaml")
    assert validate_plan_file(plain).valid
    got = messages(validate_plan_file(pd_pair(make_plan, llama_folder, llama_folder)))
    assert got == [
        "disagg.connector: disagg.connector=nixl: the NIXL transport cannot be imported (ImportError: No module "
        f"named 'nixl_cu12'); {transport.INSTALL_HINT}"
    ]
    assert "pip install nixl-cu12" in transport.INSTALL_HINT


def test_show_draws_the_handoff(make_plan, llama_folder):
    # llama: 2 layers, 2 KV heads; prefill tp1/dcp1 B16 -> decode tp1/dcp2 (replica ranks) B16, head-major (torch)
    path = pd_pair(
        make_plan,
        llama_folder,
        llama_folder,
        prefill="cache: {memory: 1MiB, block_size: 16}\nattention: {backend: torch}\n",
        decode=(
            "cache: {memory: 1MiB, block_size: 16}\nattention: {backend: torch}\nparallel: {dcp: 2, interleave: 4}\n"
        ),
    )
    result = runner.invoke(app, ["plan", "show", str(path), "--positions", "32"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    out = result.output
    assert "hand-off  prefill prefill (tp1 dcp1 I1 B16) -> decode pd (tp1 dcp2 I4 B16), head-major cache" in out
    # decode rank 0 owns 0-3, 8-11 (prefill block 0) and 16-19, 24-27 (prefill block 1): 4 runs x 2 heads
    assert "decode rank 0, block 0 (16 tokens) <- prefill rank 0 block 0 [0-3][8-11], rank 0 block 1 [0-3][8-11]" in out
    # a run is part of a block: no merging across heads, layers or K/V (4 runs x 2 heads x 2 layers x K/V)
    assert "4 runs -> 32 descriptors per block over all 2 layers x K/V (block-major cache: a whole block" in out
    pictured = out.replace(" ", "")
    assert "0prefill0000000000000000|0000000000000000" in pictured  # prefill virtual blocks are 16 tokens
    assert "0decode00001111000011110000111100001111" in pictured  # decode virtual blocks: 32 tokens
    # 512 tokens: 16 decode blocks per rank; at I = B a decode block is one whole prefill block: 1 per block
    assert "N=512: 512 / 512" in out  # 32 per block x 16 blocks
    assert "at interleave 16 (= block size): N=512: 16 / 16" in out


def test_pd_plan_is_not_an_in_process_llm(make_plan, llama_folder):
    from engine.llm import LLM
    from engine.serve_entry import serve

    path = pd_pair(make_plan, llama_folder, llama_folder)
    with pytest.raises(UserError, match=r"is a P/D plan .*: run it with `dcpctl run "):
        LLM(path)
    plain = validate_plan_file(make_plan(f"model: {{path: {llama_folder}}}\n", "plain.yaml")).require_valid()
    with pytest.raises(UserError, match="--role prefill needs a P/D plan"):
        serve(plain, [], "prefill")
    check = validate_plan_file(path).require_valid()
    with pytest.raises(UserError, match=r"--role router needs disagg\.prefill_url and disagg\.decode_url"):
        serve(check, [], "router")
    with pytest.raises(UserError, match=r"--role decode needs disagg\.prefill_url"):
        serve(check, [], "decode")


def test_prefill_and_decode_with_other_fp8_formats_is_an_error_naming_both(make_plan, llama_folder):
    path = pd_pair(
        make_plan, llama_folder, llama_folder, prefill="cache: {dtype: fp8}\n", decode="cache: {dtype: fp8_e5m2}\n"
    )
    assert messages(validate_plan_file(path)) == [
        "cache.dtype: the KV cache dtype differs: fp8_e4m3 on the prefill side, fp8_e5m2 here; "
        "set the same cache.dtype on both"
    ]


def test_fp8_hand_off_moves_half_the_bytes_of_bfloat16_in_the_same_descriptors(make_plan, llama_folder):
    def per_request(dtype: str) -> dict[int, list[tuple[int, int]]]:
        cache = f"cache: {{memory: 1MiB, dtype: {dtype}}}\n"
        path = pd_pair(make_plan, llama_folder, llama_folder, cache, cache + "parallel: {dcp: 2, interleave: 16}\n")
        return handoff_summary(validate_plan_file(path).resolved).per_request

    half, fp8 = per_request("bfloat16"), per_request("fp8")
    assert half.keys() == fp8.keys()
    for length, ranks in fp8.items():
        assert [(d, 2 * b) for d, b in ranks] == half[length]
        assert all(b > 0 for _, b in ranks)
