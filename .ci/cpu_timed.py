"""Run a command, its output to a log, and say what it cost: ``rc wall_s cpu_s``.

Usage: cpu_timed.py WALL_LIMIT_S LOG COMMAND...

The CPU seconds are those of the command and every process it waited for (user +
system). They measure the work a command does (a resolver that backtracks burns
CPU on every candidate it fetches and rejects) whatever else the machine runs,
where wall time grows with the load beside it. WALL_LIMIT_S only stops a command
that hangs: past it the command is killed and rc is 124, as timeout(1) says.
"""

import os
import resource
import signal
import subprocess
import sys
import time


def main() -> int:
    wall_limit, log, command = float(sys.argv[1]), sys.argv[2], sys.argv[3:]
    start = time.monotonic()
    with open(log, "wb") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=wall_limit)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = 124
    wall = time.monotonic() - start
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    print(f"{rc} {wall:.1f} {usage.ru_utime + usage.ru_stime:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
