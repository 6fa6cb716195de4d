"""A small language model trained on real English text, kept as a test fixture for FlashHead quality.

Synthetic heads and hidden states flatter FlashHead's approximation; this module trains a real (small)
causal LM and keeps only what the quality tests need: the LM head and hidden states captured from text
the model never trained on.

Steps of :func:`build_trained_fixture`:

1. Collect documents offline: the docstrings of the Python standard library (modules, classes, functions,
   methods) and the language reference topics of ``pydoc_data.topics``; one document per docstring or
   topic, in a deterministic order, exact duplicates dropped.
2. Split documents into train / calibration / held-out by a hash of their text, so held-out text is
   never trained on, whatever order the documents come in.
3. Train a byte-level BPE tokenizer (``tokenizers``) on the training documents, with the special tokens
   ``[PAD]``, ``[UNK]``, ``[BOS]``, ``[EOS]``. Every document ends with ``[EOS]``, so EOS is a real target.
4. Train a ``transformers`` ``LlamaForCausalLM`` from scratch on CPU on packed sequences of the training
   stream (AdamW, linear warm-up then cosine decay), for exactly ``--steps`` steps (reproducible on the same
   versions and thread count) or time-boxed.
5. Capture the final hidden states (after the last norm: the LM head's input) at every position of the
   calibration and held-out streams of two sources -- the docstrings and standard-library code, which the
   model never trained on (:func:`collect_code_documents`) -- keep a deterministic subsample, and record the
   true next token; and the states of the model's own samples, made exactly as a default
   ``my-pkg flashhead build`` self-calibrates (``generate_calibration_states``).
6. Write ``head.safetensors``, the state files of :data:`STATE_FILES`, ``generated.safetensors``,
   ``tokenizer.json`` and ``meta.json`` (see :func:`write_fixture`).

Run as ``python -m tests.support.trained_fixture --out DIR [--steps N | --minutes M] [--seed S]
[--save-model DIR2] [--from-model DIR2]``; ``--from-model`` skips steps 3-4 and re-captures from a model saved
with ``--save-model``. Run it on one thread (it sets ``torch.set_num_threads(1)``), with ``nice`` on a shared
machine.
``transformers`` and ``tokenizers`` are imported inside functions, so that :func:`load_trained_fixture` needs only
torch and safetensors (bench and the demo load the fixture without them).
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import importlib
import inspect
import json
import math
import pkgutil
import platform
import sys
import sysconfig
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "FixtureSpec",
    "TrainedFixture",
    "Corpus",
    "collect_corpus",
    "collect_documents",
    "split_documents",
    "collect_code_documents",
    "split_code_documents",
    "build_trained_fixture",
    "capture_fixture",
    "load_saved_model",
    "load_trained_fixture",
    "DEFAULT_FIXTURE_DIR",
    "STATE_FILES",
]

DEFAULT_FIXTURE_DIR = Path(__file__).resolve().parents[1] / "assets" / "trained_lm"

SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[BOS]", "[EOS]")

# Modules whose import has side effects (opens a browser, prints, starts a GUI) or that are test suites.
_SKIPPED_MODULES = frozenset(
    {
        "antigravity",
        "this",
        "__hello__",
        "__phello__",
        "__main__",
        "tkinter",
        "turtle",
        "turtledemo",
        "idlelib",
        "test",
        "lib2to3",
        "ensurepip",
        "venv",
        "pydoc_data",
        "xxlimited",
        "xxlimited_35",
        "xxsubtype",
    }
)
_SKIPPED_PARTS = frozenset({"test", "tests", "idle_test", "__main__"})

CORPUS_DESCRIPTION = (
    "Docstrings of the Python standard library (top-level modules and public submodules, their classes, "
    "functions and methods, via inspect.getdoc) and the language reference topics of pydoc_data.topics; "
    "one document per docstring or topic, exact duplicates dropped, split by the SHA-256 of the text."
)

CODE_CORPUS_DESCRIPTION = (
    "Source code of the Python standard library's top-level modules (the .py files of the stdlib directory, "
    "private modules included), docstrings removed, comments kept; one document per top-level statement "
    "(imports and assignments grouped), split by the SHA-256 of the text. The model never trained on code: "
    "this is the shifted text for FlashHead's fidelity figures."
)


@dataclass(frozen=True)
class FixtureSpec:
    """Model, tokenizer, training and capture settings of the fixture."""

    vocab_size: int = 8192
    hidden_size: int = 256
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    intermediate_size: int = 688
    context: int = 128
    batch_size: int = 32
    learning_rate: float = 2e-3
    min_learning_rate: float = 1e-4
    weight_decay: float = 0.1
    warmup_steps: int = 30
    minutes: float = 18.0
    seed: int = 0
    calibration_rows: int = 4096
    heldout_rows: int = 4096
    # Second source (stdlib code): per-mille of its documents in each split (the rest is unused).
    code_calibration_permille: int = 30
    code_heldout_permille: int = 30
    code_rows: int = 4096
    # States of the model's own samples (the default build's self-calibration, same function and settings).
    generated_rows: int = 4096
    # Per-mille of documents (by hash) in each split; the rest is training text.
    calibration_permille: int = 50
    heldout_permille: int = 50
    eval_every: int = 50
    eval_sequences: int = 64
    # Train under bfloat16 autocast (only worth it on CPUs with native bfloat16).
    bfloat16: bool = False


@dataclass
class Corpus:
    """Documents of the three splits, each in the collection order."""

    train: list[str]
    calibration: list[str]
    heldout: list[str]
    modules_imported: int
    modules_skipped: int


@dataclass
class TrainedFixture:
    """The committed fixture, loaded as float32 tensors.

    ``weight``: ``[V, H]`` LM head (tied with the input embeddings); ``calibration`` / ``heldout``:
    ``[N, H]`` final hidden states of docstrings; ``code_calibration`` / ``code_heldout``: the same for
    standard-library code (the second source); ``*_next``: ``[N]`` int64 true next token of each state;
    ``generated``: states of the model's own samples (what a default build self-calibrates on);
    ``special_ids``: name -> id of the special tokens; ``meta``: ``meta.json``.
    """

    weight: torch.Tensor
    calibration: torch.Tensor
    heldout: torch.Tensor
    calibration_next: torch.Tensor
    heldout_next: torch.Tensor
    eos_id: int
    special_ids: dict[str, int]
    meta: dict[str, Any] = field(repr=False)
    code_calibration: torch.Tensor = field(default_factory=lambda: torch.empty(0), repr=False)
    code_heldout: torch.Tensor = field(default_factory=lambda: torch.empty(0), repr=False)
    code_calibration_next: torch.Tensor = field(default_factory=lambda: torch.empty(0), repr=False)
    code_heldout_next: torch.Tensor = field(default_factory=lambda: torch.empty(0), repr=False)
    generated: torch.Tensor = field(default_factory=lambda: torch.empty(0), repr=False)

    def source(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """``(calibration, held-out)`` states of a source: ``"docstrings"`` or ``"code"``."""
        if name == "docstrings":
            return self.calibration, self.heldout
        if name == "code":
            return self.code_calibration, self.code_heldout
        raise ValueError(f"unknown source {name!r}: docstrings or code")


# --------------------------------------------------------------------------------------------- corpus


def _module_names() -> list[str]:
    """Standard-library module names, packages expanded to their public submodules, sorted."""
    names: set[str] = set()
    for top in sorted(sys.stdlib_module_names):
        if top in _SKIPPED_MODULES:
            continue
        names.add(top)
        module = _import_quietly(top)
        path = getattr(module, "__path__", None) if module is not None else None
        if path is None:
            continue
        for info in pkgutil.walk_packages(path, prefix=top + ".", onerror=lambda _name: None):
            parts = info.name.split(".")
            if any(p.startswith("_") or p in _SKIPPED_PARTS for p in parts[1:]):
                continue
            names.add(info.name)
    return sorted(names)


def _import_quietly(name: str) -> Any | None:
    """Import a module with warnings silenced; ``None`` when it cannot be imported."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            return importlib.import_module(name)
        except BaseException:  # noqa: BLE001 - any failing import (even SystemExit) just skips the module
            return None


