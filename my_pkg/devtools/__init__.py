"""Developer tools that ship with the package but are not used by the plugin itself.

`compat` checks every vLLM symbol the engine half uses against a vLLM release's sources.
"""
