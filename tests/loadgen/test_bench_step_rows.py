"""``python -m loadgen.bench_step_rows`` on the no-op model: the table, the JSON, every request's blocks back."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loadgen import bench_step_rows


def _engines_of(monkeypatch: pytest.MonkeyPatch, name: str) -> list[object]:
    """The engines that the benchmark's function ``name`` is called with, as it runs."""
    engines = []
    real = getattr(bench_step_rows, name)

    def spy(eng, *args, **kw):  # type: ignore[no-untyped-def]
        engines.append(eng)
        return real(eng, *args, **kw)

    monkeypatch.setattr(bench_step_rows, name, spy)
    return engines


def test_slope_is_least_squares() -> None:
    assert bench_step_rows.slope([1, 2, 3], [5, 7, 9]) == pytest.approx(2.0)
    assert bench_step_rows.slope([1, 8, 32], [10.0, 10.0, 10.0]) == 0.0
    assert bench_step_rows.slope([4, 4], [1.0, 9.0]) == 0.0  # one x: no slope


def test_runs_both_paths_and_frees_every_block(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    engines = _engines_of(monkeypatch, "measure")
    out = tmp_path / "rows.json"
    assert bench_step_rows.main(["--device", "cpu", "--rows", "1", "4", "--steps", "5", "--rounds", "2",
                                 "--result-file", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["noop_model"] is True
    for sampling in ("greedy", "sampled"):
        for rows in ("1", "4"):
            r = doc["results"][sampling][rows]
            for path in bench_step_rows.PATHS:
                assert len(r[path]["rounds_us"]) == 2 and r[path]["step_us"] > 0
                assert r[path]["host_us"] == pytest.approx(
                    sum(v for k, v in r[path]["phases_us"].items() if k != "wait"))
                assert set(r[path]["phases_us"]) == {"schedule", "launch", "wait", "outputs", "sample", "other"}
        for what in ("step_us", "host_us"):
            assert set(doc["us_per_row"][sampling][what]) == set(bench_step_rows.PATHS)
    eng = engines[0]
    assert not eng.has_unfinished() and eng.scheduler.fast_decodes
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks
    table = capsys.readouterr().out
    assert "| greedy | 4 | inline |" in table and "| sampled | 4 | general |" in table


def test_kernel_profile_lists_the_top_operators_a_step_and_frees_every_block(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    engines = _engines_of(monkeypatch, "kernel_profile")
    out = tmp_path / "rows.json"
    assert bench_step_rows.main(["--device", "cpu", "--rows", "1", "3", "--steps", "4", "--rounds", "1",
                                 "--samplings", "nucleus", "--kernels", "4", "--result-file", str(out)]) == 0
    k = json.loads(out.read_text())["kernels"]
    assert list(k) == ["nucleus"] and k["nucleus"]["what"] == "cpu"
    top = k["nucleus"]["top"]
    assert len(top) == 4 and all(e["us"] > 0 and e["calls"] > 0 for e in top)
    assert [e["us"] for e in top] == sorted((e["us"] for e in top), reverse=True)
    assert sum(e["us"] for e in top) <= k["nucleus"]["total_us"] + 1e-6 and k["nucleus"]["wall_us"] > 0
    eng = engines[0]
    assert not eng.has_unfinished()
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks
    printed = capsys.readouterr().out
    assert "nucleus, 3 rows under torch.profiler" in printed and "| µs a step | calls a step | operator |" in printed


def test_openai_samplings_send_what_an_openai_client_can() -> None:
    """``default`` and ``nucleus``: an OpenAI client's sampling (it has no top_k): its defaults, and top_p 0.9."""
    by_name = {s.name: s for s in bench_step_rows.STEP_SAMPLINGS}
    assert by_name["default"].fields() == {"temperature": 1.0}
    assert by_name["nucleus"].fields() == {"temperature": 1.0, "top_p": 0.9}
    p = by_name["nucleus"].params(8)
    assert not p.top_k and p.top_p == 0.9 and p.temperature == 1.0


def test_mixed_rows_take_each_sampling_in_turn(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--samplings mixed``: every other row the served benchmark's sampling (top_k 50), the others top_p 0.9
    alone, in one batch."""
    from common.engine import LLMEngine

    sent: list[tuple[int | None, float]] = []
    real = LLMEngine.add_request

    def spy(self, rid, prompt, params, *args, **kw):  # type: ignore[no-untyped-def]
        sent.append((params.top_k, params.top_p))
        return real(self, rid, prompt, params, *args, **kw)

    monkeypatch.setattr(LLMEngine, "add_request", spy)
    out = tmp_path / "rows.json"
    assert bench_step_rows.main(["--device", "cpu", "--rows", "4", "--steps", "3", "--rounds", "1",
                                 "--samplings", "mixed", "--result-file", str(out)]) == 0
    assert json.loads(out.read_text())["results"]["mixed"]["4"]["inline"]["step_us"] > 0
    assert sent[:4] == [(50, 0.9), (None, 0.9), (50, 0.9), (None, 0.9)]
