"""Build a tiny causal LM and a real tokenizer locally, because no model hub is reachable here.

Tests, CI and the laptop demo need a model that loads through the same code path as a real one
(``AutoTokenizer`` / ``AutoModelForCausalLM`` from a directory), speaks ChatML with a Jinja chat
template that renders ``tools`` hermes-style (as Qwen2.5 does), and is fast on CPU. The weights
are random; the tokenizer is a byte-level BPE trained with ``tokenizers`` on a small built-in
corpus, so every string round-trips exactly through ids. Everything is seeded: the same
arguments give byte-identical files.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

# Special tokens, in id order right after the byte alphabet and merges. The ChatML ones and the
# hermes tool-call markers follow Qwen2.5's spelling, so templates and parsers written for it fit.
ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
SPECIAL_TOKENS = [ENDOFTEXT, IM_START, IM_END]
# Added but not "special": like Qwen2.5, tool-call markers survive skip_special_tokens decoding,
# so the text a client sees still contains them when a parser did not consume them.
ADDED_TOKENS = [TOOL_CALL_START, TOOL_CALL_END]

# ChatML with hermes-style tools, written for this project after the shape of Qwen2.5's template:
# tools go into the system turn as JSON lines inside <tools></tools>; assistant tool calls are
# rendered as <tool_call>{json}</tool_call>; tool results become user turns wrapped in
# <tool_response>. ``add_generation_prompt`` opens an assistant turn. ``@DEFAULT_SYSTEM@`` is a
# model's own system prompt for conversations that bring none (empty for the tiny model).
_CHATML_TOOLS_TEMPLATE = """\
{%- set default_system = '@DEFAULT_SYSTEM@' %}
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\\n\\n' }}
{%- elif default_system %}{{- default_system + '\\n\\n' }}{%- endif %}
{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n' }}
{{- 'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}
{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}
{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments '
    'within <tool_call></tool_call> XML tags:\\n<tool_call>\\n'
    '{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}
{%- elif messages[0]['role'] == 'system' %}
{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
{%- elif default_system %}
{{- '<|im_start|>system\\n' + default_system + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message['role'] == 'system' %}
{%- if not loop.first %}{{- '<|im_start|>system\\n' + message['content'] + '<|im_end|>\\n' }}{%- endif %}
{%- elif message['role'] == 'user' %}
{{- '<|im_start|>user\\n' + message['content'] + '<|im_end|>\\n' }}
{%- elif message['role'] == 'assistant' %}
{{- '<|im_start|>assistant' }}
{%- if message['content'] %}{{- '\\n' + message['content'] }}{%- endif %}
{%- for tc in message.get('tool_calls') or [] %}
{%- set fn = tc['function'] if tc.get('function') else tc %}
{{- '\\n<tool_call>\\n{"name": "' + fn['name'] + '", "arguments": ' }}
{%- if fn['arguments'] is string %}{{- fn['arguments'] }}{%- else %}{{- fn['arguments'] | tojson }}{%- endif %}
{{- '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif message['role'] == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""


def chatml_template(default_system: str = "") -> str:
    """The ChatML + hermes-tools template; ``default_system`` is used when a conversation has no system turn."""
    if "'" in default_system or "\\" in default_system:
        raise ValueError(f"default_system must not contain quotes or backslashes: {default_system!r}")
    return _CHATML_TOOLS_TEMPLATE.replace("@DEFAULT_SYSTEM@", default_system)


CHAT_TEMPLATE = chatml_template()

# Training text for the BPE: chat turns, tool JSON, code-ish and plain English, so common
# fragments of the test prompts become single tokens and sequences stay short.
_CORPUS = [
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n",
    "<|im_start|>user\nWhat is the weather in Paris today?<|im_end|>\n<|im_start|>assistant\n",
    "The weather in Paris is sunny with a high of 21 degrees.",
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
    '{"type": "function", "function": {"name": "get_weather", "description": "Get the weather", '
    '"parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}',
    '<tool_response>\n{"temperature": 21, "unit": "celsius"}\n</tool_response>',
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))\n",
    "Reinforcement learning trains a policy from rewards. The agent acts, the environment answers.",
    "Hello, world! How are you? I am fine, thank you. Let me think step by step.",
    "The quick brown fox jumps over the lazy dog. 0123456789 + - * / = ( ) [ ] { } < > , . ; :",
    "Count to ten: one two three four five six seven eight nine ten.",
    "Answer with yes or no. Yes. No. Maybe. The answer is 42.",
]


def train_tokenizer(vocab_size: int = 384):
    """Train the byte-level BPE; returns a ``tokenizers.Tokenizer`` (deterministic for a corpus)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ADDED_TOKENS])
    return tok


def tiny_tokenizer(vocab_size: int, max_positions: int):
    """The trained BPE as a ``PreTrainedTokenizerFast`` speaking ChatML, and the ids of its special and added
    tokens (the model's config and generation config name them)."""
    from transformers import PreTrainedTokenizerFast

    raw = train_tokenizer(vocab_size)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=raw,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        unk_token=None,
        bos_token=None,
        chat_template=CHAT_TEMPLATE,
        model_max_length=max_positions,
        clean_up_tokenization_spaces=False,
    )
    return tokenizer, {t: raw.token_to_id(t) for t in SPECIAL_TOKENS + ADDED_TOKENS}


def random_causal_lm(arch: str, seed: int, ids: dict[str, int], **sizes: int):
    """A randomly initialised ``arch`` causal LM of ``sizes`` (config fields), seeded, that stops on <|im_end|>.

    The default init (std 0.02) with tied embeddings makes a random model repeat its last input token
    forever. Untied, with unit-scale embeddings and a 0.2-scale head, greedy decoding wanders through the
    vocabulary and sampling has ~4.7 nats of entropy: distributions are neither uniform nor collapsed, so
    tests can see a LoRA or a new checkpoint change them.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    common = {**sizes, "tie_word_embeddings": False, "bos_token_id": ids[ENDOFTEXT],
              "eos_token_id": ids[IM_END], "pad_token_id": ids[ENDOFTEXT]}  # fmt: skip
    torch.manual_seed(seed)
    if arch == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common))
    else:
        model = LlamaForCausalLM(LlamaConfig(**common))
    with torch.no_grad():
        gen = torch.Generator().manual_seed(seed)
        emb = model.get_input_embeddings().weight
        emb.copy_(torch.randn(emb.shape, generator=gen))
        head = model.get_output_embeddings().weight
        head.copy_(torch.randn(head.shape, generator=gen) * 0.2)
    model.generation_config.eos_token_id = [ids[IM_END], ids[ENDOFTEXT]]
    model.generation_config.pad_token_id = ids[ENDOFTEXT]
    model.generation_config.do_sample = False
    return model


def build_tiny_model(
    out_dir: Path,
    *,
    seed: int = 0,
    arch: str = "qwen2",
    hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int = 128,
    vocab_size: int = 384,
    max_positions: int = 2048,
) -> Path:
    """Write a tokenizer + randomly initialised causal LM to ``out_dir`` and return it.

    The directory is written to a temp sibling and renamed into place, so a reader never sees a
    half-written model. ``arch`` is ``qwen2`` (default) or ``llama``.
    """
    if arch not in ("qwen2", "llama"):
        raise ValueError(f"unknown arch {arch!r}; use 'qwen2' or 'llama'")
    tokenizer, ids = tiny_tokenizer(vocab_size, max_positions)
    model = random_causal_lm(
        arch,
        seed,
        ids,
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_positions,
    )
    return write_model_dir(Path(out_dir), tokenizer, model, "tracerl_tiny_model.json", {
        "built_by": "serving.models.tiny_model.build_tiny_model", "seed": seed, "arch": arch,
        "hidden": hidden, "layers": layers, "vocab_size": len(tokenizer),
    })  # fmt: skip


def write_model_dir(out_dir: Path, tokenizer, model, record_file: str, record: dict) -> Path:
    """Save tokenizer, model and a JSON record of how they were made to ``out_dir``, atomically.

    Written to a temp sibling and renamed into place (replacing an older ``out_dir``), so a reader
    never sees a half-written model; a failure leaves nothing behind.
    """
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        tokenizer.save_pretrained(tmp)
        model.save_pretrained(tmp)
        (tmp / record_file).write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
        for f in tmp.iterdir():  # mkdtemp's 0700 would hide the model from other users of the machine
            f.chmod(0o644)
        tmp.chmod(0o755)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir
