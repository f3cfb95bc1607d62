"""KV-cache transfer between workers over NIXL: decode pulls a prefill worker's blocks with one READ.

Each worker creates ONE :class:`KvTransferAgent` at start-up. It registers the whole KV pool (the block-major tensor
``[num_blocks, num_layers, 2, block_size, kv_heads, head_dim]`` of ``common.model_runner``) once, so block ``i`` of
every layer is one contiguous region of ``bytes_per_block`` bytes and one NIXL descriptor. The handshake (carried
by the services in the ``KvHandshake`` RPC, never by this module) exchanges the agent metadata, the pool split into
one descriptor per block, and a :class:`KvCompat`; a peer whose compat differs is refused.

Decode side::

    agent.add_peer(*prefill_handshake)                   # once per peer; cached, idempotent
    agent.warm_link(peer, remote_ids[0])                 # optional, ms ahead: wakes a GPU link that sat idle
    h = agent.start_read(peer, remote_ids, local_ids, notif=lease_id.encode())
    ... once per engine step: agent.poll(h) -> "PROC" | "DONE" | "ERR"; then agent.release(h)

Prefill side: ``agent.completed_notifications()`` once per step lists ``(peer, notif)`` for every READ that
finished, so the leased blocks can be freed.

No gRPC here, and no call waits for a peer except :meth:`KvTransferAgent.read_blocks` (tests, tools). But with a
pool in host memory the copy itself runs inside ``start_read`` (UCX's cma transport is a synchronous
process_vm_readv; docs/performance-notes.md has its cost). On GPUs the
copy is asynchronous (cuda_ipc: copies on UCX's own CUDA streams) and ``start_read`` only posts it: its cost is per
descriptor, so the block pairs are sorted by remote id and NIXL merges every run that is contiguous on both sides
into one descriptor. A VRAM pool's agent polls its READs in flight from a thread of its own, every
:data:`VRAM_POLL_S` once a READ nears its expected end, so a READ's seconds end when the copy ends, not at the
engine's next step. Calls are serialized by a lock, so the engine thread, the poller and a service thread may share
one agent.
"""

from __future__ import annotations

import dataclasses
import glob
import logging
import os
import struct
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple

import numpy as np
import torch
from torch.profiler import record_function

log = logging.getLogger(__name__)

PROTOCOL_VERSION = 1

# A KV pool in host memory: cma (one copy by the reader's kernel) with peer error handling, so a prefill that dies
# mid-READ fails the READ at once; measured against the other transports in docs/performance-notes.md. UCX_TLS in
# the environment overrides it.
CPU_UCX_TLS = "tcp,cma"
# Warming the link before a READ (KvTransferAgent.warm_link), by pool memory. A copy over an NVLink that sat idle
# for 20 ms or more starts slowly: on two H200s (NV18) torch's own peer copy of 128 MiB took 0.365 ms back to back,
# 0.518 ms after 20 ms idle and 0.699 ms after 150 ms, and a READ of the same bytes to the end of its copy 0.38 /
# 0.48 / 0.68 ms; a one-block READ shortly before wakes it (docs/performance-notes.md, "A cold link"). A host
# pool's READ is a copy by the CPU: no link to wake.
WARM_LINKS_BY_MEM = {"VRAM": True, "DRAM": False}
WARM_IDLE_S = 0.005  # a link with traffic this recently is still awake: no warm-up READ
UCX_ERROR_HANDLING_MODE = "peer"
# NIXL's progress thread per role (docs/performance-notes.md): the reader (decode) runs none, since its cma copy
# runs inline in start_read() and its poll() drives UCX; the target (prefill) pauses 100 µs between rounds, enough to
# answer set-up and serve tcp READs between steps without spinning a core.
ProgressThread = int | Literal["off"]  # the pause between progress rounds in µs, or no thread
PROGRESS_THREAD_BY_ROLE: dict[str, ProgressThread] = {"prefill": 100, "decode": "off", "both": 100}
# A VRAM pool's READs complete on the GPU while the engine steps; a step can take tens of ms, so the agent's own
# thread checks them while any is in flight (each check is one short call under the GIL): it sleeps through
# VRAM_POLL_EARLY of a READ's expected time (its bytes at the agent's expected rate), then checks every
# VRAM_POLL_S, with the thread's timer slack at 1 µs so that a sleep this short lasts what it says
# (docs/performance-notes.md, "Seeing a READ end").
VRAM_POLL_S = 25e-6
VRAM_POLL_EARLY = 0.75
_RATE_MIN_BYTES = 16 << 20  # READs this large or larger set the expected rate (smaller ones are mostly overhead)
# The expected rate learns only from READs whose end a check bracketed: one still in flight at or after its due
# time (VRAM_POLL_EARLY of its expected time). A READ first seen DONE at or before then ended at some unknown
# moment before: the rate was too low, and it grows RATE_PROBE times. (Learning from the time a READ was seen to
# end, late by the checker's wake-up, fed that lateness back into the next READ's sleep: short READs settled at
# four times the wake-up delay, whatever the copy took.)
RATE_PROBE = 2.0
_RATE_MAX = 10e12  # bytes/s, above any link or HBM copy: the rate's ceiling (a host pool's READs end at posting)

