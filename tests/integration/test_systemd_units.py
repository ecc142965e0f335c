"""The systemd units in systemd/ are valid (``systemd-analyze verify``) and hardened
(``systemd-analyze security`` exposure at most 2.0; the score is printed)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

UNITS = Path(__file__).resolve().parents[2] / "systemd"
SHIPPED_EXEC = "/opt/meshd/.venv/bin/meshd"
MAX_EXPOSURE = 2.0


def _analyze() -> str:
    tool = shutil.which("systemd-analyze")
    if tool is None:
        pytest.skip("systemd-analyze is not installed (Debian: apt-get install systemd; "
                    ".ci/run installs it)")
    return tool


@pytest.fixture
def units(tmp_path: Path) -> Path:
    """The shipped units, with ExecStart pointing at this checkout's meshd (verify checks
    that the program exists)."""
    meshd = Path(sys.executable).parent / "meshd"
    assert meshd.exists(), "meshd is not installed in this environment"
    text = (UNITS / "meshd.service").read_text()
    assert SHIPPED_EXEC in text
    (tmp_path / "meshd.service").write_text(text.replace(SHIPPED_EXEC, str(meshd)))
    shutil.copy(UNITS / "meshd.socket", tmp_path / "meshd.socket")
    shutil.copy(UNITS / "meshd-http.socket", tmp_path / "meshd-http.socket")
    return tmp_path


def test_units_pass_systemd_analyze_verify(units: Path) -> None:
    done = subprocess.run(
        [_analyze(), "verify", "--man=no", str(units / "meshd.service"),
         str(units / "meshd.socket"), str(units / "meshd-http.socket")],
        capture_output=True, text=True, timeout=60,
    )
    assert done.returncode == 0 and not done.stderr.strip(), done.stderr


def test_service_exposure_is_at_most_two(units: Path) -> None:
    done = subprocess.run(
        [_analyze(), "security", "--offline=true", "--no-pager", str(units / "meshd.service")],
        capture_output=True, text=True, timeout=60,
    )
    match = re.search(r"Overall exposure level for meshd\.service: ([0-9.]+)", done.stdout)
    assert match, done.stdout + done.stderr
    exposure = float(match.group(1))
    print(f"systemd-analyze security: meshd.service exposure {exposure} "
          f"(target <= {MAX_EXPOSURE})")
    assert exposure <= MAX_EXPOSURE, done.stdout


def test_socket_unit_matches_what_the_daemon_expects() -> None:
    """The socket systemd creates is the one meshd serves by default under systemd
    (RuntimeDirectory=meshd -> /run/meshd/meshd.sock), named as the daemon looks for it."""
    socket_unit = (UNITS / "meshd.socket").read_text()
    service = (UNITS / "meshd.service").read_text()
    assert "ListenStream=/run/meshd/meshd.sock" in socket_unit
    assert "FileDescriptorName=meshd" in socket_unit
    assert "SocketMode=0660" in socket_unit and "SocketGroup=meshd" in socket_unit
    assert "RuntimeDirectory=meshd" in service and "Type=notify" in service
    assert "d /run/meshd 0750 meshd meshd" in (UNITS / "meshd.tmpfiles.conf").read_text()
    assert re.search(r"^u meshd ", (UNITS / "meshd.sysusers.conf").read_text(), re.M)


def test_example_configuration_loads_and_documents_every_key() -> None:
    from meshd.daemon.config import settings as cfg

    example = UNITS / "meshd.toml"
    loaded = cfg.load(str(example), environ={})
    assert loaded.config.serve.allow_groups == ("meshd",)
    text = example.read_text()
    for section, cls in cfg.SECTIONS.items():
        assert f"[{section}]" in text
        for name in cfg.attrs.fields_dict(cls):
            assert re.search(rf"^#? ?{name} = ", text, re.M), f"{section}.{name} undocumented"


def test_example_configuration_is_generated_from_the_key_declarations() -> None:
    """systemd/meshd.toml is ``meshd config example``'s output (regenerate it with
    ``meshd config example > systemd/meshd.toml``), and every value in it is the key's
    default except the service's own settings, which say so."""
    from meshd.daemon.config import settings as cfg
    from meshd.daemon.config.text import SERVICE_SETTINGS, toml_value

    done = subprocess.run([sys.executable, "-m", "meshd", "config", "example"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout == (UNITS / "meshd.toml").read_text(), \
        "systemd/meshd.toml is stale: meshd config example > systemd/meshd.toml"
    example = cfg.load(str(UNITS / "meshd.toml"), environ={}).config
    for section, cls in cfg.SECTIONS.items():
        for name, field in cfg.attrs.fields_dict(cls).items():
            value = getattr(getattr(example, section), name)
            dotted = f"{section}.{name}"
            expected = SERVICE_SETTINGS[dotted][0] if dotted in SERVICE_SETTINGS \
                else field.default
            assert value == expected, (dotted, value, field.default)
            if dotted in SERVICE_SETTINGS:
                assert f"(the default is {toml_value(field.default)})" in done.stdout


_MDWE_LAUNCHER = """
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
if libc.prctl(65, 1, 0, 0, 0) != 0:  # PR_SET_MDWE, PR_MDWE_REFUSE_EXEC_GAIN
    sys.exit(77)
os.execv(sys.argv[1], sys.argv[1:])
"""


def test_llama_cpp_runs_without_writable_executable_memory() -> None:
    """The unit sets MemoryDenyWriteExecute=yes: a generation (llama.cpp's CPU backend,
    the ctypes callbacks for its log and progress) must work without W+X memory. The
    kernel's PR_SET_MDWE (Linux >= 6.3) enforces the same rule on this process tree."""
    from meshd.testing import testmodels

    model = str(testmodels.test_model_path("llama"))
    done = subprocess.run(
        [sys.executable, "-c", _MDWE_LAUNCHER, sys.executable, "-m", "meshd", "generate",
         "-m", model, "-p", "abc", "--raw", "--max-tokens", "4", "-t", "1", "--json"],
        capture_output=True, text=True, timeout=120,
        env={**os.environ, "OMP_WAIT_POLICY": "passive"},
    )
    if done.returncode == 77:
        pytest.skip("this kernel has no PR_SET_MDWE (Linux < 6.3)")
    assert done.returncode == 0, done.stderr
    assert '"finish_reason": "length"' in done.stdout


def test_http_socket_unit_hands_meshd_a_socket_named_http() -> None:
    """The optional HTTP socket names the service and the descriptor name meshd serves
    HTTP on, and listens on loopback only."""
    from meshd.daemon.commands.serve import HTTP_FD_NAME

    unit = (UNITS / "meshd-http.socket").read_text()
    assert f"FileDescriptorName={HTTP_FD_NAME}" in unit
    assert "Service=meshd.service" in unit
    assert "ListenStream=127.0.0.1:" in unit


def test_the_configuration_doc_lists_every_key_as_generated() -> None:
    """docs/configuration.md's key reference is ``meshd config reference``'s output
    (regenerate it by replacing the text between the markers)."""
    from meshd.daemon.config.text import REFERENCE_BEGIN, REFERENCE_END

    done = subprocess.run([sys.executable, "-m", "meshd", "config", "reference"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    doc = (UNITS.parent / "docs" / "configuration.md").read_text()
    begin, end = doc.index(REFERENCE_BEGIN), doc.index(REFERENCE_END) + len(REFERENCE_END)
    assert doc[begin:end] + "\n" == done.stdout, \
        "docs/configuration.md's key reference is stale: meshd config reference"
    from meshd.daemon.config import settings as cfg
    for section, cls in cfg.SECTIONS.items():
        for name in cfg.attrs.fields_dict(cls):
            assert f"`$MESHD_{section.upper()}_{name.upper()}`" in done.stdout
