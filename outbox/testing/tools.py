"""Finding the programs the local services need, with errors that say how to install them."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

from outbox.errors import MissingToolError, ServiceError

PG_INSTALL_HINT = (
    "Install the PostgreSQL server binaries (Debian/Ubuntu: `apt-get install postgresql`), "
    "or point OUTBOXKIT_PG_BIN at the folder that holds initdb and pg_ctl."
)
JAVA_INSTALL_HINT = (
    "Install a Java 17+ runtime (Debian/Ubuntu: `apt-get install openjdk-17-jre-headless`), "
    "or set JAVA_HOME to one."
)
MAVEN_INSTALL_HINT = (
    "Install Apache Maven (Debian/Ubuntu: `apt-get install maven`); it downloads the Kafka "
    "broker's jars from Maven Central once. Or set OUTBOXKIT_KAFKA_LIBS to a folder of jars."
)


def postgres_bin_dir() -> Path:
    """The folder holding initdb, pg_ctl and postgres (the newest Debian install wins)."""
    override = os.environ.get("OUTBOXKIT_PG_BIN")
    if override:
        folder = Path(override)
        if not (folder / "initdb").is_file():
            raise MissingToolError(f"initdb in OUTBOXKIT_PG_BIN={override}", PG_INSTALL_HINT)
        return folder
    candidates = sorted(
        Path("/usr/lib/postgresql").glob("*/bin/initdb"),
        key=lambda p: int(p.parent.parent.name) if p.parent.parent.name.isdigit() else 0,
    )
    if candidates:
        return candidates[-1].parent
    found = shutil.which("initdb")
    if found:
        return Path(found).resolve().parent
    raise MissingToolError("PostgreSQL server binaries (initdb, pg_ctl)", PG_INSTALL_HINT)


def java_executable() -> Path:
    """A Java 17+ ``java``: from JAVA_HOME when set, else from PATH."""
    java_home = os.environ.get("JAVA_HOME")
    if java_home:
        java = Path(java_home) / "bin" / "java"
        if not java.is_file():
            raise MissingToolError(
                f"java in JAVA_HOME={java_home} (no bin/java there)", JAVA_INSTALL_HINT
            )
    else:
        found = shutil.which("java")
        if not found:
            raise MissingToolError("java", JAVA_INSTALL_HINT)
        java = Path(found)
    major = java_major_version(java)
    if major < 17:
        raise MissingToolError(
            f"Java 17 or newer (found Java {major} at {java})", JAVA_INSTALL_HINT
        )
    return java


def java_major_version(java: Path) -> int:
    try:
        out = subprocess.run(
            [str(java), "-version"], capture_output=True, text=True, timeout=30, check=False
        )
    except OSError as exc:
        raise MissingToolError(f"a working java at {java} ({exc})", JAVA_INSTALL_HINT) from exc
    match = re.search(r'version "(\d+)(?:\.(\d+))?', out.stderr + out.stdout)
    if not match:
        raise ServiceError(
            f"could not read the Java version from `{java} -version`: {out.stderr!r}"
        )
    major = int(match.group(1))
    # Java 8 and older report "1.8.0_...".
    return int(match.group(2) or 0) if major == 1 else major


def maven_executable() -> Path:
    found = shutil.which("mvn")
    if not found:
        raise MissingToolError("mvn (Apache Maven)", MAVEN_INSTALL_HINT)
    return Path(found)
