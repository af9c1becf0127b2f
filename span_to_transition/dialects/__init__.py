"""GenAI dialects: one module each, listed once in ``registry.py`` with the attribute keys that mark its calls."""
