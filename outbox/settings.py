"""Settings of the write side, read from ``OUTBOXKIT_*`` environment variables."""

from __future__ import annotations

import functools
import os
import re
from typing import Any, Literal

from pydantic import Field, SecretStr, ValidationInfo, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from outbox import kafka

_IDENTIFIER = re.compile(r"^[a-z_][a-z0-9_]{0,62}$")


class OutboxSettings(BaseSettings):
    """Where the tables live and the bounds every write is checked against."""

    model_config = SettingsConfigDict(env_prefix="OUTBOXKIT_", frozen=True, extra="ignore")

    schema_name: str = Field(
        default="outboxkit",
        description="PostgreSQL schema holding the outboxkit tables (a lower-case identifier).",
    )
    max_message_bytes: int = Field(
        default=1_048_576,
        gt=0,
        description="Largest message emit accepts, counted as the Kafka record the relay "
        "sends: key + payload + headers (with room for a tracing relay's traceparent) + the "
        "record's and its batch's framing + room for compression to grow incompressible data "
        "(outbox.messages.envelope.record_size). Keep it at most the relay's max_request_bytes "
        "and the topics' max.message.bytes (1 MiB by default, like this): then whatever emit "
        "accepts is publishable.",
    )
    max_checkpoint_bytes: int = Field(
        default=65_536,
        gt=0,
        description="Largest serialised checkpoint; store bigger things as artifacts.",
    )
    lanes: int = Field(
        default=64,
        gt=0,
        le=4096,
        description="Number of relay lanes rows are hashed into by key. Changing it while rows "
        "are pending can reorder a key across the change: drain the outbox first.",
    )
    notify_channel: str = Field(
        default="outboxkit_outbox",
        description="LISTEN/NOTIFY channel an idle relay waits on.",
    )
    relay_idle_seconds: float = Field(
        default=30.0,
        gt=0,
        description="An idle relay whose heartbeat is older than this is presumed dead: emits "
        "stop paying for NOTIFY to wake it (a live relay heartbeats more often than this).",
    )
    emit_many_max_keys: int = Field(
        default=1000,
        gt=0,
        description="Most distinct (topic, key) pairs one emit_many call takes; more is "
        "refused before anything is written. Each holds a lock in PostgreSQL's shared lock "
        "table until commit (sized max_locks_per_transaction x connections: ~6,400 with the "
        "defaults, shared by every session), and a table that fills up fails this transaction "
        "and others with 'out of shared memory'. Raise it only with max_locks_per_transaction.",
    )
    ordered_topics: frozenset[str] = Field(
        default=frozenset(),
        description="Topics whose messages must carry a key (per-key order is the contract); "
        'emit refuses a keyless message to them. From the environment as a JSON list: \'["a"]\'.',
    )

    @field_validator("schema_name", "notify_channel")
    @classmethod
    def _identifier(cls, value: str) -> str:
        if not _IDENTIFIER.match(value):
            raise ValueError(
                f"{value!r} is not a plain lower-case PostgreSQL identifier "
                "(letters, digits and _, not starting with a digit, at most 63 characters)"
            )
        return value


@functools.cache
def default_settings() -> OutboxSettings:
    """The settings from the environment, read once per process (functions default to these)."""
    return OutboxSettings()


SASL_PROTOCOLS = frozenset({"SASL_PLAINTEXT", "SASL_SSL"})
TLS_PROTOCOLS = frozenset({"SSL", "SASL_SSL"})


