"""lit_ddp.run_dir.integrity: a checkpoint's bytes checked against the CRC-32s torch.save wrote with them (single
files, a sharded checkpoint's entries) and its ``.metadata`` against the digest record written with it; what is
damaged is named, once per file and process. Whole runs: ``tests/system/test_integrity.py``."""

from __future__ import annotations

import io
import json
import logging
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from lit_ddp.errors import DamagedCheckpointError
from lit_ddp.launch.preflight import check_ckpt_path
from lit_ddp.resilience.resume import choose_checkpoint
from lit_ddp.run_dir import integrity, sharded, untrusted
from lit_ddp.run_dir.checkpoints import why_not_valid
from tests.helpers import flip_payload_bit


@pytest.fixture(autouse=True)
def fresh() -> None:
    """Nothing verified or said before the test (files of other tests may reuse an inode)."""
    integrity.forget()


def checkpoint(path: Path, step: int = 3) -> Path:
    """A checkpoint with a model state and an optimizer state, as Lightning lays them out."""
    path.parent.mkdir(parents=True, exist_ok=True)
    model = torch.nn.Linear(8, 4)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(2, 8)).sum().backward()
    optimizer.step()
    torch.save(
        {"global_step": step, "state_dict": model.state_dict(), "optimizer_states": [optimizer.state_dict()]}, path
    )
    return path


def flip(path: Path, record_suffix: str, at: int = 0) -> None:
    """Flips the lowest bit of byte ``at`` of the record of ``path`` whose name ends with ``record_suffix``."""
    with open(path, "rb") as f:
        record = next(r for r in integrity.records(f) if r.name.endswith(record_suffix))
    with open(path, "r+b") as f:
        f.seek(record.start + at)
        byte = f.read(1)[0]
        f.seek(record.start + at)
        f.write(bytes([byte ^ 1]))


def test_a_flipped_bit_is_named_with_the_tensor_it_changed(tmp_path: Path) -> None:
    """torch.load returns the changed value without a word; lit-ddp's reads refuse the file, naming the record and
    the state_dict key."""
    path = checkpoint(tmp_path / "last.ckpt")
    weight = torch.load(path, weights_only=True)["state_dict"]["weight"].clone()
    assert why_not_valid(str(path)) is None
    name = flip_payload_bit(path)
    assert name == "weight"
    changed = torch.load(path, weights_only=True)["state_dict"]["weight"]
    assert not torch.equal(changed, weight) and torch.allclose(changed, weight, rtol=1e-6, atol=0)
    why = why_not_valid(str(path))
    assert why is not None and why.startswith("is damaged: its record last/data/")
    assert "(state_dict['weight']) does not match the CRC-32 torch.save wrote with it" in why
    with pytest.raises(DamagedCheckpointError, match=r"last.ckpt: its record last/data/\d+ \(state_dict\['weight'\]\)"):
        untrusted.load(path)


def test_a_file_without_a_descriptor_is_checked_and_read_from_its_start(tmp_path: Path) -> None:
    """An in-memory or fsspec file is checked by seeking (no os.pread), then read whole: the check leaves it at its
    start for the load (generate reads a sharded checkpoint so, consolidated into memory)."""
    buffer = io.BytesIO(checkpoint(tmp_path / "a.ckpt").read_bytes())
    buffer.seek(100)
    assert untrusted.load(buffer)["global_step"] == 3
    damaged = tmp_path / "b.ckpt"
    damaged.write_bytes(buffer.getvalue())
    flip_payload_bit(damaged)
    with pytest.raises(DamagedCheckpointError, match=r"its record a/data/\d+ \(state_dict\['weight'\]\)"):
        untrusted.load(io.BytesIO(damaged.read_bytes()))


def test_an_optimizer_state_and_the_header_are_named(tmp_path: Path) -> None:
    path = checkpoint(tmp_path / "a.ckpt")
    with open(path, "rb") as f:
        header = untrusted.read_archive(f, str(path)).header
    exp_avg = header["optimizer_states"][0]["state"][0]["exp_avg"].storage.key
    flip(path, f"/data/{exp_avg}", at=5)
    assert "(optimizer_states[0]['state'][0]['exp_avg'])" in str(why_not_valid(str(path)))
    other = checkpoint(tmp_path / "b.ckpt")
    flip(other, "data.pkl", at=40)
    why = str(why_not_valid(str(other)))
    assert why.startswith("is damaged: ") and "b/data.pkl (the header: step, hyperparameters, loop state)" in why


