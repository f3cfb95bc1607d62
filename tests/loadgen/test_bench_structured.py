"""`tokenmill bench structured`'s engine section on the CPU: both ways of picking a constrained step run, their
rows say which ran, every constrained row's mask came from the mask process, and the step splits into its phases."""

from __future__ import annotations

import pytest

from loadgen.bench_structured import bench_engine


@pytest.mark.parametrize("pick", ["deferred", "sync"])
def test_the_constrained_step_is_timed_each_way(pick):
    r = bench_engine("float32", steps=2, rounds=2, temperature=1.0, grammar_process=True, constrained_pick=pick)
    assert r["pick"] == pick and r["async_scheduling"] is (pick == "deferred")
    assert r["fill"] == "process" and r["steps"] == 4 and r["batch"] == 32
    assert r["step_ms_plain"] > 0 and r["step_ms_constrained"] > 0 and r["update_ms_constrained"] > 0
    assert len(r["round_ratios"]) == 2 and r["end_to_end"] == sum(r["round_ratios"]) / 2  # the median of two
    assert r["child_fill_ms"] is not None and r["child_fill_ms"] > 0
    for kind in ("none", "constrained"):  # the phase table's rows, each a median over the timed steps
        phases = r["phases_ms"][kind]
        assert {"schedule", "launch", "pick queued", "tokens handed out", "step"} <= phases.keys()
        assert 0 < phases["schedule"] < phases["step"]
    assert r["phases_ms"]["constrained"]["mask fill (or wait and copy)"] > 0


def test_the_cache_of_masks_by_place_serves_most_masks_of_long_lists():
    """The libraries section's walk through documents of long lists: every token accepted, most masks from the
    cache (the records' places repeat), both ways timed."""
    from common.loader import load_tokenizer
    from loadgen.bench_structured import bench_places

    tok = load_tokenizer()
    r = bench_places(tok, tok.vocab_size, tok.tk.token_to_id(tok.eos_token), documents=4)
    assert r["documents"] == 4 and r["masks"] > 4 * 8 * 10  # at least 8 records of ~10 tokens a document
    assert r["cached_share"] > 0.8, r  # with a place per item index: 0.47
    assert r["ms_cache"] > 0 and r["ms_llguidance"] > 0
