"""The embedded engine: a transformers causal LM (+ peft LoRA adapters) that samples like vLLM.

``ModelEngine`` owns the model and is not thread-safe; ``worker.EngineWorker`` is the single thread
that calls it, fed by a priority queue, so HTTP threads never touch torch state concurrently.
Control operations (adapter load/unload, weight reload, pause/resume) jump the queue of
generations, and run between two generations, never during one.

Sampling semantics follow vLLM (``serving.embedded.sampler``); ``seed`` gives a per-request generator, so
the same request reproduces its samples. Output ``token_ids`` include the EOS/stop token that ended
a sequence (its text is not shown), as vLLM's do (``serving.embedded.text_stream``). The prompt pass is the
plain left-padded one: no prefix caching here (``tracerl serve --engine vllm`` has vLLM's own).
"""

from __future__ import annotations

import functools
import json
import random
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from serving.embedded.sampler import LOGPROBS_MODES, process_logits, sample
from serving.embedded.sampling import EngineError, SamplingParams
from serving.embedded.text_stream import Completion, Delta, TextStream

__all__ = ["Completion", "Delta", "EngineError", "GenerationJob", "ModelEngine", "SamplingParams"]



@dataclass
class GenerationJob:
    """One request's generation: what the worker batches with others of the same adapter."""

    prompt_ids: list[int]
    params: SamplingParams
    adapter: str | None = None
    on_delta: Callable[[Delta], None] | None = None
    cancelled: Callable[[], bool] | None = None


@dataclass
class LoraAdapter:
    """A loaded adapter: the name requests use and the directory it came from (``/v1/models`` root)."""

    name: str
    path: str


