"""``tracerl gateway``: the token-capturing proxy (``proxy``), its upstream client and its worker processes."""
