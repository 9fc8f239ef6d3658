"""What an export directory holds: the graph's file for each format and the I/O manifest. Apart from
formats.py (which imports torch) so that `tokenmill export`'s flags register without loading torch:
the CLI builds every subcommand's parser at start, and a server must set its OpenMP wait settings
before torch loads (tokenmill/server/omp.py)."""

FORMATS = ("onnx", "torchscript")
FILES = {"onnx": "model.onnx", "torchscript": "model.pt"}
MANIFEST = "tokenmill_export.json"