def _docstrings_of(module: Any) -> Iterator[str]:
    """The module's docstring, then those of the classes/functions it defines and their methods."""
    name = module.__name__
    doc = inspect.getdoc(module)
    if doc:
        yield doc
    for attr in sorted(vars(module)):
        if attr.startswith("_"):
            continue
        obj = vars(module)[attr]
        if not (inspect.isclass(obj) or inspect.isroutine(obj)) or getattr(obj, "__module__", None) != name:
            continue
        doc = inspect.getdoc(obj)
        if doc:
            yield doc
        if inspect.isclass(obj):
            for member_name in sorted(vars(obj)):
                if member_name.startswith("_") and member_name != "__init__":
                    continue
                member = vars(obj)[member_name]
                if isinstance(member, (staticmethod, classmethod)):
                    member = member.__func__
                if inspect.isroutine(member) or isinstance(member, property):
                    member_doc = inspect.getdoc(member)
                    if member_doc:
                        yield member_doc


def collect_documents(min_chars: int = 40) -> tuple[list[str], int, int]:
    """All standard-library docstrings and ``pydoc_data`` topics, deduplicated, in a deterministic order.

    Returns ``(documents, modules imported, modules skipped)``. Documents shorter than ``min_chars``
    (one-word docstrings) are dropped.
    """
    from pydoc_data.topics import topics

    seen: set[str] = set()
    documents: list[str] = []

    def add(text: str) -> None:
        text = text.strip()
        if len(text) >= min_chars and text not in seen:
            seen.add(text)
            documents.append(text)

    imported = skipped = 0
    for name in _module_names():
        module = _import_quietly(name)
        if module is None:
            skipped += 1
            continue
        imported += 1
        try:
            for doc in _docstrings_of(module):
                add(doc)
        except Exception:  # noqa: BLE001 - an odd attribute breaks introspection of that module only
            skipped += 1
    for key in sorted(topics):
        add(topics[key])
    return documents, imported, skipped


