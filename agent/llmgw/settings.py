"""Typed settings for ``server.yaml`` and ``agent.yaml``.

Loading is: parse YAML -> JSON Schema (every error, with its pointer) plus
the semantic checks the schema cannot express (references between sections,
timing invariants, engine profile rules), each run when the schema accepted
what it reads -> frozen dataclasses.  Nothing starts on a file with any
error; every error is reported at once.
"""

from __future__ import annotations

import dataclasses
import ipaddress

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence
from urllib.parse import urlsplit

from llmgw.catalog import Catalog
from llmgw.clientbounds import ClientBounds
from llmgw.config import ConfigError, ConfigInvalid, read_yaml, schema_errors
from llmgw.engines import ENGINES, ProfileError, get_adapter, validate_profile
from llmgw.hardware.types import FabricDeclaration
from llmgw.schemadefaults import with_defaults


@dataclass(frozen=True)
class TLSFiles:
    ca: str
    cert: str
    key: str
    revoked: str | None = None  # the revocation list (llmgw.tls.revocation); None: revoke nothing


@dataclass(frozen=True)
class Lifecycle:
    heartbeat_interval: float = 5.0
    keepalive_interval: float = 10.0
    unreachable_after: float = 30.0
    lost_after: float = 120.0
    startup_grace: float = 120.0
    max_unreachable_share: float = 0.55
    replacements_per_minute: int = 10
    max_heartbeats_per_second: float = 500.0
    engine_signal_period: float = 5.0  # seconds between agents' reads of engine signals (autoscale on one)
    max_engine_signals_per_second: float = 250.0  # the fleet's engine_signals messages at most: the period stretches
    stream_grace: float = 60.0
    max_registrations_per_second: float = 500.0
    max_loop_lag: float = 3.0
    # Each handshake costs about 1 ms of CPU (0.8 ms measured without session tickets, 1.1 with), so 256
    # queue a quarter second of work on a full core: enough to keep it busy while each waits on its
    # agent's replies (10,000 agents dialling at once: 64 left the control plane idle a third of the
    # time; 256 and 512 took the same 64-67 s cold start).  Applies
    # while the loop runs behind or admission.BURST_FACTOR times as many are under way.
    max_tls_handshakes: int = 256

    def for_fleet(self, nodes: int) -> "Lifecycle":
        """The timings in force for a fleet of ``nodes``: heartbeats capped fleet-wide.

        Like Nomad's server-side cap: past ``heartbeat_interval x
        max_heartbeats_per_second`` nodes the interval grows with the fleet,
        and the silences that make a node unreachable or lost grow by the
        same amount, so a node still misses as many heartbeats before either.
        """
        interval = max(self.heartbeat_interval, nodes / self.max_heartbeats_per_second)
        grown = interval - self.heartbeat_interval
        if grown <= 0:
            return self
        keepalive = self.keepalive_interval * interval / self.heartbeat_interval
        return dataclasses.replace(self, heartbeat_interval=interval, unreachable_after=self.unreachable_after + grown,
                                   lost_after=self.lost_after + grown, keepalive_interval=keepalive,
                                   stream_grace=self.stream_grace + grown)


@dataclass(frozen=True)
class RestartPolicy:
    backoff_initial: float = 5.0
    backoff_max: float = 300.0


@dataclass(frozen=True)
class LivenessPolicy:
    """``agent.yaml`` ``health``: how often, how patient, how long until failed (``llmgw.agent.liveness``)."""

    interval: float = 5.0  # seconds between checks of a Ready shard
    timeout: float = 5.0  # one check's answer time
    fail_after: float = 30.0  # no passing check for this long (and >= 2 failures in a row): failed
    kill_after: float = 5.0  # SIGTERM -> SIGKILL for a shard failed this way


def policy_errors(values: Mapping[str, float], pointer: str = "/health") -> Iterable[tuple[str, str]]:
    """Checks the schema cannot express, as (JSON pointer, message); absent values are the schema's defaults."""
    p = with_defaults({"health": dict(values)}, "agent")["health"]
    if p["fail_after"] < p["interval"]:
        yield (f"{pointer}/fail_after", f"must be >= interval ({p['interval']:g}): two failed checks "
                                        "are needed to fail a shard")


