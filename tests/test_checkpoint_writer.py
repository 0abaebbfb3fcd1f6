"""Background checkpoint writes: in order, whole, flushed on demand, failures never lost."""

from __future__ import annotations

import gc
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from parties.errors import StorageError
from parties.storage.checkpoint import CheckpointWriter, checkpoint_steps, read_checkpoint, write_checkpoint


def test_flush_makes_every_submitted_checkpoint_readable_and_keeps_the_last_ones(tmp_path: Path) -> None:
    writer = CheckpointWriter(keep=2)
    for step in range(5):
        meta = {"step": step, "history": [step]}
        writer.submit(tmp_path, step, {"w": torch.full((3,), float(step))}, meta)
        meta["history"].append("changed after submit")  # the metadata was taken at submit time
    writer.flush()
    assert checkpoint_steps(tmp_path) == [3, 4]
    last = read_checkpoint(tmp_path, 4)
    assert last.meta == {"step": 4, "history": [4]}
    assert torch.equal(last.tensors["w"], torch.full((3,), 4.0))
    writer.close()


def test_a_failed_write_stops_the_writer_until_a_restore_resets_it(tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a file where the checkpoint folder should be")
    writer = CheckpointWriter()
    writer.submit(tmp_path / "ok", 0, {"w": torch.zeros(2)}, {})
    writer.submit(blocker, 1, {"w": torch.zeros(2)}, {})
    writer.flush()  # listing and reading checkpoints still work after a failure
    with pytest.raises(StorageError, match="could not write the checkpoint of step 1 to .*not-a-folder"):
        writer.check()
    with pytest.raises(StorageError):  # nothing more is written: training stops
        writer.submit(tmp_path / "ok", 2, {"w": torch.zeros(2)}, {})
    writer.reset(0)  # a restore to step 0: the writer carries on
    writer.submit(tmp_path / "ok", 1, {"w": torch.zeros(2)}, {})
    writer.close()
    assert checkpoint_steps(tmp_path / "ok") == [0, 1]


def test_a_checkpoint_is_safetensors_and_leaves_no_garbage_cycles(tmp_path: Path) -> None:
    tensors = {"w": torch.randn(4, 3), "step": torch.tensor(7.0), "rows": torch.arange(5), "none": torch.zeros(0, 2)}
    gc.collect()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        write_checkpoint(tmp_path, 3, tensors, {"step": 3})
        gc.collect()
        cyclic = [type(o).__name__ for o in gc.garbage]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
    assert cyclic == []  # the snapshot is freed at once, not at the next collector pass
    with safe_open(tmp_path / "step-3.safetensors", "pt") as f:  # safetensors' own reader
        assert json.loads(f.metadata()["cutlayer"]) == {"step": 3}
        assert all(torch.equal(f.get_tensor(k), v) for k, v in tensors.items())


def test_a_training_writer_deletes_only_what_is_older_than_the_common_step(tmp_path: Path) -> None:
    writer = CheckpointWriter()  # as training uses it: no fixed count
    for step in range(4):  # no common step known yet: nothing is deleted
        writer.submit(tmp_path, step, {"w": torch.zeros(1)}, {})
    writer.flush()
    assert checkpoint_steps(tmp_path) == [0, 1, 2, 3] and writer.durable == 3
    for step in range(4, 8):  # the other parties lag: the newest step they all hold is 1
        writer.submit(tmp_path, step, {"w": torch.zeros(1)}, {}, floor=1)
    writer.flush()
    assert checkpoint_steps(tmp_path) == [1, 2, 3, 4, 5, 6, 7]
    writer.submit(tmp_path, 8, {"w": torch.zeros(1)}, {}, floor=6)
    writer.reset(6)  # a rollback: what lies beyond belongs to an abandoned run
    assert checkpoint_steps(tmp_path) == [6, 7, 8] and writer.durable == 6
    writer.close()


def test_a_session_asked_for_a_step_it_no_longer_holds_says_so(tmp_path: Path) -> None:
    import numpy as np

    from parties.errors import OutOfOrder
    from parties.learning.model import BottomConfig
    from parties.learning.training_session import PartySession
    from parties.tables.table import AlignedRows, load_party_table

    csv = tmp_path / "p.csv"
    csv.write_text("customer_id,x\n" + "".join(f"{i},{i % 7}\n" for i in range(20)))
    table = load_party_table(csv, "customer_id")
    session = PartySession("s1", table, AlignedRows("a1", np.arange(20)), torch.arange(16), BottomConfig(cut_width=2))
    session.trainer.step(0, None, torch.arange(4))
    session.checkpoint(tmp_path / "ck")
    with pytest.raises(OutOfOrder, match=r"no checkpoint at step 5 .* holds steps \[0\]"):
        session.restore(tmp_path / "ck", 5)
    session.close()
