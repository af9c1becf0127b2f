"""The ``tracerl`` command line and its wiring; the stages' logic lives in their own packages."""

__version__ = "0.1.0"
