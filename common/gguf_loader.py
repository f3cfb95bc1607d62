"""GGUF files: a fast metadata reader, dequantization in torch, and the mapping to Hugging Face names.

Reading the metadata with our own parser takes a fraction of a second (gguf's reader builds every field as
numpy views, ~2.5 s for the default model's tokenizer arrays). Q4_0, Q4_1, Q8_0, F16, BF16 and F32 are
dequantized here with torch ops; any other ggml type goes through ``gguf.quants.dequantize``.
"""

from __future__ import annotations

import mmap
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from common.config import ModelConfig, RopeScaling

GGUF_MAGIC = b"GGUF"

# ggml tensor types we handle natively: type id -> (name, block elements, block bytes)
_TYPES: dict[int, tuple[str, int, int]] = {
    0: ("F32", 1, 4),
    1: ("F16", 1, 2),
    2: ("Q4_0", 32, 18),
    3: ("Q4_1", 32, 20),
    8: ("Q8_0", 32, 34),
    30: ("BF16", 1, 2),
}

_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NP = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
       7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}


@dataclass(frozen=True, slots=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # numpy order: outermost first, e.g. [out, in]
    ggml_type: int
    offset: int  # absolute offset in the file


class GGUFFile:
    """A memory-mapped GGUF file: ``metadata`` (dict) and ``tensors`` (name -> TensorInfo)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"GGUF file not found: {self.path}")
        with open(self.path, "rb") as f:
            self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        self._pos = 0
        if self._read(4) != GGUF_MAGIC:
            raise ValueError(f"{self.path} is not a GGUF file (bad magic)")
        version = self._scalar("<I")
        if version < 2:
            raise ValueError(f"{self.path}: GGUF version {version} is not supported (need 2 or 3)")
        n_tensors = self._scalar("<Q")
        n_kv = self._scalar("<Q")
        self.metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = self._string()
            vtype = self._scalar("<I")
            self.metadata[key] = self._value(vtype)
        infos = []
        for _ in range(n_tensors):
            name = self._string()
            n_dims = self._scalar("<I")
            dims = [self._scalar("<Q") for _ in range(n_dims)]
            ttype = self._scalar("<I")
            offset = self._scalar("<Q")
            infos.append((name, tuple(reversed(dims)), ttype, offset))
        align = int(self.metadata.get("general.alignment", 32))
        data_start = (self._pos + align - 1) // align * align
        self.tensors = {n: TensorInfo(n, s, t, data_start + o) for n, s, t, o in infos}

    # -- primitive readers -----------------------------------------------------------------------------
    def _read(self, n: int) -> bytes:
        b = self._mm[self._pos : self._pos + n]
        self._pos += n
        return b

    def _scalar(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        (v,) = struct.unpack_from(fmt, self._mm, self._pos)
        self._pos += size
        return v

    def _string(self) -> str:
        n = self._scalar("<Q")
        return self._read(n).decode("utf-8", errors="replace")

    def _value(self, vtype: int) -> Any:
        if vtype in _SCALAR:
            return self._scalar(_SCALAR[vtype])
        if vtype == 8:
            return self._string()
        if vtype == 9:
            itype = self._scalar("<I")
            count = self._scalar("<Q")
            if itype in _NP:
                dt = np.dtype(_NP[itype])
                arr = np.frombuffer(self._mm, dtype=dt, count=count, offset=self._pos).copy()
                self._pos += dt.itemsize * count
                return arr
            return [self._value(itype) for _ in range(count)]
        raise ValueError(f"{self.path}: unknown GGUF value type {vtype}")

    # -- tensors ---------------------------------------------------------------------------------------
    def tensor(self, name: str) -> torch.Tensor:
        """Dequantize one tensor to float32, shape in numpy order ([out, in] for matrices)."""
        info = self.tensors[name]
        numel = int(np.prod(info.shape))
        if info.ggml_type in _TYPES:
            tname, blk, blk_bytes = _TYPES[info.ggml_type]
            nbytes = numel // blk * blk_bytes
            raw = torch.frombuffer(self._mm, dtype=torch.uint8, count=nbytes, offset=info.offset)
            return _dequantize(tname, raw, numel).reshape(info.shape)
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize as gguf_dequantize

        qtype = GGMLQuantizationType(info.ggml_type)
        from gguf.constants import GGML_QUANT_SIZES

        blk, blk_bytes = GGML_QUANT_SIZES[qtype]
        rows = numel // info.shape[-1]
        raw_np = np.frombuffer(self._mm, dtype=np.uint8, count=numel // blk * blk_bytes, offset=info.offset)
        out = gguf_dequantize(raw_np.reshape(rows, -1), qtype)
        return torch.from_numpy(np.ascontiguousarray(out, dtype=np.float32)).reshape(info.shape)


def _dequantize(tname: str, raw: torch.Tensor, numel: int) -> torch.Tensor:
    if tname == "F32":
        return raw.view(torch.float32).clone()
    if tname == "F16":
        return raw.view(torch.float16).float()
    if tname == "BF16":
        return raw.view(torch.bfloat16).float()
    nblocks = numel // 32
    if tname == "Q8_0":
        b = raw.view(nblocks, 34)
        d = b[:, :2].contiguous().view(torch.float16).float()
        q = b[:, 2:].contiguous().view(torch.int8).float()
        return (q * d).reshape(-1)
    if tname in ("Q4_0", "Q4_1"):
        width = 18 if tname == "Q4_0" else 20
        b = raw.view(nblocks, width)
        d = b[:, :2].contiguous().view(torch.float16).float()
        qs = b[:, width - 16 :]
        # element j (j < 16) is the low nibble of byte j; element j + 16 its high nibble
        q = torch.cat((qs & 0x0F, qs >> 4), dim=1).float()
        if tname == "Q4_0":
            return ((q - 8.0) * d).reshape(-1)
        m = b[:, 2:4].contiguous().view(torch.float16).float()
        return (q * d + m).reshape(-1)
    raise AssertionError(tname)


# ---- model config and weights from GGUF -------------------------------------------------------------

_LAYER_MAP = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
SUPPORTED_ARCHS = ("llama", "qwen2", "mistral")


def gguf_model_config(g: GGUFFile, name: str) -> ModelConfig:
    md = g.metadata
    arch = md.get("general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise ValueError(f"{g.path}: architecture {arch!r} is not supported; Tokenmill runs {SUPPORTED_ARCHS}")

    def key(k: str, default: Any = None) -> Any:
        return md.get(f"{arch}.{k}", default)

    heads = int(key("attention.head_count"))
    hidden = int(key("embedding_length"))
    vocab = key("vocab_size") or len(md["tokenizer.ggml.tokens"])
    scaling = RopeScaling()
    stype = key("rope.scaling.type")
    if stype == "linear":
        scaling = RopeScaling(rope_type="linear", factor=float(key("rope.scaling.factor", 1.0)))
    eos = md.get("tokenizer.ggml.eos_token_id")
    eot = md.get("tokenizer.ggml.eot_token_id")
    eos_ids = tuple(sorted({int(t) for t in (eos, eot) if t is not None}))
    return ModelConfig(
        name=name,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(key("feed_forward_length")),
        num_layers=int(key("block_count")),
        num_heads=heads,
        num_kv_heads=int(key("attention.head_count_kv", heads)),
        head_dim=int(key("attention.key_length", hidden // heads)),
        max_position_embeddings=int(key("context_length", 4096)),
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(key("rope.freq_base", 10000.0)),
        rope_scaling=scaling,
        tie_word_embeddings="output.weight" not in g.tensors,
        attention_bias="blk.0.attn_q.bias" in g.tensors,
        bos_token_id=md.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=eos_ids,
    )


def _unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation (interleaved-pair RoPE → rotate-half)."""
    rows = w.shape[0]
    rest = w.shape[1:]
    return w.reshape(n_head, rows // n_head // 2, 2, *rest).swapaxes(1, 2).reshape(rows, *rest)


def gguf_weights(g: GGUFFile, cfg: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (Hugging Face name, float32 tensor) for every tensor of the file."""
    permuted = g.metadata.get("general.architecture") in ("llama", "mistral")
    for name in g.tensors:
        if name == "token_embd.weight":
            yield "model.embed_tokens.weight", g.tensor(name)
        elif name == "output_norm.weight":
            yield "model.norm.weight", g.tensor(name)
        elif name == "output.weight":
            yield "lm_head.weight", g.tensor(name)
        elif name.startswith("blk."):
            _, idx, rest = name.split(".", 2)
            if rest not in _LAYER_MAP:
                raise ValueError(f"{g.path}: unexpected tensor {name!r}")
            w = g.tensor(name)
            if permuted and rest.startswith("attn_q."):
                w = _unpermute(w, cfg.num_heads)
            elif permuted and rest.startswith("attn_k."):
                w = _unpermute(w, cfg.num_kv_heads)
            yield f"model.layers.{idx}.{_LAYER_MAP[rest]}", w
        elif name == "rope_freqs.weight":
            continue  # llama3 scaling factors, recomputed from the config
        else:
            raise ValueError(f"{g.path}: unexpected tensor {name!r}")
