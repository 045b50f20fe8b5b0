"""Request validation, conversion to the worker's SamplingParams, and response shapes of the router."""

from __future__ import annotations

import json

import msgspec
import pytest

from services.contract.wire import sampling_from_proto
from services.router.answers import ChatAnswer, CompletionAnswer
from services.router.errors import ContextLengthExceeded, InvalidRequest, error_response
from services.router.generation import Delta, Outcome
from services.router.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    decode_request,
    to_sampling_params,
)
from services.router.responses import usage_of
from services.router.tokenizing import UNTIL_CONTEXT_ENDS, resolve_max_tokens

CHAT = [{"role": "user", "content": "hi"}]


def _completion(**fields) -> bytes:
    return json.dumps({"model": "m", "prompt": "hello", **fields}).encode()


def _chat(**fields) -> bytes:
    return json.dumps({"model": "m", "messages": CHAT, **fields}).encode()


def _rejected(body: bytes, kind=CompletionRequest) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as info:
        decode_request(body, kind)
    return info.value


@pytest.mark.parametrize(("body", "param"), [
    (b"{", None),
    (b"", None),
    (b"[1, 2]", None),
    (b'{"model": "m"}', "prompt"),
    (_completion(max_tokens=-1), "max_tokens"),
    (_completion(max_tokens=0), "max_tokens"),
    (_completion(max_tokens="10"), "max_tokens"),
    (_completion(max_tokens=1.5), "max_tokens"),
    (_completion(max_tokens=True), "max_tokens"),
    (_completion(temperature=-0.1), "temperature"),
    (_completion(temperature="hot"), "temperature"),
    (_completion(top_p=0), "top_p"),
    (_completion(top_p=1.5), "top_p"),
    (_completion(top_k=-2), "top_k"),
    (_completion(seed=2**64), "seed"),
    (_completion(n=0), "n"),
    (_completion(n=65), "n"),
    (_completion(n=33, prompt=["a", "b"]), "n"),
    (_completion(stop=5), "stop"),
    (_completion(stop=[""]), "stop[0]"),
    (_completion(stop=["x"] * 17), "stop"),
    (_completion(logprobs=21), "logprobs"),
    (_completion(logprobs=-1), "logprobs"),
    (_completion(prompt=""), "prompt"),
    (_completion(prompt=[]), "prompt"),
    (_completion(prompt=[1, -3]), "prompt[1]"),
    (_completion(prompt=["a", 1]), "prompt"),
    (_completion(prompt=[[1], []]), "prompt"),
    (_completion(prompt=[[1], [-1]]), "prompt[1][0]"),
    (_completion(suffix="end"), "suffix"),
    (_completion(best_of=0), "best_of"),
    (_completion(best_of=2, n=3), "best_of"),
    (_completion(best_of=3, stream=True), "best_of"),
    (_completion(best_of=40, prompt=["a", "b"]), "best_of"),
    (_completion(presence_penalty=2.5), "presence_penalty"),
    (_completion(presence_penalty="high"), "presence_penalty"),
    (_completion(frequency_penalty=-2.01), "frequency_penalty"),
    (_completion(repetition_penalty=0), "repetition_penalty"),
    (_completion(repetition_penalty=-1.0), "repetition_penalty"),
    (_completion(min_p=1.5), "min_p"),
    (_completion(min_p=-0.1), "min_p"),
    (_completion(logit_bias={"1": 100.5}), "logit_bias"),
    (_completion(logit_bias={"1": -101}), "logit_bias"),
    (_completion(logit_bias={"1": "up"}), "logit_bias"),
    (_completion(logit_bias={"x": 1.0}), "logit_bias"),
    (_completion(logit_bias={"-1": 1.0}), "logit_bias"),
    (_completion(logit_bias={"1.5": 1.0}), "logit_bias"),
    (_completion(logit_bias={str(2**40): 1.0}), "logit_bias"),
    (_completion(logit_bias={str(i): 1.0 for i in range(301)}), "logit_bias"),
    (_completion(logit_bias=[1, 2]), "logit_bias"),
    (_completion(stream_options={"include_usage": True}), "stream_options"),
    (_completion(min_tokens=9, max_tokens=4), "min_tokens"),
    (_completion(stream="yes"), "stream"),
])
def test_completion_bodies_rejected_with_the_param_named(body: bytes, param: str | None) -> None:
    error = _rejected(body)
    assert error.param == param
    assert error.status_code == 400


