"""Settings, from ``FULMEN_*`` environment variables (and a ``.env`` file), in shared sections.

A variable is ``FULMEN_<SECTION>_<FIELD>``: ``FULMEN_KAFKA_BOOTSTRAP``, ``FULMEN_CLICKHOUSE_URL``,
``FULMEN_BROKER_PORT``, ``FULMEN_LOG_LEVEL``. Each process builds one settings class from the sections it needs
(:class:`FulmenSettings` has the shared ones; a process-specific class subclasses it and adds its own).

Local mode is the default: with no ``FULMEN_KAFKA_BOOTSTRAP`` Fulmen starts a single-node Kafka itself, and with
no ``FULMEN_CLICKHOUSE_URL`` it uses the embedded ClickHouse engine (chdb) at ``FULMEN_CLICKHOUSE_PATH``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

__all__ = [
    "BrokerSettings",
    "CliProcessSettings",
    "CliSettings",
    "ClickHouseSettings",
    "DashboardProcessSettings",
    "DashboardSettings",
    "FulmenSettings",
    "KafkaSettings",
    "LogSettings",
    "MetricsSettings",
    "default_home",
]


def default_home() -> Path:
    """Where local state lives unless ``FULMEN_HOME`` says otherwise."""
    return Path.home() / ".local" / "share" / "fulmen"


class KafkaSettings(BaseModel):
    """How clients reach Kafka. With ``bootstrap`` unset, the local broker (``broker`` section) is used."""

    bootstrap: str | None = Field(default=None, description="host:port[,host:port]; unset = start a local broker")
    topic_prefix: str = Field(
        default="",
        pattern=r"^[A-Za-z0-9._\-]*$",
        description="prefix of every topic name and of Fulmen's consumer groups (several installations on one cluster)",
    )
    client_id: str = Field(
        default="fulmen", description="the client id every Fulmen client sends (in broker logs and quotas)"
    )
    security_protocol: Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"] = Field(
        default="PLAINTEXT", description="client security for the cluster FULMEN_KAFKA_BOOTSTRAP names"
    )
    sasl_mechanism: Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512", "OAUTHBEARER"] | None = Field(
        default=None, description="SASL_PLAINTEXT/SASL_SSL: how clients authenticate"
    )
    sasl_username: str | None = Field(default=None, description="SASL: the user name")
    sasl_password: SecretStr | None = Field(default=None, description="SASL: the password (a secret: never printed)")
    ssl_cafile: Path | None = Field(
        default=None, description="SSL: the CA bundle that signed the brokers' certificates"
    )
    ssl_certfile: Path | None = Field(default=None, description="SSL: this client's certificate (mutual TLS)")
    ssl_keyfile: Path | None = Field(default=None, description="SSL: this client's private key (mutual TLS)")
    replication_factor: int | None = Field(default=None, ge=1, description="unset = min(3, brokers)")
    request_timeout_ms: int = Field(
        default=30_000, ge=1000, description="how long a client waits for a broker's reply to a request"
    )
    connect_timeout_s: float = Field(default=15.0, gt=0, description="how long to wait for a broker to answer")
    compression: Literal["none", "gzip", "snappy", "lz4", "zstd"] = Field(
        default="zstd", description="codec of every record batch Fulmen produces (consumers read any codec)"
    )
    client: Literal["aiokafka", "librdkafka"] = Field(
        default="aiokafka",
        description="the library of Fulmen's producers (the runner's events, spans and dead letters, the gateways' "
        "spans): librdkafka does the protocol work in C threads, and measured slower than aiokafka on every path on "
        "two cores (docs/benchmarks.md); consumers are aiokafka's either way",
    )

    @field_validator("bootstrap")
    @classmethod
    def _bootstrap_has_ports(cls, value: str | None) -> str | None:
        if value is None or value.strip() == "":
            return None
        for server in value.split(","):
            host, _, port = server.strip().rpartition(":")
            if not host or not port.isdigit():
                raise ValueError(f"{server!r} is not host:port (FULMEN_KAFKA_BOOTSTRAP=host:9092[,host2:9092])")
        return value


class BrokerSettings(BaseModel):
    """The local Apache Kafka (KRaft) that Fulmen starts when no bootstrap is given: one node, or a cluster of
    ``nodes`` (each a broker and a controller in its own JVM; node i listens on ``port + 2(i-1)`` and
    ``controller_port + 2(i-1)``)."""

    version: str = Field(
        default="4.1.1", pattern=r"^4\.\d+\.\d+$", description="Apache Kafka version of the local broker"
    )
    host: str = Field(default="127.0.0.1", description="the address the local broker listens on")
    port: int = Field(default=9092, ge=1, le=65535, description="client port of the local broker (node 1)")
    controller_port: int = Field(default=9093, ge=1, le=65535, description="KRaft controller port (node 1)")
    nodes: int = Field(default=1, ge=1, le=9, description="local KRaft nodes; 3 = replication factor 3, min ISR 2")
    data_dir: Path | None = Field(default=None, description="default: $FULMEN_HOME/kafka")
    cache_dir: Path = Field(
        default_factory=lambda: Path.home() / ".cache" / "fulmen", description="where the Kafka jars are cached"
    )
    heap: str = Field(default="768m", pattern=r"^\d+[mMgG]$", description="JVM heap of each node")
    start_timeout_s: float = Field(default=60.0, gt=0, description="how long the local broker may take to start")

    def node_ports(self) -> list[tuple[int, int]]:
        """(client port, controller port) of each local node, node 1 first."""
        return [(self.port + 2 * i, self.controller_port + 2 * i) for i in range(self.nodes)]


class ClickHouseSettings(BaseModel):
    """The store: a ClickHouse server when ``url`` is set, else the embedded engine at ``path``."""

    url: SecretStr | None = Field(default=None, description="http(s)://user:password@host:8123/db")
    path: Path | None = Field(default=None, description="embedded store directory; default $FULMEN_HOME/chdb")
    database: str = Field(
        default="fulmen", pattern=r"^[A-Za-z_][A-Za-z0-9_]*$", description="database of Fulmen's tables"
    )
    read_host: str = Field(default="127.0.0.1", description="where the owner of the embedded store serves reads")
    read_port: int = Field(default=8124, ge=0, le=65535, description="0 = do not serve reads")
    read_token: SecretStr | None = Field(
        default=None, description="bearer token the read endpoint requires (required when read_host is not loopback)"
    )
    read_url: SecretStr | None = Field(
        default=None, description="a ClickHouse server: connect reads as this (readonly) user instead of url's"
    )
    # Limits of every read-only query (fulmen sql, the read endpoint): a read never runs unbounded.
    read_max_execution_s: float = Field(default=30.0, gt=0, description="a read is cancelled after this long")
    read_max_memory_bytes: int = Field(default=2 * 1024**3, gt=0, description="memory one read may use")
    read_max_result_rows: int = Field(default=1_000_000, gt=0, description="rows one read may return")
    read_max_result_bytes: int = Field(default=256 * 1024**2, gt=0, description="bytes one read may return")
    read_max_threads: int = Field(default=1, ge=1, description="engine threads per read (ingestion keeps the rest)")
    read_concurrency: int = Field(default=2, ge=1, le=64, description="reads run at once; more wait their turn")
    # The embedded engine's memory (a server's is its own configuration). Left alone, chdb sizes its caches from
    # the machine's RAM (5 GiB mark and index caches, a cap of 90% of RAM) and the spans table's insert and merge
    # buffers from server defaults; these bound them in the process that owns the store.
    engine_max_memory_bytes: int = Field(
        default=4 * 1024**3,
        ge=0,
        description="embedded: memory the whole engine may track (max_server_memory_usage); 0 = 90% of RAM",
    )
    engine_cache_bytes: int = Field(
        default=128 * 1024**2, ge=0, description="embedded: size of each of the engine's mark and index caches"
    )
    engine_merge_threads: int = Field(
        default=0,
        ge=0,
        le=64,
        description="embedded: threads of the engine's merge pool (background_pool_size; each merge holds its own "
        "buffers); 0 = the engine's default, 16",
    )
    engine_compress_block_bytes: int = Field(
        default=256 * 1024,
        ge=64 * 1024,
        description="embedded: the spans table's compression block (each column's write buffer in inserts and "
        "merges; ClickHouse's default is 1 MiB)",
    )

    @field_validator("url", "read_url")
    @classmethod
    def _url_is_http(cls, value: SecretStr | None) -> SecretStr | None:
        if value is None or not value.get_secret_value():
            return None
        parts = urlsplit(value.get_secret_value())
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError("FULMEN_CLICKHOUSE_URL must look like http(s)://user:password@host:8123/db")
        return value


class LogSettings(BaseModel):
    """Logging of every process."""

    level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field(default="INFO", description="the lowest level logged")
    format: Literal["text", "json"] = Field(default="text", description="json: one object a line, for log pipelines")
    file: Path | None = Field(default=None, description="also write the log to this file")


class MetricsSettings(BaseModel):
    """``FULMEN_METRICS_*``: Prometheus metrics. The gateways serve ``/metrics`` on their own port, ``fulmen consume``
    on its read endpoint's; the others (runner, trainer, consume without a read endpoint) on ``port`` when set."""

    enabled: bool = Field(default=True, description="record and serve metrics (false: the gateways record none)")
    host: str = Field(default="127.0.0.1", description="listen address of the metrics listener (0.0.0.0: every one)")
    port: int = Field(
        default=0,
        ge=0,
        le=65535,
        description="port of the metrics listener of a runner, trainer or consumers; 0 = none",
    )


