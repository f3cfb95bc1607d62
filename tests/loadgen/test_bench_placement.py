"""``python -m loadgen.bench_placement`` against the real router: both ways of asking it are timed, every placement
answered, and the table names them."""

from __future__ import annotations

from loadgen import bench_placement
from tests.services.harness import free_port


def test_both_ways_of_placing_are_timed_against_a_real_router(capsys) -> None:
    bench_placement.main(["--requests", "40", "--rounds", "1", "--prompt", "64", "--gap", "0.001",
                          "--port", str(free_port())])
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| Place")]
    assert [r.split("|")[1].strip() for r in rows] == ["Place", "PlaceStream"]
    for r in rows:
        idle, busy, rate, cpu = (c.strip() for c in r.split("|")[2:6])
        assert all(float(x) > 0 for x in idle.split(" / ") + busy.split(" / "))
        assert float(rate.replace(",", "")) > 0 and float(cpu) >= 0
    assert out.count("placements,") == 2  # a round of each, all answered with the registered worker
    itself = [line for line in out.splitlines() if line.startswith("of which the placement itself")]
    assert len(itself) == 1 and float(itself[0].split(": ")[1].split()[0]) > 0
