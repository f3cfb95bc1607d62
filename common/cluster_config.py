"""The cluster's configuration: frozen dataclasses, loaded once (YAML file → ``TOKENMILL_*`` env → flags).

Every address and port a service uses comes from here. Ports:

- the gateway: public gRPC on ``gateway.port`` (50051) and the OpenAI HTTP API on ``gateway.http_port`` (8000);
  several gateways on one host serve both ports together (``gateway.share_ports``), each also on a private gRPC
  port for its health checks at ``base_port + 400 + i``;
- every internal service (router, tokenizer, prefill, decode) from ``base_port`` (20000) upward, one block of 100
  per role: router 20000+i, tokenizer 20100+i, prefill 20200+i, decode 20300+i;
- every ``/metrics`` endpoint at ``base_port + 1000`` + the same offsets (gateway: +400), so 21000+ by default.

A role's ``port`` / ``metrics_port`` fields, when set, replace the derived first port of that role (instance ``i``
takes ``port + i``). Env overrides are ``TOKENMILL_`` + the dotted key in upper case with ``.`` → ``__``, e.g.
``TOKENMILL_BASE_PORT=21000`` or ``TOKENMILL_TOKENIZER__COUNT=4``; other ``TOKENMILL_*`` variables are ignored,
except three shorter names of the compute backend's keys (``ENV_ALIASES``: ``TOKENMILL_CPU_KERNELS=0`` is
``engine.cpu_kernels=false``).

In containers (docker-compose, Helm, Ray) every process has its own host: ``host`` is the interface it binds
(``0.0.0.0``), ``advertise_host`` the name the others reach it by (a DNS name or the pod IP), ``instance_name``
its unique name (worker id) when replicas share an index, and a pool's ``hosts`` (``router.hosts``,
``tokenizer.hosts``: YAML list or comma-separated) the addresses of its instances, ``HOST`` (at the pool's first
port) or ``HOST:PORT`` each. Unset, everything is on ``host`` as ``tokenmill up`` runs it.

On CUDA (``engine.device: cuda``) ``engine.dtype`` defaults to bfloat16 unless the file, env or flags set it.
``prefill.gpus`` / ``decode.gpus`` say which GPUs ``tokenmill up`` gives a pool's workers
(``services/cluster/placement_gpu.py``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import re
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

from common.config import EngineConfig, parse_bytes

# common.loader.DEFAULT_MODEL, not imported: the loader pulls in torch, which the router and gateway do without
DEFAULT_MODEL = "smollm2"

Role = Literal["gateway", "router", "tokenizer", "prefill", "decode"]
ROLES: tuple[Role, ...] = ("router", "tokenizer", "prefill", "decode", "gateway")  # start order
_ROLE_OFFSET: dict[str, int] = {"router": 0, "tokenizer": 100, "prefill": 200, "decode": 300, "gateway": 400}
METRICS_OFFSET = 1000  # the /metrics ports: base_port + this + the role's offset (unless a pool sets metrics_port)
ENV_PREFIX = "TOKENMILL_"
# Shorter environment names of the backend choices; the TOKENMILL_ENGINE__* form wins where both are set
ENV_ALIASES = {"TOKENMILL_CPU_KERNELS": "engine.cpu_kernels", "TOKENMILL_CUDA_FAST": "engine.cuda_fast_path",
               "TOKENMILL_CUDA_GRAPHS": "engine.cuda_graphs"}
BACKEND_KEYS = ("cpu_kernels", "cuda_fast_path", "cuda_graphs")
OTHER_TENANT = "other"  # the metrics' tenant label of every tenant the config does not name
_TENANT_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")


class ConfigError(ValueError):
    """The configuration is unusable; the message names the key and what it accepts."""


def as_role(name: str) -> Role:
    """``name`` as a Role; ConfigError for a name that is not one."""
    for role in ROLES:
        if name == role:
            return role
    raise ConfigError(f"unknown role {name!r}; roles are {list(ROLES)}")


@dataclass(frozen=True, slots=True)
class ClassStreamIntervals:
    """How often the gateway sends a streaming request of each priority class its new text, in ms: 0, every
    message its decode worker sends (an engine step's tokens); more, at most once an interval, every token since
    the last send in one message (vLLM's and SGLang's ``--stream-interval``, in time and per class). A batch
    request's client gets the same tokens in fewer messages, and the gateway relays it for a fraction of the work.
    The first message goes at once: a class's time to the first token is not held back."""

    interactive: float = 0.0
    standard: float = 0.0
    batch: float = 50.0

    def __post_init__(self) -> None:
        for name in ("interactive", "standard", "batch"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0 ms, got {getattr(self, name)}")

    def seconds(self, klass: int) -> float:
        """The interval of a ``common_pb2.PriorityClass`` value (unspecified: standard), in seconds."""
        return (self.standard, self.interactive, self.standard, self.batch)[klass if 0 <= klass <= 3 else 0] / 1000


@dataclass(frozen=True, slots=True)
class GatewayConfig:
    """The public edge: the gRPC ``Frontend`` and the OpenAI HTTP API."""

    count: int = 1
    port: int = 50051
    http_port: int = 8000
    # with more than one gateway on a host (count > 1, no `hosts` list): every gateway serves the public `port` and
    # `http_port` together (SO_REUSEPORT: the kernel spreads the client connections over them, as vLLM's
    # --api-server-count), and only once it is ready; health checks reach each on its private gRPC port
    # (`base_port` + 400 + index). false: gateway i listens on port + i and http_port + i
    share_ports: bool = True
    metrics_port: int | None = None
    hosts: tuple[str, ...] | None = None  # where the instances are (containers); see the module doc
    max_inflight_per_channel: int = 256  # per tokenizer channel: 3,000 unbounded calls on one channel fail
    placement_retries: int = 2  # re-placements when a worker fails before the first token reached the client
    # moves of a stream whose decode worker fails after tokens reached the client: placed again with the tokens
    # already sent as its prior outputs, the client's stream goes on (0: such a stream ends UNAVAILABLE)
    migration_limit: int = 3
    # how long a stream whose client went away keeps generating for a Resume (Last-Event-ID over HTTP), and how
    # long a finished one stays resumable; 0: such a stream is cancelled at once (services/gateway/resume.py)
    resume_window_s: float = 0.0
    heartbeat_s: float = 15.0  # an SSE stream with nothing to send this long gets a comment line
    # how long a request waits for the cluster to be ready (no router reachable, no decode worker registered: a
    # router restarting, workers registering) before it is refused with 503 / UNAVAILABLE; 0: refused at once
    ready_wait_s: float = 10.0
    # requests to a decode worker share one DecodeStream call per worker: one message per engine step carries every
    # request's tokens (services/gateway/decode_stream.py); false: one Decode call per request
    decode_stream: bool = True
    # placements share one PlaceStream call per router: a message each way, not a call
    # (services/gateway/place_stream.py); false: one Place call per request
    place_stream: bool = True
    # on that stream, how often a streaming request of each class is sent its new tokens (ClassStreamIntervals)
    class_stream_interval_ms: ClassStreamIntervals = field(default_factory=ClassStreamIntervals)
    # API keys in plain text, for both front doors: `KEY` or `TENANT:KEY` (the tenant its requests are accounted to;
    # a tenant the tenants: section names gets its settings). Hashed at start-up, as tenants.NAME.keys_sha256 are
    # stored; no key here nor there: no auth. From the environment: TOKENMILL_GATEWAY__API_KEYS=team-a:sk-1,sk-2
    api_keys: tuple[str, ...] = ()
    served_model_names: tuple[str, ...] = ()  # empty: the model spec (e.g. smollm2) and its HF repo name if known
    max_body_bytes: int = 4 << 20  # a larger request body is refused with 413
    max_inflight_requests: int = 4096  # requests in flight at this gateway; above: 429 with Retry-After
    tenant_max_inflight: int | None = None  # per-tenant in-flight quota (None: none); above: 429 with Retry-After
    # the file in which the gateways of one host share the tenants' quotas and in-flight counts
    # (services/gateway/host_limits.py); `tokenmill up` sets it when it starts several gateways on its host. None:
    # each gateway counts its own (gateway.hosts, compose, Helm, Ray: each then holds gateway.quota_shares' share)
    shared_limits_file: str | None = None
    # the gateways (pods, hosts) that split each tenant's quotas and in-flight cap between them when they do not share
    # a file: each holds 1/N of the rates, bursts and cap (the Helm chart sets gateway.replicas), so N gateways
    # behind one load balancer admit a tenant's quota once, not N times; 1: this gateway (or host) holds it whole
    quota_shares: int = 1
    # JSON lines, one per finished or refused request: time, tenant, request id, model, class, token counts,
    # status, latency, migrations (services/gateway/accounting.py); None: no audit log
    audit_log: str | None = None
    log_prompts: bool = False  # the audit log also holds each request's prompt and output text
    # the response cache (services/gateway/response_cache.py): deterministic requests (temperature 0 or a seed)
    # answered again within the TTL without a worker; bounded by bytes (LRU), per tenant; 0 bytes: off
    response_cache_bytes: int = 0
    response_cache_ttl_s: float = 300.0

    # how tool calls are read from the model's text, as vLLM's --tool-call-parser (services/gateway/tools.py):
    # hermes (<tool_call>{...}</tool_call>) or llama3 (JSON {"name", "parameters"} calls)
    tool_parser: Literal["hermes", "llama3"] = "hermes"

PriorityClassName = Literal["interactive", "standard", "batch"]
PRIORITY_CLASSES: tuple[PriorityClassName, ...] = ("interactive", "standard", "batch")  # most urgent first


@dataclass(frozen=True, slots=True)
class TenantConfig:
    """One tenant of the ``tenants:`` section: who it is (its keys), what it may use and what it pays.

    Quotas are token buckets refilled at ``rpm`` / ``tpm`` per minute holding at most the burst (0: the rate);
    a rate of 0 is no limit. ``weight`` and ``max_running`` go to the engines' fair share on every request."""

    keys_sha256: tuple[str, ...] = ()  # SHA-256 (hex) of each API key: `tokenmill keys hash KEY`
    rpm: int = 0  # requests per minute (0: unlimited)
    rpm_burst: int = 0  # the request bucket's size (0: rpm)
    tpm: int = 0  # tokens per minute, input + output (0: unlimited)
    tpm_burst: int = 0  # the token bucket's size (0: tpm)
    default_class: PriorityClassName = "standard"  # a request that names no class gets this one
    max_class: PriorityClassName = "interactive"  # the most urgent class it may ask for (a request above: capped)
    weight: float = 1.0  # fair-share weight in the engines
    max_running: int = 0  # its running sequences per worker (0: no cap)
    max_inflight: int = 0  # its requests in flight at a gateway, HTTP and gRPC (0: gateway.tenant_max_inflight)
    share_prefix_cache: bool = False  # opt in to sharing prefix-cache blocks with other tenants
    price_input_per_mtok: float = 0.0
    price_output_per_mtok: float = 0.0

    def __post_init__(self) -> None:
        keys = tuple(k.strip().lower() for k in self.keys_sha256)
        for k in keys:
            if len(k) != 64 or any(c not in "0123456789abcdef" for c in k):
                raise ValueError(f"keys_sha256 holds {k[:70]!r}, which is not a SHA-256 in hex (64 characters "
                                 "0-9a-f); hash a key with `tokenmill keys hash KEY`")
        object.__setattr__(self, "keys_sha256", keys)
        for name in ("rpm", "rpm_burst", "tpm", "tpm_burst", "max_running", "max_inflight"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0 (0: no limit), got {getattr(self, name)}")
        for name in ("price_input_per_mtok", "price_output_per_mtok"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not self.weight > 0:
            raise ValueError(f"weight must be > 0, got {self.weight}")
        if PRIORITY_CLASSES.index(self.default_class) < PRIORITY_CLASSES.index(self.max_class):
            raise ValueError(f"default_class {self.default_class} is more urgent than max_class {self.max_class}")

    @property
    def rpm_capacity(self) -> int:
        return self.rpm_burst or self.rpm

    @property
    def tpm_capacity(self) -> int:
        return self.tpm_burst or self.tpm


@dataclass(frozen=True, slots=True)
class RouterConfig:
    """Placement: see ``services/router/placement.py`` for the cost."""

    count: int = 1
    port: int | None = None
    metrics_port: int | None = None
    hosts: tuple[str, ...] | None = None  # where the instances are (containers); see the module doc
    prefill_threshold_tokens: int = 256  # uncached prompt shorter than this: the decode worker prefills locally
    prefill_weight: float = 1.0  # weight of the prefill term in the cost (higher favours cache hits)
    prefill_saturated_tokens: int = 16384  # a prefill worker with this many queued tokens takes no more
    worker_timeout_s: float = 5.0  # a worker silent this long is forgotten


@dataclass(frozen=True, slots=True)
class ClassWindows:
    """How long the tokenizer pool holds a request of each priority class for a batch, in ms (seed 001's T_pack):
    short for interactive (latency), long for batch (fuller batches). ``standard`` None: ``batch_wait_ms``."""

    interactive: float = 0.5
    standard: float | None = None
    batch: float = 20.0

    def __post_init__(self) -> None:
        for name in ("interactive", "standard", "batch"):
            v = getattr(self, name)
            if v is not None and v < 0:
                raise ValueError(f"{name} must be >= 0 ms, got {v}")


@dataclass(frozen=True, slots=True)
class TokenizerConfig:
    """The tokenizer pool and its batching: a batch fires at ``batch_max_tokens`` or when its first request's
    class window (``class_windows_ms``; standard: ``batch_wait_ms``) is over."""

    count: int = 2
    port: int | None = None
    metrics_port: int | None = None
    hosts: tuple[str, ...] | None = None  # where the instances are (containers); see the module doc
    batch_max_tokens: int = 16384
    batch_wait_ms: float = 2.0
    class_windows_ms: ClassWindows = field(default_factory=ClassWindows)

    def window_s(self, klass: str) -> float:
        """The batching window of ``klass`` (interactive, standard or batch), in seconds."""
        ms = getattr(self.class_windows_ms, klass)
        return (self.batch_wait_ms if ms is None else ms) / 1000


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    """A model-running pool (prefill or decode)."""

    count: int = 1
    port: int | None = None
    metrics_port: int | None = None
    hosts: tuple[str, ...] | None = None  # where the instances are (containers); see the module doc
    report_interval_s: float = 0.25  # how often the worker streams its load to the router
    # the pool's GPUs under `tokenmill up --device cuda`: GPUs per worker ("1", as in Helm and Ray) or a device
    # list ("0,1", "0,0", "cuda:1": the workers take them in order; a GPU named twice is shared on purpose and
    # splits engine.gpu_memory_utilization). None: one GPU of its own per worker, chosen by the launcher
    gpus: str | None = None
    # prefill: how long a finished prompt's KV blocks wait for a decode worker to claim them, and how long a claimed
    # lease holds them for its READ; both timed on the prefill worker's own monotonic clock (services/prefill)
    kv_lease_s: float = 30.0

    def __post_init__(self) -> None:
        parse_gpus(self.gpus)  # raises ValueError naming the value
        if not self.kv_lease_s > 0:
            raise ValueError(f"kv_lease_s must be > 0 seconds, got {self.kv_lease_s}")


@dataclass(frozen=True, slots=True)
class FilterPolicyConfig:
    """One output filter policy (``common/output_filter.py``): a word list and regexes, or a custom class."""

    words: tuple[str, ...] = ()  # blocked whole words, case-insensitive
    regexes: tuple[str, ...] = ()  # blocked patterns (Python ``regex`` syntax)
    reason: str = ""  # the reason a blocked client sees (empty: which rule matched)
    class_path: str | None = None  # ``module:Class``: a custom policy instead of words/regexes, built with kwargs
    kwargs: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.class_path is None:
            from common.output_filter import PatternPolicy

            PatternPolicy(self.words, self.regexes)  # raises ValueError naming a bad regex
        elif self.words or self.regexes:
            raise ValueError("class_path and words/regexes cannot be combined: a custom class is the whole policy")


@dataclass(frozen=True, slots=True)
class OutputFilterConfig:
    """The streaming output filter, run by the decode workers: ``default``, replaced for the served model by
    ``models[<model>]`` and for a tenant (``RequestMeta.tenant_id``) by ``tenants[<tenant>]``; an empty policy
    filters nothing."""

    default: FilterPolicyConfig = field(default_factory=FilterPolicyConfig)
    models: dict[str, FilterPolicyConfig] = field(default_factory=dict)
    tenants: dict[str, FilterPolicyConfig] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class ClusterConfig:
    """The whole cluster. Immutable; derive per-process views with ``service(role, index)``."""

    host: str = "127.0.0.1"  # the interface every service binds
    advertise_host: str | None = None  # how other services reach this process (None: ``host``)
    instance_name: str | None = None  # this process's unique name, e.g. the pod name (None: ``<role>-<index>``)
    model: str = DEFAULT_MODEL
    # the tokenizer every pool uses when the model has none or another is wanted (a .gguf, an HF directory or
    # smollm2): vLLM's --tokenizer, e.g. for dummy:llama-3.1-8b; None: the model's own
    tokenizer_spec: str | None = None
    base_port: int = 20000
    grace_s: float = 10.0  # how long a draining service lets in-flight RPCs finish
    # `tokenmill up` restarts a child that died after start-up: 1 s after, doubling with each death in a row, up to
    restart_backoff_max_s: float = 30.0
    startup_timeout_s: float = 600.0  # `tokenmill up` gives up when a service is not SERVING by then
    threads_per_process: int | None = None  # OMP/RAYON threads per child; None: cores ÷ model workers, ≥ 1
    otlp_endpoint: str | None = None  # spans over OTLP/gRPC (else OTEL_EXPORTER_OTLP_ENDPOINT; none: no export)
    # a directory every service also writes its spans to, as JSON lines (common/telemetry.py); loadgen.trace_summary
    # breaks requests' time down from them. None: no files
    trace_dir: str | None = None
    # where the model workers write torch profiler traces when an operator starts and stops one (the gateway's
    # POST /start_profile and /stop_profile, vLLM's; WorkerAdmin.Profile). None: profiling is off
    profile_dir: str | None = None
    # Python's GIL switch interval in the model workers: how long the engine thread can wait for the GIL while the
    # gRPC and detokenizer threads hold it (docs/benchmarks.md, the served cluster on a GPU). None: Python's 5 ms
    worker_switch_interval_ms: float | None = 0.5
    # a model worker's engine runs in a process of its own, fed and read over a pipe, so it shares its GIL with no
    # gRPC or detokenizer thread (common/engine_core.py); False: on a thread of the worker's process
    worker_engine_process: bool = True
    # every service freezes the objects of its start-up out of later garbage collections once it is ready, so a
    # full collection scans only what serving allocated (common/gc_watch.py); False: Python's default
    gc_freeze: bool = True
    gateway: GatewayConfig = field(default_factory=GatewayConfig)
    router: RouterConfig = field(default_factory=RouterConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    prefill: WorkerConfig = field(default_factory=WorkerConfig)
    decode: WorkerConfig = field(default_factory=WorkerConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    # name → its identity, quotas, classes, fair share and prices (services/gateway/tenancy.py). Requests of a tenant
    # not named here (a bare `gateway.api_keys` key, or any request while no key is configured) have the defaults
    tenants: dict[str, TenantConfig] = field(default_factory=dict)
    output_filter: OutputFilterConfig = field(default_factory=OutputFilterConfig)

    def __post_init__(self) -> None:
        owner: dict[str, str] = {}
        for name, t in self.tenants.items():
            if not _TENANT_NAME.fullmatch(name) or name == OTHER_TENANT:
                raise ConfigError(f"tenants: the name {name!r} is not usable; use letters, digits, '.', '_' or "
                                  f"'-' (at most 64), and not {OTHER_TENANT!r} (the metrics' label of the rest)")
            for k in t.keys_sha256:
                if k in owner:
                    raise ConfigError(f"tenants.{name}.keys_sha256: the key hash {k[:12]}… is also "
                                      f"tenants.{owner[k]}'s; a key belongs to one tenant")
                owner[k] = name
        for i, entry in enumerate(self.gateway.api_keys):
            name, _, key = entry.rpartition(":")
            other = owner.get(hashlib.sha256(key.encode()).hexdigest())
            if other is not None and other != name:
                raise ConfigError(f"gateway.api_keys[{i}] is also a key of tenants.{other}; a key belongs to one "
                                  "tenant")
        for role in ROLES:
            if self.pool(role).count < 0:
                raise ConfigError(f"{role}.count must be >= 0, got {self.pool(role).count}")
        if self.grace_s < 0:
            raise ConfigError(f"grace_s must be >= 0, got {self.grace_s}")
        if self.gateway.quota_shares < 1:
            raise ConfigError(f"gateway.quota_shares must be >= 1 (the gateways that split each tenant's quotas), got "
                              f"{self.gateway.quota_shares}")
        if self.gateway.tenant_max_inflight is not None and self.gateway.tenant_max_inflight < 1:
            raise ConfigError("gateway.tenant_max_inflight must be >= 1 (or unset: no quota), got "
                              f"{self.gateway.tenant_max_inflight}")
        if self.gateway.response_cache_bytes < 0 or not self.gateway.response_cache_ttl_s > 0:
            raise ConfigError("gateway.response_cache_bytes must be >= 0 (0: off) and gateway.response_cache_ttl_s "
                              f"> 0, got {self.gateway.response_cache_bytes} and {self.gateway.response_cache_ttl_s}")
        seen: dict[int, str] = {}
        for role, i, grpc_port, metrics_port, http_port in self._endpoints():
            for kind, port in (("port", grpc_port), ("metrics port", metrics_port), ("http port", http_port)):
                if port is None:
                    continue
                where = f"{role}-{i} {kind} {port}"
                if not 0 < port < 65536:
                    raise ConfigError(f"{where} is outside 1..65535 (check base_port and {role}.port)")
                if port in seen:
                    raise ConfigError(f"{where} collides with {seen[port]}; change base_port or {role}.port")
                seen[port] = where
        if self.gateways_share_ports:
            port = self.gateway.port
            if port in seen:
                raise ConfigError(f"the gateways' shared port {port} collides with {seen[port]}; change base_port or "
                                  "gateway.port")

    def pool(self, role: str) -> GatewayConfig | RouterConfig | TokenizerConfig | WorkerConfig:
        return getattr(self, as_role(role))

    def worker_pool(self, role: str) -> WorkerConfig:
        """The pool of a model-running role (prefill or decode); ConfigError for any other role."""
        if role == "prefill":
            return self.prefill
        if role == "decode":
            return self.decode
        raise ConfigError(f"{as_role(role)} is not a model-running role (prefill, decode)")

    @property
    def gateways_share_ports(self) -> bool:
        """Whether the gateways serve the public ports together (``gateway.share_ports`` with several of them on
        this host)."""
        g = self.gateway
        return g.share_ports and g.count > 1 and g.hosts is None

    def gateway_public_ports(self, index: int = 0) -> tuple[int, int]:
        """(gRPC port, HTTP port) where gateway ``index`` serves clients."""
        if self.gateways_share_ports:
            return self.gateway.port, self.gateway.http_port
        return self.ports("gateway", index)[0], self.gateway.http_port + index

    def ports(self, role: str, index: int = 0) -> tuple[int, int]:
        """(gRPC port, metrics port) of instance ``index`` of ``role``; a gateway's private port (its health
        checks) when the gateways share the public ones."""
        pool = self.pool(role)
        first = pool.port if pool.port is not None else self.base_port + _ROLE_OFFSET[role]
        if role == "gateway" and self.gateways_share_ports:
            first = self.base_port + _ROLE_OFFSET[role]
        first_m = (pool.metrics_port if pool.metrics_port is not None
                   else self.base_port + METRICS_OFFSET + _ROLE_OFFSET[role])
        return first + index, first_m + index

    def addresses(self, role: str) -> list[str]:
        """``host:port`` of every instance of ``role`` (how services find each other): the pool's ``hosts`` when
        set (a bare host takes the pool's first port), else ``count`` instances on ``host``."""
        hosts = self.pool(role).hosts
        if hosts is not None:
            first = self.ports(role, 0)[0]
            return [h if _has_port(h) else f"{h}:{first}" for h in hosts]
        return [f"{self.host}:{self.ports(role, i)[0]}" for i in range(self.pool(role).count)]

    def service(self, role: str, index: int = 0, port: int | None = None,
                metrics_port: int | None = None) -> ServiceConfig:
        """The view one process runs with; ``port``/``metrics_port`` override the derived ones."""
        p, m = self.ports(role, index)
        return ServiceConfig(self, as_role(role), index, p if port is None else port,
                             m if metrics_port is None else metrics_port)

    def threads_for_children(self, cores: int | None = None) -> int:
        if self.threads_per_process is not None:
            return max(1, self.threads_per_process)
        workers = self.prefill.count + self.decode.count
        return max(1, (cores or os.cpu_count() or 1) // max(1, workers))

    def _endpoints(self) -> list[tuple[Role, int, int, int, int | None]]:
        out = []
        for role in ROLES:
            for i in range(self.pool(role).count):
                p, m = self.ports(role, i)
                http = self.gateway_public_ports(i)[1] if role == "gateway" else None
                out.append((role, i, p, m, None if i and self.gateways_share_ports else http))  # shared: once
        return out

    def to_dict(self) -> dict[str, Any]:
        """Plain YAML-safe types (tuples become lists)."""
        return dataclasses.asdict(self, dict_factory=lambda kv: {k: list(v) if isinstance(v, tuple) else v
                                                                 for k, v in kv})


@dataclass(frozen=True, slots=True)
class ServiceConfig:
    """What one service process needs: the cluster, its role and index, and the ports it listens on."""

    cluster: ClusterConfig
    role: Role
    index: int
    grpc_port: int
    metrics_port: int

    @property
    def name(self) -> str:
        """Unique within the cluster, e.g. ``decode-0``; workers use it as their worker id."""
        return self.cluster.instance_name or f"{self.role}-{self.index}"

    @property
    def host(self) -> str:
        """The interface this process binds."""
        return self.cluster.host

    @property
    def address(self) -> str:
        """How the other services reach this process (what a worker reports to the router)."""
        return f"{self.cluster.advertise_host or self.cluster.host}:{self.grpc_port}"

    @property
    def shared_grpc_port(self) -> int | None:
        """The public gRPC port this gateway serves together with the host's other gateways (None: its own port
        is its public one)."""
        if self.role == "gateway" and self.cluster.gateways_share_ports:
            return self.cluster.gateway.port
        return None


# -- loading -------------------------------------------------------------------------------------------------
def load_cluster_config(
    path: str | Path | None = None,
    overrides: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
) -> ClusterConfig:
    """Defaults, then the YAML file, then ``TOKENMILL_*`` env vars, then ``overrides`` (dotted keys, from flags).

    Raises ConfigError naming the offending key (unknown keys included) or file.
    """
    return load_cluster_config_given(path, overrides, env)[0]


def load_cluster_config_given(
    path: str | Path | None = None,
    overrides: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
) -> tuple[ClusterConfig, frozenset[str]]:
    """``load_cluster_config``, and the dotted keys the file, env or overrides set (every other field is its
    default): the launcher keeps a layout that was asked for and chooses one that was not."""
    data = _merged(path, overrides, env)
    given = frozenset(_given_keys(data))
    engine = data.get("engine")
    if isinstance(engine, dict) and str(engine.get("device", "")).strip() == "cuda" and "dtype" not in engine:
        engine["dtype"] = "bfloat16"  # as `tokenmill generate --device cuda`: float32 only when asked for
    return _build(ClusterConfig, data, ""), given


def _merged(path: str | Path | None, overrides: Mapping[str, Any] | None,
            env: Mapping[str, str] | None) -> dict[str, Any]:
    data: dict[str, Any] = {}
    if path is not None:
        import yaml

        p = Path(path).expanduser()
        try:
            loaded = yaml.safe_load(p.read_text()) or {}
        except FileNotFoundError as e:
            raise ConfigError(f"config file {p} not found") from e
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {p} is not valid YAML: {e}") from e
        if not isinstance(loaded, dict):
            raise ConfigError(f"config file {p} must hold a mapping at the top level")
        data = loaded
    env = os.environ if env is None else env
    for name, key in ENV_ALIASES.items():
        if name in env:
            _set_dotted(data, key, env[name])
    keys = set(_dotted_keys(ClusterConfig))
    for name, value in env.items():
        if name.startswith(ENV_PREFIX):
            key = name[len(ENV_PREFIX):].lower().replace("__", ".")
            if key in keys:
                _set_dotted(data, key, value)
    for key, value in (overrides or {}).items():
        if value is not None:
            _set_dotted(data, key, value)
    return data


def with_backend_env(cfg: EngineConfig, env: Mapping[str, str] | None = None) -> EngineConfig:
    """``cfg`` with the backend keys (``BACKEND_KEYS``) the environment sets, read as the cluster config reads them:
    for the commands that build an EngineConfig from flags of their own (``generate``, the benchmarks), which have
    no flags for these. Raises ConfigError naming the variable's key when a value is not a boolean."""
    engine = _merged(None, None, env).get("engine", {})
    hints = typing.get_type_hints(EngineConfig)
    given = {k: _coerce(hints[k], engine[k], f"engine.{k}") for k in BACKEND_KEYS if k in engine}
    return dataclasses.replace(cfg, **given) if given else cfg


def _given_keys(data: Mapping[str, Any], prefix: str = "") -> list[str]:
    out = []
    for k, v in data.items():
        out += _given_keys(v, f"{prefix}{k}.") if isinstance(v, Mapping) else [prefix + str(k)]
    return out


def parse_gpus(text: str | None) -> int | tuple[int, ...] | None:
    """A pool's ``gpus``: None (unset), a count (``"2"``) or a device list (``"0,1"``, ``"0,0"``, ``"1,"``,
    ``"cuda:1"``, ``"[0, 1]"`` from a YAML list); indices are the GPUs as ``tokenmill up`` itself sees them.

    Raises ValueError saying which forms are accepted."""
    if text is None:
        return None
    t = str(text).strip()
    if t.startswith("[") and t.endswith("]"):  # a YAML list arrives as its str()
        t = t[1:-1] + ","
    forms = "a GPU count (2) or a device list (0,1 / 0,0 / cuda:1)"
    is_list = "," in t or t.startswith("cuda:")
    items = [x.strip() for x in t.split(",")]
    if is_list and items[-1] == "":
        items.pop()  # "1," names one device
    ids = []
    for item in items:
        digits = item.removeprefix("cuda:") if is_list else item
        if not digits.isdigit():
            raise ValueError(f"gpus {text!r} is not {forms}")
        ids.append(int(digits))
    if not ids:
        raise ValueError(f"gpus {text!r} is not {forms}")
    if is_list:
        return tuple(ids)
    if ids[0] < 1:
        raise ValueError(f"gpus {text!r}: a count must be at least 1 (to name GPU 0: cuda:0 or 0,)")
    return ids[0]


def parse_set_option(items: list[str] | None) -> dict[str, str]:
    """``["router.prefill_weight=2", …]`` (from ``--set``) → a dict of dotted keys."""
    out = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--set expects KEY=VALUE (e.g. tokenizer.count=3), got {item!r}")
        out[key.strip()] = value
    return out


def _has_port(address: str) -> bool:
    host, sep, port = address.rpartition(":")
    return bool(sep) and port.isdigit() and not host.endswith(":")  # "::1" alone is a host


def _set_dotted(data: dict[str, Any], key: str, value: Any) -> None:
    parts = key.split(".")
    d = data
    for part in parts[:-1]:
        nxt = d.get(part)
        if not isinstance(nxt, dict):
            nxt = d[part] = {}
        d = nxt
    d[parts[-1]] = value


def _dotted_keys(cls: type, prefix: str = "") -> list[str]:
    out = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        t = hints[f.name]
        if isinstance(t, type) and dataclasses.is_dataclass(t):
            out += _dotted_keys(t, f"{prefix}{f.name}.")
        else:
            out.append(prefix + f.name)
    return out


def _build(cls: type, data: Mapping[str, Any], prefix: str) -> Any:
    if not isinstance(data, Mapping):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'} must be a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ConfigError(f"unknown config key {prefix}{unknown[0]}; known keys here: {sorted(names)}")
    kw = {}
    for name, value in data.items():
        t = hints[name]
        key = prefix + name
        if isinstance(t, type) and dataclasses.is_dataclass(t):
            kw[name] = _build(t, value, key + ".")
        elif get_origin(t) is dict:
            kw[name] = _build_dict(get_args(t)[1], value, key)
        else:
            kw[name] = _coerce(t, value, key)
    try:
        return cls(**kw)
    except ConfigError:
        raise
    except (ValueError, TypeError) as e:
        raise ConfigError(f"{prefix.rstrip('.') or 'config'}: {e}") from e


def _build_dict(inner: Any, value: Any, key: str) -> dict[str, Any]:
    """A mapping field: names → ``inner`` (a dataclass, built like a section, e.g. ``tenants:``) or free values
    (``Any``). From the environment or a flag the mapping comes as YAML (or JSON) text, e.g.
    ``TOKENMILL_TENANTS='{acme: {rpm: 600}}'``."""
    if isinstance(value, str):
        import yaml

        try:
            value = yaml.safe_load(value) if value.strip() else {}
        except yaml.YAMLError as e:
            raise ConfigError(f"{key}: not valid YAML ({e})") from e
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ConfigError(f"{key} must be a mapping (in the YAML file or with --set {key}.NAME...), got {value!r}")
    if isinstance(inner, type) and dataclasses.is_dataclass(inner):
        return {str(k): _build(inner, v if v is not None else {}, f"{key}.{k}.") for k, v in value.items()}
    return {str(k): v for k, v in value.items()}


def _coerce(t: Any, value: Any, key: str) -> Any:
    """Convert a YAML/env/flag value to the field's type, or raise ConfigError naming the key."""
    origin, args = get_origin(t), get_args(t)
    if origin in (typing.Union, types.UnionType):
        empty = value is None or (isinstance(value, str) and value.strip().lower() in ("", "none", "null"))
        if empty and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _coerce(inner[0], value, key)
    try:
        if origin is Literal:
            if value not in args:
                raise ValueError(f"expected one of {list(args)}")
            return value
        if t is bool:
            if isinstance(value, str):
                v = value.strip().lower()
                if v in ("1", "true", "yes", "on"):
                    return True
                if v in ("0", "false", "no", "off"):
                    return False
                raise ValueError("expected true or false")
            if not isinstance(value, bool):
                raise ValueError("expected true or false")
            return value
        if t is int:
            if isinstance(value, bool):
                raise ValueError("expected an integer")
            if isinstance(value, str) and key.endswith(("memory", "_bytes")):
                return parse_bytes(value)
            if isinstance(value, float) and not value.is_integer():
                raise ValueError("expected an integer")
            return int(value)
        if t is float:
            return float(value)
        if t is str:
            return str(value)
        if origin is tuple and args[-1:] == (Ellipsis,):
            items = value.split(",") if isinstance(value, str) else value
            if not isinstance(items, list | tuple):
                raise ValueError("expected a list (or a comma-separated string)")
            return tuple(_coerce(args[0], v.strip() if isinstance(v, str) else v, key) for v in items
                         if not (isinstance(v, str) and not v.strip()))
    except (ValueError, TypeError) as e:
        raise ConfigError(f"{key}: {value!r} is not valid ({e})") from e
    raise ConfigError(f"{key}: unsupported type {t}")
