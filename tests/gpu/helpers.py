"""Helpers of the GPU suite: a stoppable real cluster, its /metrics, gRPC and HTTP calls, the transformers reference.

Nothing here imports Triton or transformers at module level: the suite must collect (and skip) on a CPU machine.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import grpc
import torch
from tokenmill.v1 import common_pb2, frontend_pb2, frontend_pb2_grpc

from tests.services.harness import HOST, running_cluster

N_REF = 64  # tokens of the transformers reference per prompt

# Every GPU cluster: the real model on CUDA in float32 (so greedy outputs can equal transformers' token for token),
# a small KV pool, one tokenizer, a short drain on stop.
GPU_ENGINE_ARGS = ("--set", "engine.device=cuda", "--set", "engine.dtype=float32", "--tokenizers", "1",
                   "--grace", "3")


def first_diff(a: Sequence[int], b: Sequence[int]) -> int:
    """Index of the first differing token (the shorter length when one is a prefix of the other)."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def release_cuda() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def wait_until(pred: Callable[[], bool], timeout: float, what: Callable[[], str]) -> None:
    """Poll ``pred`` every 0.1 s; on timeout raise AssertionError with ``what()`` (the last observed state)."""
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s: {what()}")
        time.sleep(0.1)


def cuda_visible_devices(pid: int) -> str | None:
    """A running process's CUDA_VISIBLE_DEVICES (None: not set)."""
    for entry in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
        if entry.startswith(b"CUDA_VISIBLE_DEVICES="):
            return entry.split(b"=", 1)[1].decode()
    return None


# -- a real cluster ----------------------------------------------------------------------------------------------
def _tail(path: str | Path, n: int) -> str:
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-n:])
    except OSError as e:
        return f"(cannot read {path}: {e})"


def _logs(processes: list[dict[str, Any]], n: int) -> str:
    return "\n".join(f"--- {p['name']} ({p['log']}):\n{_tail(p['log'], n)}" for p in processes
                     if p["role"] in ("prefill", "decode"))


class GpuCluster:
    """``tokenmill up`` as real processes (``tests.services.harness.running_cluster``: ``python -m services.cli up``),
    ready on return; ``stop()`` (idempotent) ends it before its fixture does, so the next cluster has the GPU.

    A start-up failure carries the model workers' last log lines."""

    def __init__(self, tmp: Path, *args: str, timeout: float = 300) -> None:
        self.args = args
        self._stack = contextlib.ExitStack()
        self.stopped = False
        try:
            self.info: dict[str, Any] = self._stack.enter_context(running_cluster(tmp, *args, timeout=timeout))
        except BaseException as e:
            try:
                procs = json.loads((tmp / "state.json").read_text())["processes"]
                e.add_note(f"model worker logs, last lines:\n{_logs(procs, 60)}")
            except (OSError, ValueError, KeyError):
                e.add_note(f"no state file under {tmp}: the launcher did not start its children")
            raise

    def stop(self) -> None:
        """SIGTERM the launcher and wait for a clean exit (the harness asserts exit code 0)."""
        if not self.stopped:
            self.stopped = True
            self._stack.close()

    @property
    def gateway(self) -> str:
        """The public gRPC address (HOST:PORT)."""
        assert not self.stopped, "this cluster was already stopped"
        return self.info["gateway"]

    @property
    def http(self) -> str:
        """The OpenAI HTTP API root (http://HOST:PORT)."""
        assert not self.stopped, "this cluster was already stopped"
        return self.info["http"]

    def procs(self, role: str) -> list[dict[str, Any]]:
        ps = [p for p in self.info["processes"] if p["role"] == role]
        assert ps, f"no {role} process in this cluster ({self.args})"
        return ps

    def logs_tail(self, n: int = 40) -> str:
        return _logs(self.info["processes"], n)

    @staticmethod
    def metric(proc: dict[str, Any], name: str) -> float:
        """``name``'s value in one process's /metrics, summed over label sets; AssertionError when absent."""
        url = f"http://{HOST}:{proc['metrics_port']}/metrics"
        text = urllib.request.urlopen(url, timeout=5).read().decode()
        values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                  if line.startswith(name + " ") or line.startswith(name + "{")]
        assert values, f"{name} is not in {proc['name']}'s /metrics ({url})"
        return sum(values)

    def role_metric(self, role: str, name: str) -> float:
        return sum(self.metric(p, name) for p in self.procs(role))

    def kv_blocks(self, role: str) -> list[tuple[float, float]]:
        """(free, total) KV blocks of every process of ``role``."""
        return [(self.metric(p, "tokenmill:kv_blocks_free"), self.metric(p, "tokenmill:kv_blocks_total"))
                for p in self.procs(role)]

    def wait_all_blocks_free(self, roles: Sequence[str] = ("decode",), timeout: float = 20.0) -> None:
        def free() -> bool:
            return all(f == t for r in roles for f, t in self.kv_blocks(r))

        wait_until(free, timeout, lambda: "KV blocks (free, total) " + ", ".join(
            f"{r}: {self.kv_blocks(r)}" for r in roles))


