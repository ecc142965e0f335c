"""Tests for meshd.native.build: the CMake profile llama-cpp-python is compiled with.

Detection runs the real ``_run`` (subprocess) against stub ``nvcc`` / ``nvidia-smi``
shell scripts in ``tmp_path`` that print real tool output; ``which`` only searches the
stub directories, so whatever the host has (CI's /usr/local/bin/nvcc, a real GPU) never
leaks in. Nothing here builds or installs anything.
"""

from __future__ import annotations

import functools
import json
import shutil
import sys
from collections.abc import Callable, Mapping
from pathlib import Path

import pytest

from meshd.native import build
from meshd.native.build import (
    LLAMA_CPP_VERSION,
    BuildProfile,
    BuildProfileError,
    cuda_architectures,
    is_current,
    marker_path,
    parse_nvcc_version,
    parse_nvidia_smi_cuda_version,
    select_profile,
)

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="stub tools are sh scripts")

PRE_BLACKWELL = "61;75;80;86;87;89;90"

NVCC_12_6 = """\
nvcc: NVIDIA (R) Cuda compiler driver
Copyright (c) 2005-2024 NVIDIA Corporation
Built on Thu_Sep_12_02:18:05_PDT_2024
Cuda compilation tools, release 12.6, V12.6.77
Build cuda_12.6.r12.6/compiler.34841621_0
"""

NVCC_12_8 = """\
nvcc: NVIDIA (R) Cuda compiler driver
Copyright (c) 2005-2025 NVIDIA Corporation
Built on Fri_Jan__6_16:45:21_PST_2025
Cuda compilation tools, release 12.8, V12.8.61
Build cuda_12.8.r12.8/compiler.35404655_0
"""

NVCC_13_0 = """\
nvcc: NVIDIA (R) Cuda compiler driver
Copyright (c) 2005-2025 NVIDIA Corporation
Built on Wed_Jul_16_07:30:01_PM_PDT_2025
Cuda compilation tools, release 13.0, V13.0.48
Build cuda_13.0.r13.0/compiler.36260728_0
"""

SMI_12_8 = """\
Tue Jan 14 10:12:03 2025
+-----------------------------------------------------------------------------------------+
| NVIDIA-SMI 570.86.15              Driver Version: 570.86.15      CUDA Version: 12.8     |
|-----------------------------------------+------------------------+----------------------+
| GPU  Name                 Persistence-M | Bus-Id          Disp.A | Volatile Uncorr. ECC |
| Fan  Temp   Perf          Pwr:Usage/Cap |           Memory-Usage | GPU-Util  Compute M. |
|                                         |                        |               MIG M. |
|=========================================+========================+======================|
|   0  NVIDIA H100 80GB HBM3          On  |   00000000:19:00.0 Off |                    0 |
| N/A   31C    P0             70W /  700W |       1MiB /  81559MiB |      0%      Default |
|                                         |                        |             Disabled |
+-----------------------------------------+------------------------+----------------------+
"""

SMI_LIST = "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-4b1e7f0c-2d5a-8c3e-9f6b-1a2b3c4d5e6f)\n"

SMI_NO_DRIVER = (
    "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. "
    "Make sure that the latest NVIDIA driver is installed and running.\n"
)


# --------------------------------------------------------------------------- stubs


