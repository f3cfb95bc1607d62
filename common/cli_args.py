"""Engine options shared by every command that runs a model (``generate``, benchmarks, the workers)."""

from __future__ import annotations

import argparse

from common.cluster_config import with_backend_env
from common.config import DEFAULT_CPU_KV_CACHE_BYTES, EngineConfig, field_default, parse_bytes
from common.loader import DEFAULT_MODEL, ModelSource, load_model_source
from common.machine import default_dtype

TOKENIZER_HELP = ("the tokenizer to use instead of the model's own: a .gguf file, a Hugging Face directory "
                  f"(tokenizer.json) or '{DEFAULT_MODEL}'; gives a dummy:CONFIG model text in and out")


def _default(name: str) -> object:
    """``EngineConfig``'s default of ``name``: the flag's default, which its help text shows (``%(default)s``)."""
    return field_default(EngineConfig, name)


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """The engine's flags; their defaults are ``EngineConfig``'s (``--dtype``'s follows the machine)."""
    g = p.add_argument_group("model and engine")
    g.add_argument("--model", default=DEFAULT_MODEL,
                   help=f"a .gguf file, a Hugging Face directory, dummy:CONFIG, or '{DEFAULT_MODEL}' (the embedded "
                        "SmolLM2-135M-Instruct; default)")
    g.add_argument("--tokenizer", default=None, help=TOKENIZER_HELP)
    g.add_argument("--device", choices=["cpu", "cuda"], default=_default("device"),
                   help="where the model runs (default %(default)s)")
    g.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                   help="weights and KV dtype (default: bfloat16 on cuda and on CPUs with bf16 arithmetic, "
                        "else float32)")
    g.add_argument("--block-size", type=int, default=_default("block_size"),
                   help="tokens per KV block (default %(default)s)")
    g.add_argument("--kv-cache-memory", default=None,
                   help=f"bytes for the KV pool, e.g. 2GiB (default: {DEFAULT_CPU_KV_CACHE_BYTES / (1 << 30):g}GiB on cpu; "
                        "on cuda what "
                        "--gpu-memory-utilization leaves after weights and activations)")
    g.add_argument("--gpu-memory-utilization", type=float, default=_default("gpu_memory_utilization"),
                   help="fraction of GPU memory Tokenmill may use (default %(default)s)")
    g.add_argument("--max-num-batched-tokens", type=int, default=_default("max_num_batched_tokens"),
                   help="token budget of one step (default %(default)s)")
    g.add_argument("--max-num-seqs", type=int, default=_default("max_num_seqs"),
                   help="most sequences in one step (default %(default)s)")
    g.add_argument("--max-model-len", type=int, default=_default("max_model_len"), help="context limit (default: the model's)")
    g.add_argument("--no-prefix-caching", action="store_true", help="disable the prefix cache")
    g.add_argument("--no-chunked-prefill", action="store_true", help="never split a prompt across steps")
    g.add_argument("--seed", type=int, default=_default("seed"),
                   help="engine seed for requests without their own (default %(default)s)")
    g.add_argument("--tp", type=int, default=_default("tensor_parallel_size"), metavar="N",
                   help="tensor parallelism: split the model over N processes (on cuda, GPUs cuda:0..N-1; default "
                        "%(default)s)")


def model_source_from_args(a: argparse.Namespace) -> ModelSource:
    """``--model`` with ``--tokenizer``. Raises FileNotFoundError / ValueError like ``load_model_source``."""
    return load_model_source(a.model, tokenizer=a.tokenizer)


def engine_config_from_args(a: argparse.Namespace) -> EngineConfig:
    """The engine flags, and the backend keys from the environment (``TOKENMILL_ENGINE__CPU_KERNELS`` etc.)."""
    dtype = a.dtype or default_dtype(a.device)
    return with_backend_env(EngineConfig(
        device=a.device,
        dtype=dtype,
        block_size=a.block_size,
        kv_cache_memory=parse_bytes(a.kv_cache_memory) if a.kv_cache_memory else None,
        gpu_memory_utilization=a.gpu_memory_utilization,
        max_num_batched_tokens=a.max_num_batched_tokens,
        max_num_seqs=a.max_num_seqs,
        max_model_len=a.max_model_len,
        enable_prefix_caching=not a.no_prefix_caching,
        enable_chunked_prefill=not a.no_chunked_prefill,
        seed=a.seed,
        tensor_parallel_size=a.tp,
    ))