# -- requests ----------------------------------------------------------------------------------------------------
SAMPLED = dict(temperature=1.0, top_p=0.9, top_k=50, repetition_penalty=1.1)


def ids_request(ids: Sequence[int], **params: Any) -> frontend_pb2.GenerateRequest:
    return frontend_pb2.GenerateRequest(prompt_token_ids=frontend_pb2.TokenIds(ids=list(ids)),
                                        params=common_pb2.SamplingParams(**params))


async def collect(stub: frontend_pb2_grpc.FrontendStub, req: frontend_pb2.GenerateRequest
                  ) -> tuple[str, list[int], frontend_pb2.GenerateResponse]:
    """One whole stream: (text, token ids, last message)."""
    text, ids, last = "", [], None
    async for r in stub.Generate(req, timeout=300):
        text += r.text
        ids += list(r.token_ids)
        last = r
    assert last is not None, "the stream ended without a message"
    return text, ids, last


def generate_all(gateway: str, reqs: Sequence[frontend_pb2.GenerateRequest]
                 ) -> list[tuple[str, list[int], frontend_pb2.GenerateResponse]]:
    """Send every request at once over one channel; results in request order."""
    async def run():
        async with grpc.aio.insecure_channel(gateway) as ch:
            stub = frontend_pb2_grpc.FrontendStub(ch)
            return await asyncio.gather(*(collect(stub, r) for r in reqs))

    return asyncio.run(run())


def post_json(url: str, body: dict[str, Any], timeout: float = 300) -> dict[str, Any]:
    """POST JSON to the OpenAI HTTP API (plain urllib: no client package needed on the GPU machine)."""
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        raise AssertionError(f"POST {url} → {e.code}: {e.read().decode(errors='replace')[:2000]}") from e


# -- the transformers reference ----------------------------------------------------------------------------------
def hf_llama(source, device: str | torch.device):
    """transformers' own ``LlamaForCausalLM`` with the engine's weights (from ``source``, dequantized), float32."""
    from transformers import LlamaConfig, LlamaForCausalLM

    m = source.config
    cfg = LlamaConfig(
        vocab_size=m.vocab_size, hidden_size=m.hidden_size, intermediate_size=m.intermediate_size,
        num_hidden_layers=m.num_layers, num_attention_heads=m.num_heads, num_key_value_heads=m.num_kv_heads,
        head_dim=m.head_dim, max_position_embeddings=m.max_position_embeddings, rms_norm_eps=m.rms_norm_eps,
        rope_theta=m.rope_theta, tie_word_embeddings=m.tie_word_embeddings, bos_token_id=1, eos_token_id=2,
        pad_token_id=2,
    )
    hf = LlamaForCausalLM(cfg).to(torch.float32)
    missing, unexpected = hf.load_state_dict(dict(source.weights()), strict=False)
    allowed = {"lm_head.weight"} if m.tie_word_embeddings else set()
    assert not unexpected and set(missing) <= allowed, f"weights do not fit: missing {missing}, unexpected {unexpected}"
    hf.tie_weights()
    return hf.to(device).eval()


def hf_greedy(model, prompts: Sequence[Sequence[int]], n_new: int) -> list[list[int]]:
    """Greedy continuations of ``n_new`` tokens each (EOS masked until then), one prompt at a time: no padding."""
    dev = next(model.parameters()).device
    out = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([list(p)], device=dev)
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n_new,
                                 min_new_tokens=n_new, pad_token_id=2, eos_token_id=2)
            out.append(gen[0, len(p):].tolist())
    assert all(len(o) == n_new for o in out), [len(o) for o in out]
    return out
