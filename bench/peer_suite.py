"""``meshd bench-peer-suite``: llama.cpp's own server tests (``tools/server/tests`` of the
pinned llama.cpp sources) run against llama-server and against ``meshd serve``, on one
model file, and the outcomes compared test by test.

A launcher stands in for the suite's ``llama-server`` binary (:mod:`.peer_launcher`); the
suite's model downloads are turned off (:mod:`.peer_plugin`). A test that fails against
llama-server on this model (its expected strings fit another model, or it needs a
feature of another build) says nothing about meshd, so the figure is the share of
llama-server's passes that meshd passes too.
"""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from .processes import clean_env, free_port

#: The OpenAI-facing test files of the suite (``unit/test_NAME.py``).
DEFAULT_TESTS = ("basic", "completion", "chat_completion", "tokenize", "security",
                 "ignore_eos", "ctx_shift", "template", "tool_call", "stream",
                 "compat_oai_responses")
ARMS = ("llama-server", "meshd")


@attrs.frozen
class Outcome:
    """One test's result: ``passed``, ``failed``, ``error`` or ``skipped``, and why."""

    result: str
    message: str = ""


def launcher_script(path: Path, arm: str, model: Path, llama_server: str | None,
                    socket_dir: Path) -> Path:
    """Write the executable the suite starts as its ``llama-server``."""
    command = [sys.executable, "-m", "meshd.bench.peer_launcher", "--arm", arm,
               "--model", str(model), "--meshd", str(Path(sys.executable).parent / "meshd"),
               "--socket-dir", str(socket_dir)]
    if llama_server:
        command += ["--llama-server", llama_server]
    path.write_text(f"#!/bin/sh\nexec {shlex.join(command)} -- \"$@\"\n")
    path.chmod(0o755)
    return path


def read_junit(path: Path) -> dict[str, Outcome]:
    """Every test case of a pytest JUnit XML report, by ``file::name``."""
    outcomes: dict[str, Outcome] = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        test_id = f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name', '')}"
        outcome = Outcome("passed")
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                text = node.get("message") or (node.text or "")
                outcome = Outcome("failed" if tag == "failure" else tag,
                                  text.strip().splitlines()[0][:200] if text.strip() else "")
                break
        outcomes[test_id] = outcome
    return outcomes


def run_arm(arm: str, suite: Path, model: Path, llama_server: str | None,
            tests: Sequence[str], extra: Sequence[str], log: Path) -> dict[str, Outcome]:
    """Run the suite's ``tests`` with ``arm`` as its server; the outcomes by test."""
    with tempfile.TemporaryDirectory(prefix=f"meshd-peer-{arm}-") as tmp:
        tmp_dir = Path(tmp)
        script = launcher_script(tmp_dir / "llama-server", arm, model, llama_server, tmp_dir)
        junit = tmp_dir / "junit.xml"
        env = clean_env()
        env["LLAMA_SERVER_BIN_PATH"] = str(script)
        env["PORT"] = str(free_port())  # not the suite's 8080: another run may hold it
        env.pop("SLOW_TESTS", None)
        env.pop("DEBUG_EXTERNAL", None)
        command = [sys.executable, "-m", "pytest", "-p", "meshd.bench.peer_plugin",
                   "-p", "no:cacheprovider", "-q", f"--junitxml={junit}",
                   *(f"unit/test_{name}.py" for name in tests), *extra]
        with log.open("w") as out:
            subprocess.run(command, cwd=suite, env=env, stdout=out, stderr=subprocess.STDOUT,
                           check=False)
        if not junit.exists():
            raise RuntimeError(f"the suite wrote no report for {arm}; see {log}")
        return read_junit(junit)


def compare(outcomes: Mapping[str, Mapping[str, Outcome]]) -> dict[str, Any]:
    """The share of llama-server's passes that meshd passes, and every difference."""
    peer, ours = outcomes["llama-server"], outcomes["meshd"]
    peer_passed = sorted(t for t, o in peer.items() if o.result == "passed")
    both = [t for t in peer_passed if ours.get(t, Outcome("missing")).result == "passed"]
    only_peer = {t: attrs.asdict(ours.get(t, Outcome("missing"))) for t in peer_passed
                 if t not in both}
    only_ours = sorted(t for t, o in ours.items()
                       if o.result == "passed" and peer.get(t, Outcome("")).result != "passed")
    counts = {arm: {r: sum(o.result == r for o in res.values())
                    for r in ("passed", "failed", "error", "skipped")}
              for arm, res in outcomes.items()}
    return {"tests": len(peer), "counts": counts, "llama_server_passed": len(peer_passed),
            "meshd_passed_of_those": len(both),
            "share": len(both) / len(peer_passed) if peer_passed else None,
            "only_llama_server": only_peer, "only_meshd": only_ours}


