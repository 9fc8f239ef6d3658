"""Stored Responses API responses (`store`): kept in memory for `previous_response_id` and GET /
DELETE /v1/responses/{id}, bounded by --responses-store-memory, least recently used out first."""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

from tokenmill.server.protocol import ChatMessage


@dataclass
class StoredResponse:
    body: str  # the Response as JSON
    conversation: list[ChatMessage]  # input and output as chat messages: what previous_response_id continues
    size: int


class ResponseStore:
    """Stored responses by id, at most `capacity` bytes (their JSON), least recently used out first."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()
        self._size = 0
        self._lock = threading.Lock()

    def put(self, response_id: str, body: str, conversation: list[ChatMessage]) -> None:
        size = len(body) + sum(len(m.model_dump_json()) for m in conversation)
        if size > self.capacity:
            return
        with self._lock:
            self._drop(response_id)
            self._items[response_id] = StoredResponse(body, conversation, size)
            self._size += size
            while self._size > self.capacity:
                self._drop(next(iter(self._items)))

    def get(self, response_id: str) -> StoredResponse | None:
        with self._lock:
            stored = self._items.get(response_id)
            if stored is not None:
                self._items.move_to_end(response_id)
            return stored

    def delete(self, response_id: str) -> bool:
        with self._lock:
            return self._drop(response_id)

    def _drop(self, response_id: str) -> bool:
        stored = self._items.pop(response_id, None)
        if stored is None:
            return False
        self._size -= stored.size
        return True