@dataclass(frozen=True)
class EjectionPolicy:
    """When routers' ejection reports replace a replica (``server.yaml`` ``router_ejections``)."""

    min_routers: int = 2
    min_share: float = 0.5
    sick_after: float = 20.0
    report_ttl: float = 10.0
    replacements_per_minute: int = 2


@dataclass(frozen=True)
class RouterAllowance:
    """Slices of per-key limits leased to routers (``server.yaml`` ``router_allowance``)."""

    lease_seconds: float = 5.0


@dataclass(frozen=True)
class HASettings:
    """Leader election among control planes (``server.yaml`` ``ha``)."""

    endpoints: tuple[str, ...]
    ca: str | None = None
    cert: str | None = None
    key: str | None = None
    prefix: str = "/llmgw"
    name: str | None = None  # None: the host name
    advertise_url: str | None = None
    lease_ttl: int = 10
    renew_interval: float = 2.0
    max_loop_stall: float = 60.0  # the lease is renewed apart from the loop, but not for a wedged one

    @classmethod
    def from_config(cls, d: dict[str, Any]) -> "HASettings":
        """From the ``ha`` section with the schema's defaults filled in (``llmgw.schemadefaults``)."""
        etcd = d["etcd"]
        return cls(tuple(etcd["endpoints"]), etcd.get("ca"), etcd.get("cert"), etcd.get("key"),
                   etcd["prefix"], d.get("name"), d.get("advertise_url"),
                   int(d["lease_ttl"]), float(d["renew_interval"]), float(d["max_loop_stall"]))


@dataclass(frozen=True)
class FetchPolicy:
    """How the agent downloads https:// model sources (``agent.yaml`` ``fetch``)."""

    stall_timeout: float = 60.0
    attempts: int = 5
    backoff_initial: float = 2.0
    backoff_max: float = 60.0
    connect_timeout: float = 30.0
    progress_interval: float = 2.0
    checkpoint_bytes: int = 1 << 30
    insecure_http_hub: bool = False  # hf:// from a plain http:// hub_endpoint


@dataclass(frozen=True)
class ApiClients:
    """What one client may hold of the control plane's listener (``api.clients``; see ``llmgw.clientbounds``)."""

    head_timeout: float = 15.0
    body_grace: float = 10.0
    body_min_rate: int = 16384
    max_connections_per_source: int = 128
    anonymous_timeout: float = 5.0  # a connection with no client certificate: until a valid admin token

    def bounds(self) -> ClientBounds:
        return ClientBounds(self.head_timeout, self.body_grace, self.body_min_rate, self.max_connections_per_source)


@dataclass(frozen=True)
class ServerSettings:
    api_host: str
    api_port: int
    catalog: Catalog
    tls: TLSFiles | None
    insecure_no_tls: bool
    admin_tokens: tuple[tuple[str, str], ...]  # (name, sha256 hex)
    lifecycle: Lifecycle
    restart: RestartPolicy
    memory_headroom: float
    router: dict[str, Any] | None  # validated against router.schema.json; the router parses it
    router_ejections: EjectionPolicy = EjectionPolicy()
    router_allowance: RouterAllowance = RouterAllowance()
    api_clients: ApiClients = ApiClients()
    state_dir: str | None = None  # cordons, drains, epoch, grant secret; None: memory only (and an ephemeral grant secret)
    ha: HASettings | None = None  # leader election on etcd; None: the only control plane
    raw: dict[str, Any] = field(repr=False, default_factory=dict)


@dataclass(frozen=True)
class EngineTLS:
    """agent.yaml ``engine_tls``: the node's engine serving certificate and the engines given it."""

    cert: str
    key: str
    engines: tuple[str, ...] = ("vllm", "llamacpp")