class ModelEngine:
    """A causal LM on CPU with LoRA adapters served by name; call it from one thread only."""

    def __init__(self, model_dir: str | Path, *, served_model_name: str = "policy",
                 logprobs_mode: str = "raw_logprobs", max_model_len: int | None = None,
                 enable_lora: bool = True, dtype: str = "float32", seed: int = 0) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode must be one of {LOGPROBS_MODES}, got {logprobs_mode!r}")
        self.model_dir = str(model_dir)
        self.served_model_name = served_model_name
        self.logprobs_mode = logprobs_mode
        self.enable_lora = enable_lora
        self._torch = torch
        self._dtype = getattr(torch, dtype)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        self.base = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=self._dtype)
        self.base.eval()
        self.model: Any = self.base  # becomes a PeftModel once an adapter is loaded
        self.adapters: dict[str, LoraAdapter] = {}
        self.max_model_len = int(max_model_len or getattr(self.base.config, "max_position_embeddings", 2048))
        self.eos_ids = self._eos_ids()
        self.weights_path = self.model_dir
        self.weight_version: str | None = None  # set by /update_weight_version after a reload
        self._rng = random.Random(seed)
        self.prefix_cache_resets = 0  # /reset_prefix_cache calls (nothing to clear: no prefix cache here)

    def release(self) -> None:
        """Drop the weights now, on the caller's thread.

        Otherwise the last reference may be dropped by an HTTP handler thread whose keep-alive
        connection closes only at interpreter exit; freeing tensors on a daemon thread during
        finalization makes CPython unwind it through torch's C++ frames, and the process aborts
        ("terminate called without an active exception").
        """
        self.model = self.base = None
        self.adapters = {}

    def reset_prefix_cache(self) -> None:
        """vLLM's ``/reset_prefix_cache``: this engine caches no prefixes, so only count the call."""
        self.prefix_cache_resets += 1

    def _eos_ids(self) -> list[int]:
        ids: list[int] = []
        gen = getattr(self.base, "generation_config", None)
        eos = getattr(gen, "eos_token_id", None) if gen is not None else None
        for x in ([eos] if isinstance(eos, int) else list(eos or [])) + [self.tokenizer.eos_token_id]:
            if x is not None and x not in ids:
                ids.append(int(x))
        return ids

    # -- names -----------------------------------------------------------------------------

    def served_names(self) -> list[str]:
        """Base model first, then adapters in load order (the order of ``/v1/models``)."""
        return [self.served_model_name, *self.adapters]

    def resolve(self, model: str | None) -> str | None:
        """Map a request's ``model`` to an adapter name (None = base); unknown names are 404 as in vLLM."""
        if not model or model == self.served_model_name:
            return None
        if model in self.adapters:
            return model
        raise EngineError(f"The model `{model}` does not exist.", 404, "NotFoundError")

    # -- prompts ---------------------------------------------------------------------------

    def render_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None, *,
                    add_generation_prompt: bool = True, continue_final_message: bool = False,
                    chat_template: str | None = None, chat_template_kwargs: dict[str, Any] | None = None) -> list[int]:
        """Token ids of the chat prompt, rendered by the model's own chat template.

        ``chat_template`` (a request's own, allowed only with --trust-request-chat-template) replaces
        the model's; ``chat_template_kwargs`` reach the template only when it reads them, as in vLLM.
        """
        if not isinstance(messages, list) or not messages:
            raise EngineError("messages must be a non-empty list", param="messages")
        template = chat_template or self.tokenizer.chat_template
        kwargs = {k: v for k, v in (chat_template_kwargs or {}).items() if k in _template_variables(template)}
        try:
            text = self.tokenizer.apply_chat_template(
                [_normalise_message(m) for m in messages], tools=tools or None, tokenize=False,
                add_generation_prompt=add_generation_prompt and not continue_final_message,
                continue_final_message=continue_final_message, chat_template=chat_template, **kwargs)
        except EngineError:
            raise
        except Exception as e:  # jinja errors name the bad message field
            raise EngineError(f"chat template failed: {e}") from None
        return self.tokenizer.encode(text, add_special_tokens=False)

    def encode_prompt(self, prompt: Any) -> list[int]:
        """A completions ``prompt`` (text or token ids, as vLLM accepts) -> token ids."""
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, add_special_tokens=False)
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            bad = [t for t in prompt if not 0 <= t < len(self.tokenizer)]
            if bad:
                raise EngineError(f"prompt token id {bad[0]} is out of vocabulary (size {len(self.tokenizer)})")
            return list(prompt)
        if isinstance(prompt, list) and len(prompt) == 1:
            return self.encode_prompt(prompt[0])
        raise EngineError("prompt must be a string or a list of token ids; batched prompts are not "
                          "supported by the embedded server (send one request per prompt)", param="prompt")

    def decode_token(self, token_id: int) -> str:
        """The text of one token, as vLLM shows it in logprobs entries."""
        return self.tokenizer.decode([token_id])

    # -- generation ------------------------------------------------------------------------

    def check(self, job: GenerationJob) -> None:
        """Refuse a job before it joins a batch (empty prompt, context too long), as vLLM does."""
        n_prompt, p = len(job.prompt_ids), job.params
        if job.adapter is not None and job.adapter not in self.adapters:  # unloaded while queued
            raise EngineError(f"The model `{job.adapter}` does not exist.", 404, "NotFoundError")
        if not n_prompt:
            raise EngineError("the prompt is empty", param="prompt")
        room = self.max_model_len - n_prompt
        if room <= 0 or (p.max_tokens is not None and p.max_tokens > room):
            raise EngineError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you "
                f"requested {n_prompt + (p.max_tokens or 0)} tokens ({n_prompt} in the messages, "
                f"{p.max_tokens or 0} in the completion). Please reduce the length of the messages or "
                f"completion.", param="max_tokens")

    def generate(self, prompt_ids: list[int], p: SamplingParams, adapter: str | None = None,
                 on_delta: Callable[[Delta], None] | None = None,
                 cancelled: Callable[[], bool] | None = None) -> list[Completion]:
        """Sample ``p.n`` sequences for one prompt, calling ``on_delta`` as text appears."""
        job = GenerationJob(prompt_ids, p, adapter, on_delta, cancelled)
        self.check(job)
        out = self.generate_batch([job])[0]
        if isinstance(out, EngineError):
            raise out
        return out

    def generate_batch(self, jobs: list[GenerationJob]) -> list[list[Completion] | EngineError]:
        """Run several jobs (same adapter, each already ``check``-ed) as one left-padded batch.

        Each job keeps its own sampling parameters and seeded generator, so batching changes
        which requests share a forward pass, not what any of them samples (up to float noise
        of padded attention, ~1e-6 in logprobs). A job whose own setup or sampling fails gets
        its error in its slot and stops; the others of the batch go on untouched.
        """
        torch = self._torch
        if len({j.adapter for j in jobs}) > 1:
            raise ValueError("a batch must use one adapter")
        rows: list[tuple[int, int]] = [(j, i) for j, job in enumerate(jobs) for i in range(job.params.n)]
        spans: list[slice] = []
        for job in jobs:
            start = spans[-1].stop if spans else 0
            spans.append(slice(start, start + job.params.n))
        done = [False] * len(rows)
        failed: dict[int, EngineError] = {}

        def fail(j: int, e: Exception) -> None:
            failed[j] = _job_error(e)
            done[spans[j]] = [True] * jobs[j].params.n

        max_new = [job.params.max_tokens or self.max_model_len - len(job.prompt_ids) for job in jobs]
        stop_ids = [set(job.params.stop_token_ids) | (set() if job.params.ignore_eos else set(self.eos_ids))
                    for job in jobs]
        outs = [[Completion(index=i) for i in range(job.params.n)] for job in jobs]
        streams = [[TextStream(self.tokenizer, job.params, job.on_delta, i) for i in range(job.params.n)]
                   for job in jobs]
        vocab = int(self.base.config.vocab_size)
        states: list[_JobState | None] = []
        for j, job in enumerate(jobs):
            try:
                states.append(_JobState.start(torch, job, vocab, self._rng))
            except Exception as e:
                states.append(None)
                fail(j, e)
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        with torch.inference_mode(), self._adapter(jobs[0].adapter):
            out, mask, pos = _prompt_pass(torch, self.model, [jobs[j].prompt_ids for j, _ in rows], pad)
            for step in range(max(max_new)):
                logits = out.logits[:, -1, :].float()
                tokens = torch.zeros(len(rows), dtype=torch.long)
                for j, job in enumerate(jobs):
                    sl = spans[j]
                    if all(done[sl]):
                        continue
                    try:
                        tokens[sl] = self._step_job(job, states[j], logits[sl], step, outs[j], streams[j],
                                                    done, sl.start, stop_ids[j], max_new[j])
                    except Exception as e:  # this request's fault or not, it must not end the others
                        fail(j, e)
                if all(done):
                    break
                mask = torch.cat([mask, torch.ones(len(rows), 1, dtype=mask.dtype)], dim=1)
                pos = pos[:, -1:] + 1
                out = self.model(input_ids=tokens.view(-1, 1), attention_mask=mask, position_ids=pos,
                                 past_key_values=out.past_key_values, use_cache=True)
        return [failed.get(j, outs[j]) for j in range(len(jobs))]

    def _step_job(self, job: GenerationJob, st: _JobState, logits: Any, step: int, outs: list[Completion],
                  streams: list[TextStream], done: list[bool], row0: int, stop_ids: set[int], max_new: int) -> Any:
        """Sample one token for each live sequence of one job; returns the job's tokens."""
        torch = self._torch
        p = job.params
        processed = process_logits(logits, p, st.counts, st.seen, stop_ids, step) if p.penalised else None
        tok, lp, top = sample(logits, p, st.gen, self.logprobs_mode, processed)
        if p.penalised:
            st.counts[torch.arange(p.n), tok] += 1
            st.seen[torch.arange(p.n), tok] = True
        for i in range(p.n):
            if not done[row0 + i]:
                done[row0 + i] = self._advance(outs[i], streams[i], int(tok[i]), float(lp[i]),
                                               top[i] if top is not None else [], stop_ids, max_new)
        if job.cancelled is not None and job.cancelled():
            for i in range(p.n):
                if not done[row0 + i]:
                    done[row0 + i] = True
                    outs[i].finish_reason = "abort"
                    streams[i].finish(outs[i])
        return tok

    def _advance(self, c: Completion, stream: TextStream, tok: int, lp: float, top: list[tuple[int, float]],
                 stop_ids: set[int], max_new: int) -> bool:
        """Append one sampled token to a sequence; True when the sequence is finished."""
        c.token_ids.append(tok)
        c.logprobs.append(lp)
        c.top_logprobs.append(top)
        reason: tuple[str, int | str | None] | None = None
        if tok in stop_ids:
            reason = ("stop", None if tok in self.eos_ids else tok)
        elif len(c.token_ids) >= max_new:
            reason = ("length", None)
        hit = stream.push(tok, is_stop_token=tok in stop_ids, final=reason is not None)
        if hit is not None:
            reason = ("stop", hit)
        if reason is None:
            stream.flush(c)
            return False
        c.finish_reason, c.stop_reason = reason
        stream.finish(c)
        return True


    @contextmanager
    def _adapter(self, name: str | None) -> Iterator[None]:
        if not self.adapters:
            yield
        elif name is None:
            with self.model.disable_adapter():
                yield
        else:
            self.model.set_adapter(name)
            yield

    def score(self, token_ids: list[int], adapter: str | None = None) -> list[float]:
        """Raw logprob of each token given the ones before it (for tests and audits)."""
        torch = self._torch
        with torch.inference_mode(), self._adapter(adapter):
            logits = self.model(input_ids=torch.tensor([token_ids])).logits[0, :-1].float()
        lp = torch.log_softmax(logits, dim=-1)
        return lp.gather(-1, torch.tensor(token_ids[1:]).view(-1, 1)).view(-1).tolist()

    # -- adapters and weights --------------------------------------------------------------

    def load_lora(self, name: str, path: str, load_inplace: bool = False) -> None:
        """Load (or with ``load_inplace`` replace) a peft LoRA adapter served as ``name``."""
        if not self.enable_lora:
            raise EngineError("LoRA is not enabled. Restart the server with --enable-lora.", 500,
                              "InternalServerError")
        if name == self.served_model_name:
            raise EngineError(f"The lora adapter name '{name}' is the base model's name.", 400, "InvalidUserInput")
        if not (Path(path) / "adapter_config.json").is_file():
            raise EngineError(f"Loading lora {name} failed: No adapter found for {path}", 404, "NotFoundError")
        if name in self.adapters and not load_inplace:
            raise EngineError(f"The lora adapter '{name}' has already been loaded. If you want to load "
                              "the adapter in place, set 'load_inplace' to True.", 400, "InvalidUserInput")
        from peft import PeftModel

        try:
            if name in self.adapters:
                self._delete_adapter(name)
            if not self.adapters:
                self.model = PeftModel.from_pretrained(self.base, path, adapter_name=name, is_trainable=False)
            else:
                self.model.load_adapter(path, adapter_name=name, is_trainable=False)
        except Exception as e:
            raise EngineError(f"Loading lora {name} failed: {e}", 400, "BadRequestError") from None
        self.model.eval()
        self.adapters[name] = LoraAdapter(name, str(path))

    def unload_lora(self, name: str) -> None:
        if name not in self.adapters:
            raise EngineError(f"The lora adapter '{name}' cannot be found.", 404, "NotFoundError")
        self._delete_adapter(name)

    def _delete_adapter(self, name: str) -> None:
        del self.adapters[name]
        if not self.adapters:
            # unload() strips the LoRA layers and returns the untouched base model
            self.base = self.model.unload()
            self.model = self.base
        else:
            self.model.set_adapter(next(iter(self.adapters)))
            self.model.delete_adapter(name)

    def reload_weights(self, weights_path: str | None = None) -> None:
        """Replace the base weights in place from a HF checkpoint dir; loaded adapters stay."""
        from serving.models.weights import read_weights

        path = Path(weights_path or self.model_dir)
        state = read_weights(path)
        if not state:
            raise EngineError(f"no *.safetensors weights found in {path}", 400, "BadRequestError")
        target = self.model.get_base_model() if self.adapters else self.base
        current = target.state_dict()
        mapped: dict[str, Any] = {}
        for k, v in state.items():
            if k in current:
                mapped[k] = v
                continue
            head, _, leaf = k.rpartition(".")
            alt = f"{head}.base_layer.{leaf}"  # peft wraps adapted Linear layers
            if alt not in current:
                raise EngineError(f"checkpoint tensor {k} has no match in the served model; is {path} "
                                  f"the same architecture as {self.model_dir}?", 400, "BadRequestError")
            mapped[alt] = v
        for k, v in mapped.items():
            if tuple(v.shape) != tuple(current[k].shape):
                raise EngineError(f"checkpoint tensor {k} has shape {tuple(v.shape)}, the served model "
                                  f"has {tuple(current[k].shape)}", 400, "BadRequestError")
        with self._torch.no_grad():
            for k, v in mapped.items():
                current[k].copy_(v.to(current[k].dtype))
        self.weights_path = str(path)