def _split_of(text: str, spec: FixtureSpec) -> str:
    bucket = int.from_bytes(hashlib.sha256(text.encode("utf-8")).digest()[:8], "big") % 1000
    if bucket < spec.heldout_permille:
        return "heldout"
    if bucket < spec.heldout_permille + spec.calibration_permille:
        return "calibration"
    return "train"


def split_documents(documents: list[str], spec: FixtureSpec) -> dict[str, list[str]]:
    """Documents by split; a document's split depends only on its text."""
    splits: dict[str, list[str]] = {"train": [], "calibration": [], "heldout": []}
    for doc in documents:
        splits[_split_of(doc, spec)].append(doc)
    return splits


def collect_corpus(spec: FixtureSpec) -> Corpus:
    documents, imported, skipped = collect_documents()
    splits = split_documents(documents, spec)
    return Corpus(splits["train"], splits["calibration"], splits["heldout"], imported, skipped)


def _parse(source: str) -> ast.Module:
    """`ast.parse`, once more after the spurious `SystemError` "AST constructor recursion depth mismatch" that CPython
    3.11 can raise in a process with other threads (python/cpython issue 106905)."""
    try:
        return ast.parse(source)
    except SystemError:
        return ast.parse(source)


def _code_chunks(source: str) -> list[str]:
    """Top-level statements of a module's source with docstrings removed; consecutive imports/assignments grouped."""
    tree = _parse(source)
    lines = source.splitlines()
    drop: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            value = first.value if isinstance(first, ast.Expr) else None
            if isinstance(value, ast.Constant) and isinstance(value.value, str):
                drop.update(range(first.lineno - 1, first.end_lineno))
    chunks: list[str] = []
    group: list[str] = []

    def text_of(node: ast.stmt) -> str:
        begin = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])]) - 1
        return "\n".join(lines[i] for i in range(begin, node.end_lineno) if i not in drop).strip("\n")

    def flush() -> None:
        if group:
            chunks.append("\n".join(group))
            group.clear()

    for node in tree.body:
        if isinstance(node, ast.ClassDef):  # the class line with its first statements, then one chunk per method
            flush()
            header = lines[node.lineno - 1]
            for member in node.body:
                text = text_of(member)
                if not text.strip():
                    continue
                if isinstance(member, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    flush()
                    chunks.append(text)
                else:
                    group.append(text if group else header + "\n" + text)
            flush()
            continue
        text = text_of(node)
        if not text.strip():
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom, ast.Assign, ast.AnnAssign, ast.Expr)):
            group.append(text)
            continue
        flush()
        chunks.append(text)
    flush()
    return chunks


