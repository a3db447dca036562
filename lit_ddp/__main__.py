"""``python -m lit_ddp`` is the same as the ``lit-ddp`` command.

Before Lightning is imported, ``fit`` makes SIGUSR1 (Slurm's preemption notice) only record a request
(:mod:`lit_ddp.resilience.signals`): the run saves and requeues at its first optimizer step instead of dying on a
signal that arrives during start-up.
"""

import signal
import sys

from lit_ddp.resilience import signals


def main() -> None:
    """The ``lit-ddp`` console script and ``python -m lit_ddp``."""
    if "fit" in sys.argv[1:2]:
        signals.install(signal.SIGUSR1)
    from lit_ddp.cli import main as cli_main

    cli_main()


if __name__ == "__main__":
    main()
