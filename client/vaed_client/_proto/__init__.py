"""Generated gRPC stubs for vaed.v1 (regenerate with scripts/gen_proto.py)."""
