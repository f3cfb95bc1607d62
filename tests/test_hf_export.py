"""common.hf_export: the embedded GGUF exported to a Hugging Face directory loads in transformers unchanged."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from common.hf_export import export_hf_dir  # noqa: E402
from common.loader import embedded_gguf_path, load_model_source  # noqa: E402


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    try:
        embedded_gguf_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    src = load_model_source("smollm2")
    out = export_hf_dir(src, tmp_path_factory.mktemp("hf") / "smollm2")
    return src, out


def test_files_config_and_weights_round_trip(exported):
    from safetensors import safe_open

    src, out = exported
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert (cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["num_key_value_heads"]) == (30, 9, 3)
    assert cfg["tie_word_embeddings"] is True and cfg["rope_theta"] == 100000.0
    tcfg = json.loads((out / "tokenizer_config.json").read_text())
    assert tcfg["eos_token"] == "<|im_end|>" and tcfg["chat_template"] == src.tokenizer.chat_template
    with safe_open(str(out / "model.safetensors"), framework="pt") as sf:
        names = set(sf.keys())
        assert "lm_head.weight" not in names  # tied: written once
        n = 0
        for name, w in src.weights():
            assert name in names, name
            assert torch.equal(sf.get_tensor(name), w), name
            n += 1
    assert n == len(names) == 272


def test_transformers_loads_it_like_the_gguf(exported):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src, out = exported
    tok = AutoTokenizer.from_pretrained(out)
    text = "The quick brown fox jumps over the lazy dog. Ünïcödé, 1234 — <|im_end|>\n  tabs\tand spaces"
    assert tok(text, add_special_tokens=True).input_ids == src.tokenizer.encode(text)

    gguf = embedded_gguf_path()
    ref = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    prompt = src.tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    ids = torch.tensor([src.tokenizer.encode(prompt)])
    with torch.no_grad():
        got = model(ids).logits
        want = ref(ids).logits
    assert (got - want).abs().max().item() < 1e-4
    # and the model behaves: its known greedy answer
    gen = model.generate(ids, max_new_tokens=9, do_sample=False)
    assert tok.decode(gen[0, ids.shape[1] :]).startswith("The capital of France is Paris.")
