"""Model families through the Hugging Face directory loader, checked against transformers.

Each family is a tiny random model built by transformers from a config (nothing is downloaded), saved with
``save_pretrained`` (safetensors, sharded for some), loaded through ``load_model_source`` + ``LLMEngine`` and
compared with transformers on the same weights: prefill logits (all positions, several sequences in one flat
batch) and 16 greedy tokens with per-step logprobs (decode path). The shipped real-size configs are checked
against transformers' own architecture on the meta device, without allocating any weights.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from common.config import EngineConfig, ModelConfig
from common.engine import LLMEngine
from common.loader import ModelSource, available_dummy_configs, load_model_source
from common.model import LlamaModel, rope_inv_freq
from common.sampling import SamplingParams

CONFIG_DIR = Path(__file__).resolve().parents[1] / "common" / "model_configs"
VOCAB = 512
NEW_TOKENS = 16
PROMPT_LENS = (1, 9, 23)  # a 1-token prompt, one inside a block, one crossing a block boundary (block_size 16)

# Tiny shapes shared by every family; initializer_range 0.2 keeps the argmax margins of random weights far
# above float32 noise, so greedy equality is deterministic.
BASE: dict[str, Any] = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    initializer_range=0.2,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
    tie_word_embeddings=False,
)

# name: (model_type, overrides of BASE, sharded save)
FAMILIES: dict[str, tuple[str, dict[str, Any], bool]] = {
    # Llama 3.1: llama3 rope scaling (original context 64 so low, medium and high bands all occur at head_dim 16)
    "llama3": (
        "llama",
        dict(
            rope_theta=500000.0,
            rope_scaling=dict(
                rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                original_max_position_embeddings=64,
            ),
            eos_token_id=[2, 3],
        ),
        True,
    ),
    "llama2": ("llama", dict(num_key_value_heads=4, rope_theta=10000.0), False),  # multi-head attention
    "llama-linear": ("llama", dict(rope_scaling=dict(rope_type="linear", factor=2.0)), False),
    "llama-tied": ("llama", dict(num_key_value_heads=1, rope_theta=100000.0, tie_word_embeddings=True), False),
    # head_dim 32 × 4 heads != hidden 64 (as Mistral-Nemo): o_proj is not square
    "mistral": ("mistral", dict(rope_theta=1e6, sliding_window=None, head_dim=32), False),
    "qwen2": ("qwen2", dict(rope_theta=1e6, rms_norm_eps=1e-6), True),
    "qwen2-tied": ("qwen2", dict(rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=True), False),
}


@dataclasses.dataclass
class Family:
    name: str
    path: Path
    hf: torch.nn.Module
    source: ModelSource
    engine: LLMEngine
    prompts: list[list[int]]


def _engine_config(**kw: Any) -> EngineConfig:
    # a small explicit pool: the CPU default (1 GiB) would be slow to zero for every engine
    return EngineConfig(device="cpu", dtype="float32", num_gpu_blocks_override=64, **kw)


def _build(name: str, root: Path) -> Family:
    model_type, overrides, sharded = FAMILIES[name]
    cfg = AutoConfig.for_model(model_type, **{**BASE, **overrides})
    torch.manual_seed(3)  # every family's greedy steps then have top-2 gaps >= 4.8e-3 (errors here are ~1e-5)
    hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    hf.eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # transformers inits norms to 1 and biases to 0: randomize them so they are tested
        for pname, p in hf.named_parameters():
            if pname.endswith("bias"):
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
            elif "norm" in pname:
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=g))
    path = root / name
    hf.save_pretrained(path, safe_serialization=True, max_shard_size="50KB" if sharded else "1GB")
    files = sorted(path.glob("*.safetensors"))
    assert (len(files) > 1) == sharded, [f.name for f in files]
    if sharded:
        # A decoy as Mistral's Hub repos ship beside the shards (consolidated.safetensors, native names):
        # the loader must read only the files the index names.
        from safetensors.torch import save_file

        save_file({"layers.0.attention.wq.weight": torch.zeros(2, 2)}, str(path / "consolidated.safetensors"))
    source = load_model_source(str(path))
    engine = LLMEngine(source, _engine_config())
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(4, VOCAB, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    return Family(name, path, hf, source, engine, prompts)


@pytest.fixture(scope="module", autouse=True)
def _one_thread() -> Iterator[None]:
    """These models are tiny: one intra-op thread is fastest, and on a busy 2-core machine torch's default
    thread pool spins at every op barrier (measured ~50x slower per step). Restored for the other modules."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def families(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Family]:
    """Build each family once per module, on first use."""
    built: dict[str, Family] = {}

    def get(name: str) -> Family:
        if name not in built:
            built[name] = _build(name, tmp_path_factory.mktemp("hf"))
        return built[name]

    return get


