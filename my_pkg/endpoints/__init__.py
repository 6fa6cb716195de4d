"""Endpoint half of my_pkg: an admin HTTP API for vLLM's OpenAI server.

Loaded by vLLM through the ``vllm.endpoint_plugins`` entry point
``my_pkg_admin``.  Imports nothing from vLLM at import time.
"""

from my_pkg.endpoints.admin_state import AdminState
from my_pkg.endpoints.config import ROUTE_PREFIX, STATE_ATTR
from my_pkg.endpoints.plugin import AdminEndpointPlugin

__all__ = ["AdminEndpointPlugin", "AdminState", "ROUTE_PREFIX", "STATE_ATTR"]
