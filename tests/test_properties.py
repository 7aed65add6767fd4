"""Property-based: arbitrary Unicode prompts, stops, budgets and settings either decode to the same text through
generate, stream and batch, or are refused with an error that names what is wrong."""
from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

FIELDS = ("prompt", "stop", "max_new_tokens", "tau_delta", "num_branches")
OTHER_PROMPT = "The quick brown fox"


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    prompt=st.text(max_size=40),
    stop=st.lists(st.text(max_size=3), max_size=2),
    max_new_tokens=st.integers(-1, 6),
    tau_delta=st.one_of(st.floats(-0.5, 1.5), st.just(float("nan"))),
    num_branches=st.integers(0, 4),
)
def test_any_input_decodes_the_same_way_everywhere_or_is_refused(pair, prompt, stop, max_new_tokens, tau_delta,
                                                                 num_branches):
    options = {"stop": stop, "max_new_tokens": max_new_tokens, "tau_delta": tau_delta, "num_branches": num_branches}
    try:
        alone = pair.generate(prompt, **options)
    except (ValueError, TypeError) as error:
        assert any(name in str(error) for name in FIELDS), error
        return
    assert alone.finish_reason in ("stop", "eos", "length")
    assert not any(s in alone.text for s in stop)
    assert alone.stats.new_tokens <= max_new_tokens
    streamed = list(pair.stream(prompt, **options))
    assert "".join(streamed[:-1]) == streamed[-1].text == alone.text
    assert pair.generate([prompt, OTHER_PROMPT], **options)[0].text == alone.text
