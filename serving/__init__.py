"""serving: the side of tracerl that talks to inference engines.

* ``gateway``: OpenAI-compatible proxy that records exact token ids/logprobs as OTel spans.
* ``publish``: make a checkpoint (LoRA adapter or full weights) live on vLLM over HTTP.
* ``server`` + ``engine``: embedded CPU server with vLLM's API subset (laptop/CI stand-in).
* ``protocol``: pure wire-format rules shared by all of the above.
* ``tiny_model``: a tiny random-weight model + real tokenizer, built locally (no hub).
"""
