"""Build profile for llama-cpp-python: compile llama.cpp with the flags this machine needs.

Why this exists: llama-cpp-python 0.3.36 has no Linux wheel, so pip compiles llama.cpp at
install time, and the right CMake flags depend on the machine:

* x86 CPUs that advertise AMX crash (SIGILL in ``ggml_backend_amx_mul_mat``) as soon as a
  quantized model decodes; the native build must keep AMX off (``-mno-amx-int8``).
* CUDA builds must name GPU architectures the *installed* toolkit can compile for:
  Blackwell (100/120) only exists from CUDA 12.8 on (103/121 from 12.9), and CUDA 13
  no longer compiles for Pascal (61).
* pip's wheel cache is keyed by the sdist, not by CMAKE_ARGS, so a wheel built once with
  other flags is silently reused. We keep our own wheel cache keyed by the flags.
* meshd patches the runtime (``native/patches/*.patch``, applied to the sdist before it
  compiles): ``llama_set_attn_kernel`` pins ggml-cpu's flash-attention kernel per
  forward, so that prefill takes the fast tiled kernel while decoding and verify
  windows share one kernel (docs/identity.md says why). The patches key the cache too.

This file uses the standard library only: ``native/bootstrap.py`` runs it before meshd
itself is installed (``python native/build.py``), and it is importable as
``meshd.native.build`` afterwards.
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

LLAMA_CPP_PYTHON = "llama-cpp-python"
LLAMA_CPP_VERSION = "0.3.36"

AMX_OFF = ["-DCMAKE_C_FLAGS=-mno-amx-int8", "-DCMAKE_CXX_FLAGS=-mno-amx-int8"]
# Every profile carries ggml's RPC backend, so `meshd worker` can offer this machine's
# devices to a meshd elsewhere and `meshd serve --rpc` can use remote ones.
RPC_ON = "-DGGML_RPC=ON"
#: Patches applied to the sdist, in name order (``git apply -p1`` from its root).
PATCHES_DIR = Path(__file__).resolve().parent / "patches"
PRE_BLACKWELL_ARCHS = ["61", "75", "80", "86", "87", "89", "90"]
CUDA13_MIN_ARCH = 75  # CUDA 13.0 dropped Maxwell, Pascal and Volta

Runner = Callable[[Sequence[str]], str | None]


class BuildProfileError(RuntimeError):
    """The requested build profile cannot be produced on this machine."""


@dataclass(frozen=True)
class BuildProfile:
    """What to compile llama.cpp with, and why (``notes`` are printed to the user)."""

    name: str
    cmake_args: tuple[str, ...]
    notes: tuple[str, ...] = field(default=())

    def key(self) -> str:
        """Stable identity of the build: version + flags + patches (keys our wheel cache)."""
        blob = json.dumps([LLAMA_CPP_VERSION, self.name, list(self.cmake_args),
                           [hashlib.sha256(p.read_bytes()).hexdigest() for p in patches()]])
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    def as_json(self) -> dict[str, object]:
        return {
            "version": LLAMA_CPP_VERSION,
            "name": self.name,
            "cmake_args": list(self.cmake_args),
            "key": self.key(),
        }


# --------------------------------------------------------------------------- CUDA


def parse_nvcc_version(text: str) -> tuple[int, int] | None:
    """Read the toolkit release from ``nvcc --version`` ("... release 12.8, V12.8.61")."""
    m = re.search(r"release\s+(\d+)\.(\d+)", text)
    if m is None:
        m = re.search(r"\bV(\d+)\.(\d+)", text)
    return (int(m.group(1)), int(m.group(2))) if m else None


def parse_nvidia_smi_cuda_version(text: str) -> tuple[int, int] | None:
    """Read the driver's CUDA version from ``nvidia-smi`` ("CUDA Version: 12.8")."""
    m = re.search(r"CUDA Version:\s*(\d+)\.(\d+)", text)
    return (int(m.group(1)), int(m.group(2))) if m else None


def cuda_architectures(version: tuple[int, int]) -> list[str]:
    """GPU architectures a toolkit of ``version`` can compile for.

    < 12.8: up to Hopper. 12.8+: add Blackwell 100 and 120. 12.9+ and 13.x also know the
    103 and 121 variants. 13.0 removed offline compilation below Turing (``nvcc fatal:
    Unsupported gpu architecture 'compute_61'``), so 13.x drops Pascal's 61.
    """
    archs = list(PRE_BLACKWELL_ARCHS)
    if version >= (12, 8):
        archs += ["100", "120"]
    if version >= (12, 9):
        archs += ["103", "121"]
    if version >= (13, 0):
        archs = [a for a in archs if int(a) >= CUDA13_MIN_ARCH]
    return sorted(archs, key=int)