@dataclass(frozen=True)
class AgentSettings:
    node_id: str
    control_plane_url: str
    reconnect_initial: float
    reconnect_max: float
    keepalive_interval: float
    tls: TLSFiles | None
    insecure_no_tls: bool
    state_dir: str
    model_dir: str
    advertise_address: str
    engine_bind_host: str
    engine_ports: tuple[int, int]
    allow_keyless_engines: bool
    gpu_source: str
    hardware_file: str | None
    sysfs_root: str
    fabrics: tuple[FabricDeclaration, ...]
    engine_commands: dict[str, tuple[str, ...]]
    fetch: FetchPolicy = field(default_factory=FetchPolicy)
    health: LivenessPolicy = field(default_factory=LivenessPolicy)
    rediscover_interval: float = 60.0  # discovery.interval: 0 = only when (re)connecting
    control_plane_urls: tuple[str, ...] = ()  # every control plane (ha); control_plane_url is the first
    engine_tls: EngineTLS | None = None  # None: engines serve plain HTTP
    raw: dict[str, Any] = field(repr=False, default_factory=dict)


def _tls(d: dict[str, Any] | None) -> TLSFiles | None:
    return TLSFiles(d["ca"], d["cert"], d["key"], d.get("revoked")) if d else None


# A semantic check runs only when the schema accepted every value it reads,
# so a typo in one section does not hide a broken invariant in another, and
# a schema-invalid value never produces a second, misleading error.
Check = Callable[[dict[str, Any]], list[ConfigError]]


def _touches(pointer: str, reads: tuple[str, ...]) -> bool:
    """Whether a schema error at ``pointer`` concerns a value under one of ``reads``.

    An error at an ancestor counts too: ``/control_plane: 'url' is a required
    property`` is about ``/control_plane/url``, and a root-level error (the
    document is not a mapping, a required section is missing) about all.
    """
    return pointer == "" or any(
        pointer == r or pointer.startswith(r + "/") or r.startswith(pointer + "/") for r in reads)


def _run_checks(doc: Any, schema: Sequence[ConfigError],
                checks: list[tuple[tuple[str, ...], Check]]) -> list[ConfigError]:
    """Every check whose inputs (JSON pointers) the schema accepted."""
    if not isinstance(doc, dict):
        return []
    errors: list[ConfigError] = []
    for reads, check in checks:
        if any(_touches(e.pointer, reads) for e in schema):
            continue
        try:
            errors += check(doc)
        except (KeyError, TypeError, AttributeError, ValueError):
            # A shape the schema reported where the check did not expect it
            # (an error at a pointer not among ``reads``): that error stands
            # alone.  On a schema-valid document this is a bug, so re-raise.
            if not schema:
                raise
    return errors


def _lifecycle_errors(doc: dict[str, Any]) -> list[ConfigError]:
    errors: list[ConfigError] = []
    lc = doc["lifecycle"]
    if lc["unreachable_after"] <= lc["keepalive_interval"] + lc["heartbeat_interval"]:
        errors.append(ConfigError(
            "/lifecycle/unreachable_after",
            f"must exceed keepalive_interval + heartbeat_interval "
            f"({lc['keepalive_interval']} + {lc['heartbeat_interval']} = "
            f"{lc['keepalive_interval'] + lc['heartbeat_interval']}), got {lc['unreachable_after']}: "
            "a healthy node would be declared unreachable between two heartbeats"))
    if lc["lost_after"] <= lc["unreachable_after"]:
        errors.append(ConfigError(
            "/lifecycle/lost_after",
            f"must exceed unreachable_after ({lc['unreachable_after']}), got {lc['lost_after']}"))
    return errors


def _restart_errors(doc: dict[str, Any]) -> list[ConfigError]:
    rs = doc["restart"]
    if rs["backoff_max"] < rs["backoff_initial"]:
        return [ConfigError("/restart/backoff_max", f"must be >= backoff_initial ({rs['backoff_initial']})")]
    return []


def _server_tls_errors(doc: dict[str, Any]) -> list[ConfigError]:
    if not doc.get("insecure_no_tls") and "tls" not in doc:
        return [ConfigError("/tls", "required unless insecure_no_tls is true: "
                            "the agent stream and API need mutual TLS")]
    return []


def _duplicate_names(section: str) -> Check:
    def check(doc: dict[str, Any]) -> list[ConfigError]:
        errors = []
        seen: dict[str, int] = {}
        for i, item in enumerate(doc.get(section, ())):
            if item["name"] in seen:
                errors.append(ConfigError(f"/{section}/{i}/name",
                                          f"duplicate name {item['name']!r} (first at /{section}/{seen[item['name']]})"))
            seen.setdefault(item["name"], i)
        return errors
    return check


