"""Frozen configuration objects, loaded once at start-up and never mutated."""

from __future__ import annotations

import json
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any, Literal, cast

Device = Literal["cpu", "cuda"]
DType = Literal["float32", "bfloat16", "float16"]
RopeType = Literal["default", "linear", "llama3"]


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """RoPE frequency scaling (Llama-3 style ``llama3``, ``linear``, or none)."""

    rope_type: RopeType = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Architecture of a Llama-family decoder (Llama 2/3, SmolLM2, Qwen2, Mistral)."""

    name: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2 has biases on q/k/v projections
    bos_token_id: int | None = 1
    eos_token_ids: tuple[int, ...] = (2,)
    sliding_window: int | None = None  # Mistral v0.1; honoured only by rejecting longer contexts

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def num_params(self) -> int:
        """Parameter count, embeddings included once if tied."""
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        attn = h * (self.q_size + 2 * self.kv_size) + self.q_size * h
        if self.attention_bias:
            attn += self.q_size + 2 * self.kv_size
        per_layer = attn + 3 * h * i + 2 * h
        emb = v * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * per_layer + emb + h

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any], name: str = "model") -> ModelConfig:
        """Build from a Hugging Face ``config.json`` dictionary."""
        archs = cfg.get("architectures") or []
        supported = {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"}
        if archs and not supported.intersection(archs):
            raise ValueError(f"unsupported architecture {archs}; Tokenmill runs {sorted(supported)}")
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        rs = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
        rtype = rs.get("rope_type", rs.get("type", "default")) if rs else "default"
        if rtype not in ("default", "linear", "llama3"):
            raise ValueError(f"unsupported rope_scaling type {rtype!r}")
        scaling = RopeScaling(
            rope_type=cast(RopeType, rtype),
            factor=float(rs.get("factor", 1.0)),
            low_freq_factor=float(rs.get("low_freq_factor", 1.0)),
            high_freq_factor=float(rs.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(rs.get("original_max_position_embeddings", 8192)),
        )
        eos = cfg.get("eos_token_id", 2)
        eos_ids = tuple(eos) if isinstance(eos, list) else ((int(eos),) if eos is not None else ())
        is_qwen2 = "Qwen2ForCausalLM" in archs or cfg.get("model_type") == "qwen2"
        theta = cfg.get("rope_theta", rs.get("rope_theta", 10000.0) if rs else 10000.0)
        window = cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None
        max_pos = int(cfg.get("max_position_embeddings", 4096))
        if window:  # attention here is always full: refuse contexts the window would have cut
            max_pos = min(max_pos, int(window))
        return cls(
            name=name,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            max_position_embeddings=max_pos,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
            rope_theta=float(theta),
            rope_scaling=scaling,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", is_qwen2)),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            sliding_window=window,
        )

    @classmethod
    def from_json_file(cls, path: str | Path) -> ModelConfig:
        p = Path(path)
        return cls.from_hf_dict(json.loads(p.read_text()), name=p.stem)


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """How the engine runs: device, dtype, KV pool, batching budgets."""

    device: Device = "cpu"
    dtype: DType = "float32"
    block_size: int = 16
    # KV pool size: an explicit byte count wins; otherwise (CUDA) the memory left under
    # gpu_memory_utilization after weights and the measured activation peak.
    kv_cache_memory: int | None = None
    gpu_memory_utilization: float = 0.9
    num_gpu_blocks_override: int | None = None
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    # where blocks travel over NIXL, an allocation of several blocks looks for contiguous runs among this many
    # times as many of the least recently freed (common/block_manager.py); 0 takes the least recently freed
    kv_run_window: int = 8
    # a decode worker wakes the link to a prefill worker with a one-block READ as a request with a lease comes in,
    # when the link sat idle (common/kv_transfer.py, KvTransferAgent.warm_link). None: for pools on GPUs
    kv_warm_links: bool | None = None
    enable_chunked_prefill: bool = True
    # the most prompt tokens batch-class sequences get in a step that also runs an interactive or standard one
    # (None: no limit; 0: batch prompts pause while urgent work runs), and the most batch-class sequences that decode
    # in such a step (None: no limit; 0: they pause, keeping their blocks and slot, and decode in the next step
    # without urgent work). Both 0: batch work yields to urgent work, so a batch flood does not lengthen an urgent
    # token's step. On an H200 with SmolLM2 a flood moved an interactive tenant's TPOT p99 by -8% and +6% paused,
    # +9% and +10.1% with these defaults, +21% and +23% with 16 prompt tokens and no row limit (docs/benchmarks.md,
    # the noisy neighbour).
    batch_prefill_tokens_beside_urgent: int | None = 0
    batch_decode_rows_beside_urgent: int | None = 0
    # after this many steps in a row in which those caps held batch work back, one step lets every batch decode in
    # and batch prompts at least a KV block of tokens: under steady urgent work batch work still moves, one step in
    # this many plus one (None: it waits for a step without urgent work)
    batch_yield_max_steps: int | None = 32
    # the most prompt tokens a step takes while sequences are decoding, so a prompt lengthens their next token by a
    # short step only (with chunked prefill: an unsplittable prompt is not held back). None: the step budget, except
    # on a decode worker once it pulls KV from prefill workers (common/engine.py, LLMEngine.pulls_kv): its own
    # prompts are those the router could not send to one
    prompt_tokens_beside_decodes: int | None = None
    seed: int = 0
    # Ranks of Megatron-style tensor parallelism (common/tensor_parallel.py): one process each, rank r on cuda:r on
    # CUDA. 1: one process, no torch.distributed. The KV pool's size (kv_cache_memory, the GPU share) is per rank.
    tensor_parallel_size: int = 1
    # How the ranks sum each layer's row-parallel output on CUDA. "auto": a one-shot all-reduce over peer-to-peer
    # memory (common/p2p_all_reduce.py) where every pair of the ranks' GPUs can map each other's memory, NCCL for
    # inputs larger than its buffer and elsewhere; "nccl": NCCL always. The CPU's ranks use gloo.
    tp_all_reduce: str = "auto"
    # Tensor parallelism: the embedding table and the LM head split by vocabulary over the ranks (each reads 1/N of
    # the head a step; the logits all-gathered, the embedding rows all-reduced) instead of a whole copy on each
    # (common/model.py). Off until measured faster on GPUs (docs/benchmarks.md, tensor parallelism).
    tp_vocab_parallel: bool = False
    # Benchmark-only: no model at all; every step samples from constant logits. Measures the control plane
    # (scheduler, detokenizer, gRPC) without the model's cost.
    noop_model: bool = False
    # The compute backend, resolved once when the model runner is built (common/model_runner.py).
    # CPU: the C++ kernels (common/cpu_kernels.py: paged decode attention, fused stages, small-batch matmuls).
    # None: on where they compiled vectorized (AVX-512); True: on wherever they compiled; False: the portable path.
    cpu_kernels: bool | None = None
    # CUDA: the Triton forward (common/model_cuda.py); False: the portable path, and no CUDA graphs
    cuda_fast_path: bool = True
    # CUDA: decode steps replay CUDA graphs (common/cuda_graphs.py); False: eager
    cuda_graphs: bool = True
    # CUDA graphs: a step whose prompt chunks total at most this many tokens replays a graph too, each prompt token
    # a row, their attention the paged prompt kernel (common/cuda_graphs.py); graphs are captured up to
    # max_num_batched_tokens rows, so the default graphs every step of the default budget. Larger prompt steps run
    # eagerly, with flash attention. 0: graphs for decode-only steps
    cuda_graph_prefill_tokens: int = 2048
    # Async scheduling: the engine launches step N+1 (its decodes' input ids taken from step N's picks on the
    # device) before it reads step N's tokens, so the host's work on a step's outputs, the next schedule and the
    # sampler's host side run while the GPU computes. In a tensor-parallel group rank 0 sends the fed ids to the
    # other ranks over the forward's group before the forward. None: on on CUDA; True: on anywhere
    async_scheduling: bool | None = None
    # With async scheduling, a step with constrained rows (structured outputs) leaves its pick to the next step()
    # call, which queues it once the next step is scheduled and the rows' masks are filled, before that step's
    # forward: the fill then runs beside the forward and the host's work on the outputs. None: wherever async
    # scheduling is on; False: such a step is handed out synchronously, its masks filled beside the next schedule
    # and forward only
    async_constrained: bool | None = None
    # Structured outputs: grammar masks are filled in a process beside the engine (common/grammar_proc.py), while
    # the engine runs its next step; False: inline, on the engine thread
    grammar_process: bool = True
    # Structured outputs: threads that fill a step's masks in parallel (in the mask process, or inline);
    # 0: llguidance's default, 80% of the cores up to 32; 1: one after the other on the filling thread, no pool
    grammar_threads: int = 0

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a positive power of two, got {self.block_size}")
        if self.max_num_batched_tokens <= 0:
            raise ValueError(f"max_num_batched_tokens must be > 0, got {self.max_num_batched_tokens}")
        if self.max_num_seqs <= 0:
            raise ValueError(f"max_num_seqs must be > 0, got {self.max_num_seqs}")
        if self.batch_prefill_tokens_beside_urgent is not None and self.batch_prefill_tokens_beside_urgent < 0:
            raise ValueError("batch_prefill_tokens_beside_urgent must be >= 0 (or unset: no limit), got "
                             f"{self.batch_prefill_tokens_beside_urgent}")
        if self.batch_yield_max_steps is not None and self.batch_yield_max_steps < 1:
            raise ValueError(f"batch_yield_max_steps must be >= 1 (or unset: no bound), got {self.batch_yield_max_steps}")
        if self.batch_decode_rows_beside_urgent is not None and self.batch_decode_rows_beside_urgent < 0:
            raise ValueError("batch_decode_rows_beside_urgent must be >= 0 (or unset: no limit), got "
                             f"{self.batch_decode_rows_beside_urgent}")
        if self.cuda_graph_prefill_tokens < 0:
            raise ValueError(f"cuda_graph_prefill_tokens must be >= 0, got {self.cuda_graph_prefill_tokens}")
        if self.prompt_tokens_beside_decodes is not None and self.prompt_tokens_beside_decodes < 1:
            raise ValueError("prompt_tokens_beside_decodes must be >= 1 (or unset: the step budget), got "
                             f"{self.prompt_tokens_beside_decodes}")
        if self.kv_run_window < 0:
            raise ValueError(f"kv_run_window must be >= 0 (0: no search for runs), got {self.kv_run_window}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.device == "cpu" and self.dtype == "float16":
            raise ValueError("float16 is not supported on cpu; use float32 or bfloat16")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.tp_all_reduce not in ("auto", "nccl"):
            raise ValueError(f"tp_all_reduce must be 'auto' or 'nccl', got {self.tp_all_reduce!r}")
        if self.async_constrained and self.async_scheduling is False:
            raise ValueError("async_constrained needs async_scheduling (unset or true)")
        if self.noop_model and self.tensor_parallel_size > 1:
            raise ValueError(f"noop_model runs no model: tensor_parallel_size must be 1, got "
                             f"{self.tensor_parallel_size}")

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]


def field_default(cls: type, name: str) -> Any:
    """The default of dataclass ``cls``'s field ``name`` (its ``default_factory`` called); a dotted name goes into a
    nested config, e.g. ``field_default(ClusterConfig, "gateway.port")``. The command-line flags and their help text
    take their defaults from here, so a default is written once, in its dataclass. KeyError for an unknown field or
    one without a default."""
    head, _, rest = name.partition(".")
    for f in fields(cls):
        if f.name != head:
            continue
        if f.default is not MISSING:
            value = f.default
        elif f.default_factory is not MISSING:
            value = f.default_factory()
        else:
            raise KeyError(f"{cls.__name__}.{head} has no default")
        for part in rest.split(".") if rest else ():
            value = getattr(value, part)
        return value
    raise KeyError(f"{cls.__name__} has no field {head!r}")


DEFAULT_CPU_KV_CACHE_BYTES = 1 << 30  # 1 GiB: ~23k tokens of SmolLM2-135M KV in float32


def parse_bytes(text: str) -> int:
    """Parse ``4GiB``, ``512MB``, ``1e9`` or a plain integer into bytes."""
    t = text.strip().lower().replace("ib", "").replace("b", "")
    mult = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
    if t and t[-1] in mult:
        return int(float(t[:-1]) * mult[t[-1]])
    return int(float(t))