@pytest.mark.parametrize(("body", "param"), [
    (b'{"model": "m"}', "messages"),
    (_chat(messages=[]), "messages"),
    (_chat(messages="hi"), "messages"),
    (_chat(messages=[{"content": "hi"}]), "messages[0].role"),
    (_chat(messages=[{"role": "user", "content": 3}]), "messages[0].content"),
    (_chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]),
     "messages[0].content[0].type"),
    (_chat(top_logprobs=5), "top_logprobs"),
    (_chat(top_logprobs=21, logprobs=True), "top_logprobs"),
    (_chat(logprobs=3), "logprobs"),
    (_chat(n=0), "n"),
    (_chat(audio={"voice": "alloy", "format": "wav"}), "audio"),
    (_chat(modalities=["text", "audio"]), "modalities"),
    (_chat(prediction={"type": "content", "content": "x"}), "prediction"),
    (_chat(web_search_options={}), "web_search_options"),
    (_chat(functions=[{"name": "f"}]), "functions"),
    (_chat(function_call={"name": "f"}), "function_call"),
    (_chat(tool_choice="required"), "tool_choice"),
    (_chat(reasoning_effort="extreme"), "reasoning_effort"),
    (_chat(verbosity="low"), "verbosity"),
    (_chat(store=True), "store"),
    (_chat(service_tier="flex"), "service_tier"),
    (_chat(tools=[{"type": "function"}]), "tools[0].function"),
    (_chat(response_format={"type": "xml"}), "response_format"),
    (_chat(max_completion_tokens=-5), "max_completion_tokens"),
    (_chat(min_tokens=8, max_completion_tokens=2), "min_tokens"),
])
def test_chat_bodies_rejected_with_the_param_named(body: bytes, param: str) -> None:
    assert _rejected(body, ChatCompletionRequest).param == param


def test_error_body_is_openai_format() -> None:
    response = error_response(_rejected(_completion(max_tokens=-1)))
    assert response.status_code == 400
    body = json.loads(response.body)
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["type"] == "invalid_request_error"
    assert body["error"]["param"] == "max_tokens"
    assert ">= 1" in body["error"]["message"]


def test_documented_fields_without_effect_are_accepted() -> None:
    chat = decode_request(_chat(store=False, metadata={"k": "v"}, service_tier="auto", modalities=["text"],
                                tool_choice="none", parallel_tool_calls=True, prompt_cache_key="c",
                                safety_identifier="s", user="u", audio=None, functions=[]), ChatCompletionRequest)
    assert chat.tool_choice == "none"


def test_batched_prompts_and_choice_seeds() -> None:
    texts = decode_request(_completion(prompt=["a", "b"], n=3, seed=7), CompletionRequest)
    assert texts.prompts == ["a", "b"] and [texts.choice_seed(i) for i in range(3)] == [7, 8, 9]
    ids = decode_request(_completion(prompt=[[1, 2], [3]]), CompletionRequest)
    assert ids.prompts == [[1, 2], [3]]
    assert decode_request(_completion(prompt=[4, 5]), CompletionRequest).prompts == [[4, 5]]
    assert decode_request(_completion(seed=2**63 - 1), CompletionRequest).choice_seed(1) == -(2**63)


def test_unknown_fields_are_ignored_and_defaults_apply() -> None:
    request = decode_request(_completion(frobnicate=True, user="u1", metadata={"a": 1}), CompletionRequest)
    assert request.prompt == "hello" and request.temperature == 1.0 and request.n == 1
    assert request.stop_strings == () and not request.stream and not request.wants_logprobs


def test_accepted_variants() -> None:
    request = decode_request(_completion(prompt=[5, 6, 7], stop="END", temperature=0, top_k=-1, logprobs=0,
                                         stream=True, stream_options={"include_usage": True}), CompletionRequest)
    assert request.prompt == [5, 6, 7] and request.stop_strings == ("END",)
    assert request.wants_logprobs and request.include_usage
    chat = decode_request(_chat(messages=[{"role": "system", "content": [{"type": "text", "text": "a"},
                                                                          {"type": "text", "text": "b"}]},
                                          {"role": "user", "content": "q"}],
                                max_tokens=3, max_completion_tokens=7, logprobs=True, top_logprobs=0),
                          ChatCompletionRequest)
    assert chat.template_messages() == [{"role": "system", "content": "ab"}, {"role": "user", "content": "q"}]
    assert chat.requested_max_tokens == 7 and chat.wants_logprobs


def test_sampling_params_conversion() -> None:
    request = decode_request(_completion(temperature=0.7, top_p=0.9, top_k=40, seed=-3, stop=["a", "b"],
                                         stop_token_ids=[2], ignore_eos=True, min_tokens=2, logprobs=0),
                             CompletionRequest)
    params = to_sampling_params(request, max_tokens=12)
    assert params.max_tokens == 12
    assert params.temperature == pytest.approx(0.7) and params.top_p == pytest.approx(0.9)
    assert params.top_k == 40 and params.HasField("seed") and params.seed == -3
    assert list(params.stop) == ["a", "b"] and list(params.stop_token_ids) == [2]
    assert params.ignore_eos and params.min_tokens == 2 and params.logprobs
    plain = to_sampling_params(decode_request(_completion(top_k=-1), CompletionRequest), max_tokens=1)
    assert plain.top_k == 0 and not plain.HasField("seed") and not plain.logprobs


