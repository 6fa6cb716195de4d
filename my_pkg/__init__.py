"""my_pkg: a vLLM plugin bundle (FlashHead LM head + admin endpoints)."""

__version__ = "0.1.0"

PLUGIN_NAME = "my_pkg"
