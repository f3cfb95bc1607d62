"""Workloads: input lengths are exact under the target's tokenizer, the same seed gives the same stream."""

from __future__ import annotations

import numpy as np
import pytest

from loadgen.workloads import (
    DATASETS,
    PromptBuilder,
    RandomIdsBuilder,
    Tenant,
    WorkloadConfig,
    build_requests,
    parse_range,
    ratio_range,
    structured_output_valid,
)


@pytest.fixture(scope="module")
def tok():
    from common.loader import load_tokenizer

    return load_tokenizer()


@pytest.fixture(scope="module")
def builder(tok):
    return PromptBuilder(tok)


@pytest.mark.parametrize("dataset", DATASETS)
def test_input_lengths_are_exact_for_ids_and_text(tok, builder, dataset):
    cfg = WorkloadConfig(dataset=dataset, input_len=(5, 300), output_len=(1, 64), prefix_groups=3, prefix_len=40,
                         long_input_len=(1500, 2500), seed=11)
    reqs = build_requests(cfg, builder, 25)
    for r in reqs:
        assert len(r.prompt_ids) == r.input_len
        assert tok.encode(r.prompt_text) == list(r.prompt_ids)  # the HTTP targets see the same tokens
    if dataset == "long-prompt":
        assert all(1500 <= r.input_len <= 2500 for r in reqs)
    if dataset in ("random", "long-prompt", "shared-prefix"):
        assert all(1 <= r.output_len <= 64 for r in reqs)
    if dataset == "random":
        assert all(5 <= r.input_len <= 300 for r in reqs)


def test_chat_total_counts_the_template(tok, builder):
    cfg = WorkloadConfig(input_len=(40, 200), chat=True, chat_length="total", seed=3)
    for r in build_requests(cfg, builder, 20):
        full = tok.apply_chat_template([{"role": "user", "content": r.prompt_text}])
        assert len(tok.encode(full, add_special_tokens=False)) == r.input_len
        assert len(r.prompt_ids) == r.input_len - builder.chat_overhead()
    with pytest.raises(ValueError, match="chat template"):
        build_requests(WorkloadConfig(input_len=(5, 5), chat=True, chat_length="total"), builder, 1)


def test_fixed_lengths_and_the_same_seed_gives_the_same_stream(builder):
    cfg = WorkloadConfig(input_len=(64, 64), output_len=(32, 32), seed=5)
    a = build_requests(cfg, builder, 30)
    assert all(r.input_len == 64 and r.output_len == 32 for r in a)
    assert a == build_requests(cfg, builder, 30)
    assert a[:10] == build_requests(cfg, builder, 10)  # a prefix of the stream does not depend on its length
    b = build_requests(WorkloadConfig(input_len=(64, 64), output_len=(32, 32), seed=6), builder, 30)
    assert [r.prompt_ids for r in a] != [r.prompt_ids for r in b]
    assert len({r.prompt_ids for r in a}) == 30


def test_shared_prefix_groups_share_exactly_their_prefix(builder):
    cfg = WorkloadConfig(dataset="shared-prefix", prefix_groups=4, prefix_len=48, input_len=(16, 16), seed=2)
    reqs = build_requests(cfg, builder, 60)
    assert {r.group for r in reqs} == {0, 1, 2, 3}
    prefix = {}
    for r in reqs:
        assert r.input_len == 64
        prefix.setdefault(r.group, r.prompt_ids[:48])
        assert r.prompt_ids[:48] == prefix[r.group]
    assert len(set(prefix.values())) == 4
    assert len({r.prompt_ids[48:] for r in reqs}) == 60  # suffixes differ


def test_tenants_get_shares_by_rate_and_sharegpt_has_its_shape(builder):
    tenants = [Tenant("a", rate=1.0, priority=0, api_key="ka"), Tenant("b", rate=3.0, priority=10)]
    reqs = build_requests(WorkloadConfig(input_len=(2, 2), output_len=(1, 1), seed=9), builder, 2000, tenants)
    share_b = sum(r.tenant.name == "b" for r in reqs) / len(reqs)
    assert abs(share_b - 0.75) < 4 * np.sqrt(0.75 * 0.25 / 2000)
    assert {r.tenant.priority for r in reqs if r.tenant.name == "b"} == {10}
    sg = build_requests(WorkloadConfig(dataset="sharegpt", seed=1), builder, 800)
    ins = np.array([r.input_len for r in sg])
    outs = np.array([r.output_len for r in sg])
    assert ins.min() >= 4 and ins.max() <= 1024 and np.all(ins + outs <= 2048)
    assert 130 < ins.mean() < 190 and 60 < np.median(ins) < 130  # heavy right tail: mean well above the median
    assert 290 < outs.mean() < 380
    fixed = build_requests(WorkloadConfig(dataset="sharegpt", sharegpt_output_len=50, seed=1), builder, 20)
    assert {r.output_len for r in fixed} == {50}


