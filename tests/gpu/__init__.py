"""The GPU suite: CUDA-only tests (marker ``gpu``), run with ``make test-gpu``; skipped where torch sees no CUDA."""