def format_comparison(report: Mapping[str, Any]) -> str:
    """The comparison as text: counts, the share, and each test only one server passed."""
    lines = [f"meshd bench-peer-suite: {report['tests']} tests of llama.cpp's server suite, "
             f"model {report['model']}"]
    for arm, c in report["counts"].items():
        lines.append(f"  {arm:<13} passed {c['passed']:>3}  failed {c['failed']:>3}  "
                     f"error {c['error']:>3}  skipped {c['skipped']:>3}")
    share = report["share"]
    lines.append(f"meshd passes {report['meshd_passed_of_those']} of the "
                 f"{report['llama_server_passed']} tests llama-server passes"
                 + (f": {share:.1%}" if share is not None else ""))
    if report["only_llama_server"]:
        lines.append("passed by llama-server only:")
        for test, o in report["only_llama_server"].items():
            lines.append(f"  {test}: {o['result']}: {o['message']}")
    if report["only_meshd"]:
        lines.append("passed by meshd only:")
        lines += [f"  {test}" for test in report["only_meshd"]]
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """``meshd bench-peer-suite`` options."""
    p.add_argument("--suite", type=Path, required=True, metavar="DIR",
                   help="llama.cpp's tools/server/tests folder (from the llama-cpp-python "
                        "sdist's vendor/llama.cpp)")
    p.add_argument("--llama-server", metavar="PATH",
                   help="llama.cpp's llama-server (default: llama-server on PATH)")
    p.add_argument("-m", "--model", type=Path, default=None, metavar="PATH",
                   help="the GGUF both servers get (default: the embedded SmolLM2)")
    p.add_argument("--test", action="append", default=[], metavar="NAME",
                   help=f"a test file, unit/test_NAME.py (repeatable; default: "
                        f"{', '.join(DEFAULT_TESTS)})")
    p.add_argument("--logs", type=Path, default=Path("."), metavar="DIR",
                   help="where each arm's pytest output goes (default: .)")
    p.add_argument("--slow", action="store_true",
                   help="also run the tests the suite marks slow (they expect other, "
                        "larger models)")
    p.add_argument("--json", metavar="FILE", help="also write the comparison as JSON")
    p.add_argument("pytest_args", nargs="*", metavar="PYTEST_ARG",
                   help="more pytest arguments, after --, for both arms (-k EXPR, ...)")


def cmd_bench_peer_suite(args: argparse.Namespace) -> int:
    """Run both arms one after the other; exit 0, or 2 when something is missing."""
    import json

    from meshd.native.default_model import default_model_path

    from .e2e_arms import find_llama_server

    suite = args.suite.resolve()
    if not (suite / "unit").is_dir() or not (suite / "utils.py").is_file():
        print(f"meshd bench-peer-suite: {suite} is not llama.cpp's tools/server/tests",
              file=sys.stderr)
        return 2
    llama_server, why = find_llama_server(args.llama_server)
    if llama_server is None:
        print(f"meshd bench-peer-suite: {why}", file=sys.stderr)
        return 2
    model = (args.model or default_model_path()).resolve()
    tests = tuple(args.test) or DEFAULT_TESTS
    args.logs.mkdir(parents=True, exist_ok=True)
    extra = [*([] if args.slow else ["-m", "not slow"]), *args.pytest_args]
    outcomes = {}
    for arm in ARMS:
        log = args.logs / f"peer-suite-{arm}.log"
        print(f"meshd bench-peer-suite: running {len(tests)} files against {arm} "
              f"(output: {log})", file=sys.stderr, flush=True)
        outcomes[arm] = run_arm(arm, suite, model, llama_server, tests, extra, log)
    report = {"model": str(model), **compare(outcomes),
              "outcomes": {arm: {t: attrs.asdict(o) for t, o in res.items()}
                           for arm, res in outcomes.items()}}
    print(format_comparison(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0