@dataclass
class _JobState:
    """One job's sampler state in a batch: its generator and, with penalties, its token counts."""

    gen: Any
    counts: Any = None
    seen: Any = None

    @classmethod
    def start(cls, torch: Any, job: GenerationJob, vocab: int, rng: random.Random) -> _JobState:
        p = job.params
        st = cls(torch.Generator().manual_seed(p.seed if p.seed is not None else rng.randrange(2**63)))
        if p.penalised:
            st.counts = torch.zeros(p.n, vocab)
            st.seen = torch.zeros(p.n, vocab, dtype=torch.bool)
            st.seen[:, job.prompt_ids] = True
        return st


def _prompt_pass(torch: Any, model: Any, prompts: list[list[int]], pad_id: int) -> tuple[Any, Any, Any]:
    """One forward over the batch's prompts (one row each), left-padded; returns (output, mask, positions).

    The output's logits hold the last position only; ``mask`` and ``positions`` are for the decode
    steps to extend.
    """
    width = max(len(p) for p in prompts)
    ids = [[pad_id] * (width - len(p)) + list(p) for p in prompts]
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    pos = torch.tensor([[0] * (width - len(p)) + list(range(len(p))) for p in prompts])
    out = model(input_ids=torch.tensor(ids), attention_mask=mask, position_ids=pos,
                use_cache=True, logits_to_keep=1)
    return out, mask, pos


