"""Generated gRPC stubs for tokenmill.proto (regenerate with generate.sh)."""
