"""`tokenmill export`: a native model as one ONNX or TorchScript decoder step with explicit past K/V,
to run where Python and tokenmill are not (onnxruntime, libtorch), and its parity check."""
