"""The grammar compiler's trial processes (see `grammar.GrammarCompiler`).

Compiling a grammar against the vocabulary is C++ work that cannot be interrupted, and some small
specs take seconds: a spec is first compiled here, in a process that can be killed at its deadline
or when every request waiting for it has gone, and only a grammar that compiled within the limits
is compiled again in the engine's process (shipping the compiled grammar back is no option: its
serialization can take far longer than compiling it). A worker is `python -m
tokenmill.engine.structured_output.compile_worker` (a plain subprocess: no multiprocessing start
method re-imports the caller's main module), runs at a lower CPU priority than the engine, and
talks over its stdin/stdout in frames: a JSON header line, then the payload bytes it announces.
The first frame it reads is the vocabulary (xgrammar's TokenizerInfo JSON), answered with `ready`;
then each frame is a grammar (xgrammar's Grammar JSON, with `max_bytes`), answered with `ok` (and
the compiled grammar's size), `too_large` (and its size) or `error` (and a message).
"""

from __future__ import annotations

import json
import os
import sys
from typing import IO, Any

# Workers yield the CPU to the engine's threads: a long compile must not slow every stream down.
NICENESS = 10


def write_frame(stream: IO[bytes], header: dict[str, Any], payload: bytes = b"") -> None:
    stream.write(json.dumps({**header, "bytes": len(payload)}).encode() + b"\n" + payload)
    stream.flush()


def read_frame(stream: IO[bytes]) -> tuple[dict[str, Any], bytes] | None:
    """The next frame, or None at the end of the stream."""
    line = stream.readline()
    if not line:
        return None
    header = json.loads(line)
    payload = stream.read(header["bytes"])
    if len(payload) != header["bytes"]:
        return None
    return header, payload


def serve(requests: IO[bytes], replies: IO[bytes]) -> None:
    import xgrammar as xgr

    first = read_frame(requests)
    if first is None:
        return
    info = xgr.TokenizerInfo.deserialize_json(first[1].decode())
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)  # the parent caches
    write_frame(replies, {"status": "ready"})
    while (frame := read_frame(requests)) is not None:
        header, payload = frame
        try:
            compiled = compiler.compile_grammar(xgr.Grammar.deserialize_json(payload.decode()))
        except Exception as exc:
            write_frame(replies, {"status": "error", "message": f"{type(exc).__name__}: {exc}"})
            continue
        size = compiled.memory_size_bytes
        write_frame(replies, {"status": "too_large" if size > header["max_bytes"] else "ok", "size": size})
        del compiled


def main() -> None:
    os.nice(NICENESS)
    replies = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # whatever else writes to stdout (a library's print) goes to stderr, not into the frames
    serve(sys.stdin.buffer, replies)


if __name__ == "__main__":
    main()
