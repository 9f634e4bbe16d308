"""The OpenAI-compatible HTTP server (Starlette + hypercorn) over the engine-core process."""
