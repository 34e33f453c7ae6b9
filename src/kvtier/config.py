"""One config object, in vLLM's shape, validated with errors that name the field.

A user of vLLM's native offloading switches by changing the connector name: `cpu_bytes_to_use`,
`block_size`, `eviction_policy` and `secondary_tiers` mean what they mean there. TensorRT-LLM's names
(`host_cache_size`, `secondary_offload_min_priority`) are accepted as aliases where the meaning is the same.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import tempfile
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar, get_args
from urllib.parse import unquote, urlsplit

from pydantic import (
    AliasChoices,
    BaseModel,
    ConfigDict,
    Field,
    PositiveFloat,
    PositiveInt,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from kvtier.policies import POLICIES

PolicyName = Literal["lru", "arc", "s3fifo", "priority"]
assert set(get_args(PolicyName)) == set(POLICIES), "a policy registered in kvtier.policies needs its name here"
Priority = Annotated[int, Field(ge=0, le=100)]
DEFAULT_MAX_HOLD_S = 3600.0  # the guard's longest hold unless configured
LOAD_TIMEOUT_S = 10.0  # a tier's part of a load past this has failed: its blocks are recomputed
HOST = "host"  # the first tier's name
SHARED = "redis"  # the shared tier's name
MAX_TIMEOUT_S = 3600.0  # a socket timeout or a breaker's cooldown
MAX_CAP_S = 7 * 86400.0  # how long Redis keeps a lowered bound (an expiry in ms)


class ConfigError(ValueError):
    """A bad configuration; the message names the field. The CLI turns it into exit code 2."""


class _Strict(BaseModel):
    """Unknown keys are errors, and so are JSON's Infinity and NaN (Python's json reads them): a timeout or a rate
    that is not a finite number passes every bound check, then fails every call that uses it."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True, frozen=True, allow_inf_nan=False)


_M = TypeVar("_M", bound=_Strict)


class _Admission(_Strict):
    min_priority: Priority = 0
    max_write_bytes_per_s: PositiveInt | None = None  # transfer budget of the tier's write path


class AdmissionConfig(_Admission):
    """Who gets into a tier. Defaults admit everything."""

    min_sightings: PositiveInt = 1  # 2 = "store on the second sighting"


class DiskAdmissionConfig(_Admission):
    """A disk tier admits what host evicts. `auto`: on the first sighting while blocks offered to it come back,
    on the second otherwise, so that unique traffic does not write every block it evicts."""

    min_sightings: PositiveInt | Literal["auto"] = "auto"


class FsTierConfig(_Strict):
    """Local disk: one file per block under `root_dir/<namespace>/<rank>/`."""

    type: Literal["fs"]
    root_dir: Path
    max_bytes: PositiveInt
    n_read_threads: PositiveInt = 8
    n_write_threads: PositiveInt = 8
    load_timeout_s: PositiveFloat = LOAD_TIMEOUT_S  # the longest this tier's part of one load may take
    eviction_policy: PolicyName = "lru"
    write_policy: Literal["write_back", "write_through"] = "write_back"
    admission: DiskAdmissionConfig = DiskAdmissionConfig()
    o_direct: bool = True

    @field_validator("root_dir")
    @classmethod
    def _writable(cls, root: Path) -> Path:
        """Fail at startup, not at the first eviction: create the directory and write a probe file in it."""
        root = root.expanduser()
        try:
            root.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=root, prefix=".kvtier-probe-"):
                pass
        except OSError as exc:
            raise ValueError(f"not a writable directory: {root} ({exc.strerror or exc})") from None
        return root


