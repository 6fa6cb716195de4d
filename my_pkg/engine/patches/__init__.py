"""Everything this plugin changes inside vLLM, one module per vLLM component.

Each module has `apply() -> None`, which resolves every vLLM symbol it needs
before changing anything (so a moved internal leaves vLLM as it was and
raises), and is idempotent.

- `worker`: adds the `my_pkg_*` methods (see `my_pkg.engine.rpc`) to vLLM's `WorkerBase`.
- `model_registry`: registers the `FlashHead*` architectures, each mapped to vLLM's own class
  (`flashhead_model_entry`); resolving one applies `logits_processor`.
- `logits_processor`: (only once a FlashHead architecture is resolved) registers an
  out-of-tree `LogitsProcessor` that serves FlashHead models' decode steps through
  FlashHead; it is correct whatever `self` it is called with (vLLM's LoRA wrapper).
- `model_runner`: (only once a FlashHead model is built) tells the logits processor which
  call is the decode step of the V1 GPU/CPU model runner and what each row asked for.
- `model_runner_v2`: the same for vLLM's Model Runner V2 (the CUDA default), applied instead
  of `model_runner` when `VllmConfig.use_v2_model_runner` is true.
"""
