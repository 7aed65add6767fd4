"""The learned fusion gate: it drives AdaFuse's commit/explore decision, trains, saves and loads."""
import pytest
import torch

from adafuse import AdaFuse, FusionConfig
from adafuse.training.tasks import Task
from adafuse.fusion.gate import COMMIT, FusionGate, GateSession
from adafuse.training.gate import train_fusion_gate

PROMPTS = ["Question: who wrote the play Hamlet?\nAnswer:", "The quick brown fox"]


def _gate(pair: AdaFuse) -> FusionGate:
    sizes = [b.model.config.get_text_config().hidden_size for b in pair.backends]
    return FusionGate(sizes, pair.model_names)


def _always(gate: FusionGate, action: int) -> FusionGate:
    last = gate.policy[-1]
    with torch.no_grad():
        last.weight.zero_()
        last.bias.copy_(torch.tensor([10.0, -10.0] if action != COMMIT else [-10.0, 10.0]))
    return gate


@pytest.mark.parametrize("action, tau", [(COMMIT, 0.0), (1 - COMMIT, 1.0)])
def test_a_gate_that_always_commits_or_explores_matches_tau_0_or_1(pair, action, tau):
    session = GateSession(_always(_gate(pair), action))
    gated = pair.generate(PROMPTS, gate=session, max_new_tokens=10)
    fixed = pair.generate(PROMPTS, tau_delta=tau, max_new_tokens=10)
    assert [r.text for r in gated] == [r.text for r in fixed]
    assert [r.stats.explorations for r in gated] == [r.stats.explorations for r in fixed]


def test_sampled_decisions_are_filed_per_prompt(pair):
    session = GateSession(_gate(pair), sample=True, generator=torch.Generator().manual_seed(0))
    results = pair.generate(PROMPTS, gate=session, max_new_tokens=8)
    assert sorted(session.decisions) == [0, 1]
    for r, result in enumerate(results):
        decisions = session.decisions[r]
        # at least one decision per model per round (each round starts with one per model)
        assert len(decisions) >= result.stats.rounds * len(pair.backends)
        assert {d.model_index for d in decisions} == {0, 1}
        assert all(d.features.shape == (FusionGate.num_features,) for d in decisions)


def test_row_forward_passes_equal_the_calls_when_alone(pair):
    alone = pair.generate(PROMPTS[0], max_new_tokens=8)
    assert alone.stats.row_forward_passes == alone.stats.forward_passes
    together = pair.generate(PROMPTS, max_new_tokens=8)
    assert together[0].stats.row_forward_passes == alone.stats.row_forward_passes


def test_saved_gate_decodes_through_the_config_and_checks_models(pair, tmp_path, third_backend):
    folder = _always(_gate(pair), COMMIT).save(tmp_path / "gate")
    assert FusionGate.from_name(str(folder)).hidden_sizes == _gate(pair).hidden_sizes
    gated = pair.generate(PROMPTS[0], fusion_gate=str(folder), max_new_tokens=10)
    assert gated.text == pair.generate(PROMPTS[0], tau_delta=0.0, max_new_tokens=10).text
    with pytest.raises(FileNotFoundError, match="no fusion gate"):
        pair.generate(PROMPTS[0], fusion_gate=str(tmp_path / "missing"))
    FusionGate([7, 9], ["a", "b"]).save(tmp_path / "other")
    with pytest.raises(ValueError, match="was trained for models"):
        AdaFuse([pair.backends[0], third_backend], FusionConfig()).generate(PROMPTS[0], fusion_gate=str(tmp_path / "other"))


def test_training_the_gate_runs_and_resumes(pair, tmp_path):
    tasks = [Task(PROMPTS[0], lambda text: len(text) % 2 == 0), Task(PROMPTS[1], lambda text: "the" in text)]
    gate = _gate(pair)
    before = [p.detach().clone() for p in gate.parameters()]
    checkpoint = tmp_path / "gate.pt"
    history = train_fusion_gate(pair, gate, tasks, steps=3, prompts_per_step=2, samples_per_prompt=3,
                                max_new_tokens=6, checkpoint=checkpoint)
    assert [h["step"] for h in history] == [1, 2, 3] and checkpoint.exists()
    assert all(h["forward_passes"] > 0 for h in history)
    assert any(h["informative_prompts"] for h in history)  # sampled decisions change the compute, so the reward
    assert any(not torch.equal(a, b) for a, b in zip(before, gate.parameters()))
    resumed = train_fusion_gate(pair, gate, tasks, steps=4, prompts_per_step=2, samples_per_prompt=3,
                                max_new_tokens=6, checkpoint=checkpoint)
    assert [h["step"] for h in resumed] == [1, 2, 3, 4]


def test_warm_start_imitates_the_threshold_rule(pair):
    from adafuse.training.gate import imitate_threshold

    gate = _gate(pair)
    agreement = imitate_threshold(pair, gate, PROMPTS, 0.5, max_new_tokens=12, steps=200)
    assert agreement >= 0.9
