"""Router settings: the validated ``router`` document as typed, defaulted values.

Schema validation (``router.schema.json``) catches shape errors; the checks
here are the ones a schema cannot express (relations between fields,
duplicates), reported the same way: every error at once, with its pointer.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Mapping

from llmgw.clientbounds import ClientBounds
from llmgw.config import ConfigError, ConfigInvalid, schema_errors
from llmgw.schemadefaults import with_defaults

from .endpoints import Endpoint, EndpointURLError


@dataclass(frozen=True)
class KeyRates:
    """One key's limits (on every model, or on one); None: not enforced."""

    requests_per_minute: int | None = None
    input_tokens_per_minute: int | None = None
    output_tokens_per_minute: int | None = None
    tokens_per_minute: int | None = None
    concurrent_requests: int | None = None
    tokens_per_day: int | None = None


@dataclass(frozen=True)
class KeyLimits:
    """A key's ``limits`` block (``router/limits.py`` enforces it)."""

    rates: KeyRates = field(default_factory=KeyRates)
    default_max_tokens: int = 1024
    window_seconds: float = 60.0
    per_model: Mapping[str, KeyRates] = field(default_factory=dict, hash=False)
    # what one cached prompt token counts in the token windows once settled (1: a whole token; 0: nothing)
    cached_prompt_weight: float = 1.0


@dataclass(frozen=True)
class ApiKey:
    name: str
    sha256: str  # lower-case hex digest of the key's bytes
    models: frozenset[str] | None  # None: every model
    limits: KeyLimits | None = None  # None: no limits and no usage accounting


@dataclass(frozen=True)
class ControlPlane:
    url: str  # the first of urls
    ca: str
    cert: str
    key: str
    urls: tuple[str, ...] = ()  # every control plane (ha), tried in turn
    revoked: str | None = None  # revocation list: a control plane whose certificate is on it is refused


@dataclass(frozen=True)
class TLS:
    cert: str
    key: str


@dataclass(frozen=True)
class Timeouts:
    connect: float = 2.0
    per_try: float = 600.0  # a non-streaming answer arrives whole: this bounds the longest generation
    total: float = 900.0
    first_token: float = 60.0
    inter_token: float = 30.0
    shutdown_grace: float = 30.0


@dataclass(frozen=True)
class Limits:
    max_body_bytes: int = 16 * 1024 * 1024
    max_concurrency_per_endpoint: int = 1024
    upstream_keepalive: float = 4.0


@dataclass(frozen=True)
class Disaggregation:
    """Two-phase serving of models with prefill endpoints (router/prefill.py)."""

    min_prompt_bytes: int = 4096  # a cheap gate before the decoder is chosen
    min_uncached_tokens: int = 512  # the prompt less what the chosen decoder caches (router/prefill.py)
    prefill_timeout: float = 30.0


@dataclass(frozen=True)
class Clients:
    """What one client may hold of the router (0 disables a cap); see ``llmgw.clientbounds``."""

    head_timeout: float = 15.0
    body_grace: float = 10.0
    body_min_rate: int = 16384
    max_connections_per_source: int = 1024
    max_requests_per_key: int = 512
    max_requests_per_source: int = 1024
    max_body_bytes_per_key: int = 64 * 1024 * 1024
    max_body_bytes_per_source: int = 64 * 1024 * 1024

    def bounds(self) -> ClientBounds:
        return ClientBounds(self.head_timeout, self.body_grace, self.body_min_rate, self.max_connections_per_source)


@dataclass(frozen=True)
class MetricsToken:
    name: str
    sha256: str


@dataclass(frozen=True)
class CacheAware:
    models: tuple[str, ...] = ()  # routed by route keys; the rest keep ``Balancing.scorer``
    tokenizer: str = "simulator"  # the only one so far: llmgw-engine-sim's
    block_size: int = 16
    max_prompt_tokens: int = 8192
    stale_after: float = 90.0
    # the model's own tokenizer (docs/router.md "Cache-aware routing"): model -> model directory
    model_tokenizers: Mapping[str, str] = field(default_factory=dict)
    tokenize_threads: int = 2
    tokenize_deadline: float = 0.1
    parity_timeout: float = 10.0


@dataclass(frozen=True)
class Balancing:
    scorer: str = "least-outstanding"  # or "prefix-affinity"
    prefix_tokens: int = 256
    load_bound: float = 1.25
    cache_aware: CacheAware = field(default_factory=CacheAware)

    @classmethod
    def from_doc(cls, doc: dict[str, Any]) -> "Balancing":
        ca = dict(doc.get("cache_aware") or {})
        ca["models"] = tuple(ca.get("models", ()))
        ca["model_tokenizers"] = dict(ca.get("model_tokenizers") or {})
        return cls(**{**doc, "cache_aware": CacheAware(**ca)})