def _served_name_errors(doc: dict[str, Any]) -> list[ConfigError]:
    errors = []
    served: dict[str, int] = {}
    for i, m in enumerate(doc.get("models", ())):
        name = m.get("served_name", m["name"])
        if name in served:
            errors.append(ConfigError(f"/models/{i}/served_name",
                                      f"served name {name!r} already used by /models/{served[name]}"))
        served.setdefault(name, i)
    return errors


def _source_errors(doc: dict[str, Any]) -> list[ConfigError]:
    """Repository sources the agent could not fetch: a mirror URL it cannot turn into file URLs, a bad hf:// id."""
    from llmgw.repository import HUB_PREFIX, is_repository_url, parse_hub_source, repository_url_problem

    errors = []
    for i, m in enumerate(doc.get("models", ())):
        src = m["source"]
        if is_repository_url(src):
            problem = repository_url_problem(src)
            if problem:
                errors.append(ConfigError(f"/models/{i}/source", problem))
        if src.startswith(HUB_PREFIX):
            try:
                parse_hub_source(src)
            except ValueError as e:
                errors.append(ConfigError(f"/models/{i}/source", str(e)))
            if "sha256" in m:
                errors.append(ConfigError(f"/models/{i}/sha256", "an hf:// source is pinned by its revision "
                                          "(a commit), and every file is checked against the hub's digests"))
        elif "hub_endpoint" in m:
            errors.append(ConfigError(f"/models/{i}/hub_endpoint", f"only for an hf:// source, not {src!r}"))
    return errors


def _reference_errors(doc: dict[str, Any]) -> list[ConfigError]:
    errors = []
    models = {m["name"] for m in doc.get("models", ())}
    profiles = {p["name"] for p in doc.get("profiles", ())}
    pairs: dict[tuple[str, str], int] = {}
    for i, d in enumerate(doc.get("deployments", ())):
        if d["model"] not in models:
            errors.append(ConfigError(f"/deployments/{i}/model",
                                      f"unknown model {d['model']!r}; declared: {', '.join(sorted(models)) or 'none'}"))
        if d["profile"] not in profiles:
            errors.append(ConfigError(f"/deployments/{i}/profile",
                                      f"unknown profile {d['profile']!r}; declared: {', '.join(sorted(profiles)) or 'none'}"))
        key = (d["model"], d["profile"])
        if key in pairs:
            errors.append(ConfigError(f"/deployments/{i}", f"{key[0]}/{key[1]} already declared at /deployments/{pairs[key]}"))
        pairs.setdefault(key, i)
    return errors


def _autoscale_errors(doc: dict[str, Any]) -> list[ConfigError]:
    """What the schema cannot say about an ``autoscale`` block: bounds and windows in order."""
    errors = []
    for i, d in enumerate(doc.get("deployments", ())):
        a = d.get("autoscale")
        if not isinstance(a, dict):
            continue
        where = f"/deployments/{i}/autoscale"
        if a["min"] > a["max"]:
            errors.append(ConfigError(f"{where}/min", f"{a['min']} is more than max ({a['max']})"))
        if a["panic_window"] > a["stable_window"]:
            errors.append(ConfigError(f"{where}/panic_window", f"{a['panic_window']}s is longer than "
                                      f"stable_window ({a['stable_window']}s): the panic window is the short one"))
        if a["min"] < 1 and a["signal"] != "outstanding":  # at zero only the routers see a request
            errors.append(ConfigError(f"{where}/min", (
                f"{a['signal']} is read from the deployment's engines: min must be at least 1 (with none "
                "running nothing can be read); scale from zero needs signal: outstanding")))
        elif a["min"] < 1 and isinstance(a.get("sleep"), dict):
            errors.append(ConfigError(f"{where}/min", (
                "min 0 stops the last replica where sleep keeps it asleep at min: choose one (min: 1 with "
                "sleep wakes in about a second; min: 0 starts a replica from scratch)")))
        if a["headroom"] and a["signal"] != "outstanding":
            errors.append(ConfigError(f"{where}/headroom", f"headroom counts spare requests in flight; signal "
                                      f"{a['signal']!r} is not a count of them (use signal: outstanding, or 0)"))
        if 0 < a["max_scale_up_rate"] <= 1:
            errors.append(ConfigError(f"{where}/max_scale_up_rate", f"{a['max_scale_up_rate']:g} would hold every "
                                      "scale-up at the replicas already serving: more than 1, or 0 for no cap"))
        if isinstance(a.get("sleep"), dict):
            errors += _sleep_errors(doc, d, f"{where}/sleep")
        errors += _signal_errors(doc, d, a, where)
    return errors


