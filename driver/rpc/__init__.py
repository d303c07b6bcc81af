"""gRPC plumbing of the driver: sockets, service binding and the servicers."""
