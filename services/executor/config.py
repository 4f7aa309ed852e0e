"""Executor settings (``T2I_EXECUTOR_*``), with the defaults a CPU box uses."""

from __future__ import annotations

from typing import Literal

import msgspec


class ExecutorConfig(msgspec.Struct, forbid_unknown_fields=True):
    id: str = ""  # default: exec-<host>-<pid>
    device: str = "cpu"  # "cpu", "cuda", "cuda:1"
    threads: int = 1  # torch intra-op threads; pinned because the thread count changes the bits
    arena_mb: int = 256  # data-plane arena (rounded up to a power of two)
    model_root: str = "models"  # where model names in specs are looked up
    # "auto" (default: "cuda_ipc" on a CUDA device, "shm" on the CPU), "shm" (one host, host memory),
    # "cuda_ipc" (a GPU box: a device arena, GPU-to-GPU pulls between its executors), "tcp" (across
    # hosts/containers) or "nvshmem" (a GPU box as one NVSHMEM world; CUDA IPC while it cannot form).
    transport: Literal["auto", "shm", "tcp", "cuda_ipc", "nvshmem"] = "auto"
    # The box's NVSHMEM world (transport "nvshmem"): its size (every executor of the box, ranks from
    # the GPU lease) and generation (a new one for a world started again: worlds are fixed).
    nvshmem_world: int = 0
    nvshmem_generation: int = 0
    nvshmem_join_s: float = 120.0  # how long a PE waits for the others before falling back to CUDA IPC
    # After a PE of the world died: how long a survivor serves over CUDA IPC, waiting for its tensors
    # in the world's arena to be released, before it ends to join the next generation.
    nvshmem_drain_s: float = 300.0
    host: str = "127.0.0.1"  # address the tcp transport binds and advertises
    # The tcp transport: every socket operation's time limit and the server's connection cap. Its
    # shared secret comes from T2I_DATAPLANE_TOKEN or T2I_DATAPLANE_TOKEN_FILE (docs/dataplane.md).
    dataplane_timeout_s: float = 30.0
    dataplane_max_connections: int = 64
    heartbeat_s: float = 1.0  # how often the executor reports its state to the scheduler
    alloc_timeout_s: float = 30.0  # how long a full arena makes an output wait before failing
    # A node running longer fails (retryable, so it runs elsewhere); a real executor then exits for
    # its supervisor to restart it (its worker thread cannot be stopped). 0: no limit.
    node_timeout_s: float = 900.0
    # Tensors of an attempt that had no node here for this long are freed even if the scheduler's
    # end-of-request release never arrived (a lost message must not leak arena space). 0: never.
    attempt_ttl_s: float = 3600.0
    # The leading scheduler lists the attempts it has in progress every few seconds; an attempt not
    # listed that had no node here for this long is freed (its release was lost; docs/scheduling.md).
    reconcile_grace_s: float = 30.0
    # Loading (docs/loading.md): checkpoints are converted on first use into the loading format and
    # read with O_DIRECT by ``load_threads`` threads in ``load_chunk_mb`` chunks into the box's host
    # tier, one copy per box shared by every executor with the same ``host_tier`` name (default:
    # derived from the namespace), LRU under ``host_tier_mb`` (0: no host tier, private buffers;
    # -1, the default: half of the box's memory or of the tier's filesystem, whichever is smaller;
    # services.executor.memory.default_host_tier_mb).
    host_tier_mb: int = -1
    host_tier: str = ""
    host_tier_dir: str = "/dev/shm"
    load_threads: int = 4
    load_chunk_mb: int = 16
    # Weights on the device (docs/memory.md): cached layer by layer, least recently used models'
    # last layers evicted first. ``device_budget_mb`` bounds them (0: no bound of its own; on CUDA
    # the device pool below bounds them anyway); ``arena_weights`` is the share of the data-plane arena
    # that cached weights may fill while communication does not need it (it takes them back).
    device_budget_mb: int = 0
    arena_weights: float = 0.5
    # The device memory weights and activations share (docs/memory.md, "Device memory"): each model
    # runs with room for its profiled activations, others' layers evicted to make it. 0 (default):
    # on CUDA what the GPU has free when the executor starts (less 512 MiB); set it when several
    # executors share one GPU. Unused on the CPU.
    device_pool_mb: int = 0
    # The unit cached weights are kept and evicted in (docs/scheduling.md, "Deployment modes"):
    # "layer" (ServerlessT2I: layer prefixes), or the paper's baselines "model" (MCache: whole models),
    # "workflow" (WCache: whole workflows, a copy of each model per workflow) and "none" (NoCache:
    # nothing stays once a request ends). "" (default): the granularity of the scheduler's deployment
    # mode, which its dispatches name (the executor follows it from its first dispatch).
    cache_mode: Literal["", "layer", "model", "workflow", "none"] = ""
    # Component dtype per model name (as in specs): "tiny-flux=bfloat16,*=float16"; "*" for every
    # other model; unset: the family's default on the device (bf16/fp16 on CUDA, libs.models.families;
    # as saved on the CPU: the tiny CPU models stay fp32, bitwise equal to diffusers).
    dtypes: str = ""
    # One GPU per executor on a shared box (docs/deploy.md, libs/common/gpu_lease.py): claim the
    # lowest free GPU among the visible ones through a Redis lease (T2I_REDIS_* credentials) and
    # set CUDA_VISIBLE_DEVICES to it. ``gpus``: a count or a comma list of ids (default: what
    # CUDA_VISIBLE_DEVICES, nvidia-smi or /dev/nvidiaN show); ``gpu_lease_scope`` names the box
    # (executors of several boxes sharing one Redis each need their own).
    gpu_lease: bool = False
    gpus: str = ""
    gpu_lease_scope: str = "box"
    gpu_lease_ttl_s: float = 30.0
    gpu_lease_wait_s: float = 120.0  # how long to wait for a GPU when every one is leased
    # How long the registry trusts this process's ModelFn advertisement (resent every third of it).
    advertise_ttl_s: float = 300.0
    # Simulation: "sim" replays profiled times instead of computing (no torch needed).
    mode: Literal["real", "sim"] = "real"  # "sim": simulated executors replaying a profile (no torch)
    sim_count: int = 1  # simulated executors (GPUs) in this process
    sim_profile: str = "paper-h800"  # a shipped profile name (libs/sim/profiles) or a JSON path
    sim_time_scale: float = 1.0  # <1 replays faster than real time; reported times are unscaled


class DataplaneSettings(msgspec.Struct, forbid_unknown_fields=True):
    """The data plane's settings outside ``T2I_EXECUTOR_*`` (``T2I_DATAPLANE_*``): named for the
    data plane, as one box's executors share them. Read by the executor, which hands them on."""

    # The tcp data plane's shared secret (peers authenticate with HMAC; docs/dataplane.md), or a
    # file holding it (a mounted secret, surrounding whitespace stripped); set one, not both.
    token: str = ""
    token_file: str = ""

    def secret(self) -> str:
        """The token (read from ``token_file`` when that is set; "" for none). ValueError when
        both are set or the file cannot be read."""
        if self.token and self.token_file:
            raise ValueError("set T2I_DATAPLANE_TOKEN or T2I_DATAPLANE_TOKEN_FILE, not both")
        if not self.token_file:
            return self.token
        try:
            with open(self.token_file) as f:
                return f.read().strip()
        except OSError as e:
            raise ValueError(
                f"T2I_DATAPLANE_TOKEN_FILE: cannot read {self.token_file}: {e.strerror}"
            ) from None
