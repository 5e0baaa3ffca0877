"""CI's shell scripts: the apt mirror comes from the machine, no script names a mirror host, and a
Docker daemon that cannot start is reported in one line.

Runs .ci/apt-mirror.sh against fake machine roots (an /etc of our own), so nothing here reads the
real apt configuration, and .ci/docker-daemon.sh with fake `dockerd`/`docker` programs.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

CI = Path(__file__).resolve().parent.parent / ".ci"


def machine(tmp_path: Path, codename: str | None, files: dict[str, str]) -> Path:
    (tmp_path / "etc/apt/sources.list.d").mkdir(parents=True)
    if codename:
        (tmp_path / "etc/os-release").write_text(f'ID=debian\nVERSION_CODENAME={codename}\n')
    for name, text in files.items():
        (tmp_path / "etc/apt" / name).write_text(text)
    return tmp_path


def apt_mirror(root: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(CI / "apt-mirror.sh"), str(root)], capture_output=True, text=True, timeout=10)


DEB822 = """\
Types: deb-src
URIs: http://src.example/debian
Suites: trixie
Components: main

# switched off: must be passed over
Types: deb
URIs: http://off.example/debian
Suites: trixie
Enabled: no

Types: deb
URIs: http://security.example/debian-security
Suites: trixie-security
Components: main

Types: deb deb-src
# a comment inside a stanza
URIs: http://mirror.example/debian/ http://second.example/debian
Suites: trixie trixie-updates
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
"""


def test_deb822_source_of_the_machines_codename(tmp_path):
    root = machine(tmp_path, "trixie", {"sources.list.d/debian.sources": DEB822, "sources.list.d/x.sources.off": ""})
    done = apt_mirror(root)
    assert (done.returncode, done.stdout) == (0, "http://mirror.example/debian trixie\n"), done.stderr


def test_one_line_sources_list_with_options_and_comments(tmp_path):
    text = (
        "# deb http://commented.example/debian bookworm main\n"
        "deb [arch=amd64 signed-by=/usr/share/keyrings/k.gpg] http://security.example/ds bookworm-security main\n"
        "deb-src http://src.example/debian bookworm main\n"
        "deb [ trusted=yes ] http://mirror.example/debian bookworm main contrib  # the archive\n"
    )
    done = apt_mirror(machine(tmp_path, "bookworm", {"sources.list": text}))
    assert (done.returncode, done.stdout) == (0, "http://mirror.example/debian bookworm\n"), done.stderr


def test_without_a_codename_the_first_bare_suite_wins(tmp_path):
    text = "deb http://security.example/ds bookworm-security main\ndeb http://mirror.example/debian bookworm main\n"
    done = apt_mirror(machine(tmp_path, None, {"sources.list.d/a.list": text}))
    assert done.stdout == "http://mirror.example/debian bookworm\n"


@pytest.mark.parametrize("files", [{}, {"sources.list": "deb http://mirror.example/debian bullseye main\n"}])
def test_no_source_for_the_suite_is_one_clear_line(tmp_path, files):
    done = apt_mirror(machine(tmp_path, "trixie", files))
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.count("\n") == 1 and "no enabled deb source for suite 'trixie'" in done.stderr


def test_ci_scripts_name_no_mirror_host():
    for script in CI.iterdir():
        hosts = set(re.findall(r"\bhttps?://([^/\s\"'}]+)", script.read_text()))
        assert hosts <= {"host"}, f"{script.name} names a mirror: {hosts}"  # "host" is the usage placeholder


def fake_tools(tmp_path: Path, dockerd: str) -> dict[str, str]:
    """PATH with a `dockerd` running `dockerd` (shell), a `docker` that never reaches it, a `debootstrap`."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in {"dockerd": dockerd, "docker": "exit 1", "debootstrap": "exit 0"}.items():
        (bin_dir / name).write_text(f"#!/bin/sh\n{body}\n")
        (bin_dir / name).chmod(0o755)
    return {"PATH": f"{bin_dir}:/usr/sbin:/usr/bin:/sbin:/bin", "DOCKERD_WAIT_S": "1"}


def docker_daemon(action: str, work: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    argv = [str(CI / "docker-daemon.sh"), action, str(work)]
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize(
    "dockerd, reason",
    [
        ("echo 'failed to start daemon: no overlay' >&2; exit 1", "dockerd exited: failed to start daemon: no overlay"),
        ("echo starting; exec sleep 600", "dockerd did not answer within 1 s: starting"),
    ],
)
def test_docker_daemon_that_cannot_start_is_one_line_and_leaves_nothing(tmp_path, dockerd, reason):
    env, work = fake_tools(tmp_path, dockerd), tmp_path / "docker"
    done = docker_daemon("start", work, env)
    assert (done.returncode, done.stdout) == (1, "")
    if os.geteuid() != 0:
        reason = "not root, cannot start a daemon"
    assert done.stderr == f"docker: {reason}; the Docker sandbox cases will skip\n"
    if os.geteuid() == 0:
        pid = int((work / "daemon.pid").read_text())
        assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]
    assert docker_daemon("stop", work, env).returncode == 0 and not work.exists()