def collect_code_documents(min_chars: int = 80, max_chars: int = 6000) -> list[str]:
    """Standard-library code, one document per top-level statement (see :data:`CODE_CORPUS_DESCRIPTION`).

    Only the ``.py`` files directly in the stdlib directory, sorted by name; documents outside
    ``[min_chars, max_chars]`` characters and exact duplicates are dropped.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    seen: set[str] = set()
    documents: list[str] = []
    for path in sorted(root.glob("*.py")):
        try:
            chunks = _code_chunks(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, SyntaxError, ValueError):
            continue
        for chunk in chunks:
            if min_chars <= len(chunk) <= max_chars and chunk not in seen:
                seen.add(chunk)
                documents.append(chunk)
    return documents


def split_code_documents(documents: list[str], spec: FixtureSpec) -> dict[str, list[str]]:
    """Code documents by split (``calibration`` / ``heldout``; the rest unused), by the hash of their text."""
    splits: dict[str, list[str]] = {"calibration": [], "heldout": []}
    for doc in documents:
        bucket = int.from_bytes(hashlib.sha256(("code:" + doc).encode("utf-8")).digest()[:8], "big") % 1000
        if bucket < spec.code_heldout_permille:
            splits["heldout"].append(doc)
        elif bucket < spec.code_heldout_permille + spec.code_calibration_permille:
            splits["calibration"].append(doc)
    return splits


# ------------------------------------------------------------------------------------------ tokenizer


def train_tokenizer(documents: list[str], vocab_size: int) -> Any:
    """A byte-level BPE ``tokenizers.Tokenizer`` whose first ids are :data:`SPECIAL_TOKENS`, in order."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(documents, trainer=trainer)
    if tokenizer.get_vocab_size() != vocab_size:
        raise RuntimeError(
            f"the tokenizer learned {tokenizer.get_vocab_size()} tokens, wanted {vocab_size}: too little training text"
        )
    for expected, token in enumerate(SPECIAL_TOKENS):
        if tokenizer.token_to_id(token) != expected:
            raise RuntimeError(f"special token {token} did not get id {expected}")
    return tokenizer


def token_stream(tokenizer: Any, documents: list[str]) -> torch.Tensor:
    """Documents encoded and concatenated, each followed by ``[EOS]``; int64 ``[T]``."""
    eos = tokenizer.token_to_id("[EOS]")
    ids: list[int] = []
    for encoding in tokenizer.encode_batch(documents, add_special_tokens=False):
        ids.extend(encoding.ids)
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.int64)


def _windows(stream: torch.Tensor, context: int) -> torch.Tensor:
    """Non-overlapping ``[K, context + 1]`` windows (input plus the next token); the tail is dropped."""
    k = (stream.numel() - 1) // context
    if k < 1:
        raise ValueError(f"a stream of {stream.numel()} tokens is shorter than one window of {context + 1}")
    return stream[: k * context + 1].unfold(0, context + 1, context)


# ------------------------------------------------------------------------------------------- training


def build_model(spec: FixtureSpec) -> Any:
    """A freshly initialised ``LlamaForCausalLM`` of the spec's shape, tied embeddings."""
    from transformers import LlamaConfig, LlamaForCausalLM

    special = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
    config = LlamaConfig(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_attention_heads,
        max_position_embeddings=spec.context,
        tie_word_embeddings=True,
        pad_token_id=special["[PAD]"],
        bos_token_id=special["[BOS]"],
        eos_token_id=special["[EOS]"],
    )
    torch.manual_seed(spec.seed)
    return LlamaForCausalLM(config)


def _loss(model: Any, windows: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=windows[:, :-1]).logits
    targets = windows[:, 1:].reshape(-1)
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets)


@torch.no_grad()
def mean_loss(model: Any, windows: torch.Tensor, batch: int = 32) -> float:
    """Mean next-token cross-entropy (nats) over every position of ``windows``."""
    model.eval()
    total = 0.0
    for s in range(0, windows.shape[0], batch):
        part = windows[s : s + batch]
        total += float(_loss(model, part)) * part.shape[0]
    model.train()
    return total / windows.shape[0]


@dataclass
class TrainingLog:
    steps: int
    tokens: int
    seconds: float
    train_loss: float
    history: list[dict[str, float]]


