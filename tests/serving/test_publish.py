"""Publishing checkpoints: against a fake vLLM (each failure it gives) and the real embedded server."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import openai
import pytest
import torch

from serving.embedded.server import EmbeddedServer, ServeOptions
from serving.vllm.publish import PublishError, VLLMPublisher, publish_policy

from .fake_vllm import FakeVLLM
from .helpers import WEATHER_TOOL, chat_prompt_ids, recompute_logprobs

# ---------------------------------------------------------------------------------------------
# Against FakeVLLM (httpx.MockTransport): the vLLM contracts and their failures
# ---------------------------------------------------------------------------------------------


def adapter_dir(tmp_path: Path, name: str = "adapter") -> Path:
    d = tmp_path / name
    d.mkdir()
    (d / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8}))
    return d


def weights(path: Path) -> Path:
    """A directory that passes the publisher's pre-reload check: one whole (empty) safetensors file."""
    path.mkdir(parents=True, exist_ok=True)
    header = b"{}"
    (path / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header)
    return path


def publisher(fake: FakeVLLM, **kw) -> VLLMPublisher:
    sleeps: list[float] = []
    pub = VLLMPublisher("http://vllm:8000/v1", httpx.Client(transport=httpx.MockTransport(fake.handler)),
                        backoff_s=0.01, sleep=sleeps.append, **kw)
    pub.sleeps = sleeps  # type: ignore[attr-defined]
    return pub


def test_lora_publish_names_the_version_verifies_it_and_unloads_the_previous(tmp_path):
    fake = FakeVLLM()
    pub = publisher(fake)
    r1 = pub.publish_lora(adapter_dir(tmp_path, "a1"), version=1)
    assert r1.name == "policy@1" and r1.served_models == ["policy", "policy@1"] and r1.unloaded == []
    r2 = pub.publish_lora(adapter_dir(tmp_path, "a2"), version=2)
    assert r2.unloaded == ["policy@1"] and r2.served_models == ["policy", "policy@2"]
    r3 = pub.publish_lora(adapter_dir(tmp_path, "a3"), version=3, keep=None)
    assert r3.served_models == ["policy", "policy@2", "policy@3"]
    assert ("POST", "/v1/load_lora_adapter") in fake.calls and ("GET", "/v1/models") in fake.calls


def test_republishing_a_version_needs_load_inplace(tmp_path):
    fake = FakeVLLM()
    pub = publisher(fake)
    pub.publish_lora(adapter_dir(tmp_path, "a"), version=4)
    with pytest.raises(PublishError, match="load_inplace=True"):
        pub.publish_lora(adapter_dir(tmp_path, "b"), version=4)
    assert pub.publish_lora(tmp_path / "b", version=4, load_inplace=True).served_models == ["policy", "policy@4"]
    assert fake.loras["policy@4"] == str(tmp_path / "b")


def test_missing_runtime_lora_flag_is_named(tmp_path):
    pub = publisher(FakeVLLM(allow_runtime_lora_updating=False))
    with pytest.raises(PublishError, match="VLLM_ALLOW_RUNTIME_LORA_UPDATING=True"):
        pub.publish_lora(adapter_dir(tmp_path), version=1)


def test_missing_enable_lora_is_named(tmp_path):
    pub = publisher(FakeVLLM(enable_lora=False))
    with pytest.raises(PublishError, match="--enable-lora"):
        pub.publish_lora(adapter_dir(tmp_path), version=1)


def test_bad_adapter_path_is_reported_with_the_path(tmp_path):
    pub = publisher(FakeVLLM())
    with pytest.raises(PublishError, match=r"No adapter found for .*nowhere"):
        pub.publish_lora(tmp_path / "nowhere", version=1)


def test_timeouts_and_503_are_retried_then_succeed(tmp_path):
    fake = FakeVLLM(timeout_paths={"/v1/load_lora_adapter": 2}, unavailable_paths={"/v1/models": 1})
    pub = publisher(fake, retries=3)
    assert pub.publish_lora(adapter_dir(tmp_path), version=1).name == "policy@1"
    assert fake.calls.count(("POST", "/v1/load_lora_adapter")) == 3
    assert pub.sleeps == [0.01, 0.02, 0.01]  # type: ignore[attr-defined]


def test_a_load_whose_answer_was_lost_is_not_reported_as_a_conflict(tmp_path):
    fake = FakeVLLM(lost_response_paths={"/v1/load_lora_adapter": 1})
    res = publisher(fake).publish_lora(adapter_dir(tmp_path), version=1)
    assert res.served_models == ["policy", "policy@1"]
    assert fake.calls.count(("POST", "/v1/load_lora_adapter")) == 2
    # but a different adapter under a taken name is still a conflict
    with pytest.raises(PublishError, match="already been loaded"):
        publisher(fake).publish_lora(adapter_dir(tmp_path, "other"), version=1)