@pytest.mark.parametrize("kind", [CompletionRequest, ChatCompletionRequest])
def test_penalties_logit_bias_and_min_p_reach_the_worker_params(kind) -> None:
    make = _completion if kind is CompletionRequest else _chat
    request = decode_request(make(presence_penalty=-2, frequency_penalty=1.5, repetition_penalty=1.25, min_p=0.5,
                                  logit_bias={"7": 100, "3": -100, "12": 0.5}), kind)
    params = to_sampling_params(request, max_tokens=4)
    assert params.presence_penalty == -2.0 and params.frequency_penalty == 1.5
    assert params.repetition_penalty == 1.25 and params.min_p == 0.5
    assert dict(params.logit_bias) == {7: 100.0, 3: -100.0, 12: 0.5}
    request.check_vocab(13)
    with pytest.raises(InvalidRequest) as info:
        request.check_vocab(12)
    assert info.value.param == "logit_bias" and "12" in info.value.message
    assert len(decode_request(make(logit_bias={str(i): 1.0 for i in range(300)}), kind).logit_bias_pairs) == 300


def test_sampling_params_defaults_are_off() -> None:
    params = to_sampling_params(decode_request(_completion(), CompletionRequest), max_tokens=4)
    assert params.repetition_penalty == 1.0 and not params.logit_bias and params.min_p == 0.0
    engine = sampling_from_proto(params)
    assert not engine.processes_logits and engine.min_p == 0.0
    # A peer that predates repetition_penalty sends proto3's 0: read as 1.0 (off).
    params.ClearField("repetition_penalty")
    assert sampling_from_proto(params).repetition_penalty == 1.0


def test_max_tokens_against_the_context_length() -> None:
    completion = decode_request(_completion(), CompletionRequest)
    chat = decode_request(_chat(), ChatCompletionRequest)
    assert resolve_max_tokens(completion, 10, 100) == 16
    assert resolve_max_tokens(completion, 90, 100) == 10
    assert resolve_max_tokens(chat, 10, 100) == 90
    assert resolve_max_tokens(chat, 10, None) == UNTIL_CONTEXT_ENDS
    with pytest.raises(ContextLengthExceeded) as info:
        resolve_max_tokens(chat, 100, 100)
    assert info.value.param == "messages" and info.value.code == "context_length_exceeded"
    assert "maximum context length is 100 tokens" in info.value.message
    too_many = decode_request(_completion(max_tokens=50), CompletionRequest)
    with pytest.raises(ContextLengthExceeded) as info:
        resolve_max_tokens(too_many, 60, 100)
    assert info.value.param == "max_tokens" and "110 tokens" in info.value.message


# ---- response shapes -----------------------------------------------------------------------------

_OUTCOME = Outcome(num_prompt_tokens=4, num_generated_tokens=3, num_cached_tokens=0)
_USAGE = usage_of([_OUTCOME], [_OUTCOME])


def _encode(value) -> dict:
    return json.loads(msgspec.json.encode(value))


def test_completion_response_shape() -> None:
    request = decode_request(_completion(logprobs=0), CompletionRequest)
    answer = CompletionAnswer("cmpl-1", "m", request, tokenizer=None)
    body = _encode(answer.full({0: Delta("abc", (1, 2, 3), (-0.1, -0.2, -0.3), "length")}, _USAGE))
    assert body["object"] == "text_completion" and body["id"] == "cmpl-1" and body["model"] == "m"
    assert isinstance(body["created"], int)
    (choice,) = body["choices"]
    assert set(choice) == {"index", "text", "logprobs", "finish_reason"}
    assert choice["text"] == "abc" and choice["finish_reason"] == "length"
    assert choice["logprobs"]["tokens"] == ["token_id:1", "token_id:2", "token_id:3"]
    assert choice["logprobs"]["token_logprobs"] == pytest.approx([-0.1, -0.2, -0.3])
    assert set(choice["logprobs"]) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    assert body["usage"] == {"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7,
                             "prompt_tokens_details": {"cached_tokens": 0}}


def test_chat_response_shape() -> None:
    request = decode_request(_chat(), ChatCompletionRequest)
    body = _encode(ChatAnswer("chatcmpl-1", "m", request, None).full({0: Delta("Paris", (9,), (), "stop")}, _USAGE))
    assert body["object"] == "chat.completion"
    (choice,) = body["choices"]
    assert choice == {"index": 0, "message": {"role": "assistant", "content": "Paris"}, "logprobs": None,
                      "finish_reason": "stop"}
    assert body["usage"]["total_tokens"] == 7


