"""The routing history ``.coli_usage``: atomic saves, merge per model file, bad files, read-only folders."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest

from scheduler import usage as U


@pytest.fixture
def model(tmp_path):
    p = tmp_path / "m.gguf"
    p.write_bytes(b"GGUF" + bytes(60))
    return p


def test_roundtrip_and_sum(model):
    u = U.Usage.open(model, 3, 4)
    assert not u.loaded and u.path == model.parent / ".coli_usage"
    u.add(1, np.array([[0, 2], [2, 3]]))
    u.add_tokens(2)
    u.save()
    v = U.Usage.open(model, 3, 4)
    assert v.loaded and v.tokens == 2 and v.counts.tolist() == [[0] * 4, [1, 0, 2, 1], [0] * 4]
    assert list(v.hottest(1)) == [2, 0, 3, 1]



def test_add_layers_stages_what_add_of_each_layer_stages(model):
    """One row's routes of several layers in one call (the device layers' decode token) stage the counts that
    ``add`` of each layer stages; an id past the experts is refused, not counted in the next layer's row."""
    rng = np.random.default_rng(3)
    a, b = U.Usage.open(model, 6, 16), U.Usage.open(model, 6, 16)
    for _ in range(5):
        layers = np.array([0, 2, 3, 5], np.int64)
        ids = np.stack([rng.choice(16, 4, replace=False) for _ in layers]).astype(np.uint32)
        a.add_layers(layers, ids)
        for il, row in zip(layers, ids):
            b.add(int(il), row[None].astype(np.int64))
    assert a._pending.tolist() == b._pending.tolist() and a._pending.sum() == 5 * 4 * 4
    with pytest.raises(ValueError, match="outside 0 .. 15"):
        a.add_layers(np.array([0]), np.array([[16, 1, 2, 3]], np.uint32))
    with pytest.raises(ValueError, match="outside 0 .. 15"):
        a.add_layers(np.array([1]), np.array([[-1, 1, 2, 3]], np.int64))

def test_failed_save_leaves_old_file(model, monkeypatch):
    u = U.Usage.open(model, 2, 2)
    u.add(0, np.array([[1, 0]])); u.add_tokens(1); u.save()
    before = u.path.read_bytes()
    u.add(0, np.array([[1, 0]])); u.add_tokens(1)

    def boom(*a, **k):
        raise OSError("disk full")

    import coli.base.paths

    monkeypatch.setattr(coli.base.paths.os, "fsync", boom)  # the disk fails after the new bytes were written
    with pytest.raises(OSError):
        u.save()
    assert u.path.read_bytes() == before
    assert sorted(os.listdir(model.parent)) == [".coli_usage", "m.gguf"]


def test_other_models_kept_and_mismatch_ignored(model, tmp_path, capsys):
    other = tmp_path / "o.gguf"
    other.write_bytes(b"GGUF" + bytes(10))
    a = U.Usage.open(other, 1, 2); a.add(0, np.array([[1, 1]])); a.add_tokens(1); a.save()
    b = U.Usage.open(model, 2, 2); b.add_tokens(0); b.save()
    doc = json.loads((tmp_path / ".coli_usage").read_text())
    assert set(doc["models"]) == {"o.gguf", "m.gguf"}
    c = U.Usage.open(model, 5, 2)  # shape changed: ignored with a note
    assert not c.loaded and "does not match" in capsys.readouterr().err


def test_corrupt_file_is_moved_aside_with_a_note(model, capsys):
    """A default-place file coli did not write is renamed aside (never replaced), with a note saying where."""
    (model.parent / ".coli_usage").write_text("{not json")
    u = U.Usage.open(model, 2, 2)
    err = capsys.readouterr().err
    assert not u.loaded and "not a coli routing history" in err and ".coli_usage.not-history-1" in err
    assert (model.parent / ".coli_usage.not-history-1").read_text() == "{not json"


def test_read_only_folder_goes_to_cache(tmp_path, monkeypatch):
    if os.geteuid() == 0:
        # root can write anywhere: emulate a read-only folder through os.access
        monkeypatch.setattr(U.os, "access", lambda p, m: False)
    ro = tmp_path / "ro"
    ro.mkdir()
    m = ro / "x.gguf"
    m.write_bytes(b"GGUF")
    monkeypatch.setenv("COLI_CACHE", str(tmp_path / "cache"))
    p = U.default_path(m)
    assert p.parent == tmp_path / "cache" / "usage" and p.name.startswith("x.gguf-")
