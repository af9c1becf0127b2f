"""Which way a round reaches the server, what a failed reload restores, and which checkpoints stay."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainer.checkpoint import MANIFEST, checkpoint_dir
from trainer.checkpoint_store import CheckpointStore
from trainer.merge import merged_dir, served_weights
from trainer.publish import choose_mode, server_publisher
from trainer.rounds import TrainError


def test_auto_merges_an_adapter_for_a_cpu_vllm_and_loads_it_by_name_elsewhere():
    assert choose_mode("auto", adapter=True, device="cpu") == "full"
    assert choose_mode("auto", adapter=True, device="cuda") == "lora"
    assert choose_mode("auto", adapter=True, device=None) == "lora"  # tracerl serve --engine embedded, old vLLMs
    assert choose_mode("lora", adapter=True, device="cpu") == "lora"
    assert choose_mode("full", adapter=True, device="cuda") == "full"
    assert choose_mode("lora", adapter=False, device="cuda") == "full"  # full weights are always reloaded
    with pytest.raises(TrainError, match="auto, lora, full"):
        server_publisher("http://127.0.0.1:1", "merged")


def test_each_replicas_device_is_asked_once_when_known(monkeypatch, tmp_path):
    """vLLM's ``/server_info`` cost 0.6 s of every demo publish: a replica that answered is not asked again;
    one that could not say (None: no dev mode, an embedded server) is asked again next round."""
    import trainer.publish as publish

    asked: list[str] = []
    answers = {"http://a": "cpu", "http://b": None}
    sent: list[tuple[str, str | None]] = []
    monkeypatch.setattr(publish.VLLMPublisher, "device", lambda self: asked.append(self.base_url) or answers[self.base_url])
    monkeypatch.setattr(publish, "publish_to", lambda url, req, how: sent.append((url, how)))
    pub = server_publisher("http://a,http://b")
    for v in (1, 2):
        pub(publish.PublishRequest(f"policy@{v}", v, tmp_path / f"c{v}", adapter=True, base_model=tmp_path))
    pub(publish.PublishRequest("policy@3", 3, tmp_path / "c3", adapter=False, base_model=tmp_path))
    assert asked == ["http://a", "http://b", "http://b"]
    assert sent == [("http://a", "full"), ("http://b", "lora")] * 2 + [("http://a", "full"), ("http://b", "full")]


def _checkpoint(root: Path, version: int, merged: bool = False) -> Path:
    d = checkpoint_dir(root, version)
    d.mkdir(parents=True)
    (d / MANIFEST).write_text("{}")
    if merged:
        merged_dir(d).mkdir()
        (merged_dir(d) / MANIFEST).write_text("{}")
    return d


def test_a_failed_reload_restores_what_the_previous_round_left_serving(tmp_path):
    base = tmp_path / "base"
    assert served_weights(None, False, base) == base  # round 0: the base model
    full = _checkpoint(tmp_path, 1)
    assert served_weights(full, False, base) == full
    lora = _checkpoint(tmp_path, 2)
    assert served_weights(lora, True, base) == base  # an adapter by name: the base weights are loaded
    merged = _checkpoint(tmp_path, 3, merged=True)
    assert served_weights(merged, True, base) == merged_dir(merged)


def test_pruning_keeps_the_newest_checkpoints_and_the_round_files(tmp_path):
    for v in range(1, 6):
        _checkpoint(tmp_path, v, merged=v % 2 == 0)
    (tmp_path / "round-000004.json").write_text("{}")
    (tmp_path / "policy-000009").mkdir()  # incomplete: not the pruner's to judge
    gone = CheckpointStore(tmp_path).prune(keep=3)
    assert gone == [1, 2]
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == ["policy-000003", "policy-000004", "policy-000005", "policy-000009", "round-000004.json"]
    assert CheckpointStore(tmp_path).prune(keep=3) == []
    with pytest.raises(ValueError, match=">= 2"):
        CheckpointStore(tmp_path).prune(keep=1)


def test_pruning_never_removes_a_protected_version_the_serving_parent_of_a_canary(tmp_path):
    for v in range(1, 6):
        _checkpoint(tmp_path, v)
    # policy@2 kept serving through rolled-back canaries 3 and 4; 5 is the new canary, trained from 2
    assert CheckpointStore(tmp_path).prune(keep=2, protect=frozenset({2})) == [1, 3]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["policy-000002", "policy-000004", "policy-000005"]
