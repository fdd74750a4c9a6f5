"""`splitspec-gateway`: an OpenAI-compatible HTTP front for `splitspec-target`.

A separate, stateless process: FastAPI routes served by uvicorn, server-sent events by
sse-starlette, and the target reached only through the public `splitspec.v1.Generation`
gRPC API (grpc.aio), so it scales and restarts on its own.
"""