def train(
    model: Any,
    train_stream: torch.Tensor,
    heldout_windows: torch.Tensor,
    spec: FixtureSpec,
    steps: int | None = None,
    log: Any = print,
) -> TrainingLog:
    """Train on random windows of ``train_stream`` for ``spec.minutes`` (or exactly ``steps`` steps).

    The learning rate warms up linearly for ``spec.warmup_steps`` steps, then follows a cosine down to
    ``spec.min_learning_rate`` over the rest of the time box (by wall-clock time, so the box is used
    whatever the machine's speed) or of ``steps``. Logs the train loss (mean since the last log) and the
    held-out loss on ``heldout_windows[:spec.eval_sequences]``.
    """
    generator = torch.Generator().manual_seed(spec.seed)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": spec.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=spec.learning_rate,
        betas=(0.9, 0.95),
    )
    probe = heldout_windows[: spec.eval_sequences]
    max_offset = train_stream.numel() - spec.context - 1
    budget_s = spec.minutes * 60.0
    history: list[dict[str, float]] = []
    running, running_n = 0.0, 0
    start = time.perf_counter()
    warmup_end = start
    step = 0
    model.train()
    while True:
        now = time.perf_counter()
        if steps is not None:
            if step >= steps:
                break
            progress = (step - spec.warmup_steps) / max(1, steps - spec.warmup_steps)
        else:
            if now - start >= budget_s:
                break
            progress = (now - warmup_end) / max(1e-9, budget_s - (warmup_end - start))
        lr = _learning_rate(step, progress, spec)
        for group in optimizer.param_groups:
            group["lr"] = lr
        offsets = torch.randint(0, max_offset, (spec.batch_size,), generator=generator)
        batch = torch.stack([train_stream[o : o + spec.context + 1] for o in offsets.tolist()])
        # bfloat16 autocast is about a third faster on CPUs with native bfloat16 and 2.5x slower without it.
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=spec.bfloat16):
            loss = _loss(model, batch)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        running += loss.item()
        running_n += 1
        step += 1
        if step == spec.warmup_steps:
            warmup_end = time.perf_counter()
        if step % spec.eval_every == 0:
            heldout = mean_loss(model, probe)
            entry = {
                "step": step,
                "seconds": round(time.perf_counter() - start, 1),
                "lr": round(lr, 7),
                "train_loss": round(running / running_n, 4),
                "heldout_loss": round(heldout, 4),
            }
            history.append(entry)
            log(json.dumps(entry))
            running, running_n = 0.0, 0
    seconds = time.perf_counter() - start
    if running_n:
        history.append(
            {
                "step": step,
                "seconds": round(seconds, 1),
                "lr": round(lr, 7),
                "train_loss": round(running / running_n, 4),
                "heldout_loss": round(mean_loss(model, probe), 4),
            }
        )
    train_loss = history[-1]["train_loss"] if history else float("nan")
    return TrainingLog(step, step * spec.batch_size * spec.context, seconds, train_loss, history)


def _learning_rate(step: int, progress: float, spec: FixtureSpec) -> float:
    """Linear warm-up over ``spec.warmup_steps``, then cosine decay; ``progress`` in [0, 1] after warm-up."""
    if step < spec.warmup_steps:
        return spec.learning_rate * (step + 1) / spec.warmup_steps
    cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, max(0.0, progress))))
    return spec.min_learning_rate + (spec.learning_rate - spec.min_learning_rate) * cosine


# -------------------------------------------------------------------------------------------- capture


@torch.no_grad()
def capture(
    model: Any, windows: torch.Tensor, rows: int, seed: int, batch: int = 32
) -> tuple[torch.Tensor, torch.Tensor]:
    """Final hidden states (the LM head's input) and true next tokens at a deterministic subsample of positions.

    Every position of every window is a candidate; ``rows`` of them are drawn without replacement
    (``torch.randperm`` with ``seed``) and kept in stream order. Checks that the head applied to the
    captured states reproduces the model's logits.
    """
    model.eval()
    states, targets = [], []
    head = model.get_output_embeddings()
    for s in range(0, windows.shape[0], batch):
        part = windows[s : s + batch]
        out = model.model(input_ids=part[:, :-1])
        hidden = out.last_hidden_state
        if s == 0:
            logits = model(input_ids=part[:, :-1]).logits
            if not torch.allclose(head(hidden), logits, rtol=1e-4, atol=1e-4):
                raise RuntimeError("the captured states do not reproduce the model's logits")
        states.append(hidden.reshape(-1, hidden.shape[-1]))
        targets.append(part[:, 1:].reshape(-1))
    all_states, all_targets = torch.cat(states), torch.cat(targets)
    if rows > all_states.shape[0]:
        raise ValueError(f"asked for {rows} rows, the text has only {all_states.shape[0]} positions")
    pick = torch.randperm(all_states.shape[0], generator=torch.Generator().manual_seed(seed))[:rows].sort().values
    return all_states[pick], all_targets[pick]