@dataclass(frozen=True)
class Retries:
    max_attempts: int = 3
    budget_ratio: float = 0.2
    budget_min: int = 3
    budget_window: float = 10.0


@dataclass(frozen=True)
class Outlier:
    consecutive_errors: int = 5
    base_ejection: float = 10.0
    max_ejection: float = 300.0
    max_ejection_share: float = 0.5


@dataclass(frozen=True)
class Allowance:
    """How limited keys share their limits across routers and workers (``router/allowance.py``)."""

    mode: str = "shared"  # or "local"; shared needs control_plane
    on_outage: str = "serve"  # or "refuse"
    timeout: float = 2.0


@dataclass(frozen=True)
class Hold:
    """Bounds of the hold queue for sleeping models (``hold``; router/holdqueue.py)."""

    max_requests: int = 64  # requests held per model at once; one more is answered 503
    deadline: float = 30.0  # seconds a request is held at most; then 503 with Retry-After


@dataclass(frozen=True)
class RouterSettings:
    host: str = "127.0.0.1"
    port: int = 8080
    backlog: int = 1024
    workers: int = 1
    tls: TLS | None = None  # None: plain HTTP, only with insecure_http
    insecure_http: bool = False
    api_keys: tuple[ApiKey, ...] = ()
    api_keys_file: str | None = None  # merged into api_keys by router/cli.py's load (router/keysfile.py)
    usage_log: str | None = None  # the usage record limited keys' usage is appended to (router/usagelog.py)
    allow_unauthenticated: bool = False
    static_endpoints: tuple[Endpoint, ...] | None = None  # None: not configured
    control_plane: ControlPlane | None = None
    # verifies engines serving TLS; None: control_plane.ca, else the system's CAs (see engine_ca_file)
    engine_ca: str | None = None
    timeouts: Timeouts = field(default_factory=Timeouts)
    limits: Limits = field(default_factory=Limits)
    balancing: Balancing = field(default_factory=Balancing)
    retries: Retries = field(default_factory=Retries)
    outlier: Outlier = field(default_factory=Outlier)
    clients: Clients = field(default_factory=Clients)
    disaggregation: Disaggregation = field(default_factory=Disaggregation)
    metrics_tokens: tuple[MetricsToken, ...] = ()  # bearer tokens that may read /metrics
    access_log: bool = True
    allowance: Allowance = field(default_factory=Allowance)
    hold: Hold = field(default_factory=Hold)  # requests for a sleeping model (router/holdqueue.py)

    @property
    def engine_ca_file(self) -> str | None:
        """The CA that https:// engines must chain to: engine_ca, else the fleet CA of the watch."""
        if self.engine_ca is not None:
            return self.engine_ca
        return self.control_plane.ca if self.control_plane is not None else None

    @classmethod
    def from_config(cls, doc: Mapping[str, Any] | None, source: str = "router config") -> "RouterSettings":
        """Validate ``doc`` against schema ``router`` and build settings.

        Raises ``ConfigInvalid`` listing every problem with its JSON pointer
        (relative to the router document).
        """
        doc = {} if doc is None else doc
        errors = schema_errors(doc, "router")
        if errors:
            raise ConfigInvalid(source, errors)
        errors = semantic_errors(doc)
        if errors:
            raise ConfigInvalid(source, errors)
        return _build(with_defaults(doc, "router"))


def _first(url: str | list[str]) -> str:
    return url if isinstance(url, str) else url[0]