def _run(cmd: Sequence[str]) -> str | None:
    try:
        done = subprocess.run(list(cmd), capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    if done.returncode != 0:
        return None
    return done.stdout + done.stderr


@dataclass(frozen=True)
class CudaToolkit:
    version: tuple[int, int]
    source: str  # which executable told us


def find_cuda_compiler(env: Mapping[str, str], which: Callable[[str], str | None]) -> str | None:
    """The nvcc that CMake will actually use: CUDACXX, then NVCC, then ``nvcc`` on PATH."""
    for var in ("CUDACXX", "NVCC"):
        value = env.get(var)
        if value:
            return value
    return which("nvcc")


def detect_cuda_toolkit(
    env: Mapping[str, str],
    run: Runner = _run,
    which: Callable[[str], str | None] = shutil.which,
) -> CudaToolkit | None:
    """Toolkit version of the compiler that will build; nvidia-smi only as a fallback."""
    compiler = find_cuda_compiler(env, which)
    if compiler is not None:
        out = run([compiler, "--version"])
        version = parse_nvcc_version(out or "")
        if version is not None:
            return CudaToolkit(version, compiler)
    smi = which("nvidia-smi")
    if smi is not None:
        version = parse_nvidia_smi_cuda_version(run([smi]) or "")
        if version is not None:
            return CudaToolkit(version, smi)
    return None


def gpu_present(run: Runner = _run, which: Callable[[str], str | None] = shutil.which) -> bool:
    """An NVIDIA GPU is visible (a toolkit alone, as on CPU CI machines, is not enough)."""
    smi = which("nvidia-smi")
    if smi is None:
        return False
    out = run([smi, "-L"])
    return bool(out and "GPU" in out)


def cuda_profile(
    env: Mapping[str, str],
    run: Runner = _run,
    which: Callable[[str], str | None] = shutil.which,
) -> BuildProfile:
    notes: list[str] = []
    override = env.get("MESHD_CUDA_ARCHITECTURES") or env.get("CMAKE_CUDA_ARCHITECTURES")
    if override:
        archs = [a for a in re.split(r"[;,\s]+", override) if a]
        notes.append(f"CUDA architectures from the environment: {';'.join(archs)}")
    else:
        toolkit = detect_cuda_toolkit(env, run, which)
        if toolkit is None:
            raise BuildProfileError(
                "CUDA build requested but no CUDA compiler (CUDACXX, NVCC, nvcc on PATH) or "
                "nvidia-smi reports a version; set MESHD_CUDA_ARCHITECTURES to override"
            )
        archs = cuda_architectures(toolkit.version)
        major, minor = toolkit.version
        if Path(toolkit.source).name.startswith("nvidia-smi"):
            notes.append(
                f"no CUDA compiler found; using the driver's CUDA {major}.{minor} from "
                f"nvidia-smi to choose architectures (the toolkit that builds may differ)"
            )
        else:
            notes.append(f"CUDA {major}.{minor} toolkit at {toolkit.source}")
    return BuildProfile(
        name="cuda",
        cmake_args=("-DGGML_CUDA=on", f"-DCMAKE_CUDA_ARCHITECTURES={';'.join(archs)}"),
        notes=tuple(notes),
    )


# --------------------------------------------------------------------------- selection


def is_x86(machine: str) -> bool:
    return machine.lower() in {"x86_64", "amd64", "i386", "i686", "x86"}


def select_profile(
    env: Mapping[str, str] = os.environ,
    system: str | None = None,
    machine: str | None = None,
    run: Runner = _run,
    which: Callable[[str], str | None] = shutil.which,
) -> BuildProfile:
    """Pick the profile: ``MESHD_GPU`` (cpu|cuda|metal) wins, else detect."""
    system = system or platform.system()
    machine = machine or platform.machine()
    wanted = (env.get("MESHD_GPU") or "auto").lower()
    if wanted not in {"auto", "cpu", "cuda", "metal"}:
        raise BuildProfileError(f"MESHD_GPU={wanted!r}: expected auto, cpu, cuda or metal")
    if wanted == "auto":
        if system == "Darwin":
            wanted = "metal"
        elif gpu_present(run, which):
            wanted = "cuda"
        else:
            wanted = "cpu"
    extra = (RPC_ON, *(a for a in (env.get("MESHD_EXTRA_CMAKE_ARGS") or "").split() if a))
    if wanted == "cuda":
        prof = cuda_profile(env, run, which)
        return BuildProfile(prof.name, prof.cmake_args + extra, prof.notes)
    if wanted == "metal":
        return BuildProfile("metal", ("-DGGML_METAL=on", *extra), ("Metal (macOS)",))
    if is_x86(machine):
        return BuildProfile(
            "cpu-x86",
            ("-DGGML_NATIVE=ON", *AMX_OFF, *extra),
            ("native x86 build with AMX off (ggml's AMX mat-mul SIGILLs on these CPUs)",),
        )
    return BuildProfile("cpu", ("-DGGML_NATIVE=ON", *extra), ("native CPU build",))


# --------------------------------------------------------------------------- install


def patches() -> list[Path]:
    """The runtime patches meshd applies to llama-cpp-python's sdist, in order."""
    return sorted(PATCHES_DIR.glob("*.patch"))


def patched_sdist(python: str, workdir: Path, log: Callable[[str], None]) -> Path:
    """Download the pinned sdist into ``workdir``, unpack it and apply :func:`patches`;
    returns the source tree to build. A patch that does not apply is an error: a build
    without it would break meshd's identity guarantee silently."""
    subprocess.run([python, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                    "-q", "-d", str(workdir),
                    f"{LLAMA_CPP_PYTHON}=={LLAMA_CPP_VERSION}"], check=True)
    archives = sorted(workdir.glob("llama_cpp_python-*.tar.gz"))
    if not archives:
        raise BuildProfileError(f"pip download produced no sdist in {workdir}")
    shutil.unpack_archive(str(archives[-1]), str(workdir))
    tree = workdir / archives[-1].name.removesuffix(".tar.gz")
    for patch in patches():
        log(f"applying {patch.name}")
        try:
            # The ceiling keeps git from finding a repository above the tree (a TMPDIR
            # inside a checkout would have it apply the patch there, relative to its root).
            subprocess.run(["git", "apply", "-p1", str(patch)], cwd=tree, check=True,
                           env={**os.environ, "GIT_CEILING_DIRECTORIES": str(tree.parent)})
        except (OSError, subprocess.CalledProcessError) as exc:
            raise BuildProfileError(f"cannot apply {patch} to {tree.name}: {exc}") from exc
    return tree


def marker_path(prefix: str | None = None) -> Path:
    """Where we record the profile the environment's llama-cpp-python was built with."""
    return Path(prefix or sys.prefix) / "share" / "meshd" / "llama-build.json"


def installed_version(python: str) -> str | None:
    out = _run(
        [python, "-c", "import importlib.metadata as m; print(m.version('llama-cpp-python'))"]
    )
    return out.strip() if out else None


def is_current(profile: BuildProfile, python: str, prefix: str) -> bool:
    """True when ``python``'s llama-cpp-python already matches ``profile`` (idempotence)."""
    try:
        recorded = json.loads(marker_path(prefix).read_text())
    except (OSError, ValueError):
        return False
    if not isinstance(recorded, dict):
        return False
    return bool(
        recorded.get("key") == profile.key() and installed_version(python) == LLAMA_CPP_VERSION
    )


def wheel_cache_dir(profile: BuildProfile, env: Mapping[str, str] = os.environ) -> Path:
    base = Path(env.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "meshd" / "llama-wheels" / profile.key()


def install(
    profile: BuildProfile,
    python: str = sys.executable,
    prefix: str | None = None,
    log: Callable[[str], None] = print,
) -> bool:
    """Make ``python``'s environment hold llama-cpp-python built with ``profile``.

    Returns False when nothing had to be done. Builds once per profile into our own
    wheel cache (pip's ignores CMAKE_ARGS), then installs that wheel.
    """
    if prefix is None:
        out = _run([python, "-c", "import sys; print(sys.prefix)"])
        if out is None:
            raise BuildProfileError(f"cannot run {python}")
        prefix = out.strip()
    if is_current(profile, python, prefix):
        log(f"llama-cpp-python {LLAMA_CPP_VERSION} already built with profile {profile.name}")
        return False
    cache = wheel_cache_dir(profile)
    wheels = sorted(cache.glob("llama_cpp_python-*.whl"))
    if not wheels:
        cache.mkdir(parents=True, exist_ok=True)
        log(f"building llama-cpp-python {LLAMA_CPP_VERSION} ({profile.name}): "
            f"{' '.join(profile.cmake_args)}; this takes several minutes")
        env = dict(os.environ)
        env["CMAKE_ARGS"] = " ".join(profile.cmake_args)
        env.setdefault("CMAKE_BUILD_PARALLEL_LEVEL", str(os.cpu_count() or 2))
        with tempfile.TemporaryDirectory(prefix="meshd-llama-") as tmp:
            tree = patched_sdist(python, Path(tmp), log)
            command = [python, "-m", "pip", "wheel", "--no-cache-dir", "--no-deps",
                       str(tree), "-w", str(cache)]
            if sys.stderr.isatty():
                command.append("-v")  # the build's step counters, for the progress line
            run_with_progress(command, what=f"building llama.cpp ({profile.name})", env=env)
        wheels = sorted(cache.glob("llama_cpp_python-*.whl"))
        if not wheels:
            raise BuildProfileError(f"pip wheel produced no wheel in {cache}")
    subprocess.run(
        [python, "-m", "pip", "install", "--no-deps", "--force-reinstall", str(wheels[-1])],
        check=True,
    )
    # The bindings' own runtime needs (numpy, jinja2, diskcache, typing-extensions).
    subprocess.run(
        [python, "-m", "pip", "install", "numpy", "jinja2", "diskcache", "typing-extensions"],
        check=True,
    )
    mark = marker_path(prefix)
    mark.parent.mkdir(parents=True, exist_ok=True)
    mark.write_text(json.dumps(profile.as_json(), indent=2) + "\n")
    log(f"installed llama-cpp-python {LLAMA_CPP_VERSION} built with profile {profile.name}")
    return True



_STEP = re.compile(r"\[\s*(\d+)\s*/\s*(\d+)\s*\]|\[\s*(\d+)%\]")


def run_with_progress(cmd: Sequence[str], *, what: str, env: Mapping[str, str] | None = None,
                      stream: TextIO | None = None, force: bool | None = None) -> None:
    """Run a build command; on a terminal show its progress on one line.

    Why: the first build of llama.cpp takes minutes and pip prints nothing meanwhile.
    On a terminal the build's own step counters (ninja's ``[12/345]``, make's ``[ 42%]``)
    become ``building llama.cpp... 42%``; elsewhere (CI logs) the output passes through
    as before. A failure prints the last lines of the output and raises
    ``CalledProcessError``.
    """
    out = stream or sys.stderr
    tty = force if force is not None else out.isatty()
    if not tty:
        subprocess.run(list(cmd), env=None if env is None else dict(env), check=True)
        return
    tail: collections.deque[str] = collections.deque(maxlen=40)
    t0 = time.monotonic()
    out.write(f"{what}...")
    out.flush()
    with subprocess.Popen(list(cmd), env=None if env is None else dict(env),
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          errors="replace") as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            tail.append(line.rstrip())
            match = _STEP.search(line)
            if match is None:
                continue
            if match.group(3) is not None:
                percent = int(match.group(3))
            else:
                percent = int(100 * int(match.group(1)) / max(1, int(match.group(2))))
            out.write(f"\r\x1b[K{what}... {percent}% ({time.monotonic() - t0:.0f}s)")
            out.flush()
        rc = proc.wait()
    out.write("\n")
    if rc != 0:
        out.write("\n".join(tail) + "\n")
        out.flush()
        raise subprocess.CalledProcessError(rc, list(cmd))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m meshd.native.build",
        description="Install llama-cpp-python compiled with this machine's build profile.",
    )
    parser.add_argument("--python", default=sys.executable, help="interpreter to install into")
    parser.add_argument("--show", action="store_true", help="print the profile and exit")
    args = parser.parse_args(argv)
    try:
        profile = select_profile()
    except BuildProfileError as exc:
        print(f"meshd build: {exc}", file=sys.stderr)
        return 2
    for note in profile.notes:
        print(f"meshd build: {note}")
    if args.show:
        print(json.dumps(profile.as_json(), indent=2))
        return 0
    install(profile, python=args.python, log=lambda s: print(f"meshd build: {s}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
