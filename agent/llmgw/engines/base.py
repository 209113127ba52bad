"""What an engine adapter produces: the exact process to launch.

Adapters are pure: profile + model + placement in, argv and env out.  The
agent's supervisor does the launching; tests compare argv exactly.
"""

from __future__ import annotations

from dataclasses import dataclass, field


def pointer_token(key: str) -> str:
    """``key`` escaped as one JSON pointer segment (RFC 6901: ``~`` -> ``~0``, ``/`` -> ``~1``)."""
    return key.replace("~", "~0").replace("/", "~1")


class Problem(str):
    """One problem's text, plus where it is inside the profile.

    ``path`` is a JSON pointer relative to the profile (``extra_args/3``,
    ``env/CUDA_VISIBLE_DEVICES``; "" for the profile as a whole), so config
    loading can name the offending key rather than the whole profile.  A str,
    so every caller that reads problems as text keeps working.
    """

    path: str

    def __new__(cls, text: str, path: str = "") -> "Problem":
        self = super().__new__(cls, text)
        self.path = path
        return self


class ProfileError(ValueError):
    """A profile the engine would refuse, or that fights the adapter.

    ``problems`` lists every individual problem, so an operator fixes a
    profile in one pass instead of one error per launch attempt; ``paths``
    says where each one is (see ``Problem``).
    """

    def __init__(self, message: str, problems: tuple[str, ...] | list[str] = ()) -> None:
        super().__init__(message)
        self.problems: tuple[str, ...] = tuple(problems) or (message,)

    @property
    def paths(self) -> tuple[str, ...]:
        """Each problem's pointer relative to the profile ("" when it is the profile as a whole)."""
        return tuple(getattr(p, "path", "") for p in self.problems)


class SourceError(ProfileError):
    """A model source the engine cannot be pointed at (missing path, wrong kind)."""


class LaunchContextError(ValueError):
    """A LaunchContext that contradicts the profile (wrong GPU count, no rendezvous address).

    This is a bug in whoever built the context (placement, agent), not in the
    operator's profile, hence a separate type.
    """


@dataclass(frozen=True)
class LaunchContext:
    """Everything about one shard's launch that is not in the catalog."""

    host: str  # address the engine binds (rank 0 HTTP)
    port: int  # HTTP port (rank 0)
    model_path: str  # resolved weights location, or the hub id untouched
    rank: int = 0  # node rank of this shard
    nnodes: int = 1
    master_addr: str | None = None  # rank-0 node address, multi-node only
    master_port: int | None = None  # rendezvous port, multi-node only
    gpu_indices: tuple[int, ...] = ()
    extra_env: dict[str, str] = field(default_factory=dict)  # from placement (NCCL_IB_HCA ...)
    command: tuple[str, ...] | None = None  # override the engine binary (e.g. the simulator)
    # The replica's engine key (None: none issued).  Never put on the command
    # line where the engine can read it from its environment or a file.
    api_key: str | None = field(default=None, repr=False)
    secret_dir: str | None = None  # a 0700 directory of this shard's, for key files
    # The node's engine serving certificate and key (PEM paths), or None: serve
    # TLS with them where the engine can; one that cannot keeps plain HTTP.
    tls_cert: str | None = None
    tls_key: str | None = None
    shard_id: str = ""  # which shard this launches (names its KV event topic)
    # A 0700 directory of this shard's, with a short path, for the unix sockets the engine binds
    # (the KV event publisher's ipc:// endpoints); None where the caller gives none.
    socket_dir: str | None = None
    # One side of a prefill/decode pair: where its KV-transfer side channel listens, (host, port); the host
    # is the node's address its peers reach, the port one the agent allocated for this shard.
    kv_side_channel: tuple[str, int] | None = None
    # Launch with the engine's sleep mode (vLLM: --enable-sleep-mode, and VLLM_SERVER_DEV_MODE=1 on
    # rank 0, which attaches /sleep and /wake_up): the deployment has ``autoscale.sleep``.
    sleep_mode: bool = False


@dataclass(frozen=True)
class SecretFile:
    """A file the agent writes (mode 0600) before launch, e.g. a config holding the engine key."""

    path: str
    data: str = field(repr=False)


@dataclass(frozen=True)
class LaunchSpec:
    argv: tuple[str, ...]
    env: dict[str, str]
    serves_http: bool  # rank 0 serves HTTP; worker ranks are checked by liveness
    port: int | None
    files: tuple[SecretFile, ...] = ()
    tls: bool = False  # rank 0 serves HTTPS with the context's certificate (the endpoint is https://)
    # Variables the adapter owns (a profile's env may not set them): the launcher drops them from
    # the environment the engine would otherwise inherit, so only ``env`` can set them.
    owned_env: frozenset[str] = frozenset()
