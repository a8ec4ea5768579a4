"""Loading plans: schema errors with file and line, `base:` inheritance, KEY=VALUE overrides."""

import pytest

from engine.plan.loader import PlanLoadError, load_plan, plan_from_dict, plan_to_dict


def problems_of(path, overrides=None):
    with pytest.raises(PlanLoadError) as info:
        load_plan(path, overrides)
    return info.value.problems


def test_good_plan_fills_defaults_and_name(make_plan):
    loaded = load_plan(make_plan("model: {path: /m}\nparallel: {tp: 2}\n", "my_plan.yaml"))
    plan = loaded.plan
    assert plan.name == "my_plan"
    assert (plan.parallel.tp, plan.parallel.dcp, plan.cache.block_size, plan.serve.host) == (2, 1, 16, "127.0.0.1")
    assert plan_from_dict(plan_to_dict(plan)) == plan


def test_every_schema_problem_is_reported_with_its_line(make_plan):
    path = make_plan("""\
        model:
          path: /m
        parallel:
          tpp: 2
          dcp: two
        cache: 3
        scheduler:
          chunked_prefill: maybe
        """)
    problems = problems_of(path)
    assert [(p.field, p.line) for p in problems] == [
        ("parallel.tpp", 4),
        ("parallel.dcp", 5),
        ("cache", 6),
        ("scheduler.chunked_prefill", 8),
    ]
    assert "unknown key 'parallel.tpp' (did you mean 'parallel.tp'?)" in problems[0].message
    assert "could not be converted to Integer" in problems[1].message
    assert "cache must be a mapping" in problems[2].message
    assert all(p.file == str(path) for p in problems)
    assert str(problems[0]).startswith(f"{path}:4: ")


def test_unknown_section_lists_known_keys(make_plan):
    (problem,) = problems_of(make_plan("model: {path: /m}\nzzz: 1\n"))
    assert "unknown key 'zzz'; known keys: name, description" in problem.message


def test_missing_model_path(make_plan):
    (problem,) = problems_of(make_plan("parallel: {tp: 1}\n"))
    assert problem.field == "model.path"
    assert "model.path is required" in problem.message


def test_base_inheritance_and_overrides(make_plan):
    make_plan("model: {path: /m, max_model_len: 512}\ncache: {block_size: 64}\nparallel: {tp: 2}\n", "base.yaml")
    child = make_plan("base: base.yaml\nparallel: {dcp: 2}\n", "child.yaml")
    loaded = load_plan(child, ["parallel.interleave=16", "cache.memory=2GiB"])
    plan = loaded.plan
    assert (plan.parallel.tp, plan.parallel.dcp, plan.parallel.interleave) == (2, 2, 16)
    assert (plan.cache.block_size, plan.cache.memory, plan.model.max_model_len) == (64, "2GiB", 512)
    assert loaded.where("parallel.tp")[0].endswith("base.yaml")
    assert loaded.where("parallel.dcp")[0].endswith("child.yaml")
    assert loaded.where("parallel.interleave") == ("command line", None)


def test_vllm_interleave_alias(make_plan):
    plan = load_plan(make_plan("model: {path: /m}\nparallel: {cp_kv_cache_interleave_size: 8}\n")).plan
    assert plan.parallel.interleave == 8
    plan = load_plan(make_plan("model: {path: /m}\n"), ["parallel.cp_kv_cache_interleave_size=4"]).plan
    assert plan.parallel.interleave == 4


def test_bad_override_forms(make_plan):
    path = make_plan("model: {path: /m}\n")
    (problem,) = problems_of(path, ["parallel.interleave"])
    assert "is not KEY=VALUE" in problem.message
    (problem,) = problems_of(path, ["parallel.interleav=4"])
    assert problem.file == "command line"
    assert "did you mean 'parallel.interleave'" in problem.message


def test_base_errors(make_plan):
    (problem,) = problems_of(make_plan("base: nothere.yaml\nmodel: {path: /m}\n"))
    assert "base plan nothere.yaml not found" in problem.message
    make_plan("base: b.yaml\n", "a.yaml")
    looped = make_plan("base: a.yaml\n", "b.yaml")
    (problem,) = problems_of(looped)
    assert "inheritance loops" in problem.message


def test_invalid_yaml_and_missing_file(make_plan, tmp_path):
    (problem,) = problems_of(make_plan("model: {path: /m\nparallel: [\n"))
    assert "invalid YAML" in problem.message and problem.line is not None
    (problem,) = problems_of(tmp_path / "absent.yaml")
    assert "does not exist" in problem.message
    (problem,) = problems_of(make_plan("- 1\n- 2\n"))
    assert "must be a YAML mapping" in problem.message
    (problem,) = problems_of(tmp_path / "parallel.dcp")
    assert problem.message.endswith("it looks like an override missing '=': write parallel.dcp=VALUE")
    (problem,) = problems_of(tmp_path / "model.yaml")
    assert "override" not in problem.message


def test_duplicate_keys_are_refused_with_their_lines(make_plan):
    (problem,) = problems_of(make_plan("model: {path: /m}\ncache:\n  memory: 1MiB\n  memory: 2MiB\n"))
    assert problem.message == "key 'cache.memory' appears twice (lines 3 and 4); keep one of them"
    assert problem.line == 4
    (problem,) = problems_of(make_plan("model: {path: /m}\nmodel: {path: /n}\n"))
    assert "key 'model' appears twice (lines 1 and 2)" in problem.message