def test_ranges():
    assert parse_range("128") == (128, 128) and parse_range("10:20") == (10, 20) and parse_range(7) == (7, 7)
    assert ratio_range(100, 0.5) == (50, 150)
    for bad in ("0", "20:10", "x"):
        with pytest.raises(ValueError):
            parse_range(bad)
    with pytest.raises(ValueError, match="range-ratio"):
        ratio_range(100, 1.0)
    with pytest.raises(ValueError, match="unknown dataset"):
        next(iter(build_requests(WorkloadConfig(dataset="nope"), None, 1)))  # type: ignore[arg-type]


def test_a_tokenizer_that_adds_bos_counts_it(tok):
    from common.tokenizer import TextTokenizer

    llama_like = TextTokenizer(tok.tk, tok.chat_template, tok.bos_token, tok.eos_token, add_bos=True)
    b = PromptBuilder(llama_like)
    assert b.prefix == (llama_like.bos_id,)
    for dataset in ("random", "shared-prefix"):
        for r in build_requests(WorkloadConfig(dataset=dataset, input_len=(3, 90), prefix_len=20, seed=4), b, 10):
            assert r.prompt_ids[0] == llama_like.bos_id and len(r.prompt_ids) == r.input_len
            assert llama_like.encode(r.prompt_text) == list(r.prompt_ids)  # what the server counts
    chat = build_requests(WorkloadConfig(input_len=(50, 50), chat=True), b, 3)
    assert all(r.prompt_ids[0] != llama_like.bos_id and len(r.prompt_ids) == 50 for r in chat)


def test_token_id_prompts_without_a_tokenizer():
    b = RandomIdsBuilder(512)
    reqs = build_requests(WorkloadConfig(input_len=(1, 300), seed=1), b, 20)
    assert all(len(r.prompt_ids) == r.input_len and r.prompt_text == "" for r in reqs)
    assert min(min(r.prompt_ids) for r in reqs) >= 10 and max(max(r.prompt_ids) for r in reqs) < 512
    with pytest.raises(ValueError, match="no chat template"):
        build_requests(WorkloadConfig(chat=True, chat_length="total"), b, 1)


def test_constrained_requests_keep_the_free_streams_prompts_and_cycle_their_constraints(builder):
    schemas = ({"type": "json_schema", "name": "a", "schema": {"type": "object"}}, {"type": "json_object"})
    free = build_requests(WorkloadConfig(input_len=(16, 16), seed=4), builder, 40)
    half = build_requests(WorkloadConfig(input_len=(16, 16), seed=4, structured=schemas, structured_ratio=0.5),
                          builder, 40)
    assert [r.prompt_ids for r in half] == [r.prompt_ids for r in free]
    picked = [r.structured for r in half if r.structured is not None]
    assert 10 < len(picked) < 30 and picked == [schemas[k % 2] for k in range(len(picked))]
    every = build_requests(WorkloadConfig(input_len=(16, 16), seed=4, structured=schemas), builder, 40)
    assert all(r.structured is not None for r in every)


@pytest.mark.parametrize("constraint, text, valid", [
    ({"type": "json_object"}, '{"a": 1}', True),
    ({"type": "json_object"}, "[1]", False),
    ({"type": "json_object"}, '{"a": ', False),  # cut off by max tokens
    ({"type": "json_schema", "schema": {"type": "object", "properties": {"n": {"type": "integer", "maximum": 5}},
                                        "required": ["n"]}}, '{"n": 3}', True),
    ({"type": "json_schema", "schema": {"type": "object", "properties": {"n": {"type": "integer", "maximum": 5}},
                                        "required": ["n"]}}, '{"n": 9}', False),
])
def test_an_output_is_valid_when_it_parses_and_follows_its_schema(constraint, text, valid):
    assert structured_output_valid(constraint, text) is valid


def test_a_schemas_validator_is_built_once_for_all_its_outputs():
    """The client checks every constrained output on its event loop: a schema's validator (milliseconds to build)
    is made once, and a schema that is not one is an error, not an invalid output."""
    import jsonschema

    from loadgen import workloads

    schema = {"type": "object", "properties": {"k": {"type": "string", "maxLength": 3}}, "required": ["k"]}
    built = workloads._validator.cache_info().misses
    results = [structured_output_valid({"type": "json_schema", "schema": dict(schema)}, f'{{"k": "{k}"}}')
               for k in ("a", "abc", "abcd", "b")]
    assert results == [True, True, False, True]
    assert workloads._validator.cache_info().misses == built + 1
    with pytest.raises(jsonschema.SchemaError):
        structured_output_valid({"type": "json_schema", "schema": {"type": "no-such-type"}}, "{}")
