"""my_pkg: a vLLM plugin bundle (FlashHead LM head + admin endpoints)."""

__version__ = "0.1.0"

PLUGIN_NAME = "my_pkg"

# Sections of `GET /plugins/my_pkg/config/{section}`; each is the worker's `<section>_config`.
CONFIG_SECTIONS = ("scheduler", "model", "cache", "parallel")