def test_a_server_that_keeps_timing_out_fails_with_a_clear_message(tmp_path):
    pub = publisher(FakeVLLM(timeout_paths={"/v1/load_lora_adapter": 99}), retries=2)
    with pytest.raises(PublishError, match=r"failed after 3 attempts: timed out"):
        pub.publish_lora(adapter_dir(tmp_path), version=1)


def test_full_publish_pauses_reloads_resets_and_resumes_in_order(tmp_path):
    fake = FakeVLLM(world_size=2)
    r = publisher(fake).publish_full(weights(tmp_path / "ckpt"), version=5)
    assert fake.weights_path == str(tmp_path / "ckpt") and not fake.paused
    assert [c for c in fake.calls if c[1] != "/v1/models"] == [
        ("POST", "/pause"), ("POST", "/collective_rpc"), ("POST", "/reset_prefix_cache"),
        ("POST", "/update_weight_version"), ("POST", "/resume")]
    assert (r.kind, r.version, r.name) == ("full", 5, "policy") and fake.weight_version == "5"


def test_full_publish_on_vllm_without_weight_versions_still_succeeds(tmp_path):
    fake = FakeVLLM(has_weight_version=False)
    assert publisher(fake).publish_full(weights(tmp_path / "c"), version=2).version == 2
    assert fake.weights_path == str(tmp_path / "c") and fake.calls[-2] == ("POST", "/resume")


def test_full_publish_without_dev_mode_names_the_flag(tmp_path):
    with pytest.raises(PublishError, match="VLLM_SERVER_DEV_MODE=1"):
        publisher(FakeVLLM(dev_mode=False)).publish_full(weights(tmp_path), version=1)


def test_full_publish_on_vllm_without_pause_still_reloads(tmp_path):
    fake = FakeVLLM(has_pause=False)
    publisher(fake).publish_full(weights(tmp_path / "c"), version=1)
    assert fake.weights_path == str(tmp_path / "c") and ("POST", "/resume") not in fake.calls


def test_resume_is_sent_even_when_the_reload_fails(tmp_path):
    fake = FakeVLLM(timeout_paths={"/collective_rpc": 99})
    with pytest.raises(PublishError, match="timed out"):
        publisher(fake, retries=1).publish_full(weights(tmp_path), version=1)
    assert fake.calls[-1] == ("POST", "/resume") and not fake.paused


def test_publish_policy_is_the_trainers_entry_point(tmp_path):
    fake = FakeVLLM()
    client = httpx.Client(transport=httpx.MockTransport(fake.handler))
    res = publish_policy("http://vllm:8000", "policy@3", str(adapter_dir(tmp_path)), adapter=True, client=client)
    assert res.name == "policy@3" and fake.loras == {"policy@3": str(tmp_path / "adapter")}
    res = publish_policy("http://vllm:8000", "policy@4", str(weights(tmp_path / "full")), adapter=False, client=client)
    assert (res.kind, res.version, fake.weights_path) == ("full", 4, str(tmp_path / "full"))
    with pytest.raises(PublishError, match="must look like 'policy@3'"):
        publish_policy("http://vllm:8000", "policy", str(tmp_path), adapter=True, client=client)


def test_unreachable_server(tmp_path):
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    pub = VLLMPublisher("http://vllm:8000", httpx.Client(transport=httpx.MockTransport(refuse)), retries=1,
                        sleep=lambda s: None)
    with pytest.raises(PublishError, match=r"ConnectError.*is the server running"):
        pub.served_models()


# ---------------------------------------------------------------------------------------------
# Against the real embedded server: the next call is served by the new weights
# ---------------------------------------------------------------------------------------------

PROMPT = [{"role": "user", "content": "What is the weather in Paris?"}]
LORA_TARGET = "Sunny, 21 degrees.<|im_end|>"
TOOL_TARGET = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>'


