"""Whether a torchft quorum is made of this job's groups only: :class:`QuorumProof`.

torchft's lighthouse admits any process that reaches it: an extra "group" joins the quorum, averages its gradients
into the others', and at a higher step becomes the group the others heal from. So after each new quorum, before
any step of it commits, its members prove that they hold the job's secret (:mod:`lit_ddp.launch.secret`), over
the quorum's own process group (rank ``r`` of each group with rank ``r`` of the others):

1. each sums a random vector into a common nonce ``N`` (one all-reduce), so that no answer of an earlier quorum
   serves again;
2. each contributes ``v = HMAC(secret, quorum id, group rank, N)`` (four 32-bit words as float64, exact) and a 1 if
   its own quorum and heal went well (a second all-reduce, SUM): the quorum is the job's where the sum is
   ``n x v`` (``n`` its members), and ready where the count is ``n``.

An intruder cannot contribute ``v`` without the secret; what it learns from a failed proof (``v`` for that ``N``)
does not serve at the next, which draws another ``N``. Two all-reduces of five numbers, only when the quorum
changes (a group joins or leaves): nothing on the steps between. No library does this (torchft authenticates no
one), hence this module.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

WORDS = 4


@dataclass(frozen=True)
class Verdict:
    """A proof's outcome: ``members`` (every member holds the job's secret), ``healthy`` (how many members had
    their quorum and heal go well) and ``size`` (members)."""

    members: bool
    healthy: int
    size: int

    @property
    def ready(self) -> bool:
        return self.members and self.healthy == self.size


def proof_words(secret: bytes, quorum_id: int, group_rank: int, nonce: torch.Tensor) -> list[float]:
    """``v``: :data:`WORDS` 32-bit words of ``HMAC-SHA256(secret, quorum id, group rank, nonce bytes)``, as floats."""
    mac = hmac.new(secret, b"torchft quorum %d %d " % (quorum_id, group_rank) + nonce.numpy().tobytes(), hashlib.sha256)
    digest = mac.digest()
    return [float(int.from_bytes(digest[4 * i : 4 * i + 4], "big")) for i in range(WORDS)]


def quorum_gloo(timeout: timedelta) -> Any:
    """torchft's ``ProcessGroupGloo`` (the groups' all-reduce) that also remembers the quorum it was last configured
    for (``quorum``, ``rank``, ``size``): torchft configures it once per new quorum."""
    from torchft import ProcessGroupGloo

    class QuorumGloo(ProcessGroupGloo):
        quorum: int | None = None
        rank_in_quorum: int = 0
        quorum_size: int = 0

        def configure(
            self, store_addr: str, replica_id: str, rank: int, world_size: int, *args: Any, **kw: Any
        ) -> None:
            quorum = args[0] if args else kw.get("quorum_id")
            self.quorum, self.rank_in_quorum, self.quorum_size = quorum, rank, world_size
            super().configure(store_addr, replica_id, rank, world_size, *args, **kw)

    return QuorumGloo(timeout=timeout)


def _summed(pg: Any, values: list[float]) -> torch.Tensor:
    tensor = torch.tensor(values, dtype=torch.float64)
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.SUM  # type: ignore[assignment]
    pg.allreduce([tensor], opts).wait()
    return tensor


class QuorumProof:
    """The proof of :mod:`lit_ddp.ft.membership` for one process: ``pg`` from :func:`quorum_gloo`, ``secret`` the
    job's, ``group_rank`` this process's rank within its group."""

    def __init__(self, pg: Any, secret: bytes, group_rank: int) -> None:
        self.pg, self.secret, self.group_rank = pg, secret, group_rank
        self.proven: int | None = None  # the quorum last proven

    def needed(self) -> bool:
        """Whether the quorum now is one not proven yet, of more than one group (alone, nobody else is in it)."""
        return self.pg.quorum is not None and self.pg.quorum != self.proven and self.pg.quorum_size > 1

    def prove(self, healthy: bool) -> Verdict | None:
        """Runs the proof over the quorum's process group; None where a collective failed (a member gone, a
        timeout: torchft then reconfigures at the next quorum). A ready verdict marks the quorum proven."""
        quorum, size = int(self.pg.quorum), int(self.pg.quorum_size)
        try:
            nonce = _summed(self.pg, [float(secrets.randbelow(2**31)) for _ in range(WORDS)])
            words = proof_words(self.secret, quorum, self.group_rank, nonce)
            total = _summed(self.pg, [*words, 1.0 if healthy else 0.0])
        except Exception:  # noqa: BLE001 (any failure of the collective: the step is not committed)
            return None
        expected = torch.tensor(words, dtype=torch.float64) * size
        verdict = Verdict(members=torch.equal(total[:WORDS], expected), healthy=int(total[WORDS]), size=size)
        if verdict.ready:
            self.proven = quorum
        return verdict
