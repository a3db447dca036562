"""``python -m lit_ddp`` is the same as the ``lit-ddp`` command.

Before Lightning is imported, the launchers' integer variables are checked (Lightning parses ``RANK`` as it is
imported: :mod:`lit_ddp.launch.variables`), and ``fit`` makes SIGUSR1 (Slurm's preemption notice) only record a
request (:mod:`lit_ddp.resilience.signals`): the run saves and requeues at its first optimizer step instead of dying
on a signal that arrives during start-up. Where ``$LIT_DDP_BAD_USE_FILE`` names a file, an exit for bad use (status
2) creates it: a launcher that sees only torchrun's status (1 for any failure) learns not to start the job again.
"""

import os
import signal
import sys

from lit_ddp.errors import BAD_USE_FILE_ENV, UsageError
from lit_ddp.launch.variables import check_launch_variables
from lit_ddp.resilience import signals


def main() -> None:
    """The ``lit-ddp`` console script and ``python -m lit_ddp``."""
    try:
        try:
            check_launch_variables()
        except UsageError as e:  # as lit_ddp.launch.reporting prints it, which imports Lightning
            print(f"lit-ddp: error: {e}", file=sys.stderr)
            raise SystemExit(e.exit_code) from None
        if "fit" in sys.argv[1:2]:
            signals.install(signal.SIGUSR1)
        from lit_ddp.cli import main as cli_main

        cli_main()
    except SystemExit as e:
        bad_use_file = os.environ.get(BAD_USE_FILE_ENV)
        if e.code == UsageError.exit_code and bad_use_file:
            with open(bad_use_file, "w"):
                pass
        raise


if __name__ == "__main__":
    main()