class Tools:
    """Stub executables in ``tmp_path``; every call is appended to ``calls.log``."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.bindir = root / "bin"  # what PATH (our ``which``) searches
        self.bindir.mkdir()
        self.log = root / "calls.log"
        self.log.touch()

    def stub(self, path: Path, body: str) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        # Own PATH: tests may point the caller's PATH at the stub dir alone (no ``cat``).
        path.write_text(
            f'#!/bin/sh\nPATH=/usr/bin:/bin\necho "{path} $*" >> "{self.log}"\n{body}'
        )
        path.chmod(0o755)
        return path

    def nvcc(self, text: str, where: Path | None = None) -> Path:
        return self.stub(
            where or self.bindir / "nvcc",
            f'[ "$1" = "--version" ] || exit 1\ncat <<\'EOF\'\n{text}EOF\n',
        )

    def nvidia_smi(self, gpu: bool = True) -> Path:
        if gpu:
            body = (
                f'if [ "$1" = "-L" ]; then\ncat <<\'EOF\'\n{SMI_LIST}EOF\nexit 0\nfi\n'
                f"cat <<'EOF'\n{SMI_12_8}EOF\n"
            )
        else:  # driver tools installed, no usable GPU
            body = (
                'if [ "$1" = "-L" ]; then echo "No devices were found"; exit 6; fi\n'
                f"cat <<'EOF'\n{SMI_NO_DRIVER}EOF\nexit 9\n"
            )
        return self.stub(self.bindir / "nvidia-smi", body)

    @property
    def which(self) -> Callable[[str], str | None]:
        return functools.partial(shutil.which, path=str(self.bindir))

    def calls(self) -> list[str]:
        return self.log.read_text().splitlines()

    def select(
        self, env: Mapping[str, str], system: str = "Linux", machine: str = "x86_64"
    ) -> BuildProfile:
        return select_profile(env=env, system=system, machine=machine, which=self.which)


@pytest.fixture
def tools(tmp_path: Path) -> Tools:
    return Tools(tmp_path)


def cuda_arch_arg(profile: BuildProfile) -> str:
    (arg,) = [a for a in profile.cmake_args if a.startswith("-DCMAKE_CUDA_ARCHITECTURES=")]
    return arg.split("=", 1)[1]


# --------------------------------------------------------------------------- version -> archs


@pytest.mark.parametrize(
    ("version", "expected"),
    [
        ((11, 8), PRE_BLACKWELL),
        ((12, 0), PRE_BLACKWELL),
        ((12, 6), PRE_BLACKWELL),
        ((12, 7), PRE_BLACKWELL),
        ((12, 8), PRE_BLACKWELL + ";100;120"),
        ((12, 9), PRE_BLACKWELL + ";100;103;120;121"),
        # CUDA 13 cannot compile for anything below Turing: nvcc rejects sm_61.
        ((13, 0), "75;80;86;87;89;90;100;103;120;121"),
        ((13, 1), "75;80;86;87;89;90;100;103;120;121"),
    ],
)
def test_cuda_architectures_by_toolkit(version: tuple[int, int], expected: str) -> None:
    assert ";".join(cuda_architectures(version)) == expected


def test_blackwell_boundary_is_12_8() -> None:
    assert "100" not in cuda_architectures((12, 7))
    assert "120" not in cuda_architectures((12, 7))
    assert {"100", "120"} <= set(cuda_architectures((12, 8)))
    assert not {"103", "121"} & set(cuda_architectures((12, 8)))
    assert {"100", "103", "120", "121"} <= set(cuda_architectures((13, 0)))


def test_cuda_architectures_sorted_numerically() -> None:
    for version in [(12, 6), (12, 8), (12, 9), (13, 0)]:
        archs = cuda_architectures(version)
        assert archs == sorted(archs, key=int)
        assert len(set(archs)) == len(archs)


def test_parse_nvcc_version() -> None:
    assert parse_nvcc_version(NVCC_12_6) == (12, 6)
    assert parse_nvcc_version(NVCC_12_8) == (12, 8)
    assert parse_nvcc_version(NVCC_13_0) == (13, 0)
    assert parse_nvcc_version("Cuda compilation tools, V12.4.131") == (12, 4)
    assert parse_nvcc_version("") is None
    assert parse_nvcc_version("gcc (GCC) 13.2.0") is None


def test_parse_nvidia_smi_cuda_version() -> None:
    assert parse_nvidia_smi_cuda_version(SMI_12_8) == (12, 8)
    assert parse_nvidia_smi_cuda_version(SMI_NO_DRIVER) is None


# --------------------------------------------------------------------------- detection


def test_cudacxx_wins_over_nvcc_and_path(tools: Tools) -> None:
    cudacxx = tools.nvcc(NVCC_13_0, tools.root / "cuda-13.0" / "bin" / "nvcc")
    nvcc_env = tools.nvcc(NVCC_12_8, tools.root / "cuda-12.8" / "bin" / "nvcc")
    tools.nvcc(NVCC_12_6)  # on PATH
    env = {"MESHD_GPU": "cuda", "CUDACXX": str(cudacxx), "NVCC": str(nvcc_env)}
    prof = tools.select(env)
    assert prof.name == "cuda"
    assert cuda_arch_arg(prof) == ";".join(cuda_architectures((13, 0)))
    assert "-DGGML_CUDA=on" in prof.cmake_args
    assert prof.notes == (f"CUDA 13.0 toolkit at {cudacxx}",)
    assert tools.calls() == [f"{cudacxx} --version"]


def test_nvcc_env_wins_over_path(tools: Tools) -> None:
    nvcc_env = tools.nvcc(NVCC_12_8, tools.root / "cuda-12.8" / "bin" / "nvcc")
    tools.nvcc(NVCC_12_6)
    tools.nvidia_smi()
    prof = tools.select({"MESHD_GPU": "cuda", "NVCC": str(nvcc_env)})
    assert cuda_arch_arg(prof) == PRE_BLACKWELL + ";100;120"
    assert prof.notes == (f"CUDA 12.8 toolkit at {nvcc_env}",)
    assert tools.calls() == [f"{nvcc_env} --version"]


def test_empty_cudacxx_is_ignored(tools: Tools) -> None:
    nvcc = tools.nvcc(NVCC_12_6)
    prof = tools.select({"MESHD_GPU": "cuda", "CUDACXX": "", "NVCC": ""})
    assert cuda_arch_arg(prof) == PRE_BLACKWELL
    assert prof.notes == (f"CUDA 12.6 toolkit at {nvcc}",)


def test_path_nvcc_used_otherwise(tools: Tools) -> None:
    nvcc = tools.nvcc(NVCC_12_6)
    tools.nvidia_smi()  # reports 12.8, but the compiler decides
    prof = tools.select({"MESHD_GPU": "cuda"})
    assert cuda_arch_arg(prof) == PRE_BLACKWELL
    assert prof.notes == (f"CUDA 12.6 toolkit at {nvcc}",)
    assert not any("nvidia-smi" in n for n in prof.notes)
    assert tools.calls() == [f"{nvcc} --version"]  # nvidia-smi never asked


def test_nvidia_smi_fallback_only_without_compiler(tools: Tools) -> None:
    smi = tools.nvidia_smi()
    prof = tools.select({"MESHD_GPU": "cuda"})
    assert cuda_arch_arg(prof) == PRE_BLACKWELL + ";100;120"
    (note,) = prof.notes
    assert "no CUDA compiler found" in note
    assert "nvidia-smi" in note
    assert "12.8" in note
    assert tools.calls() == [f"{smi} "]


def test_detect_cuda_toolkit_reports_source(tools: Tools) -> None:
    assert build.detect_cuda_toolkit({}, which=tools.which) is None
    smi = tools.nvidia_smi()
    assert build.detect_cuda_toolkit({}, which=tools.which) == build.CudaToolkit((12, 8), str(smi))
    nvcc = tools.nvcc(NVCC_13_0)
    assert build.detect_cuda_toolkit({}, which=tools.which) == build.CudaToolkit(
        (13, 0), str(nvcc)
    )


@pytest.mark.parametrize("var", ["MESHD_CUDA_ARCHITECTURES", "CMAKE_CUDA_ARCHITECTURES"])
def test_explicit_architectures_override(tools: Tools, var: str) -> None:
    tools.nvcc(NVCC_12_6)
    tools.nvidia_smi()
    prof = tools.select({"MESHD_GPU": "cuda", var: "86, 89;90 120"})
    assert cuda_arch_arg(prof) == "86;89;90;120"
    assert prof.notes == ("CUDA architectures from the environment: 86;89;90;120",)
    assert tools.calls() == []  # no detection at all


def test_meshd_architectures_beat_cmake_architectures(tools: Tools) -> None:
    env = {
        "MESHD_GPU": "cuda",
        "MESHD_CUDA_ARCHITECTURES": "89",
        "CMAKE_CUDA_ARCHITECTURES": "61",
    }
    assert cuda_arch_arg(tools.select(env)) == "89"


def test_override_works_with_nothing_installed(tools: Tools) -> None:
    prof = tools.select({"MESHD_GPU": "cuda", "MESHD_CUDA_ARCHITECTURES": "90"})
    assert prof.cmake_args == ("-DGGML_CUDA=on", "-DCMAKE_CUDA_ARCHITECTURES=90", build.RPC_ON)


def test_cuda_requested_nothing_found_raises(tools: Tools) -> None:
    with pytest.raises(BuildProfileError, match="MESHD_CUDA_ARCHITECTURES"):
        tools.select({"MESHD_GPU": "cuda"})


def test_cuda_requested_broken_tools_raises(tools: Tools) -> None:
    tools.stub(tools.bindir / "nvcc", "echo 'segfault' >&2\nexit 139\n")
    tools.nvidia_smi(gpu=False)
    with pytest.raises(BuildProfileError):
        tools.select({"MESHD_GPU": "CUDA"})


# --------------------------------------------------------------------------- auto mode


def test_auto_toolkit_without_gpu_is_cpu(tools: Tools) -> None:
    """CPU CI machines have /usr/local/bin/nvcc but no GPU: that must not mean CUDA."""
    tools.nvcc(NVCC_12_8)
    prof = tools.select({})
    assert prof.name == "cpu-x86"
    assert not any("CUDA" in a for a in prof.cmake_args)
    assert tools.calls() == []


def test_auto_nvidia_smi_without_devices_is_cpu(tools: Tools) -> None:
    tools.nvcc(NVCC_12_8)
    smi = tools.nvidia_smi(gpu=False)
    prof = tools.select({"MESHD_GPU": "auto"})
    assert prof.name == "cpu-x86"
    assert tools.calls() == [f"{smi} -L"]


def test_auto_gpu_listed_is_cuda(tools: Tools) -> None:
    nvcc = tools.nvcc(NVCC_13_0)
    smi = tools.nvidia_smi()
    prof = tools.select({})
    assert prof.name == "cuda"
    assert cuda_arch_arg(prof) == "75;80;86;87;89;90;100;103;120;121"
    assert tools.calls() == [f"{smi} -L", f"{nvcc} --version"]


def test_auto_gpu_without_compiler_uses_driver_version(tools: Tools) -> None:
    smi = tools.nvidia_smi()
    prof = tools.select({})
    assert prof.name == "cuda"
    assert cuda_arch_arg(prof) == PRE_BLACKWELL + ";100;120"
    assert any("nvidia-smi" in n for n in prof.notes)
    assert tools.calls() == [f"{smi} -L", f"{smi} "]


def test_gpu_present(tools: Tools) -> None:
    assert build.gpu_present(which=tools.which) is False
    tools.nvidia_smi(gpu=False)
    assert build.gpu_present(which=tools.which) is False
    tools.nvidia_smi(gpu=True)
    assert build.gpu_present(which=tools.which) is True


def test_darwin_auto_is_metal(tools: Tools) -> None:
    tools.nvidia_smi()  # ignored on macOS
    prof = tools.select({}, system="Darwin", machine="arm64")
    assert prof.name == "metal"
    assert prof.cmake_args == ("-DGGML_METAL=on", build.RPC_ON)
    assert tools.calls() == []


# --------------------------------------------------------------------------- cpu / extras


@pytest.mark.parametrize("machine", ["x86_64", "AMD64", "i686"])
def test_x86_cpu_profile_keeps_amx_off(tools: Tools, machine: str) -> None:
    prof = tools.select({"MESHD_GPU": "cpu"}, machine=machine)
    assert prof.name == "cpu-x86"
    assert "-DGGML_NATIVE=ON" in prof.cmake_args
    assert "-DCMAKE_C_FLAGS=-mno-amx-int8" in prof.cmake_args
    assert "-DCMAKE_CXX_FLAGS=-mno-amx-int8" in prof.cmake_args
    assert any("AMX" in n for n in prof.notes)


@pytest.mark.parametrize("machine", ["aarch64", "arm64"])
def test_arm_cpu_profile_has_no_amx_flags(tools: Tools, machine: str) -> None:
    prof = tools.select({}, machine=machine)
    assert prof.name == "cpu"
    assert prof.cmake_args == ("-DGGML_NATIVE=ON", build.RPC_ON)
    assert not any("amx" in a.lower() for a in prof.cmake_args)


@pytest.mark.parametrize(
    ("env", "machine", "system"),
    [
        ({"MESHD_GPU": "cpu"}, "x86_64", "Linux"),
        ({"MESHD_GPU": "cpu"}, "aarch64", "Linux"),
        ({"MESHD_GPU": "metal"}, "arm64", "Darwin"),
        ({"MESHD_GPU": "cuda", "MESHD_CUDA_ARCHITECTURES": "89"}, "x86_64", "Linux"),
    ],
)
def test_extra_cmake_args_appended(
    tools: Tools, env: dict[str, str], machine: str, system: str
) -> None:
    base = tools.select(env, system=system, machine=machine)
    extra_env = {**env, "MESHD_EXTRA_CMAKE_ARGS": "  -DGGML_CCACHE=OFF   -DLLAMA_CURL=OFF "}
    prof = tools.select(extra_env, system=system, machine=machine)
    assert prof.cmake_args == (*base.cmake_args, "-DGGML_CCACHE=OFF", "-DLLAMA_CURL=OFF")
    assert prof.name == base.name
    assert prof.notes == base.notes
    assert prof.key() != base.key()


@pytest.mark.parametrize(
    ("env", "machine", "system"),
    [
        ({"MESHD_GPU": "cpu"}, "x86_64", "Linux"),
        ({"MESHD_GPU": "cpu"}, "aarch64", "Linux"),
        ({"MESHD_GPU": "metal"}, "arm64", "Darwin"),
        ({"MESHD_GPU": "cuda", "MESHD_CUDA_ARCHITECTURES": "89"}, "x86_64", "Linux"),
        ({}, "x86_64", "Linux"),
    ],
)
def test_every_profile_builds_the_rpc_backend(
    tools: Tools, env: dict[str, str], machine: str, system: str
) -> None:
    """`meshd worker` and `serve --rpc` need ggml-rpc in whatever wheel gets built."""
    prof = tools.select(env, system=system, machine=machine)
    assert prof.cmake_args.count("-DGGML_RPC=ON") == 1
    # the flag is part of the wheel-cache key: a wheel built without it is never reused
    without = BuildProfile(prof.name, tuple(a for a in prof.cmake_args if a != build.RPC_ON))
    assert prof.key() != without.key()


@pytest.mark.parametrize("value", ["rocm", "gpu", "vulkan", "yes"])
def test_invalid_meshd_gpu_raises(tools: Tools, value: str) -> None:
    with pytest.raises(BuildProfileError, match="MESHD_GPU"):
        tools.select({"MESHD_GPU": value})


def test_meshd_gpu_is_case_insensitive(tools: Tools) -> None:
    assert tools.select({"MESHD_GPU": "CPU"}).name == "cpu-x86"
    assert tools.select({"MESHD_GPU": "Metal"}).name == "metal"


# --------------------------------------------------------------------------- key / marker

CPU = BuildProfile("cpu-x86", ("-DGGML_NATIVE=ON", *build.AMX_OFF))


def test_profile_key_is_stable() -> None:
    same = BuildProfile("cpu-x86", ("-DGGML_NATIVE=ON", *build.AMX_OFF), notes=("other",))
    assert CPU.key() == same.key()  # notes are not part of the build
    assert len(CPU.key()) == 16
    int(CPU.key(), 16)
    assert CPU.as_json() == {
        "version": LLAMA_CPP_VERSION,
        "name": "cpu-x86",
        "cmake_args": list(CPU.cmake_args),
        "key": CPU.key(),
    }


def test_profile_key_differs_per_flags_and_name() -> None:
    keys = {
        CPU.key(),
        BuildProfile("cpu-x86", ("-DGGML_NATIVE=ON",)).key(),
        BuildProfile("cpu", CPU.cmake_args).key(),
        BuildProfile("cpu-x86", tuple(reversed(CPU.cmake_args))).key(),
        BuildProfile("cuda", ("-DGGML_CUDA=on", "-DCMAKE_CUDA_ARCHITECTURES=90")).key(),
        BuildProfile("cuda", ("-DGGML_CUDA=on", "-DCMAKE_CUDA_ARCHITECTURES=89;90")).key(),
    }
    assert len(keys) == 6


def test_runtime_patches_key_the_build(tmp_path: Path,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A changed runtime patch is a new build (a wheel built without it is never reused)."""
    assert [p.name for p in build.patches()] == ["llama-attn-kernel.patch"]
    patch = tmp_path / "a.patch"
    patch.write_text("one")
    monkeypatch.setattr(build, "PATCHES_DIR", tmp_path)
    first = CPU.key()
    patch.write_text("two")
    assert CPU.key() != first


