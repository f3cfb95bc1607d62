"""GPU check and baseline, in one run: correctness of the CUDA path and batch-1 decode against the limit.

1. Copy bandwidth of the card (device-to-device copy, bytes read + written).
2. A real small model (SmolLM2-135M from its GGUF) on CUDA, float32: greedy outputs for 20 prompts equal
   transformers' on the same card and weights, token for token.
3. A dummy Llama-3.1-8B (random bfloat16 weights): decode ms/token at batch 1 and a batch of 64 against the
   physical limit: (every weight matrix a step multiplies by, not the embedding table, + the KV it reads) ÷ the
   measured copy bandwidth.

Run: ``python -m loadgen.bench_gpu --gguf PATH [--json OUT]``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch


def copy_bandwidth(nbytes: int = 2 << 30, iters: int = 20) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(iters):
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    times.sort()
    del src, dst
    torch.cuda.empty_cache()
    return 2 * nbytes / times[len(times) // 2]


def check_small_model(gguf: str, n_new: int = 64) -> dict:
    from transformers import LlamaConfig, LlamaForCausalLM

    from common.config import EngineConfig
    from common.engine import LLMEngine
    from common.loader import load_model_source
    from common.sampling import SamplingParams
    from tests.prompts import prompt_ids

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    src = load_model_source(gguf)
    prompts = prompt_ids(src.tokenizer)
    eng = LLMEngine(src, EngineConfig(device="cuda", dtype="float32", max_num_seqs=32, kv_cache_memory=1 << 30))
    params = SamplingParams(max_tokens=n_new, min_tokens=n_new, temperature=0.0)
    t0 = time.perf_counter()
    ours = [r.token_ids for r in eng.generate(prompts, params)]
    ours_s = time.perf_counter() - t0
    m = src.config
    hf_cfg = LlamaConfig(
        vocab_size=m.vocab_size, hidden_size=m.hidden_size, intermediate_size=m.intermediate_size,
        num_hidden_layers=m.num_layers, num_attention_heads=m.num_heads, num_key_value_heads=m.num_kv_heads,
        max_position_embeddings=m.max_position_embeddings, rms_norm_eps=m.rms_norm_eps, rope_theta=m.rope_theta,
        tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2,
    )
    hf = LlamaForCausalLM(hf_cfg).to(torch.float32)
    missing, unexpected = hf.load_state_dict(dict(src.weights()), strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    hf.tie_weights()
    hf = hf.cuda().eval()
    ref = []
    with torch.inference_mode():
        for p in prompts:  # one at a time: no padding in the reference
            ids = torch.tensor([p], device="cuda")
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n_new,
                              min_new_tokens=n_new, pad_token_id=2, eos_token_id=2)
            ref.append(out[0, len(p):].tolist())
    equal = sum(a == b for a, b in zip(ours, ref))
    first_diff = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None) for a, b in zip(ours, ref)]
    del eng, hf
    torch.cuda.empty_cache()
    return {"prompts": len(prompts), "equal": equal, "first_diff": first_diff, "ours_seconds": ours_s}


def decode_speed(bandwidth: float, batch: int, ctx: int, steps: int = 32) -> dict:
    from common.config import EngineConfig
    from common.engine import LLMEngine
    from common.sampling import SamplingParams

    global _ENGINE_8B
    if _ENGINE_8B is None:
        t0 = time.perf_counter()
        _ENGINE_8B = LLMEngine.from_spec(
            "dummy:llama-3.1-8b",
            EngineConfig(device="cuda", dtype="bfloat16", max_num_seqs=64, max_model_len=8192,
                         gpu_memory_utilization=0.85),
        )
        torch.cuda.synchronize()
        print(f"  8B engine ready in {time.perf_counter() - t0:.1f} s, {_ENGINE_8B.runner.num_blocks} KV blocks",
              flush=True)
    eng = _ENGINE_8B
    m = eng.model_cfg
    g = torch.Generator().manual_seed(batch)
    p = SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        eng.add_request(f"b{batch}-{i}", torch.randint(0, m.vocab_size, (ctx,), generator=g).tolist(), p)
    while any(s.num_computed_tokens < s.num_tokens - 1 for s in eng.scheduler.running + eng.scheduler.waiting) \
            or eng.scheduler.waiting:
        eng.step()
    for _ in range(3):
        eng.step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        eng.step()
    torch.cuda.synchronize()
    step_s = (time.perf_counter() - t0) / steps
    while eng.has_unfinished():
        eng.step()
    weight_bytes = (m.num_params() - m.vocab_size * m.hidden_size) * 2  # every matrix but the embedding table
    kv_bytes = batch * (ctx + steps // 2) * 2 * m.num_layers * m.kv_size * 2
    limit_s = (weight_bytes + kv_bytes) / bandwidth
    return {"batch": batch, "context": ctx, "step_ms": step_s * 1e3, "limit_ms": limit_s * 1e3,
            "ratio": step_s / limit_s, "tok_s": batch / step_s}


_ENGINE_8B = None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gguf", required=True, help="SmolLM2-135M-Instruct GGUF path")
    ap.add_argument("--json", default=None, help="write the results here")
    a = ap.parse_args()
    dev = torch.cuda.get_device_name()
    print(f"device: {dev}", flush=True)
    bw = copy_bandwidth()
    print(f"copy bandwidth: {bw / 1e12:.2f} TB/s", flush=True)
    print("SmolLM2 on CUDA float32 vs transformers ...", flush=True)
    small = check_small_model(a.gguf)
    print(f"  greedy equal for {small['equal']}/{small['prompts']} prompts; first diffs {small['first_diff']}",
          flush=True)
    rows = []
    for batch, ctx in ((1, 128), (64, 1024)):
        print(f"dummy Llama-3.1-8B bf16 decode, batch {batch}, context {ctx} ...", flush=True)
        rows.append(decode_speed(bw, batch, ctx))
    print()
    print("| card | batch | context | step ms | limit ms | ratio | tok/s |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {dev} | {r['batch']} | {r['context']} | {r['step_ms']:.2f} | {r['limit_ms']:.2f} | "
              f"{r['ratio']:.2f}x | {r['tok_s']:.0f} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"device": dev, "copy_bandwidth": bw, "small_model": small, "decode": rows}, f, indent=1)
    return 0 if small["equal"] == small["prompts"] else 1


if __name__ == "__main__":
    sys.exit(main())