def test_chat_stream_chunks() -> None:
    request = decode_request(_chat(stream=True, stream_options={"include_usage": True}), ChatCompletionRequest)
    answer = ChatAnswer("chatcmpl-2", "m", request, None)
    first = [_encode(c) for c in answer.chunks(0, Delta("Pa", (1,), ()))]
    last = [_encode(c) for c in answer.chunks(0, Delta("ris", (2,), (), "stop"))]
    assert [c["choices"][0]["delta"] for c in first] == [{"role": "assistant", "content": ""}, {"content": "Pa"}]
    assert [c["choices"][0]["delta"] for c in last] == [{"content": "ris"}, {}]
    assert last[-1]["choices"][0]["finish_reason"] == "stop"
    for chunk in first + last:
        assert chunk["object"] == "chat.completion.chunk" and chunk["id"] == "chatcmpl-2"
        assert chunk["usage"] is None  # include_usage: null until the usage chunk
    usage = _encode(answer.usage_chunk(_USAGE))
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 3


def test_completion_stream_chunks_without_usage_field() -> None:
    request = decode_request(_completion(stream=True), CompletionRequest)
    answer = CompletionAnswer("cmpl-3", "m", request, None)
    assert answer.chunks(0, Delta("", (5,), ())) == []  # text held back: nothing to send yet
    (chunk,) = [_encode(c) for c in answer.chunks(0, Delta("x", (6,), (), "stop"))]
    assert "usage" not in chunk and chunk["object"] == "text_completion"
    assert chunk["choices"] == [{"index": 0, "text": "x", "logprobs": None, "finish_reason": "stop"}]


def test_usage_counts_each_prompt_once_and_every_choice() -> None:
    prompts = [Outcome(num_prompt_tokens=4, num_generated_tokens=2, num_cached_tokens=0),
               Outcome(num_prompt_tokens=6, num_generated_tokens=1, num_cached_tokens=None)]
    siblings = [Outcome(num_prompt_tokens=4, num_generated_tokens=5, num_cached_tokens=4)]
    usage = _encode(usage_of(prompts, prompts + siblings))
    assert usage == {"prompt_tokens": 10, "completion_tokens": 8, "total_tokens": 18,
                     "prompt_tokens_details": {"cached_tokens": 0}}


def test_completion_logprobs_with_alternatives_and_echo() -> None:
    request = decode_request(_completion(logprobs=2, echo=True, n=2), CompletionRequest)
    answer = CompletionAnswer("cmpl-4", "m", request, None, prompts=[[7, 8]], echo_texts=["<p>"])
    prompt_entries = (None, ((8, -1.5), (3, -0.5), (8, -1.5)))
    first = Delta("a", (4,), (-0.25,), None, (((4, -0.25), (5, -2.0)),), prompt_entries)
    (chunk,) = [_encode(c) for c in answer.chunks(1, first)]
    (choice,) = chunk["choices"]
    assert choice["index"] == 1 and choice["text"] == "<p>a"
    logprobs = choice["logprobs"]
    assert logprobs["tokens"] == ["token_id:7", "token_id:8", "token_id:4"]
    assert logprobs["token_logprobs"] == [None, -1.5, -0.25]
    assert logprobs["top_logprobs"] == [None, {"token_id:3": -0.5, "token_id:8": -1.5},
                                        {"token_id:4": -0.25, "token_id:5": -2.0}]
    (again,) = [_encode(c) for c in answer.chunks(1, Delta("b", (6,), (-3.0,), "stop", (((5, -1.0), (6, -3.0)),)))]
    assert again["choices"][0]["text"] == "b"  # the echo went out once per choice
    assert again["choices"][0]["logprobs"]["top_logprobs"] == [{"token_id:5": -1.0, "token_id:6": -3.0}]


def test_chat_top_logprobs_shape() -> None:
    request = decode_request(_chat(logprobs=True, top_logprobs=2), ChatCompletionRequest)
    answer = ChatAnswer("chatcmpl-5", "m", request, None)
    body = _encode(answer.full({0: Delta("x", (3,), (-0.1,), "stop", (((3, -0.1), (9, -2.5)),))}, _USAGE))
    (token,) = body["choices"][0]["logprobs"]["content"]
    assert token["token"] == "token_id:3" and token["logprob"] == pytest.approx(-0.1)
    assert [t["token"] for t in token["top_logprobs"]] == ["token_id:3", "token_id:9"]
    assert set(token["top_logprobs"][1]) == {"token", "logprob", "bytes"}
