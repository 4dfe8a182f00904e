"""contrib/systemd/elockd.service: hardened, valid for systemd, and right for exactly
the install steps README.md gives (a venv at /opt/elockd, a system user, the unit
enabled)."""

from __future__ import annotations

import configparser
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from elockd.daemon.main import load_config

ROOT = Path(__file__).resolve().parent.parent
UNIT = ROOT / "contrib" / "systemd" / "elockd.service"


def service_section() -> configparser.SectionProxy:
    unit = configparser.ConfigParser(strict=False, interpolation=None)
    unit.optionxform = str  # type: ignore[assignment,method-assign]
    unit.read(UNIT)
    return unit["Service"]


def install_steps() -> str:
    """The shell block of README.md's "Installing on a server" section."""
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Installing on a server", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```sh\n(.*?)```", section, re.DOTALL)
    assert blocks, "no sh block in README's install section"
    return blocks[0]


def test_the_unit_is_hardened_and_runs_elockd() -> None:
    service = service_section()
    hardening = {
        "NoNewPrivileges": "yes",
        "ProtectSystem": "strict",
        "ProtectHome": "yes",
        "PrivateTmp": "yes",
        "PrivateDevices": "yes",
        "CapabilityBoundingSet": "",
        "RestrictAddressFamilies": "AF_INET AF_INET6 AF_UNIX",
    }
    for name, value in hardening.items():
        assert service.get(name) == value, name
    command = shlex.split(service["ExecStart"])
    assert command[0] == "/opt/elockd/bin/elockd"
    config, notes = load_config(command[1:], {})  # every flag is a real one
    assert notes == []
    assert config.unix is not None and config.unix.startswith("/run/elockd/")
    assert service["RuntimeDirectory"] == "elockd"
    assert (config.host, config.port, config.metrics_port) == ("127.0.0.1", 9999, 9998)


def test_the_unit_fits_the_readme_install_steps() -> None:
    steps = install_steps()
    service = service_section()
    venv = re.search(r"python3 -m venv (\S+)", steps)
    assert venv, steps
    assert shlex.split(service["ExecStart"])[0] == f"{venv.group(1)}/bin/elockd"
    user = re.search(r"useradd --system .* (\S+)\n", steps)
    assert user, steps
    assert service["User"] == service["Group"] == user.group(1)
    assert "DynamicUser" not in service  # the user the steps create is the one used
    assert re.search(
        r"install -m 0644 \S*contrib/systemd/elockd.service /etc/systemd/system/", steps
    )
    assert "systemctl enable --now elockd" in steps
    # The optional settings file is optional ("-"): enabling works without it.
    assert service["EnvironmentFile"] == "-/etc/elockd/environment"


def test_systemd_analyze_verifies_the_unit_with_a_real_venv(tmp_path: Path) -> None:
    # .ci/run installs systemd for systemd-analyze: a missing tool fails, not skips.
    assert shutil.which("systemd-analyze"), "systemd-analyze missing (apt-get install systemd)"
    elockd = Path(sys.executable).parent / "elockd"
    assert elockd.exists(), "the elockd console script is not installed in this venv"
    text = UNIT.read_text()
    assert "ExecStart=/opt/elockd/bin/elockd " in text
    unit = tmp_path / "elockd.service"
    # ExecStart runs elockd and ExecReload elockctl, both from the venv's bin.
    assert "ExecReload=/opt/elockd/bin/elockctl upgrade " in text
    unit.write_text(text.replace("/opt/elockd/bin/", f"{elockd.parent}/"))
    result = subprocess.run(
        ["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, timeout=30
    )
    assert result.returncode == 0, result.stderr
    assert "elockd.service" not in result.stderr, result.stderr
