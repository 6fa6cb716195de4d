"""Everything this plugin changes inside vLLM, one module per vLLM component.

Each module has `apply() -> None`, which resolves every vLLM symbol it needs
before changing anything (so a moved internal leaves vLLM as it was and
raises), and is idempotent.

- `worker`: adds the `my_pkg_*` methods (see `my_pkg.engine.rpc`) to vLLM's `WorkerBase`.
- `model_registry`: registers the `FlashHead*` architectures, each mapped to vLLM's own class.
- `logits_processor`: registers an out-of-tree `LogitsProcessor` that serves FlashHead
  models' decode steps through FlashHead and leaves every other model on vLLM's code.
- `model_runner`: (only once a FlashHead model is built) tells the logits processor which
  call is the decode step of the V1 GPU/CPU model runner and what each row asked for.
"""
