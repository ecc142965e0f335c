"""``meshd bench-peer-suite``'s pure parts: llama-server's command lines mapped onto
``meshd serve`` (and onto llama-server with the fixed model), and the comparison of two
JUnit reports."""

from __future__ import annotations

from pathlib import Path

from meshd.bench.llama_server_flags import llama_server_argv, meshd_serve_argv, without_model
from meshd.bench.peer_suite import Outcome, compare, read_junit

MODEL = Path("/models/smol.gguf")
SOCK = Path("/tmp/s.sock")
SUITE = ["--port", "8123", "--temp", "0.8", "--seed", "42", "--host", "127.0.0.1",
         "--offline", "--hf-repo", "ggml-org/test-model-stories260K", "--batch-size", "32",
         "--no-slots", "--alias", "tinyllama-2,fim", "--ctx-size", "512", "--parallel", "2",
         "--n-predict", "64", "--api-key", "k", "--jinja", "--reasoning", "off",
         "--chat-template-file", "../t.jinja", "--tags", "chat,small", "--verbose",
         "--chat-template", "command-r"]


def test_model_flags_are_replaced_by_the_fixed_file() -> None:
    assert without_model(["--hf-repo", "a/b", "--hf-file=x.gguf", "-m", "y", "--offline",
                          "--port", "1"]) == ["--port", "1"]
    argv = llama_server_argv("/bin/llama-server", SUITE, MODEL)
    assert argv[0] == "/bin/llama-server" and argv[-2:] == ["--model", str(MODEL)]
    assert "--hf-repo" not in argv and "--offline" not in argv and "--jinja" in argv


def test_meshd_serve_gets_what_llama_server_was_asked() -> None:
    serve = meshd_serve_argv("meshd", SUITE, MODEL, SOCK)
    argv = list(serve.argv)

    def value(flag: str) -> str:
        return argv[argv.index(flag) + 1]

    assert argv[:2] == ["meshd", "serve"]
    # llama-server's id: the first alias in sorted order; the others stay aliases
    assert value("-m") == f"fim={MODEL}" and value("--alias") == "tinyllama-2"
    assert value("--tags") == "chat,small"
    assert "--verbose-responses" in argv  # its --verbose: answers carry __verbose
    assert value("--http") == "tcp:127.0.0.1:8123"
    assert value("-c") == "256"  # 512 split over 2 slots, as llama-server splits it
    assert value("--slots") == "2"
    assert value("--max-tokens") == "64"
    assert value("--api-key") == "k"
    assert value("--seed") == "42"
    assert value("--reasoning") == "off"
    assert value("--chat-template") == "command-r"
    assert value("--chat-template-file") == str(Path("../t.jinja").resolve())
    assert value("-s") == str(SOCK)
    assert "--temp" in serve.ignored and "--jinja" in serve.ignored
    assert "--no-slots-endpoint" in serve.argv  # llama-server's --no-slots
    on = meshd_serve_argv("meshd", ["--slots", "--host", "127.0.0.1,::1"], MODEL, SOCK).argv
    assert on[on.index("--http") + 1] == "tcp:127.0.0.1:8080,tcp:[::1]:8080"
    assert "--no-slots-endpoint" not in on and "--slots-endpoint" not in on


def test_auto_parallel_is_four_unified_slots() -> None:
    argv = list(meshd_serve_argv("meshd", ["--ctx-size", "4096"], MODEL, SOCK).argv)
    assert argv[argv.index("-c") + 1] == "4096" and argv[argv.index("--slots") + 1] == "4"
    argv = list(meshd_serve_argv("meshd", ["--spec-type", "ngram-simple",
                                           "--spec-draft-n-max", "8"], MODEL, SOCK).argv)
    assert argv[argv.index("--proposer") + 1] == "ngram"
    assert argv[argv.index("--draft-max") + 1] == "8"


JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite>
<testcase classname="unit.test_basic" name="test_a"/>
<testcase classname="unit.test_basic" name="test_b">
<failure message="assert 404 == 200">x</failure></testcase>
<testcase classname="unit.test_basic" name="test_c"><skipped message="no IPv6"/></testcase>
<testcase classname="unit.test_basic" name="test_d"><error message="boom"/></testcase>
</testsuite></testsuites>"""


def test_reports_are_read_and_compared(tmp_path: Path) -> None:
    path = tmp_path / "j.xml"
    path.write_text(JUNIT)
    peer = read_junit(path)
    assert peer == {"test_basic::test_a": Outcome("passed"),
                    "test_basic::test_b": Outcome("failed", "assert 404 == 200"),
                    "test_basic::test_c": Outcome("skipped", "no IPv6"),
                    "test_basic::test_d": Outcome("error", "boom")}
    ours = {**peer, "test_basic::test_a": Outcome("failed", "no"),
            "test_basic::test_b": Outcome("passed")}
    report = compare({"llama-server": peer, "meshd": ours})
    assert report["llama_server_passed"] == 1 and report["meshd_passed_of_those"] == 0
    assert report["share"] == 0.0
    assert report["only_llama_server"] == {"test_basic::test_a": {"result": "failed",
                                                                 "message": "no"}}
    assert report["only_meshd"] == ["test_basic::test_b"]
