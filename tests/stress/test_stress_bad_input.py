"""Bad input fuzz: hand-picked and hypothesis-generated malformed requests, sent while normal streams run.

Every malformed request must get a 4xx in the OpenAI error shape, quickly (no 500, no hang), and the
normal streams running meanwhile must complete whole.
"""

from __future__ import annotations

import asyncio
import json
import math
import threading
import time

import httpx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.stress.stress_lib import (
    check_error_body,
    load_request,
    new_client,
    record,
    stream_request,
    wait_quiescent,
)
from tests.utils.server import ServerProcess
from tokenmill.engine.sampling_params import (
    MAX_LOGIT_BIAS,
    MAX_N,
    MAX_STOP_STRINGS,
    MAX_TOP_LOGPROBS,
)

COMPLETIONS, CHAT, EMBEDDINGS = "/v1/completions", "/v1/chat/completions", "/v1/embeddings"
TIMEOUT_S = 30.0
MSG = [{"role": "user", "content": "hi"}]


def _raw(obj: object) -> bytes:
    return json.dumps(obj).encode()  # allow_nan: NaN/Infinity go out as the bare JSON literals


CURATED: list[tuple[str, bytes] | tuple[str, bytes, str]] = [  # (path, body[, content type])
    (COMPLETIONS, b"{not json"),
    (COMPLETIONS, b""),
    (COMPLETIONS, b"null"),
    (COMPLETIONS, b"[1, 2]"),
    (COMPLETIONS, b'"a string"'),
    (COMPLETIONS, b"[" * 100_000),
    (COMPLETIONS, b'{"a":' * 10_000 + b"1" + b"}" * 10_000),
    (COMPLETIONS, b'{"prompt": "\xff\xfe bad utf-8", "max_tokens": 2}'),
    (CHAT, b'{"messages": [{"role": "user", "content": "\xc3\x28"}], "max_tokens": 2}'),
    (COMPLETIONS, b"\xff\xfe\x00\x00"),
    (COMPLETIONS, b'{"prompt": "x", "temperature": NaN}'),
    (COMPLETIONS, b'{"prompt": "x", "temperature": Infinity}'),
    (COMPLETIONS, b'{"prompt": "x", "top_p": -Infinity}'),
    (CHAT, b'{"messages": [{"role": "user", "content": "x"}], "temperature": NaN, "max_tokens": 2}'),
    (COMPLETIONS, b'{"prompt": "x", "max_tokens": 1e999}'),
    (COMPLETIONS, _raw({"prompt": "x", "max_tokens": "4"})),
    (COMPLETIONS, _raw({"prompt": "x", "max_tokens": 4.5})),
    (COMPLETIONS, _raw({"prompt": "x", "max_tokens": True})),
    (COMPLETIONS, _raw({"prompt": "x", "max_tokens": -1})),
    (COMPLETIONS, _raw({"prompt": "x", "max_tokens": 0})),
    (COMPLETIONS, _raw({"prompt": "x", "max_tokens": 10**30})),
    (COMPLETIONS, _raw({"prompt": "x", "max_tokens": 2048})),
    (COMPLETIONS, _raw({"prompt": "x", "seed": 10**30})),
    (COMPLETIONS, _raw({"prompt": "x", "top_k": -5})),
    (COMPLETIONS, _raw({"prompt": "x", "temperature": -1})),
    (COMPLETIONS, _raw({"prompt": "x", "temperature": 1e308})),
    (COMPLETIONS, _raw({"prompt": "x", "presence_penalty": 3})),
    (COMPLETIONS, _raw({"prompt": "x", "repetition_penalty": 0})),
    (COMPLETIONS, _raw({"prompt": "x", "model": "no-such-model"})),
    (CHAT, _raw({"messages": MSG, "model": "gpt-4", "max_tokens": 2})),
    (COMPLETIONS, _raw({"prompt": ""})),
    (COMPLETIONS, _raw({"prompt": []})),
    (COMPLETIONS, _raw({"prompt": [[]]})),
    (COMPLETIONS, _raw({"prompt": [-1]})),
    (COMPLETIONS, _raw({"prompt": [10**7]})),
    (COMPLETIONS, _raw({"prompt": [1, "a"]})),
    (COMPLETIONS, _raw({"prompt": {"text": "x"}})),
    (COMPLETIONS, _raw({"prompt": ["a"] * 300})),
    (COMPLETIONS, _raw({"prompt": "x " * 3000, "max_tokens": 4})),  # over the context
    (COMPLETIONS, _raw({"prompt": list(range(100, 3100)), "max_tokens": 4})),
    (CHAT, _raw({"messages": [{"role": "user", "content": "x " * 5000}], "max_tokens": 2})),
    (COMPLETIONS, b'{"prompt": "' + b"a" * (10 << 20) + b'"}'),  # 10 MiB
    (CHAT, b'{"messages": [{"role": "user", "content": "' + b"a" * (10 << 20) + b'"}]}'),
    (COMPLETIONS, _raw({"prompt": "x", "stop": ["s"] * 1000})),
    (COMPLETIONS, _raw({"prompt": "x", "stop": ["s"] * (MAX_STOP_STRINGS + 1)})),
    (COMPLETIONS, _raw({"prompt": "x", "stop": "s" * 10_000})),
    (COMPLETIONS, _raw({"prompt": "x", "stop": [""]})),
    (COMPLETIONS, _raw({"prompt": "x", "stop": [1, 2]})),
    (COMPLETIONS, _raw({"prompt": "x", "logit_bias": {str(i): 1 for i in range(1000)}})),
    (COMPLETIONS, _raw({"prompt": "x", "logit_bias": {str(i): 1 for i in range(MAX_LOGIT_BIAS + 1)}})),
    (COMPLETIONS, _raw({"prompt": "x", "logit_bias": {"abc": 1}})),
    (COMPLETIONS, _raw({"prompt": "x", "logit_bias": {"-1": 1}})),
    (COMPLETIONS, _raw({"prompt": "x", "logit_bias": {"99999999": 1}})),
    (COMPLETIONS, _raw({"prompt": "x", "logit_bias": {"5": 1000}})),
    (CHAT, _raw({"messages": MSG, "logit_bias": {"5": "a"}, "max_tokens": 2})),
    (COMPLETIONS, _raw({"prompt": "x", "n": 1000})),
    (COMPLETIONS, _raw({"prompt": "x", "n": MAX_N + 1})),
    (COMPLETIONS, _raw({"prompt": "x", "n": 0})),
    (CHAT, _raw({"messages": MSG, "n": 1000, "max_tokens": 2})),
    (COMPLETIONS, _raw({"prompt": "x", "logprobs": MAX_TOP_LOGPROBS + 1})),
    (CHAT, _raw({"messages": MSG, "logprobs": True, "top_logprobs": 1000, "max_tokens": 2})),
    (CHAT, _raw({"messages": MSG, "top_logprobs": 2, "max_tokens": 2})),
    (COMPLETIONS, _raw({"prompt": "x", "best_of": 1000})),
    (COMPLETIONS, _raw({"prompt": "x", "max_tokens": 0})),  # 0 only with echo (scoring)
    (COMPLETIONS, _raw({"prompt": "x", "echo": True, "prompt_logprobs": 1, "stream": True})),
    (EMBEDDINGS, _raw({"input": []})),
    (EMBEDDINGS, _raw({"input": [[]]})),
    (EMBEDDINGS, _raw({"input": "x", "dimensions": 3})),
    (EMBEDDINGS, _raw({"input": [-1]})),
    (EMBEDDINGS, b"{not json"),
    (COMPLETIONS, _raw({"prompt": "x", "suffix": "y"})),
    (COMPLETIONS, _raw({"prompt": "x", "response_format": {"type": "json_schema", "json_schema": {"name": "s"}}})),
    (
        COMPLETIONS,
        _raw(
            {
                "prompt": "x",
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "s", "schema": {"type": "nonsense"}},
                },
            }
        ),
    ),
    (COMPLETIONS, _raw({"prompt": "x", "guided_regex": "(unclosed"})),
    (COMPLETIONS, _raw({"prompt": "x", "guided_regex": "a+", "guided_choice": ["a", "b"]})),  # one constraint only
    (CHAT, _raw({"messages": MSG, "tools": [{"type": "function", "function": {"name": "f g"}}]})),
    (
        CHAT,
        _raw({"messages": MSG, "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 1}}}]}),
    ),
    (CHAT, _raw({"messages": MSG, "tool_choice": {"type": "function", "function": {"name": "f"}}})),
    (CHAT, _raw({"messages": MSG, "store": "yes", "max_tokens": 2})),  # ignored, but typed
    (COMPLETIONS, _raw({"prompt": "x", "logit_bias": {"1_0": 1}})),
    (COMPLETIONS, b'{"prompt": "x", "max_tokens": 2}', "text/plain"),
    (COMPLETIONS, _raw({"prompt": "x", "stream": "yes"})),
    (COMPLETIONS, _raw({"prompt": "x", "stream": True, "stream_options": {"include_usage": "no"}})),
    (COMPLETIONS, _raw({"prompt": "x", "stream": True, "n": 1000})),
    (COMPLETIONS, _raw({"prompt": "x", "stop_token_ids": [-1]})),
    (CHAT, _raw({"messages": []})),
    (CHAT, _raw({"messages": "hi"})),
    (CHAT, _raw({"messages": [{"role": "robot", "content": "x"}]})),
    (CHAT, _raw({"messages": [{"content": "x"}]})),
    (CHAT, _raw({"messages": [{"role": "user", "content": 5}]})),
    (CHAT, _raw({"messages": [{"role": "user", "content": [{"type": "image_url", "url": "x"}]}]})),
    (CHAT, _raw({"messages": [None]})),
    (CHAT, _raw({"prompt": "x"})),
    (CHAT, _raw({"messages": MSG, "max_completion_tokens": -1})),
    (CHAT, _raw({"messages": MSG, "stream": True, "max_tokens": 0})),
]

# ---------------------------------------------------------------------------------------------- generated

_any_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
# (null is not among them: OpenAI's API takes null for every optional field, meaning its default.)
_not_int = (
    st.text(max_size=8)
    | st.floats().filter(lambda f: not float(f).is_integer())
    | st.booleans()
    | st.lists(st.integers(), max_size=2)
)
_not_number = st.text(max_size=8) | st.booleans() | st.lists(st.floats(), max_size=2)
_nan_or_inf = st.sampled_from([math.nan, math.inf, -math.inf])


def _out_of(lo: float, hi: float) -> st.SearchStrategy:
    return st.floats(max_value=lo, exclude_max=True) | st.floats(min_value=hi, exclude_min=True) | _nan_or_inf


# field -> values that are invalid for it (by type or by range), whatever the other fields are.
INVALID = {
    "n": _not_int | st.integers(max_value=0) | st.integers(min_value=MAX_N + 1),
    "max_tokens": _not_int | st.integers(max_value=0) | st.integers(min_value=1 << 20 + 1),
    "top_k": _not_int | st.integers(max_value=-2),
    "seed": st.text(max_size=8) | st.floats() | st.integers(min_value=1 << 64) | st.integers(max_value=-(1 << 63) - 1),
    "temperature": _not_number | _out_of(0.0, 100.0),
    "top_p": _not_number | _out_of(0.0, 1.0) | st.just(0.0),
    "min_p": _not_number | _out_of(0.0, 1.0),
    "presence_penalty": _not_number | _out_of(-2.0, 2.0),
    "frequency_penalty": _not_number | _out_of(-2.0, 2.0),
    "repetition_penalty": _not_number | _out_of(0.01, 100.0),
    "stop": st.integers()
    | st.lists(st.integers(), min_size=1, max_size=3)
    | st.lists(st.text(min_size=1, max_size=3), min_size=MAX_STOP_STRINGS + 1, max_size=MAX_STOP_STRINGS + 40)
    | st.just("")
    | st.text(min_size=513, max_size=600),
    "logit_bias": st.dictionaries(
        st.text(alphabet="abcxyz-", min_size=1, max_size=4), st.floats(-1, 1), min_size=1, max_size=3
    )
    | st.dictionaries(st.integers(0, 40000).map(str), _out_of(-100.0, 100.0), min_size=1, max_size=3)
    | st.dictionaries(
        st.integers(0, 40000).map(str), st.just(1.0), min_size=MAX_LOGIT_BIAS + 1, max_size=MAX_LOGIT_BIAS + 50
    ),
    "stream": _not_int.filter(lambda v: not isinstance(v, bool)),
    "ignore_eos": st.integers() | st.text(max_size=4),
    "model": st.text(max_size=16).filter(lambda m: m != "tiny"),
    "stop_token_ids": st.lists(st.integers(max_value=-1), min_size=1, max_size=3) | st.text(max_size=3),
    "logprobs_c": st.integers(max_value=-1) | st.integers(min_value=MAX_TOP_LOGPROBS + 1) | st.text(max_size=3),
    "prompt": st.just("")
    | st.just([])
    | st.lists(st.integers(max_value=-1), min_size=1, max_size=3)
    | st.lists(st.integers(min_value=10**6), min_size=1, max_size=3)
    | st.dictionaries(st.text(max_size=3), st.text(max_size=3))
    | st.integers()
    | st.lists(st.booleans(), min_size=1, max_size=3),
    "messages": st.just([])
    | st.text(max_size=5)
    | st.lists(
        st.fixed_dictionaries(
            {
                "role": st.text(max_size=6).filter(
                    lambda r: r not in ("system", "developer", "user", "assistant", "tool")
                ),
                "content": st.text(max_size=5),
            }
        ),
        min_size=1,
        max_size=2,
    )
    | st.lists(st.fixed_dictionaries({"role": st.just("user"), "content": st.integers()}), min_size=1, max_size=2),
}


@st.composite
def bad_request(draw) -> tuple[str, bytes]:
    """A valid small request with exactly one poisoned field, or garbage, or a random JSON object."""
    kind = draw(st.sampled_from(["field"] * 8 + ["garbage", "json", "object"]))
    if kind == "garbage":
        return draw(st.sampled_from([COMPLETIONS, CHAT])), draw(st.binary(max_size=64).filter(lambda b: b[:1] != b"{"))
    if kind == "json":  # valid JSON that is not an object
        return draw(st.sampled_from([COMPLETIONS, CHAT])), _raw(
            draw(_any_json.filter(lambda v: not isinstance(v, dict)))
        )
    if kind == "object":  # random keys: unknown fields are ignored, but prompt/messages is missing
        obj = draw(
            st.dictionaries(
                st.text(max_size=8).filter(lambda k: k not in ("prompt", "messages")), _any_json, max_size=5
            )
        )
        return draw(st.sampled_from([COMPLETIONS, CHAT])), _raw(obj)
    chat = draw(st.booleans())
    body: dict = {"max_tokens": 2, "stream": draw(st.booleans())}
    body.update({"messages": MSG} if chat else {"prompt": "hello"})
    fields = sorted(set(INVALID) - {"prompt" if chat else "messages", "logprobs_c" if chat else ""})
    name = draw(st.sampled_from(fields))
    value = draw(INVALID[name])
    body["logprobs" if name == "logprobs_c" else name] = value
    return (CHAT if chat else COMPLETIONS), _raw(body)


# ---------------------------------------------------------------------------------------------- the test


def _check(client: httpx.Client, path: str, raw: bytes, content_type: str = "application/json") -> int:
    start = time.monotonic()
    r = client.post(path, content=raw, headers={"Content-Type": content_type}, timeout=TIMEOUT_S)
    took = time.monotonic() - start
    assert 400 <= r.status_code < 500, (r.status_code, path, raw[:300], r.text[:300])
    problem = check_error_body(r.text, r.status_code)
    assert problem is None, (problem, raw[:300])
    assert took < TIMEOUT_S
    return r.status_code


def test_malformed_requests_get_4xx_while_streams_run(stress_server: ServerProcess, long_mode: bool) -> None:
    url = stress_server.base_url
    stop = threading.Event()
    background: list = []

    def normal_streams() -> None:  # back-to-back normal streams for as long as the fuzz runs (bounded)
        async def go() -> None:
            async with new_client() as client:
                for i in range(2000):
                    if stop.is_set():
                        return
                    background.append(await stream_request(client, url, *load_request(9000 + i, 24)))

        asyncio.run(go())

    t = threading.Thread(target=normal_streams)
    t.start()
    statuses: dict[int, int] = {}
    tried = 0
    try:
        with httpx.Client(base_url=url) as client:
            for path, raw, *content_type in CURATED:
                code = _check(client, path, raw, *content_type)
                statuses[code] = statuses.get(code, 0) + 1
                tried += 1

            @settings(
                max_examples=600 if long_mode else 120,
                deadline=None,
                database=None,
                derandomize=not long_mode,
                suppress_health_check=list(HealthCheck),
            )
            @given(case=bad_request())
            def fuzz(case: tuple[str, bytes]) -> None:
                nonlocal tried
                code = _check(client, *case)
                statuses[code] = statuses.get(code, 0) + 1
                tried += 1

            fuzz()
    finally:
        stop.set()
        t.join(180)
    assert not t.is_alive()
    assert stress_server.proc.poll() is None
    bad = [o for o in background if o.kind != "ok"]
    record(
        "bad_input",
        tried=tried,
        curated=len(CURATED),
        by_status=dict(sorted(statuses.items())),
        concurrent_streams_ok=len(background) - len(bad),
        concurrent_streams_bad=len(bad),
    )
    assert background and not bad, [(o.kind, o.detail) for o in bad[:5]]
    assert tried >= 100
    asyncio.run(wait_quiescent(url))
