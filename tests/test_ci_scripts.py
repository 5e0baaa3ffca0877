"""CI's shell scripts: the apt mirror comes from the machine, and no script names a mirror host.

Runs .ci/apt-mirror.sh against fake machine roots (an /etc of our own), so nothing here reads the
real apt configuration.
"""

from __future__ import annotations

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