def test_the_resume_skips_a_damaged_checkpoint_in_one_line(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    older = checkpoint(tmp_path / "checkpoints" / "epoch=0-step=10.ckpt", 10)
    newest = checkpoint(tmp_path / "checkpoints" / "epoch=0-step=20.ckpt", 20)
    flip_payload_bit(newest)
    with caplog.at_level(logging.WARNING):
        assert choose_checkpoint(str(tmp_path)) == str(older)
    [line] = [r.getMessage() for r in caplog.records if "falling back" in r.getMessage()]
    assert line.startswith(f"Checkpoint {newest} is damaged: its record epoch=0-step=20/data/") and "'weight'" in line


def test_a_damaged_ckpt_path_is_refused_with_status_2(tmp_path: Path) -> None:
    path = checkpoint(tmp_path / "x.ckpt")
    flip_payload_bit(path)
    with pytest.raises(DamagedCheckpointError, match=r"^--ckpt_path .*x.ckpt is damaged: its record") as e:
        check_ckpt_path(str(path))
    assert e.value.exit_code == 2 and "\n" not in str(e.value)


def test_each_file_is_verified_once_while_it_stays_the_same(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A resume verifies on rank zero before choosing, then loads the same file: its bytes are read for the check
    once; a file replaced since is verified again."""
    path = checkpoint(tmp_path / "last.ckpt")
    read: list[int] = []
    crc = integrity._crc
    monkeypatch.setattr(integrity, "_crc", lambda *a: read.append(a[2]) or crc(*a))
    assert why_not_valid(str(path)) is None
    once = len(read)
    untrusted.load(path)
    assert len(read) == once > 0
    checkpoint(tmp_path / "new.ckpt").replace(path)
    untrusted.load(path)
    assert len(read) == 2 * once


def test_a_checkpoint_without_crcs_loads_with_one_line(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    torch.serialization.set_crc32_options(False)
    try:
        path = checkpoint(tmp_path / "nocrc.ckpt")
    finally:
        torch.serialization.set_crc32_options(True)
    with caplog.at_level(logging.WARNING):
        assert why_not_valid(str(path)) is None
        untrusted.load(path)
        untrusted.load(path)
    [line] = [r.getMessage() for r in caplog.records if r.name.startswith("lit_ddp")]
    assert line == (
        f"Checkpoint {path} records no CRC-32s (written with torch.serialization.set_crc32_options(False)): its bytes "
        "could not be verified"
    )


def sharded_checkpoint(path: Path, step: int = 4, record: bool = True) -> Path:
    """A sharded checkpoint as FSDP2Strategy commits one (one process: one shard), with its digest record unless
    not ``record`` (one written before lit-ddp wrote it)."""
    written = Path(sharded.temporary_directory(path))
    state = {"state_dict": {"model.w": torch.arange(600.0).reshape(20, 30)}, "optimizer_0": {"state": {"step": step}}}
    dcp.save(state, checkpoint_id=str(written), no_dist=True)
    torch.save({"global_step": step, "epoch": 0}, written / sharded.META)
    sharded.commit(written, path)
    if not record:
        (path / integrity.DIGEST_RECORD).unlink()
    return path


def test_a_sharded_checkpoint_carries_a_digest_record_of_its_metadata(tmp_path: Path) -> None:
    path = sharded_checkpoint(tmp_path / "last.ckpt")
    record = json.loads((path / integrity.DIGEST_RECORD).read_text())
    data = (path / ".metadata").read_bytes()
    assert record["metadata"] == {"bytes": len(data), "crc32": integrity.crc32_of(data)}
    assert sharded.written_here(path) and integrity.DIGEST_RECORD in sharded.OWN_FILES
    assert why_not_valid(str(path)) is None


def test_a_flipped_bit_in_a_shard_names_the_shard_and_the_tensor(tmp_path: Path) -> None:
    path = sharded_checkpoint(tmp_path / "last.ckpt")
    assert flip_payload_bit(path) == "state_dict.model.w"
    why = str(why_not_valid(str(path)))
    assert why.startswith(f"is damaged: {path}/__0_0.distcp: its entry of state_dict.model.w (bytes "), why
    with pytest.raises(DamagedCheckpointError, match="__0_0.distcp: its entry of state_dict.model.w"):
        sharded.full_checkpoint(path)


def test_a_changed_metadata_or_record_is_refused(tmp_path: Path) -> None:
    path = sharded_checkpoint(tmp_path / "a.ckpt")
    data = bytearray((path / ".metadata").read_bytes())
    data[len(data) // 2] ^= 4
    (path / ".metadata").write_bytes(data)
    assert f"is damaged: {path}/.metadata does not match the digest record saved with it" in str(
        why_not_valid(str(path))
    )
    other = sharded_checkpoint(tmp_path / "b.ckpt")
    (other / integrity.DIGEST_RECORD).write_text('{"format": 1, "digest": "crc32"')
    assert f"is damaged: {other}/digest.json is not the digest record lit-ddp writes" in str(why_not_valid(str(other)))


def test_a_sharded_checkpoint_without_a_record_resumes_with_one_line(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Written before lit-ddp wrote digest records: its shards are still checked (their own CRC-32s), its
    .metadata cannot be, and one line says so however often it is read."""
    path = sharded_checkpoint(tmp_path / "checkpoints" / "last.ckpt", record=False)
    with caplog.at_level(logging.WARNING):
        assert choose_checkpoint(str(tmp_path)) == str(path)
        assert sharded.full_checkpoint(path)["global_step"] == 4
    [line] = [r.getMessage() for r in caplog.records if r.name.startswith("lit_ddp")]
    assert line.startswith(f"Checkpoint {path} has no digest record (digest.json: written before lit-ddp wrote one)")
    flip_payload_bit(path)
    assert str(why_not_valid(str(path))).startswith("is damaged: ")
