"""A streamed answer read per choice (its text, the ids of its ``: ids`` comments, its finish
reason, usage and tool calls), and the continuation body after a client got only its first events."""

from __future__ import annotations

import json

import requests


def events_of(body: str) -> list[tuple[list[str], object]]:
    """Each event block as (its comment lines, its data: a dict or "[DONE]"; None for a comment
    alone)."""
    out = []
    for block in body.split("\n\n"):
        if not block:
            continue
        comments = [line[2:] for line in block.split("\n") if line.startswith(": ")]
        data = [line[6:] for line in block.split("\n") if line.startswith("data: ")]
        out.append((comments, (data[0] if data[0] == "[DONE]" else json.loads(data[0])) if data else None))
    return out


def post(server, path: str, body: dict) -> requests.Response:
    return requests.post(server.url + path, json=body, timeout=120)


def stream(server, path: str, body: dict) -> list:
    r = post(server, path, {**body, "stream": True})
    assert r.status_code == 200, r.text
    return events_of(r.text)


def _text(chunk: dict) -> str:
    c = chunk["choices"][0]
    return c["text"] if "text" in c else c["delta"].get("content") or ""


class Answer:
    """A streamed answer read per choice: text, ids (from ``: ids`` lines), finish reason; its
    usage, ids and created of every chunk, and the order of its token-carrying events."""

    def __init__(self, events: list):
        self.text, self.ids, self.finish = {}, {}, {}
        self.usage, self.chunk_ids, self.created, self.roles = None, set(), set(), 0
        self.carrying: list[int] = []  # indices into events of those that carry ids
        self.multi = 0  # events naming several ids of which all but the last had no text of their own
        self.calls: dict = {}  # (choice, call index) -> [name, arguments] of its tool calls
        self.lps: dict = {}  # choice -> completions logprobs' tokens, logprobs and text offsets
        for k, (comments, data) in enumerate(events):
            if not isinstance(data, dict):
                continue
            self.chunk_ids.add(data["id"])
            self.created.add(data["created"])
            if data.get("usage"):
                self.usage = data["usage"]
            for c in data["choices"]:
                i = c["index"]
                self.roles += "role" in c.get("delta", {})
                self.text[i] = self.text.get(i, "") + _text(data)
                if c["finish_reason"] is not None:
                    self.finish[i] = c["finish_reason"]
                for call in c.get("delta", {}).get("tool_calls") or ():
                    got = self.calls.setdefault((i, call["index"]), ["", ""])
                    got[0] += call.get("function", {}).get("name") or ""
                    got[1] += call.get("function", {}).get("arguments") or ""
                if c.get("logprobs") and "text_offset" in c["logprobs"]:
                    lp = self.lps.setdefault(i, ([], [], []))
                    for k, key in enumerate(("tokens", "token_logprobs", "text_offset")):
                        lp[k].extend(c["logprobs"][key])
            for line in comments:
                if line.startswith("ids "):
                    _, i, *ids = line.split(" ")
                    self.ids.setdefault(int(i), []).extend(map(int, ids))
                    self.multi += len(ids) > 1
                    self.carrying.append(k)


def continuation_of(events: list, cut: int, n: int) -> tuple[dict, Answer]:
    """The continuation body after the client got ``events[:cut]``, and what those events said."""
    head = Answer(events[:cut])
    unfinished = [i for i in range(n) if i not in head.finish]
    chunk = next(d for _, d in events if isinstance(d, dict))
    done = sum(len(head.ids[i]) for i in head.finish)
    return {"id": chunk["id"], "created": chunk["created"], "finished_tokens": done,
            "choices": [{"index": i, "ids": head.ids.get(i, [])} for i in unfinished]}, head