class DashboardSettings(BaseModel):
    """The read-only dashboard (``fulmen dashboard``; ``fulmen up`` starts it): where it listens, how often
    its pages poll. It has no login: keep it on loopback, or behind a proxy that has one."""

    host: str = Field(default="127.0.0.1", description="listen address")
    port: int = Field(default=8890, ge=0, le=65535, description="listen port; 0 = any free port")
    poll_s: float = Field(default=3.0, ge=0.5, le=300, description="how often the pages fetch new data")


class CliSettings(BaseModel):
    """How ``fulmen`` prints its tables (``sql``, ``rollouts``, ``status``)."""

    timezone: str = Field(
        default="local",
        description="the zone times are shown in: 'local' (this machine's), 'UTC', or an IANA name such as "
        "'Europe/Paris'; --utc says UTC for one command",
    )
    wide: bool = Field(
        default=False,
        description="print every value whole (full ids, times to the microsecond) "
        "instead of fitting the terminal; --wide for one command",
    )

    @field_validator("timezone")
    @classmethod
    def _known_zone(cls, value: str) -> str:
        if value.lower() != "local":
            from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

            try:
                ZoneInfo(value)
            except (ZoneInfoNotFoundError, ValueError) as exc:
                raise ValueError(
                    f"FULMEN_CLI_TIMEZONE={value!r} is no time zone: use local, UTC or an IANA "
                    "name such as Europe/Paris"
                ) from exc
        return value

    def zone(self, *, utc: bool = False) -> Any:
        """The ``tzinfo`` times are shown in (None: the local zone); ``utc`` overrides the setting."""
        from zoneinfo import ZoneInfo

        if utc:
            return ZoneInfo("UTC")
        return None if self.timezone.lower() == "local" else ZoneInfo(self.timezone)


