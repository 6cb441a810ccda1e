"""`python -m benchmarks.sse_parse`: what reading one vLLM stream chunk costs the upstream leg,
by the ways it could be read: the `openai` client's pydantic model (what `RemoteEngine` used),
`json.loads` into dicts, and msgspec into the few fields used (what it uses now). One chunk of
vLLM's chat layout with continuous usage, as `vllm serve` sends it to our gateway. Single
process, in a tight loop: µs per chunk, best of 5."""

from __future__ import annotations

import argparse
import json
import timeit

import msgspec

from serving.engines.remote import _decode_chunk

CHUNK = json.dumps(
    {
        "id": "chatcmpl-2f4a1c9e8b7d4e0f9a3b6c5d4e3f2a1b",
        "object": "chat.completion.chunk",
        "created": 1764254400,
        "model": "facebook/opt-125m",
        "choices": [
            {
                "index": 0,
                "delta": {"content": " token"},
                "logprobs": None,
                "finish_reason": None,
                "stop_reason": None,
            }
        ],
        "usage": {"prompt_tokens": 128, "total_tokens": 150, "completion_tokens": 22},
    },
    separators=(",", ":"),
).encode()


def with_openai(data: bytes) -> str | None:
    from openai.types.chat import ChatCompletionChunk

    chunk = ChatCompletionChunk.model_validate_json(data)
    return chunk.choices[0].delta.content


def with_json(data: bytes) -> str | None:
    chunk = json.loads(data)
    return chunk["choices"][0]["delta"].get("content")


def with_msgspec(data: bytes) -> str | None:
    chunk = _decode_chunk(data)
    delta = chunk.choices[0].delta
    return delta.content if delta is not None else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.sse_parse", description=__doc__)
    parser.add_argument("--number", type=int, default=20_000)
    args = parser.parse_args(argv)
    assert with_openai(CHUNK) == with_json(CHUNK) == with_msgspec(CHUNK) == " token"
    print(f"one chunk: {len(CHUNK)} bytes; µs per chunk, best of 5 x {args.number:,}")
    cases = {
        "openai (pydantic)": lambda: with_openai(CHUNK),
        "json.loads": lambda: with_json(CHUNK),
        "msgspec Struct": lambda: with_msgspec(CHUNK),
    }
    for name, case in cases.items():
        best = min(timeit.repeat(case, number=args.number, repeat=5)) / args.number * 1e6
        print(f"  {name:20s} {best:6.2f}")
    print(f"(msgspec {msgspec.__version__})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
