#!/usr/bin/env bash
# Regenerate tokenmill_pb2.py / tokenmill_pb2_grpc.py from tokenmill.proto (needs grpcio-tools).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
python="${PYTHON:-python}"
cd "$here"
"$python" -m grpc_tools.protoc -I. --python_out=. --pyi_out=. --grpc_python_out=. tokenmill.proto
# protoc emits `import tokenmill_pb2`, which only works with this folder on sys.path; make it package-relative.
sed -i.bak -e 's/^import tokenmill_pb2 as/from . import tokenmill_pb2 as/' tokenmill_pb2_grpc.py
rm -f tokenmill_pb2_grpc.py.bak
echo "regenerated stubs in $here"