def _signal_errors(doc: dict[str, Any], dep: dict[str, Any], a: dict[str, Any], where: str) -> list[ConfigError]:
    """An engine signal needs an engine that exposes it (and one to read: ``min`` >= 1, checked by
    ``_autoscale_errors``); KV use is a fraction."""
    from llmgw.enginesignals import ENGINE_SIGNALS, KV_CACHE_USE, engines_for

    signal = a["signal"]
    if signal not in ENGINE_SIGNALS:
        return []
    errors = []
    engine = next((p.get("engine") for p in doc.get("profiles", ()) if p.get("name") == dep["profile"]), None)
    if isinstance(engine, str) and engine not in engines_for(signal):
        errors.append(ConfigError(f"{where}/signal", f"profile {dep['profile']!r} runs {engine}, whose metrics "
                                  f"have no {signal} (engines that have: {', '.join(engines_for(signal))}); "
                                  "use another signal or profile"))
    if signal == KV_CACHE_USE and a["target"] > 1:
        errors.append(ConfigError(f"{where}/target", f"{a['target']:g} is not a share of the KV cache: "
                                  "kv_cache_use's target is a fraction, at most 1 (e.g. 0.7)"))
    return errors


def _budget_errors(doc: dict[str, Any]) -> list[ConfigError]:
    """``autoscale_budget`` must hold every autoscaled deployment's min: the budget never cuts below one."""
    budget = doc.get("autoscale_budget")
    if not isinstance(budget, dict):
        return []
    profiles = {p["name"]: p for p in doc.get("profiles", ())}
    mins = 0
    for d in doc.get("deployments", ()):
        a, p = d.get("autoscale"), profiles.get(d["profile"])
        if isinstance(a, dict) and p is not None:
            mins += a["min"] * p["tensor_parallel_size"] * p["pipeline_parallel_size"]
    if mins > budget["gpus"]:
        return [ConfigError("/autoscale_budget/gpus", f"{budget['gpus']} GPU(s) cannot hold the autoscaled "
                            f"deployments' mins, which need {mins}: raise it or lower a min")]
    return []


def _disaggregation_errors(doc: dict[str, Any]) -> list[ConfigError]:
    """A deployment's count is ``replicas`` or its ``disaggregation`` groups; a pair needs an engine that can be one."""
    errors = []
    profiles = {p["name"]: p for p in doc.get("profiles", ())}
    for i, d in enumerate(doc.get("deployments", ())):
        where = f"/deployments/{i}"
        dis = d.get("disaggregation")
        if dis is None:
            if "replicas" not in d:
                errors.append(ConfigError(where, "needs replicas (or a disaggregation block giving each group's)"))
            continue
        if "replicas" in d:
            errors.append(ConfigError(f"{where}/replicas", "a disaggregated deployment counts replicas per group "
                                      "(disaggregation.prefill.replicas, disaggregation.decode.replicas); remove it"))
        if "autoscale" in d:
            errors.append(ConfigError(f"{where}/autoscale", "not with disaggregation: each group has a fixed count"))
        p = profiles.get(d["profile"])
        if p is None:
            continue  # the reference check names it
        if not get_adapter(p["engine"]).kv_transfer_capable:
            capable = ", ".join(sorted(n for n, a in ENGINES.items() if a.kv_transfer_capable))
            errors.append(ConfigError(f"{where}/disaggregation",
                                      f"profile {p['name']!r} runs {p['engine']}, whose driver cannot serve a "
                                      f"prefill/decode pair; only {capable} can"))
        elif p["nodes"] > 1:
            errors.append(ConfigError(f"{where}/disaggregation",
                                      f"profile {p['name']!r} spans {p['nodes']} nodes; a prefill/decode group "
                                      "runs on one node each"))
    return errors


