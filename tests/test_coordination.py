"""No rank ever hangs: one rank's storage fails at a coordinated step, and every
rank raises the same cloudckpt error within the retry deadline plus 10 seconds,
on real gloo process groups of 2 and 3 ranks against moto S3."""

from __future__ import annotations

import pytest
from coordination_workers import SCENARIOS
from dist_run import run_ranks

DEADLINE = 5.0


@pytest.mark.parametrize("world", [2, 3])
def test_a_failure_on_one_rank_is_raised_on_every_rank(s3, world):
    # The process-group timeout is 10 minutes: a rank left waiting in a collective
    # fails the test by run_ranks' timeout, not by a slow pass.
    results = run_ranks("coordination_workers.fail_one_step", world,
                        s3.options["endpoint_url"], s3.root, DEADLINE,
                        timeout=400, pg_timeout=600)
    for r in range(world):
        assert not (isinstance(results[r], tuple) and results[r][0] == "error"), results[r]
    for i, (name, bad_rank, _) in enumerate(SCENARIOS):
        seen = [results[r][i] for r in range(world)]
        raised = {s[2] for s in seen}
        where = f"{name} failing on rank {bad_rank}: {seen}"
        assert seen[bad_rank][5] >= 1, f"no fault was injected: {where}"
        if name == "retention":  # the save is committed: retention only warns, everywhere
            assert raised == {None}, where
        else:
            assert len(raised) == 1 and None not in raised, where
            assert raised <= {"AccessDeniedError"}, where
        assert all(s[3] < DEADLINE + 10 for s in seen), where
        assert seen[0][4], f"the previous checkpoint is not the latest: {where}"