# --------------------------------------------------------------------------------------------- output


STATE_FILES = ("calibration", "heldout", "code_calibration", "code_heldout")


def write_fixture(
    out: Path,
    *,
    weight: torch.Tensor,
    states: dict[str, tuple[torch.Tensor, torch.Tensor]],
    generated: torch.Tensor,
    tokenizer: Any,
    meta: dict[str, Any],
) -> None:
    """Write the fixture files to ``out``.

    ``head.safetensors``: ``weight`` float16 ``[V, H]``. ``<split>.safetensors`` for each of
    :data:`STATE_FILES`: ``hidden_states`` float16 ``[N, H]`` and ``next_token_ids`` int32 ``[N]``.
    ``generated.safetensors``: ``hidden_states`` float16 (the model's own samples; no true next token).
    ``tokenizer.json``: the ``tokenizers`` tokenizer. ``meta.json``: everything else.
    """
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    save_file({"weight": weight.detach().to(torch.float16).contiguous()}, str(out / "head.safetensors"))
    for name in STATE_FILES:
        hidden, targets = states[name]
        save_file(
            {
                "hidden_states": hidden.to(torch.float16).contiguous(),
                "next_token_ids": targets.to(torch.int32).contiguous(),
            },
            str(out / f"{name}.safetensors"),
        )
    save_file({"hidden_states": generated.to(torch.float16).contiguous()}, str(out / "generated.safetensors"))
    tokenizer.save(str(out / "tokenizer.json"), pretty=False)
    (out / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")


def load_trained_fixture(path: str | Path | None = None) -> TrainedFixture:
    """Load a fixture written by :func:`write_fixture` (default: the committed ``tests/assets/trained_lm``)."""
    from safetensors.torch import load_file

    root = Path(path) if path is not None else DEFAULT_FIXTURE_DIR
    names = ("meta.json", "head.safetensors", "generated.safetensors", *(f"{n}.safetensors" for n in STATE_FILES))
    missing = [n for n in names if not (root / n).is_file()]
    if missing:
        raise FileNotFoundError(f"{root} is not a trained-LM fixture: missing {', '.join(missing)}")
    meta = json.loads((root / "meta.json").read_text())
    files = {n: load_file(str(root / f"{n}.safetensors")) for n in STATE_FILES}
    return TrainedFixture(
        weight=load_file(str(root / "head.safetensors"))["weight"].float(),
        calibration=files["calibration"]["hidden_states"].float(),
        heldout=files["heldout"]["hidden_states"].float(),
        calibration_next=files["calibration"]["next_token_ids"].long(),
        heldout_next=files["heldout"]["next_token_ids"].long(),
        eos_id=int(meta["eos_id"]),
        special_ids={k: int(v) for k, v in meta["special_ids"].items()},
        meta=meta,
        code_calibration=files["code_calibration"]["hidden_states"].float(),
        code_heldout=files["code_heldout"]["hidden_states"].float(),
        code_calibration_next=files["code_calibration"]["next_token_ids"].long(),
        code_heldout_next=files["code_heldout"]["next_token_ids"].long(),
        generated=load_file(str(root / "generated.safetensors"))["hidden_states"].float(),
    )


def save_model(model: Any, tokenizer: Any, path: Path) -> None:
    """The full Hugging Face checkpoint and tokenizer, loadable by ``from_pretrained`` and vLLM."""
    from transformers import PreTrainedTokenizerFast

    model.save_pretrained(path, safe_serialization=True)
    PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        pad_token="[PAD]",
        unk_token="[UNK]",
        bos_token="[BOS]",
        eos_token="[EOS]",
        model_max_length=model.config.max_position_embeddings,
    ).save_pretrained(path)


def _training_meta(spec: FixtureSpec, model: Any, result: TrainingLog, heldout_loss: float) -> dict[str, Any]:
    return {
        "model_config": json.loads(model.config.to_json_string(use_diff=False)),
        "training_spec": spec.__dict__,
        "seed": spec.seed,
        "steps": result.steps,
        "tokens_trained_on": result.tokens,
        "training_seconds": round(result.seconds, 1),
        "final_train_loss": result.train_loss,
        "final_train_perplexity": round(math.exp(result.train_loss), 3),
        "final_heldout_loss": round(heldout_loss, 4),
        "final_heldout_perplexity": round(math.exp(heldout_loss), 3),
        "history": result.history,
    }