def _sleep_errors(doc: dict[str, Any], dep: dict[str, Any], where: str) -> list[ConfigError]:
    """Scale to sleep only where the profile's engine can sleep (its adapter's ``sleep_capable``)."""
    from llmgw.engines import ENGINES

    engine = next((p.get("engine") for p in doc.get("profiles", ()) if p.get("name") == dep["profile"]), None)
    adapter = ENGINES.get(engine) if isinstance(engine, str) else None
    if adapter is None or adapter.sleep_capable:
        return []  # an unknown profile or engine is reported where it is named
    able = ", ".join(sorted(n for n, a in ENGINES.items() if a.sleep_capable))
    return [ConfigError(where, f"profile {dep['profile']!r} runs {engine}, which has no sleep mode "
                        f"(engines that sleep: {able}); drop `sleep` or use another profile")]


def _profile_errors(i: int) -> Check:
    """The engine adapter's checks of ``/profiles/i``, each problem at the key it is about."""
    def check(doc: dict[str, Any]) -> list[ConfigError]:
        p = doc["profiles"][i]
        try:
            validate_profile(Catalog.from_config({"profiles": [p]}).profiles[p["name"]])
        except ProfileError as e:
            return [ConfigError(f"/profiles/{i}/{path}" if path else f"/profiles/{i}", problem)
                    for problem, path in zip(e.problems, e.paths)]
        return []
    return check


def _router_errors(doc: dict[str, Any]) -> list[ConfigError]:
    """The in-process router's own rules (TLS or insecure_http, keys), pointed into /router."""
    if "router" not in doc:
        return []
    from llmgw.router.settings import semantic_errors

    return [ConfigError(f"/router{e.pointer}", e.message) for e in semantic_errors(doc["router"])]


def _state_dir_errors(doc: dict[str, Any]) -> list[ConfigError]:
    state_dir = doc.get("state_dir")
    if state_dir is not None and Path(state_dir).name == "grant.key":
        return [ConfigError("/state_dir", f"names a directory, not the key file: {state_dir!r} would hold "
                            f"{Path(state_dir) / 'grant.key'}; use {str(Path(state_dir).parent)!r}")]
    return []


def _server_semantic_errors(doc: Any, schema: Sequence[ConfigError] = ()) -> list[ConfigError]:
    doc = with_defaults(doc, "server")
    checks: list[tuple[tuple[str, ...], Check]] = [
        (("/lifecycle",), _lifecycle_errors),
        (("/restart",), _restart_errors),
        (("/insecure_no_tls", "/tls"), _server_tls_errors),
        (("/models",), _duplicate_names("models")),
        (("/profiles",), _duplicate_names("profiles")),
        (("/models",), _served_name_errors),
        (("/models",), _source_errors),
        (("/models", "/profiles", "/deployments"), _reference_errors),
        (("/deployments",), _autoscale_errors),
        (("/autoscale_budget", "/profiles", "/deployments"), _budget_errors),
        (("/profiles", "/deployments"), _disaggregation_errors),
        (("/router",), _router_errors),
        (("/state_dir",), _state_dir_errors),
        (("/ha",), _ha_errors),
    ]
    profiles = doc.get("profiles") if isinstance(doc, dict) else None
    if isinstance(profiles, list):
        checks += [((f"/profiles/{i}",), _profile_errors(i)) for i in range(len(profiles))]
    return _run_checks(doc, schema, checks)


