"""Developer tools, run from a source checkout: not in the wheel, and never imported by the plugin.

`compat` checks every vLLM symbol the engine half uses against a vLLM release's sources.
"""