class RedisTierConfig(_Strict):
    """The shared tier: blocks in Redis/Valkey, shared by every engine that uses the same url and key_prefix.

    TLS and credentials go in the URL as redis-py reads it (`rediss://user:password@host:6380/0`); the
    ssl_* fields are passed through to redis-py for certificates.
    """

    type: Literal["redis"]
    url: str = Field(repr=False)  # may hold a password: shown only through redact_url
    max_bytes: PositiveInt  # bound on all engines' values under key_prefix (headers included)
    key_prefix: str = Field("kvtier:", max_length=200)
    # Durations go to the socket layer and to Redis as ints: bounded, so that a huge one is refused here rather
    # than overflowing in every call.
    socket_timeout_s: float = Field(1.0, gt=0, le=MAX_TIMEOUT_S)  # one send or receive; slower is a failure
    connect_timeout_s: float = Field(0.5, gt=0, le=MAX_TIMEOUT_S)
    pool_size: PositiveInt = 16  # connections per worker; mover threads beyond it wait for one
    breaker_failures: PositiveInt = 3  # consecutive failures that open the circuit breaker
    breaker_cooldown_s: float = Field(2.0, gt=0, le=MAX_TIMEOUT_S)  # open this long, then one probe call
    oom_cap_s: float = Field(600.0, gt=0, le=MAX_CAP_S)  # how long a bound set by a put Redis refused for memory holds
    lookup_deadline_s: float = Field(0.1, gt=0, le=MAX_TIMEOUT_S)  # vLLM: a request waits this long for its lookup
    lookup_queue_depth: PositiveInt = 64  # vLLM: lookups in flight at most; past it a request goes on at once
    n_read_threads: PositiveInt = 8
    n_write_threads: PositiveInt = 4
    load_timeout_s: PositiveFloat = LOAD_TIMEOUT_S  # the longest this tier's part of one load may take
    write_policy: Literal["write_back", "write_through"] = "write_back"
    admission: AdmissionConfig = AdmissionConfig()
    ssl_ca_certs: Path | None = None
    ssl_certfile: Path | None = None
    ssl_keyfile: Path | None = None
    ssl_cert_reqs: Literal["required", "optional", "none"] = "required"
    # Without auth_key_env, whoever can write to this Redis decides what every engine serves: a tier without a key
    # is refused unless this says that only trusted clients can reach the server.
    trusted_network: bool = False
    # Redis Cluster: `url` is any node of it (the seed); the tier is cut into `partitions` accountings of
    # max_bytes / partitions each, spread over the primaries, and a chain lives in the partition its first
    # `partition_tokens` tokens pick (docs/scaling.md).
    cluster: bool = False
    partitions: int = Field(64, ge=1, le=16384)
    partition_tokens: PositiveInt = 1024

    @field_validator("url")
    @classmethod
    def _redis_url(cls, url: str) -> str:
        parts = urlsplit(url)
        if parts.scheme not in ("redis", "rediss", "unix") or not url.startswith(f"{parts.scheme}://"):
            raise ValueError("must start with redis://, rediss:// (TLS) or unix://")
        if parts.scheme != "unix" and not parts.hostname:
            raise ValueError("names no host")
        try:
            parts.port  # noqa: B018  (raises on a bad port)
        except ValueError:
            raise ValueError("has a bad port") from None
        return url

    @field_validator("ssl_ca_certs", "ssl_certfile", "ssl_keyfile")
    @classmethod
    def _tls_needs_rediss(cls, path: Path | None, info: ValidationInfo) -> Path | None:
        url = info.data.get("url")
        if path is not None and url is not None and urlsplit(url).scheme != "rediss":
            raise ValueError("needs a rediss:// url (TLS)")
        return path

    @model_validator(mode="after")
    def _cluster_keys(self) -> RedisTierConfig:
        if self.cluster and ("{" in self.key_prefix or "}" in self.key_prefix):
            raise ValueError("key_prefix: no '{' or '}' with cluster: true (the tier's own hash tags place its keys)")
        if self.cluster and urlsplit(self.url).scheme == "unix":
            raise ValueError("url: a Redis Cluster is reached over TCP (redis:// or rediss://), not a unix socket")
        return self

    def connection_kwargs(self) -> dict[str, Any]:
        """What RedisStore passes to redis-py beyond the URL: the TLS files, only when TLS is on."""
        if urlsplit(self.url).scheme != "rediss":
            return {}
        files = {name: str(getattr(self, name)) for name in ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile")
                 if getattr(self, name) is not None}
        return {**files, "ssl_cert_reqs": self.ssl_cert_reqs}


SecondaryTier = Annotated[FsTierConfig | RedisTierConfig, Field(discriminator="type")]


