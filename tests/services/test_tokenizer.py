"""The Tokenizer service over real gRPC: batching gives the same ids as TextTokenizer.encode, chat templates,
INVALID_ARGUMENT for bad input, and ``tokenmill serve tokenizer`` as a real process."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import subprocess
import sys
import time

import grpc
import pytest
from tokenmill.v1 import tokenizer_pb2 as tpb
from tokenmill.v1 import tokenizer_pb2_grpc

from common.loader import load_tokenizer
from common.rpc import health_status
from services.tokenizer.server import TokenizerService
from tests.services.harness import HOST, cluster, free_base_port, free_port, serving


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("smollm2")


TEXTS = [f"Request {i}: " + "the quick brown fox jumps over the lazy dog " * (i % 7) + "é🙂" * (i % 3)
         for i in range(200)]


def test_concurrent_tokenize_is_batched_and_exact(tok):
    async def body():
        port = free_port()
        # a window wide enough that a slow or busy machine still sends the 200 requests within a few of them
        cfg = cluster(**{"tokenizer.port": port, "tokenizer.batch_wait_ms": 20})
        app = TokenizerService(cfg.service("tokenizer", 0), tokenizer=tok)
        async with serving(app, cfg, "tokenizer", port), grpc.aio.insecure_channel(f"{HOST}:{port}") as ch:
            stub = tokenizer_pb2_grpc.TokenizerStub(ch)
            resps = await asyncio.gather(*[
                stub.Tokenize(tpb.TokenizeRequest(text=t, add_special_tokens=i % 2 == 0), timeout=20)
                for i, t in enumerate(TEXTS)])
            for i, (t, r) in enumerate(zip(TEXTS, resps)):
                assert list(r.token_ids) == tok.encode(t, add_special_tokens=i % 2 == 0), i
            batches = app.metrics.batch_requests.collect()[0]
            count = next(s.value for s in batches.samples if s.name.endswith("_count"))
            total = next(s.value for s in batches.samples if s.name.endswith("_sum"))
            assert total == len(TEXTS) + 1  # + the warm-up
            assert count < len(TEXTS) / 4, f"{len(TEXTS)} concurrent requests took {count} batches"

    asyncio.run(body())


def test_incremental_detokenizer_skips_special_tokens(tok):
    """Streamed text equals the whole decode with special tokens among the outputs, skipped or kept; skipped ones
    never reach the decode stream (a run of them used to be re-decoded at every step: O(n^2))."""
    rng = random.Random(7)
    ids = [rng.choice([0, 1, 2, *range(100, 49152)]) for _ in range(2000)] + [0] * 500 + tok.encode("the end é🙂")
    for skip in (True, False):
        d = tok.detokenizer(tok.encode("Hello"), skip_special_tokens=skip)
        assert "".join(d.step(i) for i in ids) == tok.decode(ids, skip_special_tokens=skip)
    assert {0, 1, 2} <= tok.special_ids and 100 not in tok.special_ids
    d = tok.detokenizer([], skip_special_tokens=True)
    d._stream = None  # a special token must not touch the stream
    assert d.step(0) == "" and d.text == ""


def test_chat_template_detokenize_and_errors(tok):
    async def body():
        port = free_port()
        cfg = cluster(**{"tokenizer.port": port})
        app = TokenizerService(cfg.service("tokenizer", 0), tokenizer=tok)
        async with serving(app, cfg, "tokenizer", port), grpc.aio.insecure_channel(f"{HOST}:{port}") as ch:
            stub = tokenizer_pb2_grpc.TokenizerStub(ch)
            msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Capital of France?"}]
            chat = tpb.ChatMessages(messages=[tpb.ChatMessage(**m) for m in msgs], add_generation_prompt=True)
            r = await stub.Tokenize(tpb.TokenizeRequest(chat=chat))
            want = tok.encode(tok.apply_chat_template(msgs, add_generation_prompt=True), add_special_tokens=False)
            assert list(r.token_ids) == want
            assert tok.decode(want, skip_special_tokens=False).endswith("<|im_start|>assistant\n")

            d = await stub.Detokenize(tpb.DetokenizeRequest(token_ids=want, skip_special_tokens=True))
            assert "Capital of France?" in d.text and "<|im_start|>" not in d.text

            for req, message in [
                (tpb.TokenizeRequest(chat=tpb.ChatMessages()), "messages must be a non-empty list"),
                (tpb.TokenizeRequest(), "needs 'text' or 'chat'"),
            ]:
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await stub.Tokenize(req)
                assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert message in e.value.details()
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.Detokenize(tpb.DetokenizeRequest(token_ids=[5, 10**6]))
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "1000000" in e.value.details()

    asyncio.run(body())


def test_serve_tokenizer_process_reaches_serving_and_exits_on_sigterm(tmp_path):
    base = free_base_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RAYON_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "services.cli", "serve", "tokenizer", "--base-port", str(base),
                             "--grace", "2"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True)
    addr = f"{HOST}:{base + 100}"
    try:
        deadline = time.monotonic() + 60
        while health_status(addr, timeout=0.5) != "SERVING":
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline, "tokenizer did not reach SERVING in 60 s"
            time.sleep(0.2)
        with grpc.insecure_channel(addr) as ch:
            ids = tokenizer_pb2_grpc.TokenizerStub(ch).Tokenize(tpb.TokenizeRequest(text="hello world")).token_ids
        assert list(ids) == [28120, 905]
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, out
    assert f"tokenizer-0 ready: grpc {addr} metrics :{base + 1100}" in out
    assert "draining" in out and "stopped" in out and "Traceback" not in out
    assert health_status(addr, timeout=0.5) == "UNREACHABLE"


def test_each_class_has_its_own_batching_window(tok):
    """An interactive request fires the batch at once and takes a waiting batch-class request with it; over the
    token budget, interactive requests are encoded first."""
    from common.cluster_config import ConfigError, TokenizerConfig
    from common.sequence import PriorityClass
    from services.tokenizer.batcher import BatchStats, EncodeBatcher

    cfg = TokenizerConfig()
    assert cfg.window_s("standard") == cfg.batch_wait_ms / 1000  # today's window for standard
    assert cfg.window_s("interactive") < cfg.window_s("standard") < cfg.window_s("batch")
    with pytest.raises(ConfigError, match="batch must be >= 0 ms"):
        cluster(**{"tokenizer.class_windows_ms.batch": -1})

    async def body():
        encoded: list[list[str]] = []
        fired: list[BatchStats] = []

        def encode(texts, special):
            encoded.append(list(texts))
            return [tok.encode(t, add_special_tokens=special) for t in texts]

        windows = {PriorityClass.INTERACTIVE: 0.0, PriorityClass.STANDARD: 3600.0, PriorityClass.BATCH: 3600.0}
        b = EncodeBatcher(encode, 16384, windows, fired.append)
        slow = asyncio.ensure_future(b.encode("a batch request", True, PriorityClass.BATCH))
        await asyncio.sleep(0)  # the batcher holds it for its hour-long window
        fast = await b.encode("an interactive one", True, PriorityClass.INTERACTIVE)
        assert fast == tok.encode("an interactive one") and await slow == tok.encode("a batch request")
        assert [f.requests for f in fired] == [2]
        await b.close()

        encoded.clear()
        b = EncodeBatcher(encode, 1, windows)  # every request fills the token budget alone
        await asyncio.gather(b.encode("batch", True, PriorityClass.BATCH), b.encode("std", True),
                             b.encode("inter", True, PriorityClass.INTERACTIVE))
        assert encoded == [["inter"], ["std"], ["batch"]]
        await b.close()

    asyncio.run(body())
