"""A tokenizer from another spec (vLLM's ``--tokenizer``): a random-weight ``dummy:`` model with SmolLM2's tokenizer
serves text through ``load_model_source``, ``tokenmill generate`` and the whole cluster (tokenizer pool, decode
worker's detokenizer, the gateway's logprob texts); a tokenizer larger than the model's vocabulary is refused."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
import torch

from common.config import EngineConfig, ModelConfig
from common.engine import LLMEngine
from common.loader import embedded_gguf_path, load_model_source, load_tokenizer
from common.sampling import SamplingParams
from tests.services.harness import running_cluster

SMOLLM2_VOCAB = 49152
TOKENMILL = Path(sys.executable).with_name("tokenmill")
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


def tiny_config(path: Path, vocab: int) -> Path:
    """A Llama of two tiny layers with ``vocab`` tokens, as a ``config.json`` for ``dummy:PATH``."""
    path.write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 1024,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False, "vocab_size": vocab,
        "bos_token_id": 1, "eos_token_id": 2,
    }))
    return path


@pytest.fixture(scope="module")
def tiny_dummy(tmp_path_factory) -> str:
    """A model spec whose vocabulary is larger than SmolLM2's tokenizer (as Llama 3's 128,256 is)."""
    return "dummy:" + str(tiny_config(tmp_path_factory.mktemp("cfg") / "tiny-50k.json", SMOLLM2_VOCAB + 848))


def test_dummy_model_gets_the_tokenizer_of_the_spec(tiny_dummy):
    assert load_model_source(tiny_dummy).tokenizer is None
    src = load_model_source(tiny_dummy, tokenizer="smollm2")
    tok = src.tokenizer
    assert tok is not None and tok.vocab_size == SMOLLM2_VOCAB < src.config.vocab_size
    text = "The capital of France is Paris."
    ids = tok.encode(text)
    assert ids == load_tokenizer("smollm2").encode(text)
    assert tok.decode(ids) == text
    assert "<|im_start|>user" in tok.apply_chat_template(CHAT)  # SmolLM2's chat template came along
    assert src.weights is None and src.model_id == "dummy-tiny-50k"  # still random weights, same KV identity


def test_tokenizer_spec_as_gguf_or_hf_directory(tiny_dummy, tmp_path):
    ref = load_tokenizer("smollm2")
    hf = tmp_path / "hf-tokenizer"
    hf.mkdir()
    ref.tk.save(str(hf / "tokenizer.json"))
    (hf / "tokenizer_config.json").write_text(json.dumps({"chat_template": ref.chat_template,
                                                          "eos_token": ref.eos_token}))
    text = "Tokenizers, of every kind."
    for spec in (str(embedded_gguf_path()), str(hf)):
        tok = load_model_source(tiny_dummy, tokenizer=spec).tokenizer
        assert tok is not None and tok.encode(text) == ref.encode(text)
        assert tok.apply_chat_template(CHAT) == ref.apply_chat_template(CHAT)
    # a model's own tokenizer is replaced too: the embedded GGUF model with the HF directory's
    assert load_model_source("smollm2", tokenizer=str(hf)).tokenizer.chat_template == ref.chat_template


def test_tokenizer_larger_than_the_model_vocabulary_is_refused(tmp_path):
    spec = "dummy:" + str(tiny_config(tmp_path / "small-vocab.json", 32000))
    with pytest.raises(ValueError, match=r"tokenizer 'smollm2' has 49152 tokens, more than the 32000 of model"):
        load_model_source(spec, tokenizer="smollm2")


def test_generate_cli_with_a_dummy_model_and_a_tokenizer(tiny_dummy, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "The history of the printing press", "max_tokens": 4,
                                   "ignore_eos": True, "temperature": 0}) + "\n"
                       + json.dumps({"messages": CHAT, "max_tokens": 4, "ignore_eos": True, "seed": 1}) + "\n")
    r = subprocess.run([str(TOKENMILL), "generate", "--model", tiny_dummy, "--tokenizer", "smollm2",
                        "--prompts", str(prompts), "--kv-cache-memory", "16MiB"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    lines = [json.loads(x) for x in r.stdout.splitlines()]
    tok = load_tokenizer("smollm2")
    want_prompt = [len(tok.encode("The history of the printing press")),
                   len(tok.encode(tok.apply_chat_template(CHAT), add_special_tokens=False))]
    assert [x["index"] for x in lines] == [0, 1]
    for x, n in zip(lines, want_prompt):
        assert x["prompt_tokens"] == n and x["completion_tokens"] == len(x["token_ids"]) == 4
        assert x["finish_reason"] == "length" and isinstance(x["text"], str)
        assert all(0 <= t < SMOLLM2_VOCAB for t in x["token_ids"])  # only ids the tokenizer can decode
    # without --tokenizer the dummy model has no text: the line is refused with a pointer to the flag
    r = subprocess.run([str(TOKENMILL), "generate", "--model", tiny_dummy, "--prompts", str(prompts),
                        "--kv-cache-memory", "16MiB"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "--tokenizer" in r.stderr


def test_served_cluster_with_a_dummy_model_and_a_tokenizer(tmp_path):
    spec = "dummy:" + str(tiny_config(tmp_path / "tiny-49k.json", SMOLLM2_VOCAB))
    ref = LLMEngine(load_model_source(spec, tokenizer="smollm2"), EngineConfig(kv_cache_memory=16 << 20))
    tok = ref.tokenizer
    assert tok is not None
    want = ref.generate([tok.encode(tok.apply_chat_template(CHAT), add_special_tokens=False)],
                        SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))[0]
    with running_cluster(tmp_path, "--model", spec, "--tokenizer", "smollm2", "--prefills", "0",
                         "--tokenizers", "1", "--set", "engine.kv_cache_memory=16777216", "--grace", "3") as info:
        body = {"model": spec, "messages": CHAT, "max_tokens": 6, "temperature": 0, "ignore_eos": True,
                "logprobs": True, "top_logprobs": 2}
        req = urllib.request.Request(info["http"] + "/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as resp:
            r = json.loads(resp.read())
    choice = r["choices"][0]
    assert r["usage"]["prompt_tokens"] == len(want.prompt_ids) and r["usage"]["completion_tokens"] == 6
    assert choice["message"]["content"] == want.text  # the same weights (seeded) and the same tokenizer
    # the gateway names logprob tokens by the tokenizer's text, not by id
    assert len(choice["logprobs"]["content"]) == 6
    assert not any(t["token"].startswith("token_id:") for t in choice["logprobs"]["content"])


def test_llama_3_2_1b_config_has_the_real_shape():
    from transformers import AutoConfig, AutoModelForCausalLM

    path = Path(__file__).resolve().parents[1] / "common" / "model_configs" / "llama-3.2-1b.json"
    d = json.loads(path.read_text())
    cfg = ModelConfig.from_hf_dict(d, name="llama-3.2-1b")
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads,
            cfg.head_dim, cfg.vocab_size) == (2048, 8192, 16, 32, 8, 64, 128256)
    assert cfg.tie_word_embeddings and cfg.eos_token_ids == (128001, 128008, 128009)
    assert cfg.rope_scaling.rope_type == "llama3" and cfg.rope_scaling.factor == 32.0
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(AutoConfig.for_model(**d))
    assert cfg.num_params() == sum(p.numel() for p in hf.parameters()) == 1_235_814_400
    assert load_model_source("dummy:llama-3.2-1b", tokenizer="smollm2").tokenizer is not None