class GuardConfig(_Strict):
    """The rollback rule (`kvtier.guard`): a tier whose requests break a p99 budget, and do worse than the requests
    no tier served by `reference_margin`, in `breach_windows` of the last `of_windows` windows of `window_s` is
    turned off (read by nobody, written by nothing, its contents kept) for `hold_s`, times `hold_backoff` after
    each return that broke the budget again, at most `max_hold_s`; then `probe_share` of requests read it again,
    and it comes back once `breach_windows` probe windows in a row are within budget."""

    ttft_p99_ms: PositiveFloat | None = None
    itl_p99_ms: PositiveFloat | None = None
    window_s: PositiveFloat = 10.0
    breach_windows: PositiveInt = 3
    of_windows: PositiveInt = 5
    min_requests: PositiveInt = 20  # a window with fewer of a tier's requests says nothing about that tier
    hold_s: float = Field(60.0, ge=0)
    probe_share: float = Field(0.1, gt=0, le=1)
    order: list[str] | None = None  # when several tiers break the budget at once, the first here goes first
    # A tier is at fault only where its p99 is also above (1 + this) x the p99 of the window's requests no tier
    # served (engine hits and recomputes, when they are min_requests or more; else above the budget without the
    # engine's queue): an engine overloaded on its own breaks the budget for every source alike, and turning
    # tiers off would only add recompute work to it.
    reference_margin: float = Field(0.2, ge=0)
    hold_backoff: float = Field(2.0, ge=1)  # the hold grows by this after each return that broke the budget again
    # The longest hold (default: an hour, or hold_s if longer); a tier on this long after a return starts over.
    max_hold_s: float | None = Field(None, ge=0)

    @model_validator(mode="after")
    def _consistent(self) -> GuardConfig:
        if self.ttft_p99_ms is None and self.itl_p99_ms is None:
            raise ValueError("a guard needs a budget: ttft_p99_ms, itl_p99_ms or both")
        if self.breach_windows > self.of_windows:
            raise ValueError(f"breach_windows ({self.breach_windows}) exceeds of_windows ({self.of_windows})")
        if self.max_hold_s is not None and self.max_hold_s < self.hold_s:
            raise ValueError(f"max_hold_s ({self.max_hold_s:g}) is below hold_s ({self.hold_s:g})")
        return self

    def longest_hold(self) -> float:
        return self.max_hold_s if self.max_hold_s is not None else max(DEFAULT_MAX_HOLD_S, self.hold_s)