def semantic_errors(doc: Mapping[str, Any]) -> list[ConfigError]:
    """Cross-field rules; ``doc`` already passed the schema (absent keys are the schema's defaults)."""
    doc = with_defaults(doc, "router")
    errors: list[ConfigError] = []
    if "tls" not in doc and not doc["insecure_http"]:
        errors.append(ConfigError(
            "/tls",
            "no tls section: the router serves HTTPS; give it a certificate and key (fleet CA: "
            "llmgw ctl cert router) or set insecure_http: true to serve plain HTTP",
        ))
    if "tls" in doc and doc["insecure_http"]:
        errors.append(ConfigError("/insecure_http", "true while a tls section is set; remove one of them"))
    keys = doc.get("api_keys") or []
    if not keys and not doc["allow_unauthenticated"] and "api_keys_file" not in doc:
        errors.append(ConfigError(
            "/api_keys",
            "no API keys configured; add keys or set allow_unauthenticated: true to serve without them",
        ))
    errors += duplicate_key_errors(keys)
    for i, k in enumerate(keys):
        if "limits" in k:
            errors += key_limits_errors(k, f"/api_keys/{i}")
    if "static_endpoints" in doc and "control_plane" in doc:
        errors.append(ConfigError("/control_plane", "set either static_endpoints or control_plane, not both"))
    ids: dict[str, int] = {}
    for i, raw in enumerate(doc.get("static_endpoints") or []):
        where = f"/static_endpoints/{i}"
        try:
            ep = Endpoint.from_dict(raw, where=where)
        except ValueError as e:
            # a URL that urlsplit accepts but nothing can connect to (port 99999) points at the url key;
            # the pointer is the error's location, so the message does not repeat it
            at = f"{where}/url" if isinstance(e, EndpointURLError) else where
            errors.append(ConfigError(at, str(e).removeprefix(f"{where}: ")))
            continue
        if ep.id in ids:
            errors.append(ConfigError(f"/static_endpoints/{i}/id", f"duplicate endpoint id {ep.id!r} (also /static_endpoints/{ids[ep.id]})"))
        ids.setdefault(ep.id, i)
    t = doc["timeouts"]
    per_try, total, first = t["per_try"], t["total"], t["first_token"]
    if per_try > total:
        errors.append(ConfigError("/timeouts/per_try", f"per_try ({per_try}) exceeds total ({total})"))
    if first > total:
        errors.append(ConfigError("/timeouts/first_token", f"first_token ({first}) exceeds total ({total})"))
    limit = doc["limits"]["max_body_bytes"]
    for name in ("max_body_bytes_per_key", "max_body_bytes_per_source"):
        cap = doc["clients"][name]
        if cap and cap < limit:
            errors.append(ConfigError(f"/clients/{name}", f"{cap} is below limits.max_body_bytes ({limit}): "
                                      "a body of the largest size allowed could never be admitted"))
    token_names: dict[str, int] = {}
    for i, t in enumerate(doc.get("metrics_tokens") or []):
        if t["name"] in token_names:
            errors.append(ConfigError(f"/metrics_tokens/{i}/name",
                                      f"duplicate token name {t['name']!r} (also /metrics_tokens/{token_names[t['name']]})"))
        token_names.setdefault(t["name"], i)
    cache_aware = (doc.get("balancing") or {}).get("cache_aware") or {}
    if cache_aware.get("models") and not doc.get("control_plane"):
        errors.append(ConfigError("/balancing/cache_aware/models", "cache-aware routing reads route keys on the "
                                  "control plane's watch: set control_plane (a router without one, or the "
                                  "in-process router of llmgw server, is fed none)"))
    errors += _tokenizer_errors(cache_aware)
    o = doc["outlier"]
    if o["base_ejection"] > o["max_ejection"]:
        errors.append(ConfigError("/outlier/base_ejection", "base_ejection exceeds max_ejection"))
    return errors


def _tokenizer_errors(cache_aware: Mapping[str, Any]) -> list[ConfigError]:
    """Each model tokenizer listed, loadable on this host, for a model routed cache-aware."""
    errors: list[ConfigError] = []
    dirs = cache_aware.get("model_tokenizers") or {}
    if not dirs:
        return errors
    from .tokenize_model import EXTRA, ModelTokenizer, TokenizerSourceError

    try:
        import jinja2  # noqa: F401
        import tokenizers  # noqa: F401
    except ImportError as e:
        return [ConfigError("/balancing/cache_aware/model_tokenizers",
                            f"the router needs the {e.name} package for a model's own tokenizer: "
                            f"install llmgw[{EXTRA}]")]
    models = set(cache_aware.get("models") or ())
    for model, directory in dirs.items():
        pointer = "/balancing/cache_aware/model_tokenizers/" + model.replace("~", "~0").replace("/", "~1")
        if model not in models:
            errors.append(ConfigError(pointer, f"{model!r} is not in balancing.cache_aware.models: its "
                                      "tokenizer would never be used"))
            continue
        try:
            ModelTokenizer.from_directory(directory)  # loaded and compiled: a bad file fails here, by pointer
        except TokenizerSourceError as e:
            errors.append(ConfigError(pointer, str(e)))
    return errors


_RATES = tuple(f.name for f in fields(KeyRates))
_TOKEN_RATES = ("output_tokens_per_minute", "tokens_per_minute", "tokens_per_day")


