"""The relay's command line: bad settings are one clear line; secrets never leak."""

from __future__ import annotations

import os
import subprocess
import sys
import time


def run_relay(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOXKIT_")}
    return subprocess.run([sys.executable, "-m", "relay", *args], capture_output=True,
                          text=True, timeout=60, env={**clean, **env}, check=False)


def test_a_bad_value_names_the_setting_and_exits_2() -> None:
    result = run_relay(OUTBOXKIT_RELAY_BATCH_SIZE="lots")
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1
    assert "OUTBOXKIT_RELAY_BATCH_SIZE" in result.stderr
    assert "--batch-size" in result.stderr


def test_a_bad_flag_value_overrides_the_environment_and_is_named() -> None:
    result = run_relay("--on-permanent-failure", "ignore", OUTBOXKIT_RELAY_BATCH_SIZE="10")
    assert result.returncode == 2
    assert "on_permanent_failure" in result.stderr
    assert "'dead-letter' or 'block'" in result.stderr


def test_a_bad_kafka_address_is_refused() -> None:
    result = run_relay("--kafka-bootstrap", "localhost")
    assert result.returncode == 2
    assert "'localhost' is not host:port" in result.stderr


def test_missing_database_url_says_how_to_give_one() -> None:
    result = run_relay(OUTBOXKIT_RELAY_KAFKA_BOOTSTRAP="127.0.0.1:9")
    assert result.returncode == 2
    assert "OUTBOXKIT_RELAY_DATABASE_URL" in result.stderr


def test_the_database_password_never_appears_in_logs_or_errors() -> None:
    secret = "s3cr3t-pa55"
    url = f"postgresql://outbox:{secret}@127.0.0.1:9/outbox"  # nothing listens on port 9
    proc = subprocess.Popen(
        [sys.executable, "-m", "relay", "--database-url", url, "--kafka-bootstrap", "127.0.0.1:9",
         "--log-format", "json", "--shutdown-timeout-seconds", "3"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={k: v for k, v in os.environ.items() if not k.startswith("OUTBOXKIT_")})
    # Until it said where it connects (start-up takes ~0.5 s, more on a loaded machine: a
    # fixed 6 s once ended it before it logged a line), then a few seconds of retries.
    assert proc.stdout is not None
    lines: list[str] = []
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and (line := proc.stdout.readline()):
        lines.append(line)
        if "starting" in line:
            break
    time.sleep(3)
    proc.terminate()
    output = "".join(lines) + proc.communicate(timeout=30)[0]
    assert "outbox:***@127.0.0.1:9" in output  # it did log where it connects
    assert secret not in output


def test_settings_the_kafka_producer_refuses_end_the_relay_with_one_line(
    database_url: str, kafka_bootstrap: str
) -> None:
    """A delivery timeout shorter than linger + request timeout: no retrying that forever."""
    result = run_relay("--delivery-timeout-ms", "3", "--linger-ms", "5",
                       "--log-format", "json", OUTBOXKIT_RELAY_DATABASE_URL=database_url,
                       OUTBOXKIT_RELAY_KAFKA_BOOTSTRAP=kafka_bootstrap)
    assert result.returncode == 2
    errors = [line for line in result.stderr.splitlines() if line.startswith("relay: ")]
    assert errors == ["relay: the Kafka producer refused its settings: KafkaConfigurationError: "
                      "Must set delivery_timeout_ms higher than linger_ms + request_timeout_ms"]
    assert "Traceback" not in result.stderr