class FulmenSettings(BaseSettings):
    """The sections every process shares. Subclass it to add a process's own section."""

    model_config = SettingsConfigDict(
        env_prefix="FULMEN_",
        env_nested_delimiter="_",
        env_nested_max_split=1,
        env_file=".env",
        extra="ignore",
        case_sensitive=False,
    )

    home: Path = Field(
        default_factory=default_home,
        description="the directory of local state: Kafka data and log, embedded store, models, runs "
        "(default `~/.local/share/fulmen`)",
    )
    kafka: KafkaSettings = Field(default_factory=KafkaSettings)
    broker: BrokerSettings = Field(default_factory=BrokerSettings)
    clickhouse: ClickHouseSettings = Field(default_factory=ClickHouseSettings)
    log: LogSettings = Field(default_factory=LogSettings)
    metrics: MetricsSettings = Field(default_factory=MetricsSettings)

    @property
    def local_kafka(self) -> bool:
        """True when Fulmen runs its own broker (no FULMEN_KAFKA_BOOTSTRAP)."""
        return self.kafka.bootstrap is None

    @property
    def bootstrap(self) -> str:
        """The bootstrap servers clients use, local or not (a local cluster: every node, so that a client
        starting while one node is down still finds the others)."""
        if self.kafka.bootstrap:
            return self.kafka.bootstrap
        return ",".join(f"{self.broker.host}:{port}" for port, _ in self.broker.node_ports())

    @property
    def broker_data_dir(self) -> Path:
        return self.broker.data_dir or self.home / "kafka"

    @property
    def store_path(self) -> Path:
        return self.clickhouse.path or self.home / "chdb"

    def masked(self) -> dict[str, Any]:
        """Everything in force, every section a subclass adds included, with secrets masked: every
        ``SecretStr`` is ``***`` (a URL one shows as :func:`fulmen.infra.http.mask_url` of it, user name kept;
        aiohttp is imported only then), and every string that looks like a URL loses its credentials
        (``user:password@``, secret-looking query values)."""
        return _mask(self, self.model_dump(mode="json"))


def _mask(model: BaseModel, data: dict[str, Any]) -> dict[str, Any]:
    for name in type(model).model_fields:
        value, dumped = getattr(model, name, None), data.get(name)
        if isinstance(value, BaseModel) and isinstance(dumped, dict):
            data[name] = _mask(value, dumped)
        elif isinstance(value, SecretStr):
            secret = value.get_secret_value()
            data[name] = _mask_keeping_user(secret) if "://" in secret else "***"
        elif isinstance(dumped, str) and "://" in dumped:
            data[name] = _mask_keeping_user(dumped)
    return data


def _mask_keeping_user(url: str) -> str:
    """:func:`fulmen.infra.http.mask_url` of ``url``, with the user name shown (``user:***@host``)."""
    from fulmen.infra.http import mask_url

    masked = mask_url(url)
    try:
        parts = urlsplit(url)
        user = parts.username
    except ValueError:
        return masked
    if not user or "://" not in masked:
        return masked
    scheme, _, rest = masked.partition("://")
    return f"{scheme}://{user}{':***' if parts.password is not None else ''}@{rest}"


class DashboardProcessSettings(FulmenSettings):
    """Settings of ``fulmen dashboard``: the shared sections plus ``FULMEN_DASHBOARD_*``."""

    dashboard: DashboardSettings = Field(default_factory=DashboardSettings)


class CliProcessSettings(FulmenSettings):
    """Settings of the commands that print tables (``fulmen sql``, ``rollouts``, ``status``): the shared sections
    plus ``FULMEN_CLI_*``."""

    cli: CliSettings = Field(default_factory=CliSettings)
