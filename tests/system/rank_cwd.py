"""``python -m tests.system.rank_cwd ARGS``: ``lit-ddp ARGS`` in a directory of this rank's own, the
``LOCAL_RANK``-th of the comma-separated ``LIT_DDP_RANK_DIRS``: each rank sees its own "node-local" run directory
under the same relative path, as ranks on nodes without shared storage do (tests/system/test_reliability.py)."""

import os

if __name__ == "__main__":
    os.chdir(os.environ["LIT_DDP_RANK_DIRS"].split(",")[int(os.environ["LOCAL_RANK"])])
    from lit_ddp.__main__ import main

    main()