def overfit(model, prompt_ids: list[int], target_ids: list[int], steps: int, lr: float) -> None:
    """Teach ``model`` (in place) to answer ``prompt_ids`` with ``target_ids``."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.Adam(params, lr=lr)
    ids = torch.tensor([prompt_ids + target_ids])
    labels = torch.tensor([[-100] * len(prompt_ids) + target_ids])
    model.train()
    for _ in range(steps):
        loss = model(input_ids=ids, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()


@pytest.fixture
def server(tiny_model_dir):
    s = EmbeddedServer.start(str(tiny_model_dir))
    yield s
    s.stop()


def greedy(client, model: str, **kw):
    return client.chat.completions.create(model=model, messages=PROMPT, temperature=0, max_tokens=30,
                                          logprobs=True, extra_body={"return_token_ids": True}, **kw)


def test_publish_lora_to_the_embedded_server_changes_the_next_call(server, tiny_model_dir, tokenizer, tmp_path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    prompt_ids = chat_prompt_ids(tokenizer, PROMPT)
    target = tokenizer.encode(LORA_TARGET, add_special_tokens=False)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    torch.manual_seed(0)
    peft_model = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
    overfit(peft_model, prompt_ids, target, steps=60, lr=2e-2)
    peft_model.save_pretrained(tmp_path / "round1")

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    before = greedy(client, "policy")
    pub = VLLMPublisher(server.url, httpx.Client(timeout=60))
    with pytest.raises(PublishError, match=r"No adapter found for .*missing"):
        pub.publish_lora(tmp_path / "missing", version=1)
    res = pub.publish_lora(tmp_path / "round1", version=1)
    assert res.served_models == ["policy", "policy@1"]

    after = greedy(client, "policy@1")
    assert after.choices[0].message.content == "Sunny, 21 degrees." and after.choices[0].finish_reason == "stop"
    assert after.choices[0].model_extra["token_ids"] == target
    # the adapter's logprobs are those of base+LoRA, recomputed independently with peft
    want = recompute_logprobs(peft_model, after.model_extra["prompt_token_ids"], target)
    assert [e.logprob for e in after.choices[0].logprobs.content] == pytest.approx(want, abs=1e-4)
    # the base model is untouched and still served
    assert greedy(client, "policy").choices[0].message.content == before.choices[0].message.content

    # next round replaces policy@1 (keep=1): the old name is gone, calls to it are 404
    peft_model.save_pretrained(tmp_path / "round2")
    res = pub.publish_lora(tmp_path / "round2", version=2)
    assert res.unloaded == ["policy@1"] and res.served_models == ["policy", "policy@2"]
    with pytest.raises(openai.NotFoundError):
        greedy(client, "policy@1")
    assert greedy(client, "policy@2").choices[0].message.content == "Sunny, 21 degrees."
    pub.unload_lora("policy@2")
    assert pub.served_models() == ["policy"]
    assert greedy(client, "policy").choices[0].message.content == before.choices[0].message.content


def test_publish_full_checkpoint_changes_the_next_call_and_tool_calls_parse(server, tiny_model_dir, tokenizer,
                                                                           tmp_path):
    from transformers import AutoModelForCausalLM

    prompt_ids = chat_prompt_ids(tokenizer, PROMPT, tools=[WEATHER_TOOL])
    target = tokenizer.encode(TOOL_TARGET, add_special_tokens=False)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    torch.manual_seed(0)
    overfit(model, prompt_ids, target, steps=60, lr=1e-2)
    model.save_pretrained(tmp_path / "full2")
    tokenizer.save_pretrained(tmp_path / "full2")

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    before = greedy(client, "policy", tools=[WEATHER_TOOL])
    assert not before.choices[0].message.tool_calls

    res = VLLMPublisher(server.url).publish_full(tmp_path / "full2", version=2)
    assert res.served_models == ["policy"] and server.engine.prefix_cache_resets == 1
    assert server.engine.weights_path == str(tmp_path / "full2") and not server.worker.paused

    after = greedy(client, "policy", tools=[WEATHER_TOOL])
    msg = after.choices[0].message
    assert after.choices[0].finish_reason == "tool_calls" and msg.content is None
    assert [(c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls] == \
        [("get_weather", {"city": "Paris"})]
    assert after.choices[0].model_extra["token_ids"] == target
    want = recompute_logprobs(model, after.model_extra["prompt_token_ids"], target)
    assert [e.logprob for e in after.choices[0].logprobs.content] == pytest.approx(want, abs=1e-4)

    stream = client.chat.completions.create(model="policy", messages=PROMPT, tools=[WEATHER_TOOL], temperature=0,
                                            max_tokens=30, stream=True)
    calls = [tc for ch in stream if ch.choices for tc in (ch.choices[0].delta.tool_calls or [])]
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [("get_weather", {"city": "Paris"})]


def test_embedded_server_gives_the_same_flag_errors_as_vllm(tiny_model_dir, tmp_path):
    s = EmbeddedServer.start(str(tiny_model_dir), options=ServeOptions(enable_lora_updating=False, dev_mode=False))
    try:
        pub = VLLMPublisher(s.url, retries=0)
        with pytest.raises(PublishError, match="VLLM_ALLOW_RUNTIME_LORA_UPDATING"):
            pub.publish_lora(tmp_path, version=1)
        with pytest.raises(PublishError, match="VLLM_SERVER_DEV_MODE=1"):
            pub.publish_full(tiny_model_dir, version=1)
    finally:
        s.stop()
    s = EmbeddedServer.start(str(tiny_model_dir), options=ServeOptions(enable_lora=False))
    try:
        (tmp_path / "adapter_config.json").write_text("{}")
        with pytest.raises(PublishError, match="--enable-lora"):
            VLLMPublisher(s.url, retries=0).publish_lora(tmp_path, version=1)
    finally:
        s.stop()
