"""Pieces every node shares: gRPC servicer base, protobuf conversion, metrics, lifecycle, registration."""
