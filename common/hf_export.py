"""Export a loaded model (GGUF or any other source) to a Hugging Face directory.

The directory holds ``config.json``, ``model.safetensors``, ``generation_config.json``, ``tokenizer.json`` and
``tokenizer_config.json``: what transformers' ``from_pretrained`` and vLLM need. Peers that cannot read a GGUF
(vLLM) run the very weights Tokenmill runs, dequantized to float32 (or bfloat16).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from common.config import ModelConfig
from common.loader import ModelSource

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def hf_config_dict(cfg: ModelConfig, dtype: str = "float32") -> dict[str, Any]:
    """The ``config.json`` of ``cfg``: Llama (or Qwen2 when the attention has biases)."""
    qwen2 = cfg.attention_bias
    eos = list(cfg.eos_token_ids)
    rs = cfg.rope_scaling
    rope_scaling: dict[str, Any] | None = None
    if rs.rope_type == "linear":
        rope_scaling = {"rope_type": "linear", "factor": rs.factor}
    elif rs.rope_type == "llama3":
        rope_scaling = {
            "rope_type": "llama3",
            "factor": rs.factor,
            "low_freq_factor": rs.low_freq_factor,
            "high_freq_factor": rs.high_freq_factor,
            "original_max_position_embeddings": rs.original_max_position_embeddings,
        }
    out: dict[str, Any] = {
        "architectures": ["Qwen2ForCausalLM" if qwen2 else "LlamaForCausalLM"],
        "model_type": "qwen2" if qwen2 else "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "max_position_embeddings": cfg.max_position_embeddings,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": rope_scaling,
        "hidden_act": "silu",
        "initializer_range": 0.02,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": eos[0] if len(eos) == 1 else (eos or None),
        "use_cache": True,
        "torch_dtype": dtype,
    }
    if qwen2:
        out["use_sliding_window"] = cfg.sliding_window is not None
        out["sliding_window"] = cfg.sliding_window
    else:
        out["attention_bias"] = False
        out["mlp_bias"] = False
        if cfg.sliding_window is not None:  # Mistral-style: Llama ignores it, so say Mistral
            out["architectures"] = ["MistralForCausalLM"]
            out["model_type"] = "mistral"
            out["sliding_window"] = cfg.sliding_window
    return out


def export_hf_dir(source: ModelSource, out_dir: str | Path, dtype: str = "float32") -> Path:
    """Write ``source`` as a Hugging Face directory at ``out_dir`` (created; files overwritten). Returns it.

    Tied embeddings are written once (no ``lm_head.weight``, ``tie_word_embeddings: true``).
    """
    from safetensors.torch import save_file

    if source.weights is None:
        raise ValueError(f"{source.spec}: a model with random weights has nothing to export")
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    tdtype = _DTYPES[dtype]
    cfg = source.config
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    tensors: dict[str, torch.Tensor] = {}
    for name, w in source.weights():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        tensors[name] = w.detach().to(tdtype).contiguous()
    if "model.embed_tokens.weight" not in tensors:
        raise ValueError(f"{source.spec}: the weights have no model.embed_tokens.weight")
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(hf_config_dict(cfg, dtype), indent=2) + "\n")

    eos = list(cfg.eos_token_ids)
    gen: dict[str, Any] = {"bos_token_id": cfg.bos_token_id, "eos_token_id": eos[0] if len(eos) == 1 else eos}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")

    tok = source.tokenizer
    if tok is not None:
        tok.tk.save(str(out / "tokenizer.json"))
        eos_tok = tok.eos_token
        tcfg: dict[str, Any] = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": tok.bos_token,
            "eos_token": eos_tok,
            "pad_token": eos_tok,
            "unk_token": None,
            "add_bos_token": tok.add_bos,
            "add_eos_token": False,
            "clean_up_tokenization_spaces": False,
            "model_max_length": cfg.max_position_embeddings,
        }
        if tok.chat_template:
            tcfg["chat_template"] = tok.chat_template
        (out / "tokenizer_config.json").write_text(json.dumps(tcfg, indent=2) + "\n")
        special = {"bos_token": tok.bos_token, "eos_token": eos_tok, "pad_token": eos_tok}
        (out / "special_tokens_map.json").write_text(
            json.dumps({k: v for k, v in special.items() if v}, indent=2) + "\n"
        )
    return out