class KVTierConfig(_Strict):
    cpu_bytes_to_use: PositiveInt = Field(validation_alias=AliasChoices("cpu_bytes_to_use", "host_cache_size"))
    block_size: PositiveInt = 256  # tokens per kvtier block
    engine_block_size: PositiveInt = 16  # tokens per engine block; block_size must be a multiple of it
    eviction_policy: PolicyName = "lru"
    secondary_offload_min_priority: Priority = 0  # blocks below this priority are not offloaded at all
    admit_after_sightings: PositiveInt = 1
    secondary_tiers: list[SecondaryTier] = []
    queue_depth: PositiveInt = 64  # pending store jobs before stores are dropped (never blocking compute)
    shutdown_flush_s: float = Field(10.0, ge=0)  # a graceful shutdown writes the host's blocks to disk this long
    tenant_salt: str = ""
    # The name of an environment variable holding a secret: disk and redis blocks are signed with it, and only
    # blocks signed with it are served (anyone who can write root_dir or the Redis server could plant others).
    auth_key_env: str | None = Field(None, min_length=1)
    guard: GuardConfig | None = None
    # Per request, load a prefix only if its load is expected to beat recomputing it ("auto"), or always.
    load_policy: Literal["auto", "always"] = "auto"
    max_load_tokens: PositiveInt | None = None  # at most this many tokens loaded for one request
    prefill_tokens_per_s: PositiveFloat = 20_000  # the recompute speed assumed until the engine's is measured

    @field_validator("auth_key_env")
    @classmethod
    def _secret_is_there(cls, name: str | None) -> str | None:
        if name is not None:
            value = os.environ.get(name, "")
            if not value:
                raise ValueError(f"environment variable {name} is not set: it must hold the secret")
            if len(value.encode()) < 16:
                raise ValueError(f"environment variable {name} holds under 16 bytes: too short for a secret")
        return name

    def auth_key(self) -> bytes | None:
        """The key that signs blocks (derived from the secret, never the secret itself), or None."""
        if self.auth_key_env is None:
            return None
        secret = os.environ.get(self.auth_key_env, "").encode()
        return hashlib.blake2b(secret, digest_size=64, person=b"kvtier-key").digest()

    def auth_fingerprint(self) -> str:
        """What the namespace carries of the key: signed and unsigned deployments never share blocks."""
        key = self.auth_key()
        return "" if key is None else hashlib.blake2b(key, digest_size=8, person=b"kvtier-ns").hexdigest()

    @model_validator(mode="after")
    def _consistent(self) -> KVTierConfig:
        if self.block_size % self.engine_block_size:
            raise ValueError(
                f"block_size ({self.block_size}) must be a multiple of the engine's block size "
                f"({self.engine_block_size})"
            )
        roots = [t.root_dir.resolve() for t in self.secondary_tiers if t.type == "fs"]
        if len(set(roots)) != len(roots):
            raise ValueError("two fs tiers share one root_dir")
        shared = [(t.url, t.key_prefix) for t in self.secondary_tiers if t.type == "redis"]
        if len(set(shared)) != len(shared):
            raise ValueError("two redis tiers share one url and key_prefix")
        for i, tier in enumerate(self.secondary_tiers):
            if tier.type == "redis" and self.auth_key_env is None and not tier.trusted_network:
                raise ValueError(
                    f"secondary_tiers[{i}].trusted_network: a redis tier without auth_key_env serves any block that "
                    "whoever can write to that Redis puts there; set auth_key_env (blocks signed with a secret), or "
                    '"trusted_network": true on the tier if only trusted clients can reach the server')
        unknown = [name for name in (self.guard.order or []) if name not in self.tier_names()] if self.guard else []
        if unknown:
            raise ValueError(f"guard.order names {unknown}, not tiers of this config: {self.tier_names()}")
        return self

    def tier_names(self) -> list[str]:
        """Every tier's name: host, then one per entry of `secondary_tiers` ("disk", "disk1", ..., "redis")."""
        names, fs = [HOST], 0
        for tier in self.secondary_tiers:
            if tier.type == "fs":
                names.append("disk" if fs == 0 else f"disk{fs}")
                fs += 1
            else:
                names.append(SHARED)
        return names

    def redacted(self) -> dict[str, Any]:
        """The config as JSON data with every redis url's credentials replaced (`redact_url`): what may be shown."""
        data = self.model_dump(mode="json")
        for tier in data["secondary_tiers"]:
            if tier["type"] == "redis":
                tier["url"] = redact_url(tier["url"])
        return data

    @property
    def host_admission(self) -> AdmissionConfig:
        return AdmissionConfig(
            min_priority=self.secondary_offload_min_priority, min_sightings=self.admit_after_sightings
        )


# Query parameters of a redis url (redis-py passes each to the connection) that never hold a secret; any other's
# value (password=, or a name redis-py will learn later) is shown as ***.
PLAIN_URL_PARAMS = frozenset({"db", "protocol", "socket_timeout", "socket_connect_timeout", "socket_keepalive",
                              "retry_on_timeout", "max_connections", "health_check_interval", "ssl_cert_reqs",
                              "ssl_check_hostname", "client_name", "timeout"})


