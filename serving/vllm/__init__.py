"""Real vLLM: its launcher (``launcher``), its CPU virtualenv (``cpu_venv``) and the publish client (``publish``).

Imports nothing: ``trainer.publish`` loads the publish client without torch or vLLM."""
