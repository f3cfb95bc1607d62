"""Decode.DecodeStream on a real decode worker (SmolLM2 on the CPU, float32, its gRPC server in this process): many
requests on one call give each the tokens its own Decode call gives, in fewer messages than tokens; a bad request
gets its error on the stream while the others go on; a cancel, and closing the stream, free the blocks."""

from __future__ import annotations

import asyncio

import grpc
from tokenmill.v1 import common_pb2, decode_pb2, decode_pb2_grpc

from common.engine import FinishReason, RequestOutput
from services.decode.server import DecodeWorker, _turns
from tests.services.harness import HOST, cluster, free_port, serving

PROMPTS = {"a": [1, 2, 3, 4, 5], "b": [9, 8, 7, 6, 5, 4, 3], "c": [42] * 20}


def _req(rid: str, prompt: list[int], max_tokens: int = 8, **params) -> decode_pb2.DecodeStreamRequest:
    return decode_pb2.DecodeStreamRequest(request=decode_pb2.DecodeRequest(
        meta=common_pb2.RequestMeta(request_id=rid), prompt_token_ids=prompt,
        params=common_pb2.SamplingParams(**{"max_tokens": max_tokens, "ignore_eos": True, "temperature": 0,
                                            **params})))


async def _all_free(worker: DecodeWorker, timeout: float = 10) -> None:
    """Wait until every KV block is free and no stream is registered (a cancel frees within a step)."""
    assert worker.loop is not None
    free = total = 0
    for _ in range(int(timeout / 0.05)):
        free, total = await asyncio.wrap_future(worker.loop.submit(
            lambda e: (e.block_manager.num_free_blocks, e.block_manager.num_blocks)))
        if free == total and not worker.streams:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"{total - free} of {total} KV blocks still held; streams {sorted(worker.streams)}")


async def _first_delta_of(call, rid: str) -> None:
    while True:
        batch = await call.read()
        assert batch is not grpc.aio.EOF
        if any(d.request_id == rid and d.token_ids for d in batch.deltas):
            return


def test_many_requests_share_one_decode_stream():
    async def body() -> None:
        port = free_port()
        cfg = cluster(**{"decode.port": port, "engine.kv_cache_memory": "256MiB", "engine.dtype": "float32",
                         "worker_engine_process": False})  # the test reads the engine on its thread
        worker = DecodeWorker(cfg.service("decode", 0, port=port))
        async with serving(worker, cfg, "decode", port), grpc.aio.insecure_channel(f"{HOST}:{port}") as ch:
            stub = decode_pb2_grpc.DecodeStub(ch)
            # each prompt on its own Decode call: the reference
            want = {}
            for rid, p in PROMPTS.items():
                want[rid] = [t async for d in stub.Decode(_req(f"ref-{rid}", p).request) for t in d.token_ids]
                assert len(want[rid]) == 8

            # the same three ("c" in the batch class: its outputs take the detokenizer's later turn), a bad one and
            # a duplicate id on one stream
            call = stub.DecodeStream()
            for rid, p in PROMPTS.items():
                req = _req(rid, p)
                if rid == "c":
                    req.request.meta.priority_class = common_pb2.PRIORITY_CLASS_BATCH
                await call.write(req)
            await call.write(_req("bad", [1, 2], temperature=-1.0))
            await call.write(_req("a", [1, 2]))  # "a" is still streaming: refused, "a" itself goes on
            got: dict[str, list[int]] = {rid: [] for rid in PROMPTS}
            errors: dict[str, decode_pb2.RequestError] = {}
            finished: set[str] = set()
            messages = 0
            while finished != set(PROMPTS):
                batch = await asyncio.wait_for(call.read(), 120)
                assert batch is not grpc.aio.EOF
                messages += 1
                for d in batch.deltas:
                    if d.HasField("error"):
                        errors.setdefault(d.request_id, d.error)
                        continue
                    assert d.request_id not in finished, f"a delta after {d.request_id}'s last"
                    got[d.request_id] += d.token_ids
                    if d.finish_reason:
                        assert d.finish_reason == common_pb2.FINISH_REASON_LENGTH and d.usage.completion_tokens == 8
                        finished.add(d.request_id)
            assert got == want
            assert messages < sum(len(v) for v in got.values()), "one message per delta: nothing was batched"
            assert errors["bad"].code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
            assert "temperature" in errors["bad"].message
            assert errors["a"].code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and "unique" in errors["a"].message
            await _all_free(worker)

            # a cancel frees a running request's blocks; the stream goes on serving others
            await call.write(_req("long", PROMPTS["c"], max_tokens=4000))
            await _first_delta_of(call, "long")
            await call.write(decode_pb2.DecodeStreamRequest(cancel_request_id="long"))
            await _all_free(worker)
            await call.write(_req("after", PROMPTS["b"]))
            tokens: list[int] = []
            while len(tokens) < 8:
                batch = await asyncio.wait_for(call.read(), 120)
                tokens += [t for d in batch.deltas if d.request_id == "after" for t in d.token_ids]
            assert tokens == want["b"]

            # closing the stream cancels what still runs on it
            await call.write(_req("orphan", PROMPTS["a"], max_tokens=4000))
            await _first_delta_of(call, "orphan")
            call.cancel()
            await _all_free(worker)

    asyncio.run(body())