def test_wheel_cache_is_keyed_by_profile(tmp_path: Path) -> None:
    env = {"XDG_CACHE_HOME": str(tmp_path)}
    other = BuildProfile("cpu-x86", ("-DGGML_NATIVE=ON",))
    assert build.wheel_cache_dir(CPU, env) == tmp_path / "meshd" / "llama-wheels" / CPU.key()
    assert build.wheel_cache_dir(CPU, env) != build.wheel_cache_dir(other, env)


def test_marker_path(tmp_path: Path) -> None:
    assert marker_path(str(tmp_path)) == tmp_path / "share" / "meshd" / "llama-build.json"
    assert marker_path() == Path(sys.prefix) / "share" / "meshd" / "llama-build.json"


def _write_marker(prefix: Path, payload: object) -> None:
    mark = marker_path(str(prefix))
    mark.parent.mkdir(parents=True, exist_ok=True)
    mark.write_text(json.dumps(payload))


def test_is_current(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    versions: list[str | None] = [LLAMA_CPP_VERSION]
    monkeypatch.setattr(build, "installed_version", lambda python: versions[0])
    prefix = str(tmp_path)

    assert is_current(CPU, "python", prefix) is False  # no marker

    _write_marker(tmp_path, BuildProfile("cpu-x86", ("-DGGML_NATIVE=ON",)).as_json())
    assert is_current(CPU, "python", prefix) is False  # other flags

    _write_marker(tmp_path, CPU.as_json())
    assert is_current(CPU, "python", prefix) is True

    versions[0] = "0.3.16"  # someone pip-installed another version over it
    assert is_current(CPU, "python", prefix) is False
    versions[0] = None  # not installed any more
    assert is_current(CPU, "python", prefix) is False


@pytest.mark.parametrize("content", ["", "{not json", "[]", '"cpu-x86"', "null"])
def test_is_current_tolerates_bad_marker(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, content: str
) -> None:
    monkeypatch.setattr(build, "installed_version", lambda python: LLAMA_CPP_VERSION)
    mark = marker_path(str(tmp_path))
    mark.parent.mkdir(parents=True)
    mark.write_text(content)
    assert is_current(CPU, "python", str(tmp_path)) is False


# --------------------------------------------------------------------------- main


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch, tools: Tools) -> Tools:
    """os.environ with no build knobs and PATH = the (empty) stub dir."""
    for var in (
        "MESHD_GPU",
        "MESHD_CUDA_ARCHITECTURES",
        "CMAKE_CUDA_ARCHITECTURES",
        "MESHD_EXTRA_CMAKE_ARGS",
        "CUDACXX",
        "NVCC",
    ):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("PATH", str(tools.bindir))
    monkeypatch.setattr(build.platform, "system", lambda: "Linux")
    monkeypatch.setattr(build.platform, "machine", lambda: "x86_64")

    def no_install(*args: object, **kwargs: object) -> bool:
        raise AssertionError("--show must not install")

    monkeypatch.setattr(build, "install", no_install)
    return tools


