"""``tokenmill generate``: offline batch generation from a JSONL file of prompts."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from dataclasses import fields
from typing import Any, TextIO

from common.cli_args import add_engine_args, engine_config_from_args, model_source_from_args
from common.engine import LLMEngine, RequestError
from common.sampling import SamplingParams

_PARAM_FIELDS = {f.name for f in fields(SamplingParams)} - {"extra"}
_TUPLE_FIELDS = {"stop", "stop_token_ids"}


class InputError(ValueError):
    """A line of the prompts file is unusable; the message names the line."""


def params_from_dict(d: dict[str, Any], where: str) -> SamplingParams:
    kw: dict[str, Any] = {}
    for k, v in d.items():
        if k in ("prompt", "messages", "prompt_token_ids", "id"):
            continue
        if k == "max_completion_tokens":
            k = "max_tokens"
        if k not in _PARAM_FIELDS:
            raise InputError(f"{where}: unknown field {k!r}; sampling fields are {sorted(_PARAM_FIELDS)}")
        if k in _TUPLE_FIELDS:
            v = (v,) if isinstance(v, str | int) else tuple(v)
        kw[k] = v
    return SamplingParams(**kw)


def read_requests(engine: LLMEngine, f: TextIO) -> list[tuple[list[int], SamplingParams]]:
    tok = engine.tokenizer
    out = []
    for n, line in enumerate(f, 1):
        if not line.strip():
            continue
        where = f"line {n}"
        try:
            d = json.loads(line)
        except json.JSONDecodeError as e:
            raise InputError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from e
        if not isinstance(d, dict):
            raise InputError(f"{where}: expected a JSON object with 'prompt' or 'messages'")
        if "prompt_token_ids" in d:
            ids = [int(t) for t in d["prompt_token_ids"]]
        elif tok is None:
            raise InputError(f"{where}: this model has no tokenizer; give 'prompt_token_ids', or --tokenizer")
        elif "messages" in d:
            ids = tok.encode(tok.apply_chat_template(d["messages"]), add_special_tokens=False)
        elif isinstance(d.get("prompt"), str):
            ids = tok.encode(d["prompt"])
        else:
            raise InputError(f"{where}: needs 'prompt' (a string), 'messages' (a list) or 'prompt_token_ids'")
        try:
            params = params_from_dict(d, where)
            engine.validate(ids, params)
        except (TypeError, ValueError) as e:
            raise InputError(f"{where}: {e}") from e
        out.append((ids, params))
    return out


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "generate",
        help="generate completions for a JSONL file of prompts",
        description="Each input line is {\"prompt\": ...} or {\"messages\": [...]} plus sampling fields "
        "(max_tokens, temperature, top_p, top_k, min_p, seed, stop, ...). Writes one JSON line per prompt, "
        "in input order: text, token_ids, finish_reason.",
    )
    p.add_argument("--prompts", required=True, help="input JSONL file ('-' for standard input)")
    p.add_argument("--output", default="-", help="output JSONL file (default: standard output)")
    p.add_argument("--progress", action="store_true", help="show a progress bar on standard error")
    add_engine_args(p)
    p.set_defaults(func=run)


def run(a: argparse.Namespace) -> int:
    try:
        engine = LLMEngine(model_source_from_args(a), engine_config_from_args(a))
    except (FileNotFoundError, ValueError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    with engine:  # stops the other tensor-parallel ranks, if any
        return _generate(a, engine)


def _generate(a: argparse.Namespace, engine: LLMEngine) -> int:
    try:
        src = sys.stdin if a.prompts == "-" else open(a.prompts, encoding="utf-8")  # noqa: SIM115
    except OSError as e:
        print(f"error: cannot read prompts: {e}", file=sys.stderr)
        return 2
    try:
        with src:
            reqs = read_requests(engine, src)
    except InputError as e:
        print(f"error: {a.prompts}: {e}", file=sys.stderr)
        return 2
    try:
        results = engine.generate([r[0] for r in reqs], [r[1] for r in reqs], progress=a.progress)
    except RequestError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    dst = sys.stdout if a.output == "-" else open(a.output, "w", encoding="utf-8")  # noqa: SIM115
    with dst if dst is not sys.stdout else contextlib.nullcontext():
        for i, r in enumerate(results):
            rec: dict[str, Any] = {
                "index": i,
                "text": r.text,
                "token_ids": r.token_ids,
                "finish_reason": r.finish_reason,
                "prompt_tokens": len(r.prompt_ids),
                "completion_tokens": len(r.token_ids),
                "cached_tokens": r.num_cached_tokens,
            }
            if r.logprobs is not None:
                rec["logprobs"] = [
                    {"token_id": lp.token_id, "logprob": lp.logprob, "top": [[t, v] for t, v in lp.top]}
                    for lp in r.logprobs
                ]
            dst.write(json.dumps(rec, ensure_ascii=False) + "\n")
    return 0