def test_a_step_is_detokenized_first_tokens_first_and_the_batch_class_last():
    def out(rid: str, n: int, finished: bool = False) -> RequestOutput:
        return RequestOutput(rid, [7], None, finished, FinishReason.LENGTH if finished else None, 4, n, 0)

    i1, i2, b1, b2, f = out("i1", 3), out("i2", 1), out("b1", 1), out("b2", 5, True), out("f", 1)
    ids = lambda turns: [(first, [o.request_id for o in t]) for first, t in turns]  # noqa: E731
    assert ids(_turns([b2, i1, b1, i2, f], {"b1", "b2"})) == [
        (True, ["i2", "f"]), (False, ["i1"]), (True, ["b1"]), (False, ["b2"])]
    assert ids(_turns([b2, i1, b1], set())) == [(True, ["b1"]), (False, ["b2", "i1"])]
    assert ids(_turns([b2, b1], {"b1", "b2"})) == [(True, ["b1"]), (False, ["b2"])]
    assert ids(_turns([i1], {"b1"})) == [(False, ["i1"])] and _turns([], {"b1"}) == []


def test_a_request_behind_gets_its_waiting_deltas_in_one_message():
    """The gateway side (services/gateway/decode_stream.py): deltas already queued for a request merge into one,
    tokens, text and logprobs in order, the last one's finish reason and usage, up to an error, which comes next."""
    from services.gateway.decode_stream import _merge

    def delta(ids: list[int], text: str, **kw) -> decode_pb2.TokenDelta:
        return decode_pb2.TokenDelta(token_ids=ids, text=text,
                                     logprobs=[common_pb2.TokenLogprob(token_id=i, logprob=-0.5) for i in ids], **kw)

    q: asyncio.Queue = asyncio.Queue()
    for d in (delta([2], "b"), delta([3, 4], "cd"),
              delta([5], "e", finish_reason=common_pb2.FINISH_REASON_LENGTH, usage=common_pb2.Usage(completion_tokens=5)),
              delta([6], "f")):
        q.put_nowait(d)
    merged, held = _merge(delta([1], "a"), q)
    assert held is None and list(merged.token_ids) == [1, 2, 3, 4, 5] and merged.text == "abcde"
    assert [lp.token_id for lp in merged.logprobs] == [1, 2, 3, 4, 5]
    assert merged.finish_reason == common_pb2.FINISH_REASON_LENGTH and merged.usage.completion_tokens == 5
    assert q.qsize() == 1  # nothing after the finish is taken
    err = decode_pb2.TokenDelta(error=decode_pb2.RequestError(code=3, message="bad"))
    q = asyncio.Queue()
    for d in (delta([2], "b"), err, delta([3], "c")):
        q.put_nowait(d)
    merged, held = _merge(delta([1], "a"), q)
    assert list(merged.token_ids) == [1, 2] and held is err and q.qsize() == 1
    merged, held = _merge(delta([7], "g"), asyncio.Queue())
    assert list(merged.token_ids) == [7] and held is None
