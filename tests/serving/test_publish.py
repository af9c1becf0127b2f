"""Publishing checkpoints to the real embedded server (real vLLM: test_publish_vllm.py and test_vllm.py)."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
import torch

from serving.embedded.server import EmbeddedServer, ServeOptions
from serving.vllm.publish import PublishError, VLLMPublisher

from .helpers import WEATHER_TOOL, chat_prompt_ids, recompute_logprobs

pytestmark = pytest.mark.slow  # starts processes or builds models (make test-fast skips it)

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