def _ha_errors(doc: dict[str, Any]) -> list[ConfigError]:
    ha = doc.get("ha")
    if ha is None:
        return []
    out = []
    ttl, renew = ha["lease_ttl"], ha["renew_interval"]
    if renew * 2 > ttl:
        out.append(ConfigError("/ha/renew_interval", f"must be at most half of lease_ttl ({ttl}): the leader "
                                                       "must renew at least twice before it steps down"))
    if ha["max_loop_stall"] <= renew:
        out.append(ConfigError("/ha/max_loop_stall", f"must exceed renew_interval ({renew}): the event loop shows "
                                                     "its progress once a renew interval"))
    etcd = ha["etcd"]
    tls = [url for url in etcd["endpoints"] if url.startswith("https://")]
    if tls and "ca" not in etcd:
        out.append(ConfigError("/ha/etcd/ca", f"required: endpoint {tls[0]} is https://"))
    for i, url in enumerate(etcd["endpoints"]):
        host = urlsplit(url).hostname or ""
        if url.startswith("http://") and not _loopback(host):
            out.append(ConfigError(f"/ha/etcd/endpoints/{i}", f"{url} is plaintext on a non-loopback address; "
                                                               "use https:// with ca, cert and key"))
    if ("cert" in etcd) != ("key" in etcd):
        out.append(ConfigError("/ha/etcd/" + ("key" if "cert" in etcd else "cert"), "cert and key go together"))
    return out


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def parse_server_settings(doc: Any, source: str = "server.yaml") -> ServerSettings:
    schema = schema_errors(doc, "server")
    errors = schema + _server_semantic_errors(doc, schema)
    if errors:
        raise ConfigInvalid(source, errors)
    d = with_defaults(doc, "server")
    api = d["api"]
    return ServerSettings(
        api_host=api["listen"]["host"],
        api_port=api["listen"]["port"],
        catalog=Catalog.from_config(d),
        tls=_tls(d.get("tls")),
        insecure_no_tls=bool(d["insecure_no_tls"]),
        admin_tokens=tuple((t["name"], t["sha256"]) for t in api.get("admin_tokens", ())),
        lifecycle=Lifecycle(**d["lifecycle"]),
        restart=RestartPolicy(**d["restart"]),
        memory_headroom=float(d["placement"]["memory_headroom"]),
        router=doc.get("router"),  # as written: the router fills its own defaults
        router_ejections=EjectionPolicy(**d["router_ejections"]),
        router_allowance=RouterAllowance(**d["router_allowance"]),
        api_clients=ApiClients(**api["clients"]),
        state_dir=d.get("state_dir"),
        ha=HASettings.from_config(d["ha"]) if "ha" in d else None,
        raw=doc,
    )


def _agent_tls_errors(doc: dict[str, Any]) -> list[ConfigError]:
    if not doc.get("insecure_no_tls") and "tls" not in doc:
        return [ConfigError("/tls", "required unless insecure_no_tls is true")]
    return []


def _engine_tls_errors(doc: dict[str, Any]) -> list[ConfigError]:
    if "engine_tls" in doc and "tls" not in doc:
        return [ConfigError("/engine_tls", "needs the tls section: routers and the agent verify engines "
                                           "against its ca, the fleet CA that issued the engine certificate")]
    return []


def _agent_url_errors(doc: dict[str, Any]) -> list[ConfigError]:
    insecure = bool(doc.get("insecure_no_tls"))
    url = doc["control_plane"]["url"]
    urls = [("/control_plane/url", url)] if isinstance(url, str) else [
        (f"/control_plane/url/{i}", u) for i, u in enumerate(url)]
    out = []
    for pointer, u in urls:
        if not insecure and u.startswith("ws://"):
            out.append(ConfigError(pointer, "ws:// is plaintext; use wss:// (or set insecure_no_tls for development)"))
        if insecure and u.startswith("wss://"):
            out.append(ConfigError(pointer, "insecure_no_tls is set but the URL is wss://"))
    return out


def _reconnect_errors(doc: dict[str, Any]) -> list[ConfigError]:
    cp = doc["control_plane"]
    if cp["reconnect_max"] < cp["reconnect_initial"]:
        return [ConfigError("/control_plane/reconnect_max", "must be >= reconnect_initial")]
    return []


def _fetch_errors(doc: dict[str, Any]) -> list[ConfigError]:
    fetch = doc["fetch"]
    if fetch["backoff_max"] < fetch["backoff_initial"]:
        return [ConfigError("/fetch/backoff_max", f"must be >= backoff_initial ({fetch['backoff_initial']})")]
    return []


def _health_errors(doc: dict[str, Any]) -> list[ConfigError]:
    return [ConfigError(pointer, message) for pointer, message in policy_errors(doc["health"])]


