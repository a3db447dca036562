"""A job's secret: how the processes of one job tell each other's messages from anyone else's.

Every user of a machine can connect to its loopback address, and every machine of a network to a port bound to
its interfaces: torch's TCPStore, torchrun's rendezvous and torchft's lighthouse and servers authenticate no one.
What lit-ddp starts and controls (``lit-ddp chaos``'s rendezvous store, the torchft launcher and
``slurm/train_torchft.sbatch``) creates one secret per job at launch (:func:`create`: 32 random bytes), hands it to
the job's processes in the environment (``$LIT_DDP_JOB_SECRET``: ``/proc/PID/environ`` is readable by the
process's own user alone, unlike its command line) and never prints it. The processes then

- name what they meet at by identifiers drawn from it (:func:`random_id`), which nobody can guess or read off
  ``ps``; and
- tag what they send with an HMAC of it (:func:`tag`; RFC 2104, SHA-256) and accept only what carries a tag of it
  (:func:`is_tag`).

Python's ``secrets`` and ``hmac`` modules do the cryptography; this module only fixes how a secret travels and how
the parts of a message are framed (each part's length first, so that ``("ab", "c")`` and ``("a", "bc")`` differ).
docs/security.md says what it protects and what it cannot (the stores and servers of torch and torchft themselves).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from collections.abc import Mapping, MutableMapping

from lit_ddp.errors import UsageError

SECRET_ENV = "LIT_DDP_JOB_SECRET"
"""The environment variable that hands a job's secret (hexadecimal) to its processes."""
SECRET_BYTES = 32


def create(env: MutableMapping[str, str] | None = None) -> bytes:
    """A new secret for a job, set in ``env`` (default ``os.environ``) as :data:`SECRET_ENV` for the processes it
    starts; returned as bytes. An existing one is kept (a launcher started by another launcher of the same job)."""
    env = os.environ if env is None else env
    existing = job_secret(env)
    if existing is not None:
        return existing
    env[SECRET_ENV] = secrets.token_hex(SECRET_BYTES)
    return bytes.fromhex(env[SECRET_ENV])


def job_secret(env: Mapping[str, str] | None = None) -> bytes | None:
    """This job's secret from ``env`` (default ``os.environ``); None where it has none.

    Raises:
        UsageError: :data:`SECRET_ENV` is set but is not :data:`SECRET_BYTES` bytes in hexadecimal (its value is
            not printed).
    """
    value = (os.environ if env is None else env).get(SECRET_ENV)
    if not value:
        return None
    try:
        secret = bytes.fromhex(value)
    except ValueError:
        secret = b""
    if len(secret) != SECRET_BYTES:
        raise UsageError(
            f"${SECRET_ENV} is set but is not {SECRET_BYTES} bytes in hexadecimal ({len(value)} characters): unset "
            "it, and the launcher creates the job's secret itself"
        )
    return secret


def random_id(prefix: str) -> str:
    """``prefix-`` and 128 random bits in hexadecimal: an identifier (a rendezvous id, a store key) nobody can guess.
    Hand it to processes in their environment, not on their command line, which every user can read."""
    return f"{prefix}-{secrets.token_hex(16)}"


def tag(secret: bytes, *parts: bytes | str | int) -> str:
    """The HMAC-SHA256 of ``parts`` under ``secret`` (hexadecimal, 64 characters); each part framed by its length."""
    mac = hmac.new(secret, digestmod=hashlib.sha256)
    for part in parts:
        data = part if isinstance(part, bytes) else str(part).encode()
        mac.update(len(data).to_bytes(8, "big"))
        mac.update(data)
    return mac.hexdigest()


def is_tag(secret: bytes, candidate: str | None, *parts: bytes | str | int) -> bool:
    """Whether ``candidate`` is :func:`tag` of ``parts`` under ``secret`` (compared in constant time)."""
    return candidate is not None and hmac.compare_digest(candidate, tag(secret, *parts))
