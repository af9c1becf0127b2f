"""Model directories built locally, with no hub: a tiny random model (``tiny_model``), real ones from PyPI
(``pretrained``)."""
