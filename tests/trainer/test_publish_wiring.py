"""``tracerl train --server URL`` wiring: a round published to the real embedded server
(``serving.embedded.server.EmbeddedServer``, vLLM's API subset) through ``serving.vllm.publish``; the server then
serves the new policy with exactly the trained checkpoint's probabilities. A LoRA round becomes
``policy@1``; a full fine-tune is a weight reload of ``policy`` (vLLM cannot rename a served model)."""

from __future__ import annotations

import httpx
import pytest
import torch

from store.layout import StoreLayout
from trainer.checkpoint import checkpoint_dir
from trainer.manifest import read_rounds
from trainer.publish import server_publisher
from trainer.rounds import PublishRequest, run_once

pytestmark = pytest.mark.slow  # starts processes or builds models (make test-fast skips it)


@pytest.fixture
def server(tiny_model_dir):
    from serving.embedded.server import EmbeddedServer

    s = EmbeddedServer.start(str(tiny_model_dir))
    yield s
    s.stop()


@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
def test_a_round_is_published_to_the_embedded_server(tmp_path, server, tiny_model_dir, make_rollouts, write_rows,
                                                     train_settings, lora):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    store = tmp_path / "store"
    write_rows(store, make_rollouts(0))
    s = train_settings(store, lora_rank=4 if lora else 0, lr=5e-2 if lora else 5e-3,
                     server=server.url)
    out = run_once(s, publisher=server_publisher(server.url), log=lambda m: None)
    assert out.status == "published"
    assert read_rounds(StoreLayout.at(store).location)[0]["published_at"] is not None

    models = [m["id"] for m in httpx.get(server.url + "/v1/models").json()["data"]]
    assert ("policy@1" in models) == lora
    body = {"model": "policy@1" if lora else "policy", "messages": [{"role": "user", "content": "task 0: say something nice"}],
            "max_tokens": 4, "temperature": 0, "logprobs": True, "return_token_ids": True}
    resp = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60).json()
    prompt_ids, out_ids = resp["prompt_token_ids"], resp["choices"][0]["token_ids"]
    served = [e["logprob"] for e in resp["choices"][0]["logprobs"]["content"]]

    ckpt = checkpoint_dir(StoreLayout.at(store).checkpoints, 1)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    ours = (PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), str(ckpt)) if lora
            else AutoModelForCausalLM.from_pretrained(ckpt)).eval()

    def logprobs(model) -> list[float]:
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([prompt_ids + out_ids])).logits[0, :-1].float(), -1)
        return [logp[len(prompt_ids) - 1 + i, t].item() for i, t in enumerate(out_ids)]

    want, base_want = logprobs(ours), logprobs(base)
    assert served == pytest.approx(want, abs=1e-4)
    assert served != pytest.approx(base_want, abs=1e-3)  # it is the trained adapter, not the base


def test_serving_logprobs_line_up_with_the_trainers(server, tiny_model_dir, tokenizer):
    """Importance correction divides by the serving engine's logprobs token by token: sampled at
    temperature 1 from the embedded server, they must equal the trainer's own logprobs for the same
    ids (ratio 1 on-policy), or the correction would silently reweight every token."""
    from transformers import AutoModelForCausalLM

    from trainer.dataset import Sample
    from trainer.packing import collate, sequence_logprobs

    body = {"model": "policy", "messages": [{"role": "user", "content": "task 1: pick a token"}], "n": 3,
            "max_tokens": 6, "temperature": 1.0, "seed": 7, "logprobs": True, "return_token_ids": True}
    resp = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60).json()
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    samples = [Sample(f"t{i}", "r", resp["prompt_token_ids"], c["token_ids"],
                      [e["logprob"] for e in c["logprobs"]["content"]], advantage=1.0, weight=1.0)
               for i, c in enumerate(resp["choices"])]
    assert len({tuple(s.response_ids) for s in samples}) > 1  # really sampled
    batch = collate([samples], pad_id=tokenizer.pad_token_id)  # packed, as the trainer sees them
    with torch.no_grad():
        ours = sequence_logprobs(model, batch)
    served = batch.rollout_logprobs[batch.has_rollout_logprobs]
    torch.testing.assert_close(ours[batch.has_rollout_logprobs], served, rtol=0, atol=2e-4)


def test_every_replica_gets_the_new_policy(tmp_path, server, tiny_model_dir, make_rollouts, write_rows,
                                           train_settings):
    """``--server A,B``: a LoRA round is loaded on both replicas; publishing again is a no-op."""
    from serving.embedded.server import EmbeddedServer
    from trainer.publish import server_urls

    assert server_urls(f" {server.url}/, {server.url} ,") == [server.url]
    second = EmbeddedServer.start(str(tiny_model_dir))
    try:
        store = tmp_path / "store"
        write_rows(store, make_rollouts(0))
        both = f"{server.url},{second.url}"
        out = run_once(train_settings(store, lora_rank=4, lr=5e-2, server=both), publisher=server_publisher(both),
                       log=lambda m: None)
        assert out.status == "published"
        for url in (server.url, second.url):
            assert "policy@1" in [m["id"] for m in httpx.get(url + "/v1/models").json()["data"]]
        again = PublishRequest(name="policy@1", version=1, checkpoint_path=checkpoint_dir(
            StoreLayout.at(store).checkpoints, 1), adapter=True, base_model=tiny_model_dir)
        server_publisher(both)(again)  # a retried publish: both replicas already serve it, nothing raises
    finally:
        second.stop()