class _HiddenStr(str):
    """A password handed to kafka-python: the real text for the SASL exchange, but hidden
    when the client logs its configuration dict (KafkaAdminClient does, at DEBUG)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "'<hidden>'"



def answer_timeout_field() -> Any:
    """``database_answer_timeout_seconds``, the same for every daemon (outbox.db.answers)."""
    return Field(
        default=60.0, ge=0,
        description="The longest any database round trip (statement, fetch, commit) waits for "
        "PostgreSQL's answer; then the connection is closed and the call fails like a lost "
        "connection. Finds a hung server or a middlebox that stopped forwarding, which TCP "
        "keepalives cannot. Keep it above the longest statement (lock waits included); 0: "
        "no bound.",
    )


class ConnectionSettings(BaseSettings):
    """Where a daemon (relay, consumer) finds PostgreSQL and Kafka, and how it authenticates
    to Kafka; each daemon's settings class extends this with its own ``env_prefix``, falling
    back to the shared ``OUTBOXKIT_DATABASE_URL`` / ``OUTBOXKIT_KAFKA_BOOTSTRAP``."""

    # A ValidationError's text would otherwise quote the raw database URL or SASL password
    # (``input_value=...``); errors() keeps the input, and ``explain`` hides the secret ones.
    # Subclasses' model_config is merged with this one, so they keep it.
    model_config = SettingsConfigDict(hide_input_in_errors=True)

    database_url: SecretStr = Field(
        default=SecretStr(""),
        description="PostgreSQL URL of the outboxkit database (falls back to "
        "OUTBOXKIT_DATABASE_URL). Kept secret: never logged.",
    )
    database_answer_timeout_seconds: float = answer_timeout_field()
    kafka_bootstrap: str = Field(
        default="",
        description="Kafka bootstrap servers, comma separated (falls back to "
        "OUTBOXKIT_KAFKA_BOOTSTRAP).",
    )
    kafka_client: Literal["kafka-python", "confluent"] | None = Field(
        default=None,
        description="Kafka client library: kafka-python (pure Python, the default) or "
        "confluent (librdkafka, pip install 'outboxkit[confluent]'; several times faster). "
        "Both put every key in the same partition. Falls back to OUTBOXKIT_KAFKA_CLIENT.",
    )
    # Declared before the settings that depend on it: their checks read it.
    kafka_security_protocol: Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"] = Field(
        default="PLAINTEXT",
        description="How every Kafka client connects: SSL and SASL_SSL use TLS; the SASL_ ones "
        "authenticate with kafka_sasl_mechanism, kafka_sasl_username and kafka_sasl_password.",
    )
    kafka_sasl_mechanism: Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"] | None = Field(
        default=None,
        validate_default=True,
        description="SASL mechanism; required with SASL_PLAINTEXT or SASL_SSL.",
    )
    kafka_sasl_username: str = Field(
        default="",
        validate_default=True,
        description="SASL user name; required with SASL_PLAINTEXT or SASL_SSL.",
    )
    kafka_sasl_password: SecretStr = Field(
        default=SecretStr(""),
        validate_default=True,
        description="SASL password; required with SASL_PLAINTEXT or SASL_SSL. Kept secret: "
        "never logged; prefer the environment variable to the flag (visible in ps).",
    )
    kafka_ssl_cafile: str = Field(
        default="",
        description="PEM file of the CA(s) that signed the brokers' certificates (default: "
        "the system's CAs). SSL and SASL_SSL only.",
    )
    kafka_ssl_certfile: str = Field(
        default="",
        description="PEM client certificate, for brokers that require TLS client "
        "authentication. SSL and SASL_SSL only.",
    )
    kafka_ssl_keyfile: str = Field(
        default="",
        description="PEM private key of kafka_ssl_certfile (if not in that file). "
        "SSL and SASL_SSL only.",
    )
    kafka_ssl_check_hostname: bool = Field(
        default=True,
        description="Check that the broker's certificate names the host connected to.",
    )

    @field_validator("kafka_bootstrap")
    @classmethod
    def _bootstrap(cls, value: str) -> str:
        for server in filter(None, (s.strip() for s in value.split(","))):
            host, sep, port = server.rpartition(":")
            if not sep or not host or not port.isdigit():
                raise ValueError(f"{server!r} is not host:port")
        return value

    @field_validator("kafka_sasl_mechanism", "kafka_sasl_username", "kafka_sasl_password")
    @classmethod
    def _sasl_fits_protocol(cls, value: Any, info: ValidationInfo) -> Any:
        protocol = info.data.get("kafka_security_protocol")
        if protocol is None:  # the protocol itself is invalid: that error is reported
            return value
        given = value.get_secret_value() if isinstance(value, SecretStr) else value
        if protocol in SASL_PROTOCOLS and not given:
            raise ValueError(f"required when kafka_security_protocol is {protocol}")
        if protocol not in SASL_PROTOCOLS and given:
            # Set but unused would mean an operator believes the connection authenticates.
            raise ValueError(
                f"set, but kafka_security_protocol is {protocol}, which does not use SASL: "
                "set SASL_PLAINTEXT or SASL_SSL, or leave it unset"
            )
        return value

    @field_validator("kafka_ssl_cafile", "kafka_ssl_certfile", "kafka_ssl_keyfile")
    @classmethod
    def _tls_file(cls, value: str, info: ValidationInfo) -> str:
        if not value:
            return value
        protocol = info.data.get("kafka_security_protocol")
        if protocol is not None and protocol not in TLS_PROTOCOLS:
            # Set but unused would mean an operator believes the connection is encrypted.
            raise ValueError(
                f"set, but kafka_security_protocol is {protocol}, which does not use TLS: "
                "set SSL or SASL_SSL, or leave it unset"
            )
        if info.field_name == "kafka_ssl_keyfile" and info.data.get("kafka_ssl_certfile") == "":
            raise ValueError("set without kafka_ssl_certfile, the certificate it belongs to")
        if not os.path.isfile(value):
            raise ValueError(f"no such file: {value}")
        if not os.access(value, os.R_OK):
            raise ValueError(f"cannot read {value} (permissions)")
        return value

    def resolved_database_url(self) -> str:
        return self.database_url.get_secret_value() or os.environ.get("OUTBOXKIT_DATABASE_URL", "")

    def resolved_bootstrap(self) -> str:
        return self.kafka_bootstrap or os.environ.get("OUTBOXKIT_KAFKA_BOOTSTRAP", "")

    def resolved_kafka_client(self) -> str:
        return self.kafka_client or os.environ.get("OUTBOXKIT_KAFKA_CLIENT", "") or "kafka-python"

    def kafka_connection(self) -> kafka.Connection:
        """Where the brokers are and how every Kafka client of this daemon authenticates."""
        protocol = self.kafka_security_protocol
        tls, sasl = protocol in TLS_PROTOCOLS, protocol in SASL_PROTOCOLS
        return kafka.Connection(
            bootstrap=self.resolved_bootstrap(),
            security_protocol=protocol,
            sasl_mechanism=self.kafka_sasl_mechanism if sasl else None,
            sasl_username=self.kafka_sasl_username if sasl else "",
            sasl_password=_HiddenStr(self.kafka_sasl_password.get_secret_value()) if sasl else "",
            ssl_cafile=self.kafka_ssl_cafile if tls else "",
            ssl_certfile=self.kafka_ssl_certfile if tls else "",
            ssl_keyfile=self.kafka_ssl_keyfile if tls else "",
            ssl_check_hostname=self.kafka_ssl_check_hostname,
        )

    def kafka(self) -> kafka.Backend:
        """The Kafka client backend chosen (``kafka_client``), bound to these brokers."""
        return kafka.backend(self.resolved_kafka_client(), self.kafka_connection())

    def kafka_client_config(self) -> dict[str, Any]:
        """Keyword arguments for a kafka-python client of these brokers (bootstrap servers,
        TLS/SASL), with outboxkit's fixes of kafka-python installed: for code that builds a
        kafka-python client itself. outboxkit's own clients go through :meth:`kafka`."""
        from outbox.kafka.kafka_python import client_config  # noqa: PLC0415

        return client_config(self.kafka_connection())
