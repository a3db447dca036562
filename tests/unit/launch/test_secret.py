"""lit_ddp.launch.secret: one secret per job, handed down in the environment, and tags only it can make."""

from __future__ import annotations

import pytest

from lit_ddp.errors import UsageError
from lit_ddp.launch import secret


def test_a_job_gets_one_secret_and_its_processes_the_same() -> None:
    env: dict[str, str] = {}
    first = secret.create(env)
    assert len(first) == secret.SECRET_BYTES and env[secret.SECRET_ENV] == first.hex()
    assert secret.create(env) == first  # a launcher under a launcher of the same job keeps it
    assert secret.job_secret(env) == first
    assert secret.create({}) != first


def test_a_tag_is_made_only_with_the_secret_and_the_same_parts() -> None:
    key, other = secret.create({}), secret.create({})
    mac = secret.tag(key, "step", 7, b"\x00digest")
    assert secret.is_tag(key, mac, "step", 7, b"\x00digest")
    assert not secret.is_tag(other, mac, "step", 7, b"\x00digest")
    assert not secret.is_tag(key, mac, "step", 8, b"\x00digest")
    assert not secret.is_tag(key, None, "step", 7, b"\x00digest")
    # parts are framed by their lengths: moving a boundary changes the tag
    assert secret.tag(key, "ab", "c") != secret.tag(key, "a", "bc")


def test_a_malformed_secret_is_refused_without_printing_it() -> None:
    with pytest.raises(UsageError, match=r"LIT_DDP_JOB_SECRET is set but is not 32 bytes") as raised:
        secret.job_secret({secret.SECRET_ENV: "not-hex-and-confidential"})
    assert "confidential" not in str(raised.value)
    assert secret.job_secret({}) is None


def test_random_ids_differ_and_keep_their_prefix() -> None:
    ids = {secret.random_id("reference") for _ in range(100)}
    assert len(ids) == 100 and all(i.startswith("reference-") and len(i) == len("reference-") + 32 for i in ids)
