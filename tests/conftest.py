"""Shared fixtures: the real default model is loaded once per session, as is the transformers reference."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def source():
    from common.loader import load_model_source

    return load_model_source("smollm2")


@pytest.fixture(scope="session")
def make_engine(source):
    """Build engines that share the loaded weights' source; each call gets a fresh KV pool and scheduler."""
    from common.config import EngineConfig
    from common.engine import LLMEngine

    created = []

    def make(**kw):
        eng = LLMEngine(source, EngineConfig(**kw))
        created.append(eng)
        return eng

    yield make
    for eng in created:  # block accounting: every engine ends with every block free
        assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks, "KV blocks leaked"


@pytest.fixture(scope="session")
def engine(make_engine):
    return make_engine(dtype="float32", max_num_seqs=32)


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