POST_RANGE = "tokenmill.kv_read_post"  # the profiler's range around posting a READ
WARM_RANGE = "tokenmill.kv_warm_post"  # and around posting a warm-up READ (warm_link): its copy is not a READ's

_DESC_MAGIC = b"TMKV"
_DESC_HEADER = struct.Struct("<4sHBxIQQ")  # magic, format version, mem type, pad, device id, count, bytes/desc
_MEM_TYPES = {0: "DRAM", 1: "VRAM"}
_MEM_CODES = {v: k for k, v in _MEM_TYPES.items()}

XferState = Literal["PROC", "DONE", "ERR"]


class KvTransferError(RuntimeError):
    """A KV transfer could not be started or failed."""


class KvIncompatibleError(KvTransferError):
    """Two workers disagree on what a KV block is; names every differing field."""


class UnknownPeerError(KvTransferError):
    """A transfer named a peer whose handshake was never added."""


class KvTransferTimeout(KvTransferError):
    """read_blocks() did not finish in time."""


_PATCH_LOCK = threading.Lock()


def _new_nixl_agent(name: str, conf: Any, progress_delay_us: int) -> Any:
    """``nixl_agent(name, conf)`` with the progress thread's delay set (the Python API hard-codes 0)."""
    import nixl._api as api

    real = api.nixlBind

    class _Bind:  # nixl_agent.__init__ reads the module global ``nixlBind``; only nixlAgent() is changed
        def __getattr__(self, attr: str) -> Any:
            return getattr(real, attr)

        @staticmethod
        def nixlAgent(agent_name: str, agent_config: Any) -> Any:
            agent_config.pthrDelay = progress_delay_us
            return real.nixlAgent(agent_name, agent_config)

    with _PATCH_LOCK:
        api.nixlBind = _Bind()
        try:
            return api.nixl_agent(name, conf)
        finally:
            api.nixlBind = real


def _fine_timer_slack() -> None:
    """Let this thread's sleeps end within ~1 µs of their time, not Linux's default 50 µs (per thread; best effort)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(29, 1000, 0, 0, 0)  # PR_SET_TIMERSLACK, in ns
    except (OSError, AttributeError):
        pass


def _nvidia_gpu_present() -> bool:
    """What NIXL checks (its hwInfo): an NVIDIA (0x10de) display-class (0x03xxxx) device on the PCI bus."""
    for dev in glob.glob("/sys/bus/pci/devices/*"):
        try:
            with open(f"{dev}/vendor") as v, open(f"{dev}/class") as c:
                if v.read().strip() == "0x10de" and c.read().strip().startswith("0x03"):
                    return True
        except OSError:
            continue
    return False


def _needs_cuda_copy(tls: str) -> bool:
    """NIXL refuses to create the UCX backend on a host with NVIDIA GPUs when UCX_TLS lists transports without
    cuda/cuda_copy, even for a pool in host memory; on a host without GPUs, naming cuda_copy only draws a UCX
    warning, so it is added only where GPUs are."""
    tokens = {t.strip() for t in tls.split(",")}
    return tls.strip() != "all" and not tls.strip().startswith("^") and not tokens & {"cuda", "cuda_copy"} \
        and _nvidia_gpu_present()


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True, slots=True)
class KvCompat:
    """What two workers must agree on before KV bytes are trusted (mirrors ``tokenmill.v1.KvCompat``)."""

    protocol_version: int
    model_id: str
    dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    layout: str

    @classmethod
    def for_pool(cls, kv_cache: torch.Tensor, model_id: str, layout: str | None = None) -> KvCompat:
        """The compat of a block-major pool tensor ``[blocks, layers, 2, block_size, kv_heads, head_dim]``."""
        if layout is None:
            from common.model_runner import KV_LAYOUT

            layout = KV_LAYOUT
        _, layers, _, block_size, kv_heads, head_dim = kv_cache.shape
        return cls(PROTOCOL_VERSION, model_id, dtype_name(kv_cache.dtype), layers, kv_heads, head_dim,
                   block_size, layout)

    @classmethod
    def from_message(cls, msg: Any) -> KvCompat:
        """From anything with these attributes, e.g. a ``tokenmill.v1.KvCompat`` protobuf message."""
        return cls(**{f.name: getattr(msg, f.name) for f in dataclasses.fields(cls)})

    def as_dict(self) -> dict[str, Any]:
        """Keyword arguments for ``tokenmill.v1.KvCompat(**compat.as_dict())``."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def differences(self, other: KvCompat) -> list[str]:
        return [
            f"{f.name}: ours {getattr(self, f.name)}, peer {getattr(other, f.name)}"
            for f in dataclasses.fields(self)
            if getattr(self, f.name) != getattr(other, f.name)
        ]

    def check(self, other: KvCompat) -> None:
        """Raise :class:`KvIncompatibleError` naming every field that differs, with both values."""
        diffs = self.differences(other)
        if diffs:
            raise KvIncompatibleError("incompatible KV cache: " + "; ".join(diffs))