def _engine_ports_errors(doc: dict[str, Any]) -> list[ConfigError]:
    ports = doc.get("engine_ports")
    if ports and ports["last"] < ports["first"]:
        return [ConfigError("/engine_ports/last", f"must be >= first ({ports['first']})")]
    return []


def _fabric_errors(doc: dict[str, Any]) -> list[ConfigError]:
    errors = []
    seen: dict[str, int] = {}
    for i, f in enumerate(doc.get("fabrics", ())):
        if f["name"] in seen:
            errors.append(ConfigError(f"/fabrics/{i}/name", f"duplicate fabric {f['name']!r}"))
        seen.setdefault(f["name"], i)
    from llmgw.hardware.fabric_rules import declaration_errors

    errors += [ConfigError(pointer, message) for pointer, message in declaration_errors(doc.get("fabrics", ()))]
    return errors


def _agent_semantic_errors(doc: Any, schema: Sequence[ConfigError] = ()) -> list[ConfigError]:
    doc = with_defaults(doc, "agent")
    return _run_checks(doc, schema, [
        (("/insecure_no_tls", "/tls"), _agent_tls_errors),
        (("/tls", "/engine_tls"), _engine_tls_errors),
        (("/insecure_no_tls", "/control_plane/url"), _agent_url_errors),
        (("/control_plane/reconnect_initial", "/control_plane/reconnect_max"), _reconnect_errors),
        (("/fetch",), _fetch_errors),
        (("/health",), _health_errors),
        (("/engine_ports",), _engine_ports_errors),
        (("/fabrics",), _fabric_errors),
    ])


def parse_agent_settings(doc: Any, source: str = "agent.yaml") -> AgentSettings:
    schema = schema_errors(doc, "agent")
    errors = schema + _agent_semantic_errors(doc, schema)
    if errors:
        raise ConfigInvalid(source, errors)
    d = with_defaults(doc, "agent")
    state_dir = d["state_dir"]
    disc = d["discovery"]
    cp = d["control_plane"]
    advertise = d["advertise_address"]
    etls = d.get("engine_tls")
    return AgentSettings(
        node_id=d["node_id"],
        control_plane_url=_urls(cp["url"])[0],
        control_plane_urls=_urls(cp["url"]),
        reconnect_initial=float(cp["reconnect_initial"]),
        reconnect_max=float(cp["reconnect_max"]),
        keepalive_interval=float(cp["keepalive_interval"]),
        tls=_tls(d.get("tls")),
        insecure_no_tls=bool(d["insecure_no_tls"]),
        state_dir=state_dir,
        # derived from other keys, so not a schema default (the schema's descriptions say so)
        model_dir=d.get("model_dir") or str(Path(state_dir) / "models"),
        advertise_address=advertise,
        # the fleet address, not every interface: nothing else on the node's networks reaches an engine
        engine_bind_host=d.get("engine_bind_host") or advertise,
        allow_keyless_engines=bool(d["allow_keyless_engines"]),
        engine_ports=(d["engine_ports"]["first"], d["engine_ports"]["last"]),
        gpu_source=disc["gpus"],
        hardware_file=disc.get("hardware_file"),
        sysfs_root=disc["sysfs_root"],
        fabrics=tuple(FabricDeclaration(
            f["name"], tuple(f["hcas"]), f.get("min_rate_gbps"), f.get("link_layer"),
            tuple((name, tuple(sorted(ident.items()))) for name, ident in sorted(f.get("identities", {}).items())))
            for f in d.get("fabrics", ())),
        engine_commands={k: tuple(v) for k, v in d.get("engines", {}).items()},
        fetch=FetchPolicy(**d["fetch"]),
        health=LivenessPolicy(**{k: float(v) for k, v in d["health"].items()}),
        rediscover_interval=float(disc["interval"]),
        engine_tls=EngineTLS(etls["cert"], etls["key"], tuple(etls["engines"])) if etls else None,
        raw=doc,
    )


def _urls(url: str | list[str]) -> tuple[str, ...]:
    return (url,) if isinstance(url, str) else tuple(url)


def load_server_settings(path: str | Path) -> ServerSettings:
    return parse_server_settings(read_yaml(path), str(path))


def load_agent_settings(path: str | Path) -> AgentSettings:
    return parse_agent_settings(read_yaml(path), str(path))
