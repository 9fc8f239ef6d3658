"""Stream a completion from `tokenmill serve` over gRPC.

    tokenmill serve --grpc-port 50051 &
    python examples/grpc_client.py --prompt "The capital of France is" --max-tokens 32

Needs only grpcio and protobuf plus the stubs shipped in tokenmill.server.proto
(or regenerate your own from tokenmill/server/proto/tokenmill.proto for another language).
"""

from __future__ import annotations

import argparse
import sys

import grpc

from tokenmill.server.proto import tokenmill_pb2 as pb
from tokenmill.server.proto import tokenmill_pb2_grpc as pb_grpc


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="127.0.0.1:50051", help="host:port of the gRPC server")
    parser.add_argument("--prompt", default="Once upon a time")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--api-key", default=None, help="sent as `authorization: Bearer KEY` metadata")
    args = parser.parse_args()

    metadata = [("authorization", f"Bearer {args.api_key}")] if args.api_key else []
    request = pb.GenerateRequest(prompt=args.prompt, max_tokens=args.max_tokens, temperature=args.temperature)
    with grpc.insecure_channel(args.target) as channel:
        stub = pb_grpc.GenerationStub(channel)
        try:
            for chunk in stub.GenerateStream(request, metadata=metadata, timeout=300):
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
                if chunk.finish_reason:
                    u = chunk.usage
                    print(
                        f"\n[finish_reason={chunk.finish_reason} prompt_tokens={u.prompt_tokens} "
                        f"completion_tokens={u.completion_tokens}]",
                        file=sys.stderr,
                    )
        except grpc.RpcError as err:
            print(f"\nerror: {err.code().name}: {err.details()}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