@pytest.fixture(params=list(FAMILIES))
def family(request: pytest.FixtureRequest, families: Callable[[str], Family]) -> Family:
    return families(request.param)


def _assert_close_rel(ours: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    """Within 1e-4 relative (to each value, and to the tensor's scale for values near zero)."""
    scale = ref.abs().max().item()
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4 * scale, msg=lambda m: f"{what}: {m}")


def _our_prefill_logits(engine: LLMEngine, prompts: list[list[int]]) -> list[torch.Tensor]:
    """One flat-batch prefill of every prompt through our model on a scratch cache; logits of every position."""
    return engine.runner.score(prompts)


def _hf_generate(hf: torch.nn.Module, prompt: list[int]) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy tokens and the raw logits of each step ([NEW_TOKENS, vocab])."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = hf.generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS, pad_token_id=0, return_dict_in_generate=True, output_logits=True,
        )
    return out.sequences[0, len(prompt) :].tolist(), torch.cat(out.logits, dim=0).float()


GREEDY = SamplingParams(
    max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, logprobs=5
)


def _check_generate_matches(fam: Family, engine: LLMEngine) -> None:
    results = engine.generate(fam.prompts, GREEDY)
    for prompt, res in zip(fam.prompts, results):
        ref_tokens, ref_logits = _hf_generate(fam.hf, prompt)
        top2 = ref_logits.topk(2, dim=-1).values
        assert (top2[:, 0] - top2[:, 1]).min() > 1e-3, "near-tied argmax in the reference: pick another seed"
        assert res.token_ids == ref_tokens, f"{fam.name}: prompt of {len(prompt)} tokens"
        assert res.finish_reason == "length"
        # logprobs of every step (prefill, then decodes) against the reference's raw logits
        ref_lp = torch.log_softmax(ref_logits, dim=-1)
        assert res.logprobs is not None and len(res.logprobs) == NEW_TOKENS
        for step, lp in enumerate(res.logprobs):
            ids = [lp.token_id] + [t for t, _ in lp.top]
            ours = torch.tensor([lp.logprob] + [v for _, v in lp.top])
            _assert_close_rel(ours, ref_lp[step, ids], f"{fam.name} step {step} logprobs")
            assert min(v for _, v in lp.top) >= ref_lp[step].topk(5).values[-1].item() - 1e-4  # a true top-5


# ---- per family ----------------------------------------------------------------------------------------
def test_config_parsed(family: Family) -> None:
    hf_cfg = family.hf.config
    c = family.source.config
    assert c.vocab_size == VOCAB and c.num_layers == 2 and c.hidden_size == 64
    assert c.num_heads == 4 and c.num_kv_heads == hf_cfg.num_key_value_heads
    assert c.head_dim == getattr(hf_cfg, "head_dim", None) or 64 // 4
    assert c.tie_word_embeddings == hf_cfg.tie_word_embeddings
    assert c.attention_bias == (hf_cfg.model_type == "qwen2")
    assert c.rms_norm_eps == hf_cfg.rms_norm_eps
    assert c.rope_theta == hf_cfg.rope_parameters["rope_theta"]
    assert c.rope_scaling.rope_type == hf_cfg.rope_parameters["rope_type"]
    eos = hf_cfg.eos_token_id
    assert c.eos_token_ids == (tuple(eos) if isinstance(eos, list) else (eos,))
    assert c.num_params() == sum(p.numel() for p in family.hf.parameters())
    rotary = family.hf.model.rotary_emb
    assert torch.equal(rope_inv_freq(c), rotary.inv_freq)
    assert rotary.attention_scaling == 1.0


