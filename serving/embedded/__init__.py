"""``tracerl serve --engine embedded``: a transformers engine that samples like vLLM, behind vLLM's API subset."""
