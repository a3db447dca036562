"""``python -m lit_ddp`` is the same as the ``lit-ddp`` command."""

from lit_ddp.cli import cli_main

if __name__ == "__main__":
    cli_main()
