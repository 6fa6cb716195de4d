"""FlashHead through vLLM's offline `LLM` API, started with MY_PKG_FLASHHEAD=0 and switched on live."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.e2e

SCRIPT = textwrap.dedent(
    """
    import json, sys
    from vllm import LLM, SamplingParams

    llm = LLM(model=sys.argv[1], dtype="float32", max_model_len=256, enforce_eager=True)
    greedy = SamplingParams(temperature=0.0, max_tokens=16)
    prompts = ["the world and the sun", "hello world"]

    def texts():
        return [o.outputs[0].text for o in llm.generate(prompts, greedy, use_tqdm=False)]

    off = texts()
    status_off = llm.collective_rpc("my_pkg_flashhead_status")[0]
    llm.collective_rpc("my_pkg_flashhead_apply", args=({"enabled": True, "n_probes": int(sys.argv[2])},))
    exact = texts()
    status_on = llm.collective_rpc("my_pkg_flashhead_status")[0]
    print("RESULT " + json.dumps({"off": off, "exact": exact, "status_off": status_off, "status_on": status_on}))
    """
)


def test_offline_llm_dense_by_env_then_flashhead_live(flashhead_model, logs_dir):
    from e2e_support import NUM_CLUSTERS

    env = dict(
        os.environ, MY_PKG_FLASHHEAD="0", VLLM_PLUGINS="my_pkg_engine", HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="1"
    )
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(flashhead_model), str(NUM_CLUSTERS)],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    (logs_dir / "offline-llm.log").write_text(done.stdout + done.stderr)
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(out for out in done.stdout.splitlines() if out.startswith("RESULT "))
    result = json.loads(line.removeprefix("RESULT "))
    off, on = result["status_off"], result["status_on"]
    assert off["enabled"] is False and off["counters"]["rows_flashhead"] == 0
    assert off["counters"]["rows_dense"]["disabled"] >= 2 * 15
    assert on["active"] is True and on["counters"]["rows_flashhead"] >= 2 * 15
    # Every cluster probed: FlashHead reproduces the dense head's greedy answers.
    assert result["exact"] == result["off"]
