"""``outbox bench``: run the benchmark suite (bench/suite.py) of a source checkout.

The benchmarks are not part of the installed package: they import relay and consumers,
which the base package must not, and they only make sense next to the code they measure.
So this command finds ``bench/suite.py`` (in the current directory, else in the checkout
this package was installed from in editable mode) and runs it as a child process with the
same interpreter.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import click

from outbox.cli import EXIT_FAILED

SUITE = Path("bench") / "suite.py"


def find_suite() -> Path | None:
    package_root = Path(__file__).resolve().parent.parent
    for root in (Path.cwd(), package_root):
        if (root / SUITE).is_file():
            return root / SUITE
    return None


@click.command("bench")
@click.option("--quick", is_flag=True, help="A smoke run (about a minute): checks, no verdicts.")
@click.option("--json", "json_path", metavar="PATH",
              help="Write the figures here (default bench/results/latest.json).")
@click.option("--out-dir", metavar="DIR", help="Write the plots here (default bench/results).")
@click.option("--database-url", help="An existing PostgreSQL server (admin URL); with "
              "--kafka-bootstrap. Default: start throwaway services for the run.")
@click.option("--kafka-bootstrap", help="An existing Kafka broker, host:port.")
def bench_command(quick: bool, json_path: str | None, out_dir: str | None,
                  database_url: str | None, kafka_bootstrap: str | None) -> None:
    """Run the benchmark suite: one table, bench/results/latest.json and two SVG plots."""
    suite = find_suite()
    if suite is None:
        click.echo("outbox bench runs from a source checkout: bench/suite.py not found", err=True)
        sys.exit(EXIT_FAILED)
    argv = [sys.executable, str(suite)]
    if quick:
        argv.append("--quick")
    for flag, value in (("--json", json_path), ("--out-dir", out_dir),
                        ("--database-url", database_url), ("--kafka-bootstrap", kafka_bootstrap)):
        if value:
            argv += [flag, value]
    proc = subprocess.Popen(argv)  # in this directory: relative paths mean what they say
    try:
        code = proc.wait()
    except KeyboardInterrupt:
        code = proc.wait()  # the suite got Ctrl-C too and is cleaning up: wait for it
    sys.exit(code)
