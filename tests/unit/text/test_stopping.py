"""Stop conditions: tokens and lengths per step, stop strings over a streamed text."""

from __future__ import annotations

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from services.contract.sampling_params import SamplingParams
from services.engine.request import Request, RequestStatus
from services.engine.sched.stopping import check_token_stop
from services.text.stop_strings import StopStringMatcher

EOS = frozenset({2})


def _request(output_token_ids: list[int], num_prompt_tokens: int = 4, **params: object) -> Request:
    return Request(
        request_id="r",
        prompt_token_ids=list(range(10, 10 + num_prompt_tokens)),
        sampling_params=SamplingParams(**params),
        output_token_ids=output_token_ids,
    )


def test_keeps_going() -> None:
    assert check_token_stop(_request([5, 6], max_tokens=5), EOS, max_model_len=100) is None
    assert check_token_stop(_request([], max_tokens=5), EOS, max_model_len=100) is None


def test_eos_stops_unless_ignored() -> None:
    request = _request([5, 2], max_tokens=5)
    assert check_token_stop(request, EOS, max_model_len=100) is RequestStatus.FINISHED_STOPPED
    assert request.stop_reason is None
    assert check_token_stop(_request([5, 2], max_tokens=5, ignore_eos=True), EOS, 100) is None
    assert check_token_stop(_request([2, 5], max_tokens=5), EOS, 100) is None


def test_stop_token_id_stops_and_is_recorded() -> None:
    request = _request([5, 9], max_tokens=5, stop_token_ids=(9, 11))
    assert check_token_stop(request, EOS, 100) is RequestStatus.FINISHED_STOPPED
    assert request.stop_reason == 9
    ignoring = _request([5, 9], max_tokens=5, stop_token_ids=(9,), ignore_eos=True)
    assert check_token_stop(ignoring, EOS, 100) is RequestStatus.FINISHED_STOPPED


def test_stop_tokens_wait_for_min_tokens() -> None:
    early = _request([5, 9], max_tokens=5, min_tokens=3, stop_token_ids=(9,))
    assert check_token_stop(early, EOS, 100) is None
    assert early.stop_reason is None
    assert check_token_stop(_request([5, 2], max_tokens=5, min_tokens=3), EOS, 100) is None
    on_time = _request([5, 6, 9], max_tokens=5, min_tokens=3, stop_token_ids=(9,))
    assert check_token_stop(on_time, EOS, 100) is RequestStatus.FINISHED_STOPPED


def test_max_tokens() -> None:
    assert check_token_stop(_request([5, 6, 7], max_tokens=3), EOS, 100) is RequestStatus.FINISHED_LENGTH
    assert check_token_stop(_request([5, 6], max_tokens=3), EOS, 100) is None


def test_max_model_len() -> None:
    request = _request([5, 6], num_prompt_tokens=8, max_tokens=50)
    assert check_token_stop(request, EOS, max_model_len=10) is RequestStatus.FINISHED_LENGTH
    assert check_token_stop(request, EOS, max_model_len=11) is None


def test_stop_token_wins_over_length_on_the_same_token() -> None:
    request = _request([5, 6, 2], max_tokens=3)
    assert check_token_stop(request, EOS, max_model_len=7) is RequestStatus.FINISHED_STOPPED


# ---------------------------------------------------------------------------------------------
# Stop strings


def _reference(text: str, stops: tuple[str, ...]) -> tuple[str, str | None]:
    """The full text cut before its earliest stop string, longest first on a tie."""
    found = [(text.find(s), -len(s), s) for s in stops if s in text]
    if not found:
        return text, None
    position, _, stop = min(found)
    return text[:position], stop


def _stream(deltas: list[str], stops: tuple[str, ...]) -> tuple[str, str | None]:
    """Feed deltas as a server would, checking invariants after each; return (emitted, matched)."""
    matcher = StopStringMatcher(stops)
    longest = max((len(s) for s in stops), default=1)
    emitted, fed = "", ""
    for delta in deltas:
        fed += delta
        safe, matched = matcher.feed(delta)
        emitted += safe
        if matched is not None:
            assert matcher.matched == matched
            return emitted, matched
        # Nothing held back that could not start a stop, and never a stop in what was emitted.
        assert fed.startswith(emitted)
        assert len(fed) - len(emitted) < longest
        assert not any(s in emitted for s in stops)
    emitted += matcher.flush()
    return emitted, matcher.matched


def _split(text: str, cuts: list[int]) -> list[str]:
    bounds = [0, *sorted({c % (len(text) + 1) for c in cuts}), len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]


@settings(max_examples=400, deadline=None)
@given(
    text=st.text(alphabet="ab\nc", max_size=40),
    stops=st.lists(st.text(alphabet="ab\nc", min_size=1, max_size=5), max_size=4).map(tuple),
    cuts=st.lists(st.integers(min_value=0, max_value=40), max_size=20),
)
@example(text="abcd", stops=("abcd", "bc"), cuts=[1, 2, 3])
@example(text="abcx", stops=("abcd", "bc"), cuts=[1, 2, 3])
@example(text="xabc", stops=("ab", "abc"), cuts=[2, 3])
def test_stop_strings_match_reference_truncation(text: str, stops: tuple[str, ...], cuts: list[int]) -> None:
    emitted, matched = _stream(_split(text, cuts), stops)
    assert (emitted, matched) == _reference(text, stops)


@settings(max_examples=200, deadline=None)
@given(text=st.text(alphabet="ab\nc", max_size=40), stops=st.lists(st.text(min_size=1), max_size=3))
def test_every_prefix_emitted_is_a_prefix_of_the_reference(text: str, stops: list[str]) -> None:
    """Char by char, a client never sees text past the final cut, even briefly."""
    final, _ = _reference(text, tuple(stops))
    matcher = StopStringMatcher(tuple(stops))
    emitted = ""
    for char in text:
        safe, matched = matcher.feed(char)
        emitted += safe
        assert final.startswith(emitted)
        if matched is not None:
            break


def test_stop_spanning_deltas_is_cut_out() -> None:
    matcher = StopStringMatcher(("STOP",))
    assert matcher.feed("Hello S") == ("Hello ", None)
    assert matcher.feed("T") == ("", None)
    assert matcher.feed("OP and more") == ("", "STOP")
    assert matcher.matched == "STOP"


def test_false_start_is_released() -> None:
    matcher = StopStringMatcher(("STOP",))
    assert matcher.feed("a ST") == ("a ", None)
    assert matcher.feed("AR") == ("STAR", None)
    assert matcher.feed("S") == ("", None)
    assert matcher.flush() == "S"
    assert matcher.matched is None


def test_earlier_partial_stop_delays_a_later_complete_one() -> None:
    matcher = StopStringMatcher(("abcd", "bc"))
    assert matcher.feed("xabc") == ("x", None)
    assert matcher.feed("d") == ("", "abcd")
    waiting = StopStringMatcher(("abcd", "bc"))
    assert waiting.feed("xabc") == ("x", None)
    assert waiting.flush() == "a"
    assert waiting.matched == "bc"


def test_no_stops_passes_text_through() -> None:
    matcher = StopStringMatcher(())
    assert matcher.feed("anything") == ("anything", None)
    assert matcher.flush() == ""


def test_misuse_raises_value_error() -> None:
    with pytest.raises(ValueError):
        StopStringMatcher(("",))
    matcher = StopStringMatcher(("x",))
    matcher.feed("ax")
    with pytest.raises(ValueError):
        matcher.feed("more")
