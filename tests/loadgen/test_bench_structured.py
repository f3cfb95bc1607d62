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


def test_batches_of_masks_are_timed_serial_and_on_pools():
    """The libraries section's batches of k masks: every size timed each way, p50 ≤ p90, a batch of more masks no
    faster than one of a single mask on this thread."""
    from common.loader import load_tokenizer
    from loadgen.bench_structured import bench_batches

    tok = load_tokenizer()
    r = bench_batches(tok, tok.vocab_size, tok.tk.token_to_id(tok.eos_token), gap_s=1e-4, reps=8, sizes=(1, 4),
                      pools=(2,))
    assert set(r["us_p50_p90"]) == {"serial", "pool 2"}
    for fill in r["us_p50_p90"].values():
        assert set(fill) == {1, 4} and all(0 < p50 <= p90 for p50, p90 in fill.values())
    assert r["us_p50_p90"]["serial"][4][1] >= r["us_p50_p90"]["serial"][1][0]
