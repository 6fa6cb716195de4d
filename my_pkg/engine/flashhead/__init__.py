"""FlashHead in one vLLM worker, without vLLM: the controller and its parts.

- `controller`: `FlashHeadController`, one model's FlashHead from its assets to each decode step
  and the admin API's status, validate and apply; it orchestrates the parts below.
- `availability`: the model directory's assets, and why FlashHead cannot serve with them.
- `build`: the head's build over the loaded LM head, its warm-up and start-up timing steps, its memory.
- `step`: one armed step's routing (which rows go dense) and its two ways to FlashHead's answer.
- `updates`: the admin update: what the served model refuses, and applying the rest.
- `rows`: which rows of a step FlashHead may serve (request classification, `StepRows`).
- `pins`: the token ids scored exactly on every row, with their cached weight rows.
- `telemetry`: counters, the head's timer and the live fidelity check.
- `timing`: which way serves each step (FlashHead's kernels or the masked dense product).
- `exchange`: tensor parallelism's stage-1 exchange (what each rank sends).
- `report`: the status reply and the start-up timing's log lines.

Where vLLM meets them is `my_pkg.engine.patches`.
"""

from my_pkg.engine.flashhead.controller import FlashHeadController
from my_pkg.engine.flashhead.report import status_without_controller
from my_pkg.engine.flashhead.rows import StepRows

__all__ = ["FlashHeadController", "StepRows", "status_without_controller"]
