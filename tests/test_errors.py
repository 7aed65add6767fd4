"""Bad input fails early with an error that names the problem."""
import socket

import huggingface_hub
import pytest

from adafuse import AdaFuse, FusionConfig, ModelLoadError, load_model


def test_empty_prompt(pair):
    with pytest.raises(ValueError, match="prompt is empty"):
        pair.generate("   ")


def test_bad_parameter_values(pair):
    with pytest.raises(ValueError, match="tau_delta"):
        pair.generate("hi", tau_delta=1.5)
    with pytest.raises(ValueError, match="num_branches"):
        pair.generate("hi", num_branches=0)
    with pytest.raises(ValueError, match="model_weights"):
        pair.generate("hi", model_weights=[1.0])
    with pytest.raises(ValueError, match="min_new_tokens"):
        pair.generate("hi", max_new_tokens=4, min_new_tokens=5)
    with pytest.raises(ValueError, match="min_new_tokens"):
        pair.generate("hi", min_new_tokens=-1)


def test_unknown_parameter(pair):
    with pytest.raises(ValueError, match="unknown decoding parameter"):
        pair.generate("hi", temprature=0.5)


def test_over_long_prompt_names_the_model(pair):
    with pytest.raises(ValueError, match="context window of model 'tiny-llama'"):
        pair.generate("word " * 400)


def test_prompt_of_wrong_type(pair):
    with pytest.raises(TypeError, match="string or a list of chat messages"):
        pair.generate([3])


def test_unknown_model(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelLoadError, match="no/such-model'; it is not in the local Hugging Face cache and HF_HUB_OFFLINE is set"):
        load_model("no/such-model")
    with pytest.raises(ModelLoadError, match="not a transformers model folder"):
        load_model(str(tmp_path))
    with pytest.raises(ModelLoadError, match="no model folder at '/no/such/folder'"):
        load_model("/no/such/folder")


def test_a_hub_model_fails_at_once_when_the_hub_does_not_resolve(monkeypatch):
    """No network: the model is looked up in the local cache only, not asked of the hub with retries."""
    for variable in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)

    def no_dns(host, *args, **kwargs):
        raise socket.gaierror(-2, f"Name or service not known: {host}")

    def no_download(*args, **kwargs):
        raise AssertionError("the hub was asked although it cannot be reached")

    monkeypatch.setattr(socket, "getaddrinfo", no_dns)
    monkeypatch.setattr(huggingface_hub.file_download, "_get_metadata_or_catch_error", no_download)
    with pytest.raises(ModelLoadError, match=r"no/such-model'; .* the hub \(huggingface.co\) cannot be reached"):
        load_model("no/such-model")


def test_no_models():
    with pytest.raises(ValueError, match="at least one model"):
        AdaFuse([])


def test_config_update_and_validate():
    config = FusionConfig().update(stop="\n", tau_delta=0.5)
    assert config.stop == ["\n"] and config.tau_delta == 0.5
    assert FusionConfig().tau_delta == 0.7 and FusionConfig().max_span_words == 3 and FusionConfig().num_branches == 3
    with pytest.raises(ValueError, match="stop"):
        FusionConfig(stop=[""]).validate()


def test_cli_names_an_unknown_training_task(capsys):
    from adafuse.cli import main

    assert main(["train-adapter", "--task", "poetry"]) == 2
    assert "unknown task 'poetry'" in capsys.readouterr().err


def test_cli_names_an_unknown_benchmark(capsys):
    from adafuse.cli import main

    assert main(["eval", "--bench", "mmlu"]) == 2
    assert "unknown benchmark(s) ['mmlu']" in capsys.readouterr().err
