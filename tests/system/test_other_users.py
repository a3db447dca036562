"""Another user of the machine (docs/security.md, "Threats"): what a process under another uid can reach of a
lit-ddp job on loopback, and that none of it runs code, joins or changes the job. The torchft cases (the lighthouse,
a heal, the quorum) are in ``tests/system/test_torchft_other_users.py``.

The attacker is plain Python under uid 65534 (:func:`tests.helpers.as_other_user`), as on a shared login or compute
node: it reads what every user may read (``/proc/PID/cmdline``; ``/proc/net/tcp`` lists the listening ports, which
the tests hand it directly) and connects to loopback ports."""

from __future__ import annotations

import sys
import time
from argparse import Namespace
from pathlib import Path

import pytest

from lit_ddp.chaos.job import Job
from lit_ddp.strategies import loopback
from tests.helpers import QUIET, as_other_user, compose, needs_root, subprocess_env

# The planter: every second, for each rendezvous id it can name (the ids lit-ddp chaos used before this test, and any
# --rdzv_id on a command line it can read), it sets torch's c10d rendezvous state to a pickle whose load creates
# MARKER. torch's C10dRendezvousBackend unpickles that state (base64) at its next read.
PLANTER = """
import base64, builtins, os, pickle, sys, time
from datetime import timedelta
import torch.distributed as dist

port, marker, seconds = int(sys.argv[1]), sys.argv[2], float(sys.argv[3])

class Payload:
    def __reduce__(self):
        return builtins.open, (marker, "w")

state = base64.b64encode(pickle.dumps(Payload()))
store = dist.TCPStore("127.0.0.1", port, None, False, timedelta(seconds=10))
guessed = {f"{name}-{n}" for name in ("reference", "faulted") for n in (1, 2, 3)}
print("planter ready", flush=True)
end = time.monotonic() + seconds
while time.monotonic() < end:
    seen = set(guessed)
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            argv = open(f"/proc/{pid}/cmdline", "rb").read().decode(errors="replace").split("\\0")
        except OSError:
            continue
        for i, arg in enumerate(argv):
            if arg in ("--rdzv_id", "--rdzv-id") and i + 1 < len(argv):
                seen.add(argv[i + 1])
            elif arg.startswith(("--rdzv_id=", "--rdzv-id=")):
                seen.add(arg.split("=", 1)[1])
    for run_id in seen:
        store.set("torch.rendezvous." + run_id, state)
    time.sleep(0.2)
print("planter planted", sorted(seen), flush=True)
"""


@needs_root
@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_another_user_cannot_plant_a_rendezvous_state_in_chaos_store(tmp_path: Path) -> None:
    """``lit-ddp chaos --launcher torchrun --nodes 2`` holds its agents' rendezvous store on loopback, where every
    user of the machine can connect. With the rendezvous ids it used to give on the agents' command lines
    (``reference-1``), another uid's process set the state torch unpickles and ran code as the chaos user; the ids
    are now random and in the agents' environment: the job trains to its end, and the payload never runs."""
    root, marker = tmp_path / "run", tmp_path / "MARKER"
    args = Namespace(
        launcher="torchrun", nodes=2, nproc_per_node=1, max_restarts=0, kinds=["kill"], faults=1, root=tmp_path
    )
    fit = [*compose("trainer/ddp", "regression/multinode"), "--trainer.max_steps", "6", *QUIET]
    job = Job(args, fit, root, faulted=False)
    job.env.update(subprocess_env(OMP_NUM_THREADS="1"))
    job.store = loopback.store(0, None, True, multi_tenant=True, wait_for_workers=False)  # as Job.start makes it
    planter = as_other_user(PLANTER, str(job.store.port), str(marker), "60")
    try:
        assert planter.stdout is not None and planter.stdout.readline().strip() == "planter ready"
        job.start()  # the planter is in place before the agents' first read
        deadline = time.monotonic() + 240
        while (code := job.poll()) is None and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        job.stop()
        planter.kill()
    out = planter.communicate(timeout=30)[0]
    assert not marker.exists(), f"the planted rendezvous state ran code as the chaos user\n{out}"
    assert code == 0, job.output()[-3000:]
    assert "--rdzv_id" not in " ".join(job._agent_command()), "the rendezvous id is on the agents' command line"
    print(out, file=sys.stderr)
