"""docs/flashhead-serving.md lists the reason codes and dense reasons the contract defines, generated
from `my_pkg.contract`; these tests keep the two in step and print the table to paste when they differ."""

from __future__ import annotations

import ast
import inspect
import re
import sys
from pathlib import Path
from typing import get_args

from my_pkg import contract
from my_pkg.engine.flashhead import step

ROOT = Path(__file__).resolve().parents[3]
DOC = ROOT / "docs" / "flashhead-serving.md"


def render(name: str) -> str:
    """The markdown table `name` (`REASON_CODES` or `DENSE_ROW_REASONS`) of `my_pkg.contract`."""
    table, header = {
        "REASON_CODES": (contract.REASON_CODES, "| `reason_code` | FlashHead is not active because |"),
        "DENSE_ROW_REASONS": (contract.DENSE_ROW_REASONS, "| `rows_dense` key | The rows were served dense because |"),
        "SPEC_REASON_CODES": (
            contract.SPEC_REASON_CODES,
            "| `spec.verify` / `spec.draft` `reason_code` | FlashHead does not serve it because |",
        ),
    }[name]
    lines = [header, "|---|---|", *(f"| `{key}` | {text} |" for key, text in table.items())]
    return "\n".join(lines)


def _block(text: str, name: str) -> str | None:
    found = re.search(
        rf"<!-- generated from my_pkg/contract/reasons.py: {name} -->\n(.*?)\n<!-- end {name} -->", text, re.S
    )
    return found.group(1) if found else None


def test_the_docs_tables_are_generated_from_the_contract():
    text = DOC.read_text()
    for name in ("REASON_CODES", "DENSE_ROW_REASONS", "SPEC_REASON_CODES"):
        expected = render(name)
        assert _block(text, name) == expected, f"paste into {DOC.name} between the {name} markers:\n{expected}"


def test_the_admin_api_docs_list_every_worker_method_with_its_reply_model():
    text = (ROOT / "docs" / "admin-api.md").read_text()
    listed = dict(re.findall(r"^\| `(my_pkg_\w+)\([^)]*\)` \| `(\w+)`", text, re.M))
    assert listed == {name: model.__name__ for name, model in contract.WORKER_METHOD_REPLIES.items()}


def test_the_literals_and_their_tables_name_the_same_codes():
    assert list(get_args(contract.ReasonCode)) == list(contract.REASON_CODES)
    assert list(get_args(contract.DenseRowReason)) == list(contract.DENSE_ROW_REASONS)
    assert list(get_args(contract.SpecReasonCode)) == list(contract.SPEC_REASON_CODES)
    labels = [reason.label for reason in contract.DenseReason]
    assert list(get_args(contract.DenseRowReason)) == labels + list(get_args(contract.StepDenseReason))


def test_every_code_the_engine_writes_is_declared():
    """String literals the engine gives as a reason code, or counts rows dense under, are in the contract."""
    code_patterns = (
        r'make_unavailable\(\s*"(\w+)"',
        r'status_without_controller\(\s*"(\w+)"',
        r'unavailable = \("(\w+)"',
        r'return "(\w+)", ',
        r'code, reason = "(\w+)"',
        r'unavailable_code = "(\w+)"',
    )
    reason_patterns = (
        r'rows_dense\["(\w+)"\]',
        r'_all_dense\(hidden, dense, "(\w+)"\)',
        r'"(\w+)" if "lora" in',
        r'"lora" in type\(layer\).__name__.lower\(\) else "(\w+)"',
    )
    spec_patterns = (r'_part\(\s*"(\w+)"', r'"(\w+)" if method in', r'\("(draft_\w+)", ')
    codes, reasons, spec_codes = set(), set(), set()
    engine = ROOT / "my_pkg" / "engine"
    for path in [*(engine / "flashhead").rglob("*.py"), *(engine / "patches").rglob("*.py"), engine / "setup.py"]:
        text = path.read_text()
        for pattern in code_patterns:
            codes.update(re.findall(pattern, text))
        for pattern in reason_patterns:
            reasons.update(re.findall(pattern, text))
        for pattern in spec_patterns:
            spec_codes.update(re.findall(pattern, text))
    # A whole step's dense reasons, as the step's routing returns them.
    reasons.update(re.findall(r'return "(\w+)"', inspect.getsource(step.all_dense_reason)))
    assert {"quantized_head", "runner_hook_failed", "logits_processor_taken", "assets_invalid"} <= codes
    assert {"error", "batch_threshold", "lora", "wrapped_head"} <= reasons
    assert codes <= set(contract.REASON_CODES), codes - set(contract.REASON_CODES)
    assert reasons <= set(contract.DENSE_ROW_REASONS), reasons - set(contract.DENSE_ROW_REASONS)
    assert {"model_runner_v2", "spec_hook_failed", "no_draft_head", "flashhead_inactive"} <= spec_codes
    assert {"draft_no_assets", "draft_vocab_mismatch", "draft_head_unavailable", "draft_hook_failed"} <= spec_codes
    assert spec_codes <= set(contract.SPEC_REASON_CODES), spec_codes - set(contract.SPEC_REASON_CODES)


# The compat check reads the engine's vLLM declarations; their vocabulary module imports the standard library only.
ALLOWED_ENGINE_IMPORTS = {("my_pkg/devtools/compat/manifest.py", "my_pkg.engine.vllm_uses")}


def test_nothing_outside_the_engine_imports_it():
    """The engine half is loaded by vLLM; the CLI, the endpoints and the FlashHead core stand without it."""
    offenders = []
    for path in (ROOT / "my_pkg").rglob("*.py"):
        if path.is_relative_to(ROOT / "my_pkg" / "engine"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            module = node.module if isinstance(node, ast.ImportFrom) else None
            names = [alias.name for alias in node.names] if isinstance(node, ast.Import) else []
            relative_engine = isinstance(node, ast.ImportFrom) and node.level and (module or "").startswith("engine")
            engine = [m for m in [module or "", *names] if m.startswith("my_pkg.engine")]
            rel = str(path.relative_to(ROOT))
            if relative_engine or any((rel, m) not in ALLOWED_ENGINE_IMPORTS for m in engine):
                offenders.append(rel)
    assert offenders == []
    vocabulary = ast.parse((ROOT / "my_pkg" / "engine" / "vllm_uses.py").read_text())
    imported = {
        name
        for node in ast.walk(vocabulary)
        for name in (
            [node.module or ""] if isinstance(node, ast.ImportFrom) else [a.name for a in getattr(node, "names", [])]
        )
        if isinstance(node, ast.Import | ast.ImportFrom)
    }
    assert all(name.split(".")[0] in sys.stdlib_module_names for name in imported), imported
