"""Helpers shared by the demo, the end-to-end tests and the benchmarks.

They build small models locally (no model hub) and run a real vLLM OpenAI
server in a subprocess. Nothing here is imported by the plugin itself.
"""