def _job_error(e: Exception) -> EngineError:
    if isinstance(e, EngineError):
        return e
    return EngineError(f"generation failed for this request ({type(e).__name__}: {e}); the other requests "
                       "batched with it were not affected", 500, "InternalServerError")


@functools.lru_cache(maxsize=16)
def _template_variables(template: str | None) -> frozenset[str]:
    """Names a Jinja chat template reads but does not set (vLLM's ``_resolve_chat_template_kwargs``)."""
    if not template or not isinstance(template, str):
        return frozenset()
    import jinja2
    import jinja2.meta

    try:
        return frozenset(jinja2.meta.find_undeclared_variables(jinja2.Environment().parse(template)))
    except jinja2.TemplateSyntaxError:
        return frozenset()  # apply_chat_template reports the syntax error itself


def _normalise_message(m: Any) -> dict[str, Any]:
    """Content parts -> plain text; tool-call arguments stay strings (the template accepts both)."""
    if not isinstance(m, dict) or "role" not in m:
        raise EngineError("each message must be an object with a role", param="messages")
    out = dict(m)
    content = out.get("content")
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, dict) and part.get("type") == "text":
                parts.append(part.get("text", ""))
            else:
                raise EngineError("only text content parts are supported by the embedded server",
                                  param="messages")
        out["content"] = "".join(parts)
    elif content is None:
        out["content"] = ""
    for tc in out.get("tool_calls") or []:
        fn = tc.get("function") or {}
        if isinstance(fn.get("arguments"), str):
            try:
                json.loads(fn["arguments"])
            except json.JSONDecodeError:
                raise EngineError("tool_calls[].function.arguments must be a JSON string",
                                  param="messages") from None
    return out