def build_trained_fixture(
    out: Path,
    spec: FixtureSpec,
    *,
    steps: int | None = None,
    model_dir: Path | None = None,
    from_model: Path | None = None,
    command: str = "",
    log: Any = print,
) -> dict[str, Any]:
    """Collect, tokenize, train (or load ``from_model``), capture and write the fixture to ``out``; returns ``meta``.

    ``model_dir``: also save the trained model there (with ``fixture_training.json``), so that a later run
    with ``from_model`` re-captures the states (new sources, other row counts) without training again.
    """
    torch.manual_seed(spec.seed)
    corpus = collect_corpus(spec)
    log(
        f"documents: train {len(corpus.train)}, calibration {len(corpus.calibration)}, "
        f"held-out {len(corpus.heldout)} (modules imported {corpus.modules_imported}, "
        f"skipped {corpus.modules_skipped})"
    )
    if from_model is not None:
        model, tokenizer, training = load_saved_model(from_model)
        log(f"model and tokenizer from {from_model.name}: trained {training['steps']} steps")
    else:
        tokenizer = train_tokenizer(corpus.train, spec.vocab_size)
        train_stream = token_stream(tokenizer, corpus.train)
        heldout_windows = _windows(token_stream(tokenizer, corpus.heldout), spec.context)
        log(f"tokens: train {train_stream.numel():,}")
        model = build_model(spec)
        log(f"model: {sum(p.numel() for p in model.parameters()):,} parameters")
        result = train(model, train_stream, heldout_windows, spec, steps=steps, log=log)
        heldout_loss = mean_loss(model, heldout_windows)
        log(
            f"trained {result.steps} steps in {result.seconds:.0f} s; held-out loss {heldout_loss:.3f} "
            f"(perplexity {math.exp(heldout_loss):.1f})"
        )
        training = {**_training_meta(spec, model, result, heldout_loss), "training_command": command}
        if model_dir is not None:
            save_model(model, tokenizer, model_dir)
            (model_dir / "fixture_training.json").write_text(json.dumps(training, indent=2) + "\n")
    return capture_fixture(out, model, tokenizer, corpus, spec, training, command=command, log=log)


def load_saved_model(path: Path) -> tuple[Any, Any, dict[str, Any]]:
    """``(model, tokenizers.Tokenizer, training meta)`` of a model saved by ``--save-model``."""
    from tokenizers import Tokenizer
    from transformers import LlamaForCausalLM

    training_file = path / "fixture_training.json"
    if not training_file.is_file():
        raise FileNotFoundError(f"{path} was not saved by this generator: missing fixture_training.json")
    model = LlamaForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    return model, Tokenizer.from_file(str(path / "tokenizer.json")), json.loads(training_file.read_text())


def _hf_tokenizer(tokenizer: Any, context: int) -> Any:
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        pad_token="[PAD]",
        unk_token="[UNK]",
        bos_token="[BOS]",
        eos_token="[EOS]",
        model_max_length=context,
        padding_side="left",
    )


