"""RLinf's usual launch, written as its ``examples/reasoning/main_grpo.py`` is: a Hydra
app (``--config-path config/math --config-name NAME key=value ...``) under RLinf's own
``output_redirector``, with RLinf's ``MetricLogger`` and ``ReasoningRunner`` (its
``init_workers``, ``_set_max_steps``, ``_save_checkpoint``, and ``check_progress`` for when
to save). What needs GPUs is stood in (``rlinf_runner_driver.py``): the actor group is two
gloo ranks running RLinf's FSDP2 strategy, and a step trains them on the batch RLinf's
dataloader draws, where RLinf's would roll out and train.

It writes ``rlinf-run.json`` in the working directory: the step it resumed at, the log
path RLinf's loggers got, and per saved step every rank's digests and the next batch.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the compat drivers

import hydra  # noqa: E402
import rlinf_runner_driver as driver  # noqa: E402  (before RLinf: PyPI's, not the peers')
from rlinf.utils.utils import output_redirector  # noqa: E402

WORLD = 2
REPORT = "rlinf-run.json"


@hydra.main(version_base="1.1")
@output_redirector
def main(cfg) -> None:
    from rlinf.utils.metric_logger import MetricLogger
    from rlinf.utils.runner_utils import check_progress

    group = driver.RankGroup(WORLD)
    try:
        runner = driver.runner_with(cfg, group)
        runner._set_max_steps()
        runner.metric_logger = MetricLogger(cfg)
        runner.init_workers()
        report: dict = {"resumed_at": runner.global_steps, "saved": [],
                        "log_path": cfg.runner.logger.log_path}
        batches = iter(runner.train_dataloader)
        while runner.global_steps < runner.max_steps:
            step = runner.global_steps + 1
            group.call("train", step, next(batches).tolist())
            runner.global_steps = step
            runner.metric_logger.log({"train/step": float(step)}, step)
            _, save, _ = check_progress(step, runner.max_steps, cfg.runner.val_check_interval,
                                        cfg.runner.save_interval, 1.0)
            if save:
                runner._save_checkpoint()
                report["saved"].append({"step": step, "digests": group.call("digests"),
                                        "next": driver._next_batch(runner)})
        runner.metric_logger.finish()
    finally:
        group.close()
    Path(REPORT).write_text(json.dumps(report))


if __name__ == "__main__":
    main()