class KvHandshake(NamedTuple):
    """What one worker tells another (the fields of ``KvHandshakeResponse``); ``add_peer(*hs)`` takes it."""

    agent_name: str
    agent_metadata: bytes
    kv_descriptors: bytes
    compat: KvCompat


def encode_descriptors(addresses: np.ndarray, nbytes: int, mem_type: str, device_id: int) -> bytes:
    """The pool as one descriptor per block: a header, then one little-endian uint64 address per block.

    Our own format rather than NIXL's ``get_serialized_descs`` (a pickle): these bytes come from the network,
    and unpickling a peer's bytes would let it run code in this process.
    """
    addrs = np.ascontiguousarray(addresses, dtype="<u8")
    header = _DESC_HEADER.pack(_DESC_MAGIC, 1, _MEM_CODES[mem_type], device_id, len(addrs), nbytes)
    return header + addrs.tobytes()


def decode_descriptors(data: bytes) -> tuple[np.ndarray, str]:
    """Inverse of :func:`encode_descriptors`: an ``N×3`` uint64 array (address, length, device) and the mem type."""
    if len(data) < _DESC_HEADER.size:
        raise KvTransferError(f"KV descriptors too short ({len(data)} bytes)")
    magic, version, mem_code, device_id, count, nbytes = _DESC_HEADER.unpack_from(data)
    if magic != _DESC_MAGIC or version != 1 or mem_code not in _MEM_TYPES:
        raise KvTransferError("KV descriptors: unknown format (magic/version/memory type)")
    if len(data) != _DESC_HEADER.size + 8 * count:
        raise KvTransferError(f"KV descriptors: {count} blocks announced, {len(data)} bytes received")
    out = np.empty((count, 3), dtype=np.uint64)
    out[:, 0] = np.frombuffer(data, dtype="<u8", count=count, offset=_DESC_HEADER.size)
    out[:, 1] = nbytes
    out[:, 2] = device_id
    return out, _MEM_TYPES[mem_code]


def pair_runs(remote_block_ids: list[int], local_block_ids: list[int]) -> tuple[np.ndarray, np.ndarray, int]:
    """The (remote, local) block pairs sorted by remote id, and how many runs they form: a run is a stretch where
    both ids go up by one, which NIXL posts as one descriptor (its default descriptor merging). Sorting is free
    (every pair is its own copy) and turns runs handed over in descending order, as a freed sequence's blocks come
    back from the block manager's free list, into ascending ones."""
    remote = np.asarray(remote_block_ids, dtype=np.int32)
    local = np.asarray(local_block_ids, dtype=np.int32)
    order = np.argsort(remote, kind="stable")
    remote, local = remote[order], local[order]
    breaks = (np.diff(remote) != 1) | (np.diff(local) != 1)
    return remote, local, int(breaks.sum()) + 1 if len(remote) else 0


@dataclass(eq=False)
class KvReadHandle:
    """One READ in flight: pass it to poll() until DONE/ERR, then to release()."""

    peer: str
    num_blocks: int
    nbytes: int
    started: float
    runs: int = 0  # descriptors after merging the runs contiguous on both sides
    due: float = 0.0  # when checks begin (perf_counter; 0: no expected rate yet)
    checked: float = 0.0  # the last check that saw it in flight
    state: XferState = "PROC"
    finished: float | None = None
    error: str | None = None
    _xfer: Any = field(default=None, repr=False)

    @property
    def seconds(self) -> float:
        """Start to the poll that saw it finish (or to now while in flight)."""
        return (self.finished if self.finished is not None else time.perf_counter()) - self.started


