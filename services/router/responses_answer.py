"""``/v1/responses`` answers: the ``response`` object, or its stream of typed events.

The text is read as in chat (``chat_output``): reasoning becomes a ``reasoning`` item, the answer a ``message`` item
with one ``output_text`` part, each call a ``function_call`` item. Streamed, each item opens
(``response.output_item.added``), grows (``response.reasoning_text.delta``, ``response.output_text.delta``,
``response.function_call_arguments.delta``) and closes (its ``.done`` events), between ``response.created`` /
``response.in_progress`` and ``response.completed`` (``response.incomplete`` when it ran out of tokens).
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable, Mapping
from typing import Any

import msgspec
from msgspec import UNSET, UnsetType

from services.router.chat_output import ChatOutput, ChatPiece
from services.router.generation import Delta
from services.router.responses import Usage
from services.router.responses_request import ResponsesRequest


class ResponsesEvent(msgspec.Struct, omit_defaults=True):
    """One streamed event (only the fields its type has)."""

    type: str
    sequence_number: int
    response: dict[str, Any] | UnsetType = UNSET
    output_index: int | UnsetType = UNSET
    item: dict[str, Any] | UnsetType = UNSET
    item_id: str | UnsetType = UNSET
    content_index: int | UnsetType = UNSET
    part: dict[str, Any] | UnsetType = UNSET
    delta: str | UnsetType = UNSET
    text: str | UnsetType = UNSET
    arguments: str | UnsetType = UNSET
    name: str | UnsetType = UNSET
    logprobs: list[Any] | UnsetType = UNSET
    # pdserve's own, on the last event only: how the response was served (routes.py).
    pdserve_route: str | UnsetType = UNSET


def _item_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


class ResponsesAnswer:
    """The same three calls as the chat answers (``full``, ``chunks``, ``usage_chunk``), in the Responses shapes."""

    include_usage = True  # the closing event carries the response with its usage
    done_event = b""  # no [DONE]: the stream ends after response.completed

    def __init__(self, request_id: str, model: str, request: ResponsesRequest,
                 new_output: Callable[[], ChatOutput]) -> None:
        self.request_id = "resp_" + request_id.removeprefix("resp-")
        self.model = model
        self.created = int(time.time())
        self._request = request
        self._output = new_output()
        self._items: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None  # the item being streamed
        self._calls: dict[int, dict[str, Any]] = {}  # a call's index in the text -> its item
        self._sequence = 0
        self._finish_reason: str | None = None

    # ---- whole ----------------------------------------------------------------------------------

    def full(self, deltas: Mapping[int, Delta], usage: Usage) -> dict[str, Any]:
        delta = deltas[0]
        self._add(self._output.feed(delta.text, final=True))
        self._finish_reason = delta.finish_reason
        self._close()
        return self._response(usage)

    # ---- streamed -------------------------------------------------------------------------------

    def sse(self, event: ResponsesEvent) -> bytes:
        return b"event: " + event.type.encode() + b"\ndata: " + msgspec.json.encode(event) + b"\n\n"

    def chunks(self, index: int, delta: Delta) -> list[ResponsesEvent]:
        events = []
        if self._sequence == 0:
            events += [self._event("response.created", response=self._response(None)),
                       self._event("response.in_progress", response=self._response(None))]
        events += self._add(self._output.feed(delta.text, final=delta.finish_reason is not None))
        if delta.finish_reason is not None:
            self._finish_reason = delta.finish_reason
            events += self._close()
        return events

    def usage_chunk(self, usage: Usage) -> ResponsesEvent:
        response = self._response(usage)
        kind = "response.completed" if response["status"] == "completed" else "response.incomplete"
        return self._event(kind, response=response)

    # ---- items ----------------------------------------------------------------------------------

    def _add(self, piece: ChatPiece) -> list[ResponsesEvent]:
        events = []
        if piece.reasoning:
            events += self._text_delta("reasoning", piece.reasoning)
        if piece.content:
            events += self._text_delta("message", piece.content)
        for call in piece.tool_calls:
            item = self._calls.get(call.index)
            if item is None:
                events += self._close()
                item = {"type": "function_call", "id": _item_id("fc"), "call_id": call.id or _item_id("call"),
                        "name": call.name or "", "arguments": "", "status": "in_progress"}
                self._calls[call.index] = item
                events += self._open_item(item)
            item["arguments"] += call.arguments
            events.append(self._event("response.function_call_arguments.delta", item_id=item["id"],
                                      output_index=self._items.index(item), delta=call.arguments))
        return events

    def _text_delta(self, kind: str, text: str) -> list[ResponsesEvent]:
        events = []
        if self._open is None or self._open["type"] != kind:
            events += self._close()
            part_type = "reasoning_text" if kind == "reasoning" else "output_text"
            item: dict[str, Any] = {"type": kind, "id": _item_id("rs" if kind == "reasoning" else "msg"),
                                    "status": "in_progress", "content": [_part(part_type)]}
            if kind == "reasoning":
                item["summary"] = []
            else:
                item["role"] = "assistant"
            events += self._open_item(item)
            events.append(self._event("response.content_part.added", **self._where(), part=_part(part_type)))
        part = self._open["content"][0]
        part["text"] += text
        event_type = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        extra = {} if kind == "reasoning" else {"logprobs": []}
        events.append(self._event(event_type, **self._where(), delta=text, **extra))
        return events

    def _open_item(self, item: dict[str, Any]) -> list[ResponsesEvent]:
        self._items.append(item)
        self._open = item
        return [self._event("response.output_item.added", output_index=len(self._items) - 1,
                            item=_without_text(item))]

    def _close(self) -> list[ResponsesEvent]:
        """The open item's closing events."""
        item, self._open = self._open, None
        if item is None:
            return []
        item["status"] = "completed"
        index = self._items.index(item)
        events = []
        if item["type"] == "function_call":
            events.append(self._event("response.function_call_arguments.done", item_id=item["id"],
                                      output_index=index, arguments=item["arguments"], name=item["name"]))
        else:
            part = item["content"][0]
            kind = "reasoning_text" if item["type"] == "reasoning" else "output_text"
            extra = {} if item["type"] == "reasoning" else {"logprobs": []}
            events += [self._event(f"response.{kind}.done", item_id=item["id"], output_index=index,
                                   content_index=0, text=part["text"], **extra),
                       self._event("response.content_part.done", item_id=item["id"], output_index=index,
                                   content_index=0, part=part)]
        events.append(self._event("response.output_item.done", output_index=index, item=item))
        return events

    def _where(self) -> dict[str, Any]:
        assert self._open is not None
        return {"item_id": self._open["id"], "output_index": self._items.index(self._open), "content_index": 0}

    def _event(self, kind: str, **fields: Any) -> ResponsesEvent:
        event = ResponsesEvent(kind, self._sequence, **fields)
        self._sequence += 1
        return event

    def _response(self, usage: Usage | None) -> dict[str, Any]:
        """The response object as it stands: in progress until usage (the end) is known."""
        r = self._request
        status = "in_progress" if usage is None else ("incomplete" if self._finish_reason == "length" else "completed")
        fmt = r.text.format if r.text is not None and r.text.format is not None else None
        tool_choice = r.tool_choice if isinstance(r.tool_choice, str) or r.tool_choice is None \
            else msgspec.to_builtins(r.tool_choice)
        return {
            "id": self.request_id, "object": "response", "created_at": self.created, "status": status,
            "model": self.model, "output": list(self._items) if usage is not None else [],
            "error": None, "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": r.instructions, "max_output_tokens": r.max_output_tokens, "metadata": r.metadata or {},
            "parallel_tool_calls": r.parallel_tool_calls, "previous_response_id": None,
            "temperature": r.temperature, "top_p": r.top_p, "tool_choice": tool_choice or "auto",
            "tools": [msgspec.to_builtins(t) for t in r.tools or ()], "store": False, "truncation": "disabled",
            "text": {"format": msgspec.to_builtins(fmt) if fmt is not None else {"type": "text"}},
            "reasoning": {"effort": r.reasoning.effort if r.reasoning else None, "summary": None},
            "usage": _usage(usage) if usage is not None else None,
        }


def _part(kind: str) -> dict[str, Any]:
    return {"type": kind, "text": ""} if kind == "reasoning_text" else \
        {"type": kind, "text": "", "annotations": [], "logprobs": []}


def _without_text(item: dict[str, Any]) -> dict[str, Any]:
    """An item as it opens: no text and no arguments yet."""
    out = dict(item)
    if "content" in out:
        out["content"] = []
    if "arguments" in out:
        out["arguments"] = ""
    return out


def _usage(usage: Usage) -> dict[str, Any]:
    cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details is not msgspec.UNSET else 0
    return {"input_tokens": usage.prompt_tokens, "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": usage.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage.total_tokens}