def _show_json(out: str) -> dict[str, object]:
    data = json.loads(out[out.index("{") :])
    assert isinstance(data, dict)
    return data


def test_main_show_cpu(
    clean_env: Tools, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("MESHD_GPU", "cpu")
    monkeypatch.setenv("MESHD_EXTRA_CMAKE_ARGS", "-DGGML_CCACHE=OFF")
    assert build.main(["--show"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("meshd build: native x86 build with AMX off")
    expected = BuildProfile(
        "cpu-x86", ("-DGGML_NATIVE=ON", *build.AMX_OFF, build.RPC_ON, "-DGGML_CCACHE=OFF")
    ).as_json()
    assert _show_json(out) == expected


def test_main_show_auto_detects_stub_gpu(
    clean_env: Tools, capsys: pytest.CaptureFixture[str]
) -> None:
    nvcc = clean_env.nvcc(NVCC_12_8)
    clean_env.nvidia_smi()
    assert build.main(["--show"]) == 0
    out = capsys.readouterr().out
    assert f"meshd build: CUDA 12.8 toolkit at {nvcc}" in out
    data = _show_json(out)
    assert data["name"] == "cuda"
    assert data["cmake_args"] == [
        "-DGGML_CUDA=on",
        f"-DCMAKE_CUDA_ARCHITECTURES={PRE_BLACKWELL};100;120",
        build.RPC_ON,
    ]
    assert data["version"] == LLAMA_CPP_VERSION


def test_main_show_auto_toolkit_only_is_cpu(
    clean_env: Tools, capsys: pytest.CaptureFixture[str]
) -> None:
    clean_env.nvcc(NVCC_12_8)
    assert build.main(["--show"]) == 0
    assert _show_json(capsys.readouterr().out)["name"] == "cpu-x86"


def test_main_reports_profile_error(
    clean_env: Tools, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("MESHD_GPU", "cuda")
    assert build.main(["--show"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("meshd build: CUDA build requested")