def capture_fixture(
    out: Path,
    model: Any,
    tokenizer: Any,
    corpus: Corpus,
    spec: FixtureSpec,
    training: dict[str, Any],
    *,
    command: str = "",
    log: Any = print,
) -> dict[str, Any]:
    """Capture every state file of the fixture from ``model`` and write it (see :func:`write_fixture`).

    Docstrings (the training source): calibration and held-out documents. Code (a second source the model
    never trained on): :func:`collect_code_documents`. Generated: the model's own samples, through
    ``generate_calibration_states`` with the settings a default ``my-pkg flashhead build`` uses.
    """
    import tokenizers
    import transformers

    from my_pkg.flashhead.calibration import generate_calibration_states

    model.eval()
    code = split_code_documents(collect_code_documents(), spec)
    streams = {
        "calibration": token_stream(tokenizer, corpus.calibration),
        "heldout": token_stream(tokenizer, corpus.heldout),
        "code_calibration": token_stream(tokenizer, code["calibration"]),
        "code_heldout": token_stream(tokenizer, code["heldout"]),
    }
    log("tokens: " + ", ".join(f"{k} {v.numel():,}" for k, v in streams.items()))
    rows = {
        "calibration": spec.calibration_rows,
        "heldout": spec.heldout_rows,
        "code_calibration": spec.code_rows,
        "code_heldout": spec.code_rows,
    }
    captured = {
        name: capture(model, _windows(stream, spec.context), rows[name], spec.seed + 1 + i)
        for i, (name, stream) in enumerate(streams.items())
    }
    losses = {name: round(mean_loss(model, _windows(stream, spec.context)), 4) for name, stream in streams.items()}
    log(f"mean next-token loss per split: {losses}")
    t0 = time.perf_counter()
    generated = generate_calibration_states(
        model, _hf_tokenizer(tokenizer, spec.context), max_states=spec.generated_rows, seed=spec.seed
    )
    log(f"generated {generated.hidden.shape[0]} states in {time.perf_counter() - t0:.1f} s")
    special_ids = {token: tokenizer.token_to_id(token) for token in SPECIAL_TOKENS}
    meta = {
        "description": "Small Llama LM trained from scratch on Python standard-library docstrings; its LM head "
        "and final hidden states of text it never trained on (docstrings, and standard-library "
        "code, a second source), and of its own samples, for FlashHead quality tests.",
        "vocab_size": spec.vocab_size,
        "hidden_size": spec.hidden_size,
        "eos_id": special_ids["[EOS]"],
        "bos_id": special_ids["[BOS]"],
        "pad_id": special_ids["[PAD]"],
        "unk_id": special_ids["[UNK]"],
        "special_ids": special_ids,
        **training,
        "spec": spec.__dict__,
        "split_losses": losses,
        "corpus": {
            "description": CORPUS_DESCRIPTION,
            "documents": {
                "train": len(corpus.train),
                "calibration": len(corpus.calibration),
                "heldout": len(corpus.heldout),
            },
            "modules_imported": corpus.modules_imported,
            "modules_skipped": corpus.modules_skipped,
            "licence": "Python Software Foundation License (text of the Python standard library)",
        },
        "code_corpus": {
            "description": CODE_CORPUS_DESCRIPTION,
            "documents": {"calibration": len(code["calibration"]), "heldout": len(code["heldout"])},
            "licence": "Python Software Foundation License (source of the Python standard library)",
        },
        "tokens": {name: stream.numel() for name, stream in streams.items()},
        "rows": {**rows, "generated": int(generated.hidden.shape[0])},
        "generated": generated.record(),
        "python_version": platform.python_version(),
        "versions": {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "tokenizers": tokenizers.__version__,
        },
        "command": command,
    }
    write_fixture(
        out,
        weight=model.get_output_embeddings().weight,
        states=captured,
        generated=generated.hidden,
        tokenizer=tokenizer,
        meta=meta,
    )
    return meta


def _recorded_args(argv: list[str]) -> list[str]:
    """The arguments that shape the fixture: ``--save-model`` (a local output path) is left out."""
    kept: list[str] = []
    skip_next = False
    for arg in argv:
        if skip_next:
            skip_next = False
        elif arg in ("--save-model", "--from-model"):
            skip_next = True
        elif not arg.startswith(("--save-model=", "--from-model=")):
            kept.append(arg)
    return kept


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.support.trained_fixture", description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="directory for the fixture files")
    parser.add_argument("--minutes", type=float, default=FixtureSpec.minutes, help="training time box")
    parser.add_argument("--steps", type=int, default=None, help="train exactly this many steps (ignores --minutes)")
    parser.add_argument("--seed", type=int, default=FixtureSpec.seed)
    parser.add_argument("--bfloat16", action="store_true", help="train under bfloat16 autocast")
    parser.add_argument(
        "--save-model",
        type=Path,
        default=None,
        metavar="DIR",
        help="also save the full Hugging Face model and tokenizer here",
    )
    parser.add_argument(
        "--from-model",
        type=Path,
        default=None,
        metavar="DIR",
        help="skip training: capture the states from a model saved earlier with --save-model",
    )
    args = parser.parse_args(argv)
    if args.minutes <= 0:
        parser.error("--minutes must be positive")
    if args.steps is not None and args.steps < 1:
        parser.error("--steps must be >= 1")
    torch.set_num_threads(1)
    recorded = _recorded_args(sys.argv[1:] if argv is None else argv)
    command = " ".join(["python -m tests.support.trained_fixture", *recorded])
    spec = FixtureSpec(minutes=args.minutes, seed=args.seed, bfloat16=args.bfloat16)
    build_trained_fixture(
        args.out,
        spec,
        steps=args.steps,
        model_dir=args.save_model,
        from_model=args.from_model,
        command=command,
        log=lambda line: print(line, flush=True),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