@dataclass
class _Peer:
    metadata: bytes
    descriptors: bytes
    compat: KvCompat
    num_blocks: int
    prepped: Any  # nixl_prepped_dlist_handle of the peer's blocks, or None (peer not readable)


class KvTransferAgent:
    """One NIXL agent (UCX backend) over one worker's whole KV pool."""

    def __init__(self, name: str, kv_cache: torch.Tensor, compat: KvCompat, *,
                 role: Literal["prefill", "decode", "both"] = "both", ucx_tls: str | None = None,
                 error_handling_mode: Literal["peer", "none"] | None = None,
                 progress_thread: ProgressThread | Literal["by-role"] = "by-role",
                 warm_links: bool | None = None) -> None:
        """``role``: "prefill" (its blocks are read), "decode" (it reads) or "both"; picks the progress thread
        (:data:`PROGRESS_THREAD_BY_ROLE`). ``ucx_tls`` / ``error_handling_mode`` / ``progress_thread`` (µs
        between rounds, or "off") and ``warm_links`` (:data:`WARM_LINKS_BY_MEM`) override the defaults, for
        benchmarks and tests. For a CPU pool UCX_TLS is set to
        :data:`CPU_UCX_TLS` unless the environment already sets it; a CUDA pool keeps UCX's own choice (cuda_ipc,
        NVLink). UCX reads the variable when the backend is created: once per process."""
        if kv_cache.dim() != 6 or not kv_cache.is_contiguous():
            raise ValueError("kv_cache must be a contiguous [blocks, layers, 2, block_size, kv_heads, head_dim] tensor")
        pool = KvCompat.for_pool(kv_cache, compat.model_id, compat.layout)
        wrong = [f"{k}: compat {v}, pool {getattr(pool, k)}" for k, v in compat.as_dict().items()
                 if k != "protocol_version" and v != getattr(pool, k)]
        if wrong:
            raise ValueError("compat does not describe kv_cache: " + "; ".join(wrong))
        try:
            from nixl._api import nixl_agent_config, nixl_thread_sync_t
        except ImportError as e:
            raise RuntimeError(f"the KV transfer agent needs NIXL, which does not import here ({e}); it is a tokenmill "
                               "dependency: `make install`, or pip install nixl==1.5.1 beside torch") from e

        self.name = name
        self.compat = compat
        self.kv_cache = kv_cache
        self.num_blocks = kv_cache.shape[0]
        self.bytes_per_block = kv_cache[0].numel() * kv_cache.element_size()
        self.mem_type = "DRAM" if kv_cache.device.type == "cpu" else "VRAM"
        self.device_id = 0 if kv_cache.device.type == "cpu" else kv_cache.device.index or 0
        if ucx_tls is None and self.mem_type == "DRAM" and "UCX_TLS" not in os.environ:
            ucx_tls = CPU_UCX_TLS
        if ucx_tls is not None and _needs_cuda_copy(ucx_tls):
            ucx_tls += ",cuda_copy"
        if ucx_tls is not None:
            os.environ["UCX_TLS"] = ucx_tls
        self.ucx_tls = os.environ.get("UCX_TLS", "(UCX default)")
        self.error_handling_mode = error_handling_mode or UCX_ERROR_HANDLING_MODE

        # counters (the services export them as nixl_xfer_* metrics)
        self.bytes_transferred = 0
        self.transfer_seconds = 0.0  # summed over READs: overlapping READs each count their own time
        self.busy_seconds = 0.0  # time with at least one READ in flight: bytes / this is the link's delivered rate
        self._busy_since = 0.0
        self.transfers = 0
        self.failures = 0
        # READs posted, their descriptors after merging (a descriptor costs UCX a copy of its own) and the time
        # the posting took (make_prepped_xfer + transfer, on the caller's thread)
        self.posted = 0
        self.posted_descriptors = 0
        self.post_seconds = 0.0
        self.notifications_received = 0
        self.warmups = 0  # one-block READs into the scratch block (warm_link), counted in none of the above

        self._lock = threading.RLock()
        self._peers: dict[str, _Peer] = {}
        self._inflight: set[KvReadHandle] = set()
        self._poller: threading.Thread | None = None
        self._poll_wake = threading.Event()  # set while READs are in flight
        self._poll_kick = threading.Event()  # a READ was posted: the poller's sleep ends
        self._rate = 0.0  # bytes/s of recent large READs (0: none yet), for when to check the next one
        self._stuck: list[Any] = []  # xfer handles NIXL refused to release (retried at close)
        # only a reader warms links: a prefill agent's blocks are read, it reads nothing
        self.warm_links = role != "prefill" and (WARM_LINKS_BY_MEM[self.mem_type] if warm_links is None else warm_links)
        self._warm: list[tuple[str, Any]] = []  # (peer, xfer) of warm-up READs not yet seen over
        self._last_traffic: dict[str, float] = {}  # peer -> perf_counter of the last READ posted to it or ended
        # No listener thread: metadata travels in our own handshake RPC. The progress thread lets UCX serve a
        # peer's READ (tcp emulates RMA on the target), answer connection set-up and deliver notifications
        # between our calls; see PROGRESS_THREAD_BY_ROLE for who gets one and why it pauses.
        self.role = role
        self.progress_thread = PROGRESS_THREAD_BY_ROLE[role] if progress_thread == "by-role" else progress_thread
        pause_us = 0 if self.progress_thread == "off" else self.progress_thread
        self._agent = _new_nixl_agent(name, nixl_agent_config(
            enable_prog_thread=self.progress_thread != "off", enable_listen_thread=False, backends=[],
            sync_mode=nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT), pause_us)
        try:
            self._agent.create_backend("UCX", {"ucx_error_handling_mode": self.error_handling_mode})
        except Exception as e:  # NIXL logs the reason (e.g. UCX_TLS refused) on stderr; the exception says little
            raise KvTransferError(f"NIXL could not create its UCX backend (UCX_TLS={self.ucx_tls}, error "
                                  f"handling {self.error_handling_mode}): {e}; see NIXL's log above") from e
        # Register first: metadata taken before registration lacks the memory (peer reads get NOT_FOUND).
        self._reg = self._agent.register_memory(kv_cache)
        base = kv_cache.data_ptr()
        self._addresses = base + np.arange(self.num_blocks, dtype=np.uint64) * np.uint64(self.bytes_per_block)
        local = np.stack([self._addresses,
                          np.full(self.num_blocks, self.bytes_per_block, dtype=np.uint64),
                          np.full(self.num_blocks, self.device_id, dtype=np.uint64)], axis=1)
        self._local_prepped = self._agent.prep_xfer_dlist("NIXL_INIT_AGENT", local, self.mem_type)
        # warm-up READs land in a block of their own, outside the pool (the peers never read it)
        self._scratch = self._scratch_reg = self._scratch_prepped = None
        if self.warm_links:
            self._scratch = torch.empty(self.bytes_per_block, dtype=torch.uint8, device=kv_cache.device)
            self._scratch_reg = self._agent.register_memory(self._scratch)
            self._scratch_prepped = self._agent.prep_xfer_dlist("NIXL_INIT_AGENT", np.array(
                [[self._scratch.data_ptr(), self.bytes_per_block, self.device_id]], dtype=np.uint64), self.mem_type)
        self._metadata: bytes = self._agent.get_agent_metadata()
        self._descriptors = encode_descriptors(self._addresses, self.bytes_per_block, self.mem_type, self.device_id)

    # -- handshake -------------------------------------------------------------------------------------
    def handshake_payload(self) -> KvHandshake:
        return KvHandshake(self.name, self._metadata, self._descriptors, self.compat)

    def add_peer(self, name: str, metadata: bytes, descriptors: bytes | None, compat: KvCompat) -> None:
        """Check compat, load the peer's agent metadata and prepare its block descriptors; cached per peer.

        Idempotent: the same handshake again is a no-op; a changed one (the peer restarted) replaces the old.
        ``descriptors`` may be empty when this side only needs to accept the peer (prefill checking a decode).
        """
        self.compat.check(compat)
        descriptors = descriptors or b""
        with self._lock:
            self._check_open()
            old = self._peers.get(name)
            if old is not None:
                if old.metadata == metadata and old.descriptors == descriptors and old.compat == compat:
                    return
                self._drop_peer(name, old)
            remote, mem_type = decode_descriptors(descriptors) if descriptors else (None, None)
            if remote is not None and len(remote) and int(remote[0, 1]) != self.bytes_per_block:
                raise KvIncompatibleError(
                    f"peer {name!r} blocks are {int(remote[0, 1])} bytes, ours {self.bytes_per_block}")
            loaded = self._agent.add_remote_agent(metadata)
            loaded = loaded.decode() if isinstance(loaded, bytes) else loaded
            if loaded != name:
                if loaded not in self._peers:
                    self._agent.remove_remote_agent(loaded)
                raise KvTransferError(f"handshake names agent {name!r} but its metadata is agent {loaded!r}")
            prepped = None
            try:
                if remote is not None:
                    prepped = self._agent.prep_xfer_dlist(name, remote, mem_type)
            except Exception as e:
                self._agent.remove_remote_agent(name)
                raise KvTransferError(f"peer {name!r}: its KV descriptors do not match its metadata: {e}") from e
            self._peers[name] = _Peer(metadata, descriptors, compat, 0 if remote is None else len(remote), prepped)

    def remove_peer(self, name: str) -> None:
        """Forget a peer (cancelling READs from it still in flight); unknown names are ignored."""
        with self._lock:
            peer = self._peers.get(name)
            if peer is not None:
                self._drop_peer(name, peer)

    def has_peer(self, name: str) -> bool:
        return name in self._peers

    def _drop_peer(self, name: str, peer: _Peer) -> None:
        for h in [h for h in self._inflight if h.peer == name]:  # they use the descriptors released below
            self.release(h)
        self._reap_warm(peer=name)
        self._last_traffic.pop(name, None)
        if peer.prepped is not None:
            peer.prepped.release()
        del self._peers[name]
        try:
            self._agent.remove_remote_agent(name)
        except Exception as e:  # already disconnected
            log.debug("remove_remote_agent(%s): %s", name, e)

    # -- decode side: pull ------------------------------------------------------------------------------
    def start_read(self, peer: str, remote_block_ids: list[int], local_block_ids: list[int],
                   notif: bytes = b"") -> KvReadHandle:
        """Post ONE NIXL READ of the peer's blocks (all layers each) into ours; ``notif`` reaches the peer when
        it completes. Never waits for the peer, but a host-memory pool's copy happens here (see the module
        docstring). Raises ValueError on bad ids, UnknownPeerError for a peer not added, KvTransferError when NIXL
        cannot post (a peer that disconnected is then forgotten)."""
        n = len(remote_block_ids)
        if n == 0 or n != len(local_block_ids):
            raise ValueError(f"need as many local as remote block ids, at least one ({n} vs {len(local_block_ids)})")
        if len(set(local_block_ids)) != n:
            raise ValueError("local block ids repeat: two remote blocks would land in one local block")
        remote_idx, local_idx, runs = pair_runs(remote_block_ids, local_block_ids)
        with self._lock:
            self._check_open()
            p = self._peers.get(peer)
            if p is None:
                raise UnknownPeerError(f"unknown KV peer {peer!r}: do the KvHandshake and add_peer() first "
                                       f"(known: {sorted(self._peers) or 'none'})")
            if p.prepped is None:
                raise UnknownPeerError(f"KV peer {peer!r} was added without descriptors: its blocks cannot be read")
            if remote_idx.min() < 0 or remote_idx.max() >= p.num_blocks:
                raise ValueError(f"remote block ids out of range for {peer!r} (pool of {p.num_blocks} blocks)")
            if local_idx.min() < 0 or local_idx.max() >= self.num_blocks:
                raise ValueError(f"local block ids out of range (pool of {self.num_blocks} blocks)")
            h = KvReadHandle(peer, n, n * self.bytes_per_block, time.perf_counter(), runs)
            self._expect(h)
            try:
                with record_function(POST_RANGE):  # a profile (common/profiling.py) shows where each READ began
                    h._xfer = self._agent.make_prepped_xfer("READ", self._local_prepped, local_idx,
                                                            p.prepped, remote_idx, notif)
                    state = self._agent.transfer(h._xfer)
            except Exception as e:
                self.failures += 1
                if h._xfer is not None:
                    self._release_xfer(h._xfer)
                gone = self._forget_if_disconnected(peer, e)
                raise KvTransferError(f"READ of {n} blocks from {peer!r} could not be posted: {e}"
                                      + ("; peer forgotten, handshake again" if gone else "")) from e
            self.posted += 1
            self.posted_descriptors += runs
            self.post_seconds += time.perf_counter() - h.started
            self._last_traffic[peer] = h.started
            if self._warm:
                self._reap_warm()
            if not self._inflight:
                self._busy_since = h.started
            self._inflight.add(h)
            if self._settle(h, state) == "PROC" and self.mem_type == "VRAM":
                self._start_poller()
        return h

    def _start_poller(self) -> None:
        """Wake the poller (started on the first READ that stays in flight); caller holds the lock."""
        if self._poller is None:
            self._poller = threading.Thread(target=self._poll_inflight, name=f"kv-poll-{self.name}", daemon=True)
            self._poller.start()
        self._poll_wake.set()
        self._poll_kick.set()

    def _poll_inflight(self) -> None:
        _fine_timer_slack()
        while True:
            self._poll_wake.wait()
            with self._lock:
                if self._agent is None:
                    return
                self._poll_kick.clear()
                for h in list(self._inflight):
                    self.poll(h)
                if not self._inflight:
                    self._poll_wake.clear()
                    continue
                pause = self._poll_pause(time.perf_counter())
            self._poll_kick.wait(pause)

    def _poll_pause(self, now: float) -> float:
        """Until the next check: VRAM_POLL_S, or longer while every READ in flight is early in its expected time."""
        return max(VRAM_POLL_S, min((h.due for h in self._inflight), default=0.0) - now)

    def poll(self, handle: KvReadHandle) -> XferState:
        """Non-blocking state of a READ; call once per engine step. Counters are updated when it finishes."""
        if handle.state != "PROC":
            return handle.state
        with self._lock:
            if handle._xfer is None or self._agent is None:
                return self._settle(handle, "ERR", "released or agent closed while in flight")
            try:
                state = self._agent.check_xfer_state(handle._xfer)
            except Exception as e:  # e.g. nixlRemoteDisconnectError: the peer went away
                self._forget_if_disconnected(handle.peer, e)
                return self._settle(handle, "ERR", str(e))
            return self._settle(handle, state)

    def _forget_if_disconnected(self, peer: str, exc: Exception) -> bool:
        """A peer that disconnected (died, restarted) is dropped, so has_peer() is False and the caller redoes
        the handshake instead of failing every READ against stale metadata."""
        if "DISCONNECT" not in f"{type(exc).__name__} {exc}".upper() or peer not in self._peers:
            return False
        self._drop_peer(peer, self._peers[peer])
        return True

    def _settle(self, h: KvReadHandle, state: str, error: str | None = None) -> XferState:
        if h.state != "PROC":
            return h.state
        if state == "PROC":
            h.checked = time.perf_counter()
            return h.state
        h.finished = time.perf_counter()
        self._last_traffic[h.peer] = h.finished
        self._inflight.discard(h)
        if not self._inflight:
            self.busy_seconds += h.finished - self._busy_since
        if state == "DONE":
            h.state = "DONE"
            self.transfers += 1
            self.bytes_transferred += h.nbytes
            self.transfer_seconds += h.finished - h.started
            if h.nbytes >= _RATE_MIN_BYTES:
                self._learn_rate(h)
        else:
            h.state = "ERR"
            h.error = error or "NIXL reported a transfer error"
            self.failures += 1
        return h.state

    def _expect(self, h: KvReadHandle) -> None:
        """Set when the checks of a READ just posted begin (none known yet: at once)."""
        if self._rate > 0:
            h.due = h.started + VRAM_POLL_EARLY * h.nbytes / self._rate

    def _learn_rate(self, h: KvReadHandle) -> None:
        """Fold a finished READ into the expected rate (see RATE_PROBE)."""
        assert h.finished is not None
        if self._rate <= 0:
            self._rate = h.nbytes / max(h.finished - h.started, 1e-6)
        elif h.checked >= h.due:  # in flight at a check after its due time: it ended between that and the next
            self._rate = 0.7 * self._rate + 0.3 * h.nbytes / max((h.checked + h.finished) / 2 - h.started, 1e-6)
        else:  # first seen DONE before or at the first check: the checks began too late
            self._rate = max(h.nbytes / max(h.finished - h.started, 1e-6), RATE_PROBE * self._rate)
        self._rate = min(self._rate, _RATE_MAX)

    def release(self, handle: KvReadHandle) -> bool:
        """Free the NIXL request. Releasing one still in flight cancels it (counted as a failure); returns False
        when NIXL could not cancel it: the local blocks may still be written, so don't reuse them yet."""
        with self._lock:
            if handle._xfer is None:
                return True
            if handle.state == "PROC":
                self._settle(handle, "ERR", "cancelled")
            xfer, handle._xfer = handle._xfer, None
            if self._agent is None:
                return True
            return self._release_xfer(xfer)

    def _release_xfer(self, xfer: Any) -> bool:
        try:
            xfer.release()
            return True
        except Exception as e:
            log.warning("NIXL could not release a KV transfer (%s); retrying at close", e)
            self._stuck.append(xfer)
            return False

    def warm_link(self, peer: str, remote_block: int) -> bool:
        """Wake the link to ``peer`` ahead of a READ: post a one-block READ of its block ``remote_block`` into
        this agent's scratch block, unless warm-ups are off (a host pool), the peer is unknown or not readable, or
        the link had traffic within :data:`WARM_IDLE_S` or has a READ in flight. Nothing waits for it and nothing
        tells the peer. The decode worker calls it as a request with a lease comes in, a few ms before the
        request's own READ. Returns whether one was posted."""
        if not self.warm_links:
            return False
        with self._lock:
            if self._agent is None:
                return False
            self._reap_warm()
            p = self._peers.get(peer)
            if p is None or p.prepped is None or not 0 <= remote_block < p.num_blocks:
                return False
            now = time.perf_counter()
            if (now - self._last_traffic.get(peer, -WARM_IDLE_S) < WARM_IDLE_S
                    or any(h.peer == peer for h in self._inflight) or any(w == peer for w, _ in self._warm)):
                return False
            with record_function(WARM_RANGE):
                try:
                    xfer = self._agent.make_prepped_xfer("READ", self._scratch_prepped, [0], p.prepped,
                                                         [remote_block], b"")
                except Exception as e:
                    log.debug("warm-up READ from %s not made: %s", peer, e)
                    return False
                try:
                    state = self._agent.transfer(xfer)
                except Exception as e:
                    log.debug("warm-up READ from %s not posted: %s", peer, e)
                    state = "ERR"
            self._last_traffic[peer] = now
            if state == "PROC":
                self._warm.append((peer, xfer))
            else:
                self._release_xfer(xfer)
            self.warmups += state != "ERR"
            return state != "ERR"

    def _reap_warm(self, peer: str | None = None) -> None:
        """Release the warm-up READs that are over (with ``peer``: that peer's, over or not). Under the lock."""
        keep = []
        for name, xfer in self._warm:
            if peer is None:
                try:
                    if self._agent.check_xfer_state(xfer) == "PROC":
                        keep.append((name, xfer))
                        continue
                except Exception as e:
                    log.debug("warm-up READ from %s: %s", name, e)
            elif name != peer:
                keep.append((name, xfer))
                continue
            self._release_xfer(xfer)
        self._warm = keep

    def read_blocks(self, peer: str, remote_block_ids: list[int], local_block_ids: list[int],
                    notif: bytes = b"", timeout: float = 30.0) -> float:
        """Blocking READ (tests and tools); returns its seconds. Raises on error or timeout."""
        h = self.start_read(peer, remote_block_ids, local_block_ids, notif)
        deadline = time.perf_counter() + timeout
        try:
            while (state := self.poll(h)) == "PROC":
                if time.perf_counter() > deadline:
                    raise KvTransferTimeout(f"READ of {h.num_blocks} blocks from {peer!r} not done in {timeout}s")
                time.sleep(0.0001)
            if state == "ERR":
                raise KvTransferError(f"READ of {h.num_blocks} blocks from {peer!r} failed: {h.error}")
            return h.seconds
        finally:
            self.release(h)

    # -- prefill side ------------------------------------------------------------------------------------
    def completed_notifications(self) -> list[tuple[str, bytes]]:
        """``(peer, notif)`` for every READ of our blocks that finished since the last call (non-blocking)."""
        with self._lock:
            if self._agent is None:
                return []
            notifs = self._agent.get_new_notifs()
        out = [(peer, bytes(msg)) for peer, msgs in notifs.items() for msg in msgs]
        self.notifications_received += len(out)
        return out

    # -- life cycle -------------------------------------------------------------------------------------
    @property
    def inflight(self) -> int:
        return len(self._inflight)

    def counters(self) -> dict[str, float]:
        return {"bytes_transferred": self.bytes_transferred, "transfer_seconds": self.transfer_seconds,
                "busy_seconds": self.busy_seconds,
                "transfers": self.transfers, "failures": self.failures,
                "notifications_received": self.notifications_received, "posted": self.posted,
                "posted_descriptors": self.posted_descriptors, "post_seconds": self.post_seconds,
                "warmups": self.warmups}

    def _check_open(self) -> None:
        if self._agent is None:
            raise KvTransferError(f"KV transfer agent {self.name!r} is closed")

    def close(self) -> None:
        """Cancel what is in flight, forget the peers, deregister the pool. Idempotent."""
        with self._lock:
            if self._agent is None:
                return
            self._poll_wake.set()  # the poller sees the agent closed and ends
            self._poll_kick.set()
            for h in list(self._inflight):
                self.release(h)
            for _, xfer in self._warm:
                self._release_xfer(xfer)
            self._warm.clear()
            for xfer in self._stuck:
                try:
                    xfer.release()
                except Exception as e:
                    log.warning("NIXL transfer still not releasable at close: %s", e)
            self._stuck.clear()
            for name, peer in list(self._peers.items()):
                self._drop_peer(name, peer)
            self._local_prepped.release()
            try:
                self._agent.deregister_memory(self._reg)
            except Exception as e:
                log.warning("deregistering the KV pool: %s", e)
            if self._scratch_prepped is not None:
                self._scratch_prepped.release()
                try:
                    self._agent.deregister_memory(self._scratch_reg)
                except Exception as e:
                    log.warning("deregistering the warm-up block: %s", e)
            self._agent = None

    def __enter__(self) -> KvTransferAgent:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
