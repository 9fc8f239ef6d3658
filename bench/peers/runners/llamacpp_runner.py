"""llama.cpp's llama-server on the workload, one slot per request, all requests at once.

The HF model is converted once to GGUF with the vendored convert_hf_to_gguf.py (run by this
interpreter: tokenmill's, which has torch, transformers and numpy; the vendored gguf-py goes first on
the path so the script and its gguf library match). The client is the standard library.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import Timer, load_workload, max_len, parser, wait_until_ok, write_result


def convert(model: str, script: Path, gguf: Path, outtype: str, python: str) -> None:
    if gguf.exists():
        return
    gguf.parent.mkdir(parents=True, exist_ok=True)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(script.parent / "gguf-py"), os.environ.get("PYTHONPATH", "")]),
    }
    subprocess.run([python, str(script), model, "--outtype", outtype, "--outfile", str(gguf)], check=True, env=env)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=3600) as response:
        return json.loads(response.read())


def main() -> None:
    p = parser("llama.cpp")
    p.add_argument("--server", required=True, help="llama-server binary")
    p.add_argument("--convert-script", required=True, help="llama.cpp's convert_hf_to_gguf.py")
    p.add_argument("--gguf", required=True, help="converted model path (made once)")
    p.add_argument(
        "--convert-python",
        default=sys.executable,
        help="interpreter with the converter's requirements (default: this one)",
    )
    p.add_argument("--no-repack", action="store_true", help="pass --no-repack to llama-server")
    args = p.parse_args()
    workload = load_workload(args.workload)
    # The weights in the compute precision, or q8_0 (--weights int8: blocks of 32 with an f16 scale).
    outtype = "q8_0" if args.weights == "int8" else "bf16" if args.precision == "bf16" else "f32"
    convert(args.model, Path(args.convert_script), Path(args.gguf), outtype, args.convert_python)
    port = free_port()
    slots = len(workload)
    command = [
        args.server,
        "-m",
        args.gguf,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "-np",
        str(slots),
        "-c",
        str(slots * (max_len(workload) + 16)),
        "-t",
        str(args.threads),
        "--no-webui",
    ]
    if args.no_repack:
        command.append("--no-repack")
    # The KV cache in the compute precision (llama.cpp's default is f16), or q8_0 (8-bit blocks with a
    # scale each, which needs flash attention).
    kv_cache = "q8_0" if args.kv_cache == "int8" else {"bf16": "bf16", "fp32": "f32"}[args.precision]
    command += ["--cache-type-k", kv_cache, "--cache-type-v", kv_cache]
    if args.kv_cache == "int8":
        command += ["--flash-attn", "on"]
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until_ok(f"{base}/health", server, timeout=600)

        def complete(request: dict) -> int:
            body = {
                "prompt": request["prompt_token_ids"],
                "n_predict": request["output_len"],
                "ignore_eos": True,
                "temperature": 0.0,
                "top_k": 1,
                "cache_prompt": False,
            }
            return int(post(f"{base}/completion", body)["tokens_predicted"])

        complete({"prompt_token_ids": workload[0]["prompt_token_ids"], "output_len": 8})  # warmup
        with ThreadPoolExecutor(slots) as pool, Timer() as t:
            tokens = sum(pool.map(complete, workload))
    finally:
        server.terminate()
        server.wait(timeout=60)
    write_result(
        args.out,
        "llama.cpp",
        args.precision,
        tokens,
        t.seconds,
        sum(r["output_len"] for r in workload),
        kv_cache=kv_cache,
        weights={"int8": "q8_0, blocks of 32", "gguf": "GGUF as is"}.get(args.weights),
        slots=slots,
    )


if __name__ == "__main__":
    main()