def duplicate_key_errors(keys: list[Any]) -> list[ConfigError]:
    """A key name or digest given twice in ``api_keys`` (``router.yaml``'s or a keys file's):
    which entry is in force must never be a question. Entries of the wrong shape are skipped
    (the schema reports them)."""
    errors: list[ConfigError] = []
    names: dict[str, int] = {}
    hashes: dict[str, int] = {}
    for i, k in enumerate(keys):
        if not isinstance(k, dict):
            continue
        name, digest = k.get("name"), k.get("sha256")
        if isinstance(name, str):
            if name in names:
                errors.append(ConfigError(f"/api_keys/{i}/name", f"duplicate key name {name!r} (also /api_keys/{names[name]})"))
            names.setdefault(name, i)
        if isinstance(digest, str):
            if digest in hashes:
                errors.append(ConfigError(f"/api_keys/{i}/sha256", f"same key hash as /api_keys/{hashes[digest]}"))
            hashes.setdefault(digest, i)
    return errors


def key_limits_errors(key: Mapping[str, Any], where: str) -> list[ConfigError]:
    """A per-model block for a model the key may not use, or a default reservation no window could hold."""
    errors: list[ConfigError] = []
    lim = key["limits"]
    default = lim["default_max_tokens"]
    models = key["models"]
    blocks = [(f"{where}/limits", lim)]
    for model, rates in (lim.get("per_model") or {}).items():
        at = f"{where}/limits/per_model/{_pointer_token(model)}"
        if models != "*" and model not in models:
            errors.append(ConfigError(at, f"model {model!r} is not among this key's models"))
        blocks.append((at, rates))
    for at, rates in blocks:
        for name in _TOKEN_RATES:
            if name in rates and rates[name] < default:
                errors.append(ConfigError(
                    f"{at}/{name}", f"{rates[name]} is below default_max_tokens ({default}): a request that "
                    "sets no max_tokens could never be admitted; lower default_max_tokens"))
    return errors


def _pointer_token(name: str) -> str:
    return name.replace("~", "~0").replace("/", "~1")


def _key_limits(raw: Mapping[str, Any] | None) -> KeyLimits | None:
    if raw is None:
        return None
    return KeyLimits(
        rates=KeyRates(**{n: raw.get(n) for n in _RATES}),
        default_max_tokens=raw["default_max_tokens"],
        window_seconds=float(raw["window_seconds"]),
        cached_prompt_weight=float(raw["cached_prompt_weight"]),
        per_model={m: KeyRates(**{n: r.get(n) for n in _RATES}) for m, r in (raw.get("per_model") or {}).items()},
    )


def _build(doc: Mapping[str, Any]) -> RouterSettings:
    """Settings from a valid document with the schema's defaults filled in."""
    listen = doc["listen"]
    keys = tuple(
        ApiKey(
            name=k["name"],
            sha256=k["sha256"],
            models=None if k["models"] == "*" else frozenset(k["models"]),
            limits=_key_limits(k.get("limits")),
        )
        for k in doc.get("api_keys") or []
    )
    static = None
    if "static_endpoints" in doc:
        static = tuple(
            Endpoint.from_dict(raw, where=f"/static_endpoints/{i}")
            for i, raw in enumerate(doc["static_endpoints"])
        )
    cp = doc.get("control_plane")
    tls = doc.get("tls")
    return RouterSettings(
        host=listen["host"],
        port=listen["port"],
        backlog=listen["backlog"],
        workers=doc["workers"],
        tls=TLS(tls["cert"], tls["key"]) if tls else None,
        insecure_http=doc["insecure_http"],
        api_keys=keys,
        api_keys_file=doc.get("api_keys_file"),
        usage_log=doc.get("usage_log"),
        allow_unauthenticated=doc["allow_unauthenticated"],
        static_endpoints=static,
        control_plane=ControlPlane(_first(cp["url"]), cp["ca"], cp["cert"], cp["key"],
                                   urls=(cp["url"],) if isinstance(cp["url"], str) else tuple(cp["url"]),
                                   revoked=cp.get("revoked")) if cp else None,
        engine_ca=doc.get("engine_ca"),
        timeouts=Timeouts(**doc["timeouts"]),
        limits=Limits(**doc["limits"]),
        balancing=Balancing.from_doc(doc["balancing"]),
        retries=Retries(**doc["retries"]),
        outlier=Outlier(**doc["outlier"]),
        clients=Clients(**doc["clients"]),
        disaggregation=Disaggregation(**doc["disaggregation"]),
        hold=Hold(max_requests=doc["hold"]["max_requests"], deadline=float(doc["hold"]["deadline"])),
        metrics_tokens=tuple(MetricsToken(t["name"], t["sha256"]) for t in doc.get("metrics_tokens") or ()),
        access_log=doc["access_log"],
        allowance=Allowance(**doc["allowance"]),
    )