def test_prefill_logits_match_transformers(family: Family) -> None:
    ours = _our_prefill_logits(family.engine, family.prompts)
    for prompt, got in zip(family.prompts, ours):
        with torch.no_grad():
            ref = family.hf(torch.tensor([prompt])).logits[0].float()
        _assert_close_rel(got, ref, f"{family.name}: prefill logits of a {len(prompt)}-token prompt")


def test_greedy_generate_matches_transformers(family: Family) -> None:
    _check_generate_matches(family, family.engine)


@pytest.mark.parametrize("name", ["llama3", "qwen2"])
def test_chunked_prefill_and_prefix_cache_match_transformers(name: str, families: Callable[[str], Family]) -> None:
    family = families(name)
    # 8-token budget: the 23-token prompt is prefilled in chunks over its own cached prefix; the second run
    # finds its first full block in the prefix cache.
    engine = LLMEngine(family.source, _engine_config(max_num_batched_tokens=8, max_num_seqs=4))
    _check_generate_matches(family, engine)
    _check_generate_matches(family, engine)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


@pytest.mark.parametrize("name", [n for n, (_, _, sharded) in FAMILIES.items() if sharded])
def test_sharded_checkpoint_loads_only_indexed_shards(name: str, families: Callable[[str], Family]) -> None:
    family = families(name)
    index = json.loads((family.path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    names = [n for n, _ in family.source.weights()]
    assert sorted(names) == sorted(index["weight_map"])  # every shard's tensors, not the decoy's


# ---- the shipped configs -------------------------------------------------------------------------------
EXPECTED_PARAMS = {
    "llama-3.1-8b": 8_030_261_248,
    "llama-3.1-70b": 70_553_706_496,
    "llama-2-7b": 6_738_415_616,
    "mistral-7b": 7_248_023_552,
    "qwen2-7b": 7_615_616_512,
    "smollm2-135m": 134_515_008,
}


def test_shipped_configs_listed() -> None:
    assert set(EXPECTED_PARAMS) | {"tiny-llama"} <= set(available_dummy_configs())


@pytest.mark.parametrize("name", [*EXPECTED_PARAMS, "tiny-llama"])
def test_shipped_config_matches_transformers_architecture(name: str) -> None:
    """Our parameter count equals transformers' model built on the meta device (no memory allocated)."""
    d = json.loads((CONFIG_DIR / f"{name}.json").read_text())
    ours = ModelConfig.from_hf_dict(d, name=name)
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(AutoConfig.for_model(**d))
    assert ours.num_params() == sum(p.numel() for p in hf.parameters())
    if name in EXPECTED_PARAMS:
        assert ours.num_params() == EXPECTED_PARAMS[name]
    assert torch.equal(rope_inv_freq(ours), LlamaRotaryEmbedding(hf.config).inv_freq)


def test_dummy_llama31_8b_config_without_allocating() -> None:
    src = load_model_source("dummy:llama-3.1-8b")
    assert src.weights is None and src.tokenizer is None  # random weights, drawn only by an engine
    c = src.config
    assert abs(c.num_params() - 8.03e9) / 8.03e9 < 0.01
    assert (c.vocab_size, c.hidden_size, c.intermediate_size, c.num_layers) == (128256, 4096, 14336, 32)
    assert (c.num_heads, c.num_kv_heads, c.head_dim) == (32, 8, 128)
    assert c.max_position_embeddings == 131072 and c.rope_theta == 500000.0
    assert c.rope_scaling.rope_type == "llama3" and c.rope_scaling.factor == 8.0
    assert (c.rope_scaling.low_freq_factor, c.rope_scaling.high_freq_factor) == (1.0, 4.0)
    assert c.rope_scaling.original_max_position_embeddings == 8192
    assert c.bos_token_id == 128000 and c.eos_token_ids == (128001, 128008, 128009)
    assert not c.tie_word_embeddings and not c.attention_bias and c.sliding_window is None


def test_shipped_family_specifics() -> None:
    mistral = load_model_source("dummy:mistral-7b").config
    assert (mistral.vocab_size, mistral.rope_theta, mistral.sliding_window) == (32768, 1e6, None)
    assert mistral.max_position_embeddings == 32768
    qwen = load_model_source("dummy:qwen2-7b").config
    assert qwen.attention_bias and qwen.sliding_window is None  # use_sliding_window: false
    assert qwen.max_position_embeddings == 131072 and qwen.rms_norm_eps == 1e-6
    llama2 = load_model_source("dummy:llama-2-7b").config
    assert llama2.num_kv_heads == 32 and llama2.rope_scaling.rope_type == "default"
    smol = load_model_source("dummy:smollm2-135m").config
    assert smol.tie_word_embeddings and (smol.num_heads, smol.num_kv_heads, smol.head_dim) == (9, 3, 64)


def test_sliding_window_caps_the_context() -> None:
    """Attention is always full, so a sliding-window model (Mistral v0.1) only accepts contexts within its window."""
    d = json.loads((CONFIG_DIR / "mistral-7b.json").read_text())
    v01 = ModelConfig.from_hf_dict({**d, "sliding_window": 4096, "vocab_size": 32000})
    assert v01.sliding_window == 4096 and v01.max_position_embeddings == 4096
    d = json.loads((CONFIG_DIR / "qwen2-7b.json").read_text())
    assert ModelConfig.from_hf_dict(d).max_position_embeddings == 131072


def test_llama31_rope_tables_match_transformers() -> None:
    """cos/sin at the 8B's head_dim across the full 128k context, bit for bit (only the rotary tables are
    real-size: the layers are shrunk so nothing of 8B size is allocated)."""
    d = json.loads((CONFIG_DIR / "llama-3.1-8b.json").read_text())
    real = ModelConfig.from_hf_dict(d)
    small = dataclasses.replace(
        real, vocab_size=8, hidden_size=128, intermediate_size=8, num_layers=1, num_heads=1, num_kv_heads=1
    )
    assert small.head_dim == 128
    ours = LlamaModel(small, torch.float32, "cpu")
    rotary = LlamaRotaryEmbedding(AutoConfig.for_model(**d))
    pos = torch.cat([torch.arange(0, 131072, 61), torch.tensor([131071])])
    cos, sin = rotary(torch.zeros(1, dtype=torch.float32), pos[None])
    assert torch.equal(ours.rope_cos[pos], cos[0]) and torch.equal(ours.rope_sin[pos], sin[0])


def test_dummy_tiny_llama_generates() -> None:
    src = load_model_source("dummy:tiny-llama")
    assert src.weights is None and src.config.num_layers == 2 and src.config.hidden_size == 64
    prompts = [[1, 5, 9, 13], list(range(3, 40))]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    runs = []
    for _ in range(2):  # random weights are drawn from the engine seed: two engines agree
        eng = LLMEngine(src, _engine_config(seed=0))
        res = eng.generate(prompts, params)
        assert [len(r.token_ids) for r in res] == [8, 8]
        assert all(0 <= t < src.config.vocab_size for r in res for t in r.token_ids)
        assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks
        runs.append([r.token_ids for r in res])
    assert runs[0] == runs[1]
    sampled = LLMEngine(src, _engine_config()).generate(
        prompts, SamplingParams(max_tokens=8, temperature=1.0, seed=7, ignore_eos=True)
    )
    assert [len(r.token_ids) for r in sampled] == [8, 8]
