"""What a slow or surprising start tells a person at a terminal: progress of the model
load and the calibration, a capped --ctx, a recalibration for other --threads."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import pytest

from meshd.clients.terminal import Progress, format_count, stats_line
from meshd.testing import testmodels


def meshd(*argv: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "meshd", *argv], capture_output=True,
                          text=True, timeout=300,
                          env={**os.environ, "OMP_WAIT_POLICY": "passive", **env})


def test_numbers_and_the_stats_line_are_plain_text() -> None:
    assert [format_count(v) for v in (134_515_008, 4096, 12_345, 2.5e9, 7)] == \
        ["134.5M", "4096", "12.3k", "2.5G", "7"]
    line = stats_line(finish="length", tokens=8, prompt=5, wall_ms=100.0, proposer=None,
                      forwards=7, drafted=0, accepted=0, refusals={"budget": 1, "cost": 2},
                      extra={"id": "x"})
    assert line == ("--\nfinish=length tokens=8 prompt=5 tok/s=80.0 proposer=off "
                    "forwards=7 accepted=0/0 refused=budget:1,cost:2 id=x")


def test_progress_draws_only_on_a_terminal() -> None:
    quiet = io.StringIO()  # not a terminal
    bar = Progress("loading x", stream=quiet)
    bar.update(0.5)
    bar.done()
    assert quiet.getvalue() == ""
    shown = io.StringIO()
    bar = Progress("loading x", stream=shown, force=True)
    bar.update(1.0)
    bar.done()
    assert "meshd: loading x... 100%" in shown.getvalue()
    assert shown.getvalue().endswith("s)\n") and "loading x: done (" in shown.getvalue()


@pytest.mark.slow
@pytest.mark.quiet_machine
def test_generate_shows_load_and_calibration_progress_and_notes(tmp_path: Path) -> None:
    """A first run on a model calibrates (with progress shown); a run with other
    --threads says why it measures again; a --ctx above the training context says it is
    capped. MESHD_PROGRESS=1 stands in for a terminal."""
    model = str(testmodels.test_model_path("llama"))
    env = {"XDG_CACHE_HOME": str(tmp_path), "MESHD_PROGRESS": "1"}
    base = ["generate", "-m", model, "--raw", "-p", "hello", "--max-tokens", "4",
            "--draft-max", "2"]
    first = meshd(*base, "-t", "1", env=env)
    assert first.returncode == 0, first.stderr
    if "other processes are using the CPUs" in first.stderr:
        # Beside busy processes nothing is measured (it would come out wrong) and the run
        # says so; the rest needs a quiet machine (test_idle_calibration covers the load).
        assert "decodes without drafts" in first.stderr
        pytest.skip("other processes keep the machine busy: the calibration waits for quiet")
    assert "meshd: loading " in first.stderr and "100%" in first.stderr
    assert "measuring the verify cost (once per model, threads and machine): done" \
        in first.stderr
    assert "again" not in first.stderr
    cached = meshd(*base, "-t", "1", env=env)
    assert "measuring the verify cost" not in cached.stderr  # the cached curve is used
    other = meshd(*base, "-t", "2", "-c", "100000", env=env)
    assert other.returncode == 0, other.stderr
    assert ("note: measuring the verify cost again for --threads 2: the cached "
            "measurement is for --threads 1") in other.stderr
    assert ("note: --ctx 100000 is more than the model was trained for; using its "
            "training context of 2048") in other.stderr
    quiet = meshd(*base, "-t", "1", env={**env, "MESHD_PROGRESS": "0"})
    assert "meshd: loading" not in quiet.stderr


@pytest.mark.parametrize("fails", [False, True])
def test_build_progress_on_a_terminal(fails: bool) -> None:
    """The first build of llama.cpp shows cmake/ninja's progress on one line."""
    from meshd.native.build import run_with_progress

    script = ("import sys\nfor i in range(1, 5): print(f'[{i}/4] Building CXX object x{i}.o')\n"
              f"sys.exit({1 if fails else 0})")
    shown = io.StringIO()
    if fails:
        with pytest.raises(subprocess.CalledProcessError):
            run_with_progress([sys.executable, "-c", script], what="building llama.cpp",
                              stream=shown, force=True)
        assert "[4/4] Building CXX object x4.o" in shown.getvalue()  # the output's tail
    else:
        run_with_progress([sys.executable, "-c", script], what="building llama.cpp",
                          stream=shown, force=True)
        assert "building llama.cpp... 50%" in shown.getvalue()
        assert "building llama.cpp... 100%" in shown.getvalue()


def test_quantizing_a_bench_model_shows_progress(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    from meshd.bench.arms import requantized

    monkeypatch.setenv("MESHD_PROGRESS", "1")
    src = testmodels.test_model_path("llama")
    out = requantized(src, "q8_0", cache_dir=tmp_path, threads=1)
    assert out.is_file()
    assert f"meshd: quantizing {src.name} to Q8_0 (once; cached): done (" in capsys.readouterr().err
    assert requantized(src, "q8_0", cache_dir=tmp_path, threads=1) == out
    assert "quantizing" not in capsys.readouterr().err  # cached: nothing to show