def redact_url(url: str) -> str:
    """`url` as it may be shown (errors, logs, `kvtier config`, the engine's startup line). The userinfo runs to the
    last '@' (a password may hold '/' or '@'): its password (all of it without a ':') is ***, and so is every query
    value but PLAIN_URL_PARAMS' and any fragment. A url that does not read as scheme://..., or whose last '@' may
    sit in its query, shows no more than its scheme."""
    scheme, sep, rest = url.partition("://")
    if not sep or not scheme.isalnum():
        scheme = url.partition(":")[0] if ":" in url else ""
        return f"{scheme}:***" if scheme.isalnum() else "***"
    userinfo, at, rest = rest.rpartition("@")
    if at:
        if any(c in userinfo for c in "?#"):
            return f"{scheme}://***"
        user, colon, _ = userinfo.partition(":")
        userinfo = f"{user}:***@" if colon and "/" not in user else "***@"
    try:
        parts = urlsplit(f"{scheme}://{rest}")
    except ValueError:
        return f"{scheme}://{userinfo}***"
    query = "&".join(item if unquote(item.partition("=")[0]) in PLAIN_URL_PARAMS else f"{item.partition('=')[0]}=***"
                     for item in parts.query.split("&") if item)
    return (f"{scheme}://{userinfo}{parts.netloc}{parts.path}" + (f"?{query}" if query else "")
            + ("#***" if parts.fragment else ""))


def finite_float(text: str) -> float:
    """argparse's type for every float flag: `float()` reads 'inf' and 'nan', which then pass every bound check."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
    return value


def _field_path(loc: tuple[Any, ...]) -> str:
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif part in ("fs", "redis"):
            continue  # the discriminator's tag is not a field
        else:
            path += f".{part}" if path else str(part)
    return path or "config"


def parse_config(data: dict[str, Any] | str | os.PathLike[str]) -> KVTierConfig:
    """Build a config from a dict, a JSON string or a JSON file, each either the `kv_connector_extra_config`
    object or a whole `--kv-transfer-config` holding it; raise ConfigError naming the bad field."""
    return _parse(KVTierConfig, data, "config")


def for_engine(data: dict[str, Any] | str | os.PathLike[str], engine_block_size: int) -> KVTierConfig:
    """`parse_config` as kvtier runs inside an engine whose KV blocks hold `engine_block_size` tokens (vLLM's
    `--block-size`): `block_size` defaults to it, and `engine_block_size` is it."""
    extra, source = _load(data, "config")
    extra = dict(extra.get("kv_connector_extra_config", extra))
    extra.setdefault("block_size", engine_block_size)
    if "engine_block_size" in extra and extra["engine_block_size"] != engine_block_size:
        raise ConfigError(f"{source}: engine_block_size: {extra['engine_block_size']} but vLLM's block size is "
                          f"{engine_block_size}")
    extra["engine_block_size"] = engine_block_size
    return parse_config(extra)


def parse_guard(data: dict[str, Any] | str | os.PathLike[str]) -> GuardConfig:
    """A config's `guard` object on its own (`kvtier simulate --guard`), as `parse_config` reads a config."""
    return _parse(GuardConfig, data, "guard")


def _parse(model: type[_M], data: dict[str, Any] | str | os.PathLike[str], what: str) -> _M:
    data, source = _load(data, what)
    if model is KVTierConfig and isinstance(data.get("kv_connector_extra_config"), dict):
        data = data["kv_connector_extra_config"]  # a whole --kv-transfer-config
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(f"invalid kvtier {what}: " + "; ".join(_problems(exc))) from None


def _load(data: dict[str, Any] | str | os.PathLike[str], what: str) -> tuple[dict[str, Any], str]:
    """A JSON object from a dict, a JSON string or a file, and what to call it in errors."""
    source = what
    if isinstance(data, (str, os.PathLike)):
        text = str(data)
        if not text.lstrip().startswith("{"):
            source = text
            try:
                text = Path(text).read_text()
            except OSError as exc:
                raise ConfigError(f"{source}: cannot read config file ({exc.strerror})") from None
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{source}: not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a JSON object, got {type(data).__name__}")
    return data, source


def _problems(exc: ValidationError) -> list[str]:
    """One line per bad field, naming it; never echoing credentials."""
    problems = []
    for err in exc.errors():
        field = _field_path(err["loc"])
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "union_tag_invalid":
            msg = f"unknown tier type {err.get('input', {}).get('type')!r}; known types: fs, redis"
        got = err.get("input")
        if isinstance(got, str) and field.endswith(".url"):
            got = redact_url(got)  # never echo credentials
        shown = "" if isinstance(got, (dict, list)) or err["type"] == "missing" else f" (got {got!r})"
        problems.append(f"{field}: {msg}{shown}")
    return problems
