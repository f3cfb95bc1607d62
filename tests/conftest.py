"""Shared fixtures: the real default model is loaded once per session, as is the transformers reference.

Marker ``e2e``: every test of a module that starts processes (a cluster through ``tokenmill up`` or the harness, a
subprocess, Ray) gets it at collection, so ``pytest -m "not e2e"`` is the quick inner loop; ``make test`` runs all.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


# what a module's source calls when it starts processes
_STARTS_PROCESSES = ("running_cluster(", "start_cluster(", "Popen(", "subprocess.run(", ".Process(", "GpuCluster(",
                     "ray.init(")
_module_starts: dict[Path, bool] = {}


def _starts_processes(path: Path) -> bool:
    if path not in _module_starts:
        _module_starts[path] = any(call in path.read_text() for call in _STARTS_PROCESSES)
    return _module_starts[path]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if _starts_processes(Path(item.path)):
            item.add_marker(pytest.mark.e2e)


@pytest.fixture(scope="session")
def source():
    from common.loader import load_model_source

    return load_model_source("smollm2")


_created: list = []


@pytest.fixture(scope="session")
def make_engine(source):
    """Build engines on the shared model source; each gets its own KV pool and scheduler, weights are shared.

    Every engine is checked for leaked KV blocks when the test that made it ends, then dropped (a session
    holding every engine's weights and pool would not fit in memory)."""
    from common.config import EngineConfig
    from common.engine import LLMEngine

    models: dict = {}

    def make(**kw):
        kw.setdefault("kv_cache_memory", 256 << 20)
        cfg = EngineConfig(**kw)
        if cfg.noop_model:
            eng = LLMEngine(source, cfg)
        else:  # the weights are read-only in forward: engines of one dtype share them
            eng = LLMEngine(source, cfg, model=models.get(cfg.dtype))
            models[cfg.dtype] = eng.runner.model
        _created.append(eng)
        return eng

    return make


def _assert_no_leak(eng) -> None:
    bm = eng.block_manager
    used = bm.num_blocks - bm.num_free_blocks
    assert used == 0, f"KV blocks leaked: {used} of {bm.num_blocks} still in use"


@pytest.fixture(autouse=True)
def _kv_blocks_are_all_free_after_each_test(request):
    """Block accounting: after every test, every engine it used has all its blocks free again."""
    yield
    engines, _created[:] = list(_created), []
    if "engine" in request.fixturenames:
        engines.append(request.getfixturevalue("engine"))
    for eng in engines:
        _assert_no_leak(eng)


@pytest.fixture(scope="session")
def engine(source):
    """The shared float32 engine (the reference tests' batch of 32 runs here)."""
    from common.config import EngineConfig
    from common.engine import LLMEngine

    eng = LLMEngine(source, EngineConfig(dtype="float32", max_num_seqs=32, kv_cache_memory=512 << 20))
    yield eng
    _assert_no_leak(eng)


@pytest.fixture(scope="session")
def hf_model():
    """transformers' own Llama on the same GGUF, float32: the reference."""
    from transformers import AutoModelForCausalLM

    from common.loader import embedded_gguf_path

    path = embedded_gguf_path()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    model.eval()
    return model
