"""``tokenmill bench offline``: offline throughput of Tokenmill against transformers' ``generate`` and vLLM CPU.

One command, one run: the same prompts (windows of real text, exact token counts, from a seeded RNG) and the same
weights for every engine (the GGUF dequantized; transformers and vLLM read it exported to a Hugging Face directory),
greedy, EOS ignored, at each batch size and dtype asked for. Each engine warms up first; only generation is timed.
Output tok/s = generated tokens ÷ seconds of generation (prefill included).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import gc
import json
import logging
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

ENGINES = ("tokenmill", "transformers", "vllm")
DTYPES = ("bfloat16", "float32")
_DTYPE_ALIASES = {"bf16": "bfloat16", "fp32": "float32", "float": "float32", "bfloat16": "bfloat16", "float32": "float32"}

log = logging.getLogger(__name__)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "offline",
        help="offline engine throughput against transformers and vLLM CPU",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", default="smollm2",
                   help="a .gguf file, a Hugging Face directory, dummy:CONFIG, or 'smollm2' (the embedded "
                        "default)")
    p.add_argument("--tokenizer", default=None,
                   help="the tokenizer the text prompts are built from instead of the model's own: a .gguf file, "
                        "a Hugging Face directory or 'smollm2' (for dummy:CONFIG, whose prompts are otherwise "
                        "random ids)")
    p.add_argument("--engines", default=",".join(ENGINES), help=f"comma-separated subset of {','.join(ENGINES)}")
    p.add_argument("--dtypes", default=",".join(DTYPES), help="comma-separated: bfloat16,float32 (default both)")
    p.add_argument("--batches", default="1,16",
                   help="comma-separated concurrent sequences per run (default 1,16); 1 = one sequence at a time")
    p.add_argument("--num-prompts", type=int, default=64, help="prompts for each batch > 1 run (default 64)")
    p.add_argument("--num-prompts-batch1", type=int, default=4,
                   help="prompts for the batch 1 runs: the first N of the same list (default 4)")
    p.add_argument("--min-prompt-len", type=int, default=100, help="shortest prompt, tokens (default 100)")
    p.add_argument("--max-prompt-len", type=int, default=500, help="longest prompt, tokens (default 500)")
    p.add_argument("--max-tokens", "--output-len", dest="max_tokens", type=int, default=128,
                   help="output tokens per prompt, EOS ignored (default 128)")
    p.add_argument("--prompt-source", choices=["text", "random"], default="text",
                   help="text: windows of real English text tokenized by the model's tokenizer (default); "
                        "random: random token ids")
    p.add_argument("--seed", type=int, default=0, help="seed of the prompt RNG (default 0)")
    p.add_argument("--output", type=Path, default=None, help="write the results as JSON here")
    p.add_argument("--bench-dir", type=Path, default=None,
                   help="scratch directory: exported model, vLLM venv, logs (default <repo>/.bench)")
    p.add_argument("--vllm-venv", type=Path, default=None, help="vLLM's virtual environment (default <bench-dir>/vllm-venv)")
    p.add_argument("--no-install-vllm", action="store_true", help="do not create the vLLM venv when it is missing")
    p.add_argument("--wait-quiet", type=float, default=0.0, metavar="SECONDS",
                   help="before each row, wait up to SECONDS for other processes to leave the CPU (default 0)")
    p.add_argument("--vllm-env", action="append", default=[], metavar="KEY=VALUE",
                   help="extra environment for vLLM (repeatable), e.g. LD_PRELOAD=...")
    p.add_argument("--vllm-kv-space-gib", type=int, default=4, help="VLLM_CPU_KVCACHE_SPACE in GiB (default 4)")
    p.set_defaults(func=run)


def _split(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def _parse(a: argparse.Namespace) -> tuple[list[str], list[str], list[int]]:
    engines = _split(a.engines)
    bad = [e for e in engines if e not in ENGINES]
    if bad or not engines:
        raise SystemExit(f"--engines: unknown {bad}; choose from {','.join(ENGINES)}")
    dtypes = []
    for d in _split(a.dtypes):
        if d not in _DTYPE_ALIASES:
            raise SystemExit(f"--dtypes: unknown {d!r}; choose from bfloat16,float32")
        dtypes.append(_DTYPE_ALIASES[d])
    try:
        batches = sorted({int(b) for b in _split(a.batches)})
    except ValueError as e:
        raise SystemExit(f"--batches: {e}") from e
    if not batches or batches[0] < 1:
        raise SystemExit("--batches: give positive integers, e.g. 1,16")
    if a.num_prompts < 1 or a.num_prompts_batch1 < 1 or a.max_tokens < 1:
        raise SystemExit("--num-prompts, --num-prompts-batch1 and --max-tokens must be >= 1")
    return engines, dtypes, batches


# -- the table ---------------------------------------------------------------------------------------------------
def _fmt_ratio(x: float | None) -> str:
    return f"{x:.2f}×" if x else "—"


def build_table(rows: list[Any]) -> str:
    """Markdown table of the rows, with ratios vs transformers and vs vLLM (same dtype and batch)."""
    from loadgen.peers import common_prefix_fraction

    by_key = {(r.engine, r.dtype, r.batch): r for r in rows}
    lines = [
        "| engine | dtype | batch | prompts | output tokens | gen time (s) | output tok/s | vs transformers | vs vLLM "
        "| greedy match vs transformers | load + warm-up (s) | other load (cores) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|",
    ]
    for r in rows:
        if r.error:
            lines.append(f"| {r.engine} | {r.dtype} | {r.batch} | {r.num_prompts} | — | — | FAILED | — | — | — | "
                         f"{r.error.replace('|', '/')} | — |")
            continue
        hf = by_key.get(("transformers", r.dtype, r.batch))
        vl = by_key.get(("vllm", r.dtype, r.batch))
        vs_hf = r.tok_s / hf.tok_s if hf and hf.tok_s and r is not hf else None
        vs_vl = r.tok_s / vl.tok_s if vl and vl.tok_s and r is not vl else None
        match = "—"
        if hf and not hf.error and r is not hf and r.token_ids and hf.token_ids:
            n = min(len(r.token_ids), len(hf.token_ids))
            m = sum(common_prefix_fraction(a, b) for a, b in zip(r.token_ids[:n], hf.token_ids[:n])) / n
            match = f"{m:.0%}"
        lines.append(
            f"| {r.engine} | {r.dtype} | {r.batch} | {r.num_prompts} | {r.output_tokens} | {r.seconds:.1f} | "
            f"{r.tok_s:.1f} | {_fmt_ratio(vs_hf)} | {_fmt_ratio(vs_vl)} | {match} | "
            f"{r.load_s:.1f} + {r.warmup_s:.1f} | {'—' if r.other_cpu is None else f'{r.other_cpu:.2f}'} |"
        )
    return "\n".join(lines)


# -- machine facts -----------------------------------------------------------------------------------------------
def _machine() -> dict[str, Any]:
    info: dict[str, Any] = {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()}
    try:
        text = Path("/proc/cpuinfo").read_text()
        model = next((ln.split(":", 1)[1].strip() for ln in text.splitlines() if ln.startswith("model name")), "")
        flags = next((ln.split(":", 1)[1].split() for ln in text.splitlines() if ln.startswith("flags")), [])
        info["cpu"] = model
        info["isa"] = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile") if f in flags]
        mem = next(ln for ln in Path("/proc/meminfo").read_text().splitlines() if ln.startswith("MemTotal"))
        info["memory_gib"] = round(int(mem.split()[1]) / 2**20, 1)
    except (OSError, StopIteration):
        pass
    return info


def _versions(vllm_venv: Path | None) -> dict[str, str]:
    import importlib.metadata as md
    import subprocess

    out = {}
    for name in ("torch", "transformers"):
        with contextlib.suppress(md.PackageNotFoundError):
            out[name] = md.version(name)
    if vllm_venv is not None and (vllm_venv / "bin" / "python").exists():
        r = subprocess.run([str(vllm_venv / "bin" / "python"), "-c",
                            "import importlib.metadata as m; print(m.version('vllm-cpu'), m.version('torch'))"],
                           capture_output=True, text=True)
        if r.returncode == 0:
            v = r.stdout.split()
            out["vllm-cpu"], out["vllm torch"] = v[0], v[1]
    return out


SOURCE_DIRS = ("common", "services", "loadgen", "protos")


def _source_state(repo: Path | None = None) -> dict[str, Any]:
    """The commit the benchmark ran from and, where the tree differs from it in the code (``SOURCE_DIRS``), a digest
    of the difference and the files that differ: a tree copied to another machine with an older ``.git`` says so.
    ``repo``: this checkout unless given."""
    import hashlib
    import subprocess

    def git(*args: str) -> str:
        r = subprocess.run(["git", "-C", str(repo or Path(__file__).resolve().parents[1]), *args],
                           capture_output=True, text=True)
        return r.stdout if r.returncode == 0 else ""

    head = git("rev-parse", "--short", "HEAD").strip()
    diff = git("diff", "HEAD", "--", *SOURCE_DIRS)
    out: dict[str, Any] = {"commit": head or "unknown"}
    if diff:
        out["uncommitted_sha1"] = hashlib.sha1(diff.encode()).hexdigest()[:12]
        out["uncommitted_files"] = git("diff", "HEAD", "--name-only", "--", *SOURCE_DIRS).split()
    return out


def _export_dir(source: Any, bench_dir: Path, dtype: str) -> Path:
    """The model as an HF directory in ``dtype``: the directory itself if it is one, else an export cached under
    bench_dir (bfloat16 is the float32 weights rounded, as a load with ``dtype=bfloat16`` would do)."""
    from common.hf_export import export_hf_dir
    from common.loader import DEFAULT_MODEL, embedded_gguf_path

    spec = Path(source.spec).expanduser()
    if source.spec != DEFAULT_MODEL and spec.is_dir() and (spec / "config.json").is_file():
        return spec
    gguf = embedded_gguf_path() if source.spec == DEFAULT_MODEL else spec
    st = gguf.stat() if gguf.is_file() else None
    stamp = {"source": str(gguf.resolve()), "size": st.st_size if st else 0, "mtime": st.st_mtime if st else 0,
             "dtype": dtype, "version": 1}
    out = bench_dir / "hf" / f"{source.model_id}-{dtype}"
    stamp_path = out / ".tokenmill-export.json"
    if stamp_path.is_file() and json.loads(stamp_path.read_text()) == stamp and (out / "model.safetensors").is_file():
        return out
    t0 = time.perf_counter()
    export_hf_dir(source, out, dtype=dtype)
    stamp_path.write_text(json.dumps(stamp))
    _say(f"exported {source.model_id} ({dtype}) to {out} in {time.perf_counter() - t0:.1f} s")
    return out


def _say(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# -- the run -----------------------------------------------------------------------------------------------------
def run(a: argparse.Namespace) -> int:
    from common.loader import load_model_source
    from loadgen import peers
    from loadgen.peers import RunResult

    engines, dtypes, batches = _parse(a)
    bench_dir = (a.bench_dir or peers.DEFAULT_BENCH_DIR).resolve()
    venv = (a.vllm_venv or bench_dir / "vllm-venv").resolve()
    t_start = time.perf_counter()
    started = dt.datetime.now(dt.UTC)
    load_start = os.getloadavg()
    phases: dict[str, float] = {}
    monitor = peers.CpuMonitor().start()
    extra_env = dict(kv.split("=", 1) for kv in a.vllm_env if "=" in kv)

    t0 = time.perf_counter()
    source = load_model_source(a.model, tokenizer=a.tokenizer)
    tok = source.tokenizer if a.prompt_source == "text" else None
    n_all = max(a.num_prompts if any(b > 1 for b in batches) else 0, a.num_prompts_batch1 if 1 in batches else 0)
    prompts = peers.build_prompts(tok, n_all, a.min_prompt_len, a.max_prompt_len, a.seed, source.config.vocab_size)
    lens = [len(p) for p in prompts]
    phases["prompts"] = time.perf_counter() - t0
    _say(f"{len(prompts)} prompts ({a.prompt_source}), {min(lens)}–{max(lens)} tokens (mean {sum(lens) / len(lens):.0f}), "
         f"{a.max_tokens} output tokens each; engines {engines}, dtypes {dtypes}, batches {batches}")

    def prompts_for(b: int) -> list[list[int]]:
        return prompts[: a.num_prompts_batch1] if b == 1 else prompts[: a.num_prompts]

    hf_dirs: dict[str, Path] = {}
    export_error: str | None = None
    if "transformers" in engines or "vllm" in engines:
        t0 = time.perf_counter()
        try:
            for d in dtypes:
                hf_dirs[d] = _export_dir(source, bench_dir, d)
        except Exception as e:
            export_error = f"export to an HF directory failed: {type(e).__name__}: {e}"
            _say(export_error)
        phases["export"] = time.perf_counter() - t0

    vllm_error: str | None = export_error
    if "vllm" in engines and vllm_error is None:
        t0 = time.perf_counter()
        try:
            peers.ensure_vllm_venv(venv, install=not a.no_install_vllm, progress=_say)
        except Exception as e:
            vllm_error = str(e)
            _say(f"vLLM unavailable: {vllm_error}")
        phases["vllm_install"] = time.perf_counter() - t0

    rows: list[RunResult] = []
    meta: dict[str, Any] = {
        "date": started.isoformat(timespec="seconds"),
        "command": "tokenmill bench offline " + " ".join(sys.argv[3:] if sys.argv[1:3] == ["bench", "offline"]
                                                          else sys.argv[1:]),
        "machine": _machine(),
        "source": _source_state(),
        "model": source.model_id,
        "hf_dirs": {k: str(v) for k, v in hf_dirs.items()},
        "prompts": {"source": a.prompt_source, "seed": a.seed, "num": a.num_prompts, "num_batch1": a.num_prompts_batch1,
                    "min_len": min(lens), "max_len": max(lens), "mean_len": round(sum(lens) / len(lens), 1),
                    "output_tokens": a.max_tokens},
        "vllm_env": {k: v for k, v in peers.vllm_env(kv_space_gib=a.vllm_kv_space_gib).items()
                     if k.startswith("VLLM_CPU")},
    }

    def save() -> None:
        if a.output is None:
            return
        doc = {**meta, "loadavg_start": load_start, "loadavg_now": os.getloadavg(), "phases_s": phases,
               "wall_s": round(time.perf_counter() - t_start, 1), "results": [r.to_json() for r in rows],
               "table": build_table(rows)}
        a.output.parent.mkdir(parents=True, exist_ok=True)
        a.output.write_text(json.dumps(doc, indent=2) + "\n")

    def record(r: RunResult) -> None:
        if not r.error and r.output_tokens != r.num_prompts * a.max_tokens:
            r.note = f"expected {r.num_prompts * a.max_tokens} tokens"
        r.loadavg_1m = round(os.getloadavg()[0], 2)
        if not r.error and r.t_end > r.t_start:
            oc = monitor.other_cores(r.t_start, r.t_end)
            r.other_cpu = round(oc, 2) if oc is not None else None
        rows.append(r)
        if r.error:
            _say(f"{r.engine} {r.dtype} batch {r.batch}: FAILED: {r.error}")
        else:
            _say(f"{r.engine} {r.dtype} batch {r.batch}: {r.output_tokens} tokens in {r.seconds:.1f} s = "
                 f"{r.tok_s:.1f} tok/s {r.note}")
        save()

    for engine in engines:
        t0 = time.perf_counter()
        for dtype in dtypes:
            if engine == "vllm":
                groups = _vllm_groups(batches)
                for group in groups:
                    if vllm_error is not None or dtype not in hf_dirs:
                        for b in group:
                            record(RunResult("vllm", dtype, b, len(prompts_for(b)), error=vllm_error))
                        continue
                    monitor.wait_quiet(a.wait_quiet, progress=_say)
                    for r in peers.run_vllm(venv, hf_dirs[dtype], dtype, [(b, prompts_for(b)) for b in group], a.max_tokens,
                                            bench_dir, kv_space_gib=a.vllm_kv_space_gib, progress=_say,
                                            extra_env=extra_env):
                        record(r)
                continue
            for b in batches:
                ps = prompts_for(b)
                _say(f"{engine} {dtype} batch {b}: {len(ps)} prompts")
                monitor.wait_quiet(a.wait_quiet, progress=_say)
                try:
                    if engine == "tokenmill":
                        r = peers.run_tokenmill(a.model, ps, dtype, b, a.max_tokens, progress=_say)
                    elif dtype not in hf_dirs:
                        r = RunResult(engine, dtype, b, len(ps), error=export_error)
                    else:
                        pad = source.config.eos_token_ids[0] if source.config.eos_token_ids else 0
                        r = peers.run_transformers(hf_dirs[dtype], ps, dtype, b, a.max_tokens, pad, progress=_say)
                except Exception as e:  # one failing row must not lose the others
                    log.exception("%s %s batch %d failed", engine, dtype, b)
                    r = RunResult(engine, dtype, b, len(ps), error=f"{type(e).__name__}: {e}")
                record(r)
                gc.collect()
        phases[engine] = time.perf_counter() - t0

    meta["versions"] = _versions(venv if "vllm" in engines else None)
    save()
    table = build_table(rows)
    wall = time.perf_counter() - t_start
    la = os.getloadavg()
    print()
    print(f"Offline throughput: {source.model_id}, prompts {min(lens)}–{max(lens)} tokens ({a.prompt_source}, seed "
          f"{a.seed}), {a.max_tokens} output tokens, greedy, EOS ignored. Batch 1 rows ran "
          f"{min(a.num_prompts_batch1, len(prompts))} prompts one at a time; batch B rows ran {a.num_prompts} "
          f"prompts with B in flight.")
    print(table)
    print(f"\nwall {wall:.0f} s; phases: " + ", ".join(f"{k} {v:.0f} s" for k, v in phases.items())
          + f"; load average {load_start[0]:.2f} at start, {la[0]:.2f} at end")
    monitor.stop()
    busy = [r for r in rows if (r.other_cpu or 0) > 0.2]
    if busy:
        print(f"WARNING: other processes used more than 0.2 cores during {len(busy)} of {len(rows)} timed runs "
              f"(column 'other load'): treat those numbers as provisional")
    if a.output is not None:
        print(f"results written to {a.output}")
    return 1 if rows and all(r.error for r in rows) else 0


def _vllm_groups(batches: list[int]) -> list[list[int]]:
    """One vLLM instance per batch > 1 (its max_num_seqs); batch 1 rides on the first instance."""
    big = [b for b in batches if b > 1]
    if not big:
        return [[1]]
    groups = [[b] for b in big]
    if 1 in batches:
        groups[0].insert(0, 1)
    return groups
