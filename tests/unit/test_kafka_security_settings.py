"""Kafka TLS/SASL settings: their checks, the client kwargs they give, and the secret's hiding."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner
from kafka import KafkaAdminClient, KafkaConsumer, KafkaProducer
from kafka.net.sasl.plain import SaslMechanismPlain
from pydantic import ValidationError

from consumers.commands import consume_command
from consumers.settings import ConsumerSettings
from outbox.cli.daemon import EXIT_CONFIG
from outbox.cli.flags import explain
from outbox.settings import ConnectionSettings
from relay.commands import relay_command
from relay.settings import RelaySettings

PASSWORD = "s3cr3t-Pa55"  # distinctive, so finding it anywhere in output is meaningful
SASL = {
    "kafka_bootstrap": "kafka-1:9093,kafka-2:9093",
    "kafka_security_protocol": "SASL_PLAINTEXT",
    "kafka_sasl_mechanism": "PLAIN",
    "kafka_sasl_username": "relay",
    "kafka_sasl_password": PASSWORD,
}


def errors(cls: type[ConnectionSettings], prefix: str, **values: object) -> str:
    with pytest.raises(ValidationError) as caught:
        cls(**values)  # type: ignore[arg-type]
    text = explain(caught.value, prefix)
    assert PASSWORD not in str(caught.value)
    assert PASSWORD not in text
    return text


@pytest.fixture
def cafile(tmp_path: Path) -> str:
    path = tmp_path / "ca.pem"
    path.write_text("-----BEGIN CERTIFICATE-----\n")
    return str(path)


class TestClientConfig:
    def test_plaintext_passes_only_the_bootstrap_servers_and_the_protocol(self) -> None:
        settings = RelaySettings(kafka_bootstrap="a:9092,b:9092")
        assert settings.kafka_client_config() == {
            "bootstrap_servers": ["a:9092", "b:9092"],
            "security_protocol": "PLAINTEXT",
            "reconnect_backoff_max_ms": 2000,
        }

    def test_sasl_ssl_gives_kafka_pythons_tls_and_sasl_arguments(self, cafile: str) -> None:
        settings = ConsumerSettings(
            **{**SASL, "kafka_security_protocol": "SASL_SSL",  # type: ignore[arg-type]
               "kafka_sasl_mechanism": "SCRAM-SHA-512", "kafka_ssl_cafile": cafile,
               "kafka_ssl_check_hostname": False}
        )
        assert settings.kafka_client_config() == {
            "bootstrap_servers": ["kafka-1:9093", "kafka-2:9093"],
            "security_protocol": "SASL_SSL",
            "reconnect_backoff_max_ms": 2000,
            "ssl_cafile": cafile,
            "ssl_certfile": None,
            "ssl_keyfile": None,
            "ssl_check_hostname": False,
            "sasl_mechanism": "SCRAM-SHA-512",
            "sasl_plain_username": "relay",
            "sasl_plain_password": PASSWORD,
        }

    @pytest.mark.parametrize("client", [KafkaProducer, KafkaConsumer, KafkaAdminClient])
    def test_every_argument_is_one_the_kafka_clients_know(self, client: type, cafile: str) -> None:
        settings = RelaySettings(
            **{**SASL, "kafka_security_protocol": "SASL_SSL",  # type: ignore[arg-type]
               "kafka_ssl_cafile": cafile, "kafka_ssl_certfile": cafile,
               "kafka_ssl_keyfile": cafile}
        )
        unknown = set(settings.kafka_client_config()) - set(client.DEFAULT_CONFIG)
        assert not unknown, f"{client.__name__} does not take {unknown}"

    def test_the_password_is_hidden_when_the_config_is_logged_but_authenticates(self) -> None:
        config = RelaySettings(**SASL).kafka_client_config()  # type: ignore[arg-type]
        assert PASSWORD not in repr(config)
        assert PASSWORD not in f"{config}"  # what KafkaAdminClient's DEBUG line prints
        assert config["sasl_plain_password"] == PASSWORD
        plain = SaslMechanismPlain(**config)
        assert plain.auth_bytes() == f"relay\0relay\0{PASSWORD}".encode()

    def test_the_settings_are_read_from_the_daemons_environment(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        for name, value in SASL.items():
            monkeypatch.setenv(f"OUTBOXKIT_CONSUMER_{name.upper()}", value)
        config = ConsumerSettings().kafka_client_config()
        assert config["sasl_plain_username"] == "relay"
        assert config["sasl_plain_password"] == PASSWORD


class TestChecks:
    @pytest.mark.parametrize(("missing", "got"), [("kafka_sasl_mechanism", "None"),
                                                  ("kafka_sasl_username", "''"),
                                                  ("kafka_sasl_password", "'<hidden>'")])
    def test_sasl_without_one_of_its_settings_names_that_setting(
        self, missing: str, got: str
    ) -> None:
        values = {k: v for k, v in SASL.items() if k != missing}
        text = errors(RelaySettings, "OUTBOXKIT_RELAY_", **values)
        assert text == (
            f"invalid setting {missing} (env OUTBOXKIT_RELAY_{missing.upper()}, flag "
            f"--{missing.replace('_', '-')}): Value error, required when "
            f"kafka_security_protocol is SASL_PLAINTEXT (got {got})"
        )

    def test_sasl_with_nothing_else_set_lists_all_three_settings(self) -> None:
        text = errors(ConsumerSettings, "OUTBOXKIT_CONSUMER_", kafka_security_protocol="SASL_SSL")
        assert [line.split(" (env ")[0] for line in text.splitlines()] == [
            "invalid setting kafka_sasl_mechanism",
            "invalid setting kafka_sasl_username",
            "invalid setting kafka_sasl_password",
        ]
        assert "OUTBOXKIT_CONSUMER_KAFKA_SASL_USERNAME" in text

    def test_an_unsupported_mechanism_is_refused(self) -> None:
        text = errors(RelaySettings, "OUTBOXKIT_RELAY_",
                      **{**SASL, "kafka_sasl_mechanism": "GSSAPI"})
        assert "kafka_sasl_mechanism" in text
        assert "SCRAM-SHA-512" in text

    def test_a_ca_file_that_does_not_exist_is_named(self, tmp_path: Path) -> None:
        missing = tmp_path / "nope.pem"
        text = errors(RelaySettings, "OUTBOXKIT_RELAY_", kafka_security_protocol="SSL",
                      kafka_ssl_cafile=str(missing))
        assert text == (
            "invalid setting kafka_ssl_cafile (env OUTBOXKIT_RELAY_KAFKA_SSL_CAFILE, flag "
            f"--kafka-ssl-cafile): Value error, no such file: {missing} (got '{missing}')"
        )

    def test_a_key_without_its_certificate_is_refused(self, cafile: str) -> None:
        text = errors(RelaySettings, "OUTBOXKIT_RELAY_", kafka_security_protocol="SSL",
                      kafka_ssl_keyfile=cafile)
        assert "kafka_ssl_keyfile" in text
        assert "kafka_ssl_certfile" in text

    def test_tls_files_with_a_protocol_without_tls_are_refused(self, cafile: str) -> None:
        # Otherwise an operator could believe the connection is encrypted when it is not.
        text = errors(RelaySettings, "OUTBOXKIT_RELAY_", kafka_ssl_cafile=cafile)
        assert "kafka_ssl_cafile" in text
        assert "does not use TLS" in text

    def test_credentials_with_a_protocol_without_sasl_are_refused_and_stay_hidden(self) -> None:
        text = errors(RelaySettings, "OUTBOXKIT_RELAY_", kafka_sasl_password=PASSWORD)
        assert "kafka_sasl_password" in text
        assert "does not use SASL" in text
        assert "(got '<hidden>')" in text


class TestNeverPrinted:
    def test_not_in_the_settings_repr(self) -> None:
        settings = RelaySettings(**SASL)  # type: ignore[arg-type]
        assert PASSWORD not in repr(settings)
        assert PASSWORD not in str(settings)
        assert PASSWORD not in str(settings.model_dump())

    def test_not_in_the_relay_command_lines_error(self) -> None:
        argv = ["--kafka-security-protocol", "SASL_PLAINTEXT", "--kafka-sasl-password", PASSWORD]
        done = CliRunner().invoke(relay_command, argv)
        assert done.exit_code == EXIT_CONFIG
        err = done.stderr
        assert "--kafka-sasl-mechanism" in err
        assert "--kafka-sasl-username" in err
        assert PASSWORD not in err

    def test_not_in_the_consumer_command_lines_error(self) -> None:
        argv = ["mod:app", "--kafka-sasl-password", PASSWORD]
        done = CliRunner().invoke(consume_command, argv)
        assert done.exit_code == EXIT_CONFIG
        err = done.stderr
        assert "OUTBOXKIT_CONSUMER_KAFKA_SASL_PASSWORD" in err
        assert PASSWORD not in err


def test_every_security_setting_has_a_flag() -> None:
    text = (CliRunner().invoke(relay_command, ["--help"]).stdout
            + CliRunner().invoke(consume_command, ["--help"]).stdout)
    for flag in ("--kafka-security-protocol", "--kafka-sasl-mechanism", "--kafka-sasl-username",
                 "--kafka-sasl-password", "--kafka-ssl-cafile", "--kafka-ssl-certfile",
                 "--kafka-ssl-keyfile", "--kafka-ssl-check-hostname",
                 "--no-kafka-ssl-check-hostname"):
        assert text.count(flag) >= 2, flag  # once in each daemon's help
    args = relay_command.make_context("relay", ["--no-kafka-ssl-check-hostname"]).params
    assert args["kafka_ssl_check_hostname"] is False
